# One command that runs what CI runs: lint, types, tests.
.PHONY: check lint types test bench

check: lint types test

lint:
	ruff check gpucx tests benchmarks
	ruff format --check gpucx tests benchmarks

types:
	mypy

test:
	python -m pytest -q

bench:
	python benchmarks/bench_tag.py
