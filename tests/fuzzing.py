"""Hypothesis settings shared by the fuzz tests: one test, two sizes of run.

Every fuzz test is decorated with :data:`fuzzed`, which runs it once per
profile and passes the profile's name as ``profile``.  The default run gets
the ``gpucx-sample`` profile (:data:`SAMPLE` cases, seconds); ``python -m
pytest -m fuzz`` runs the same tests again under ``gpucx-fuzz``
(:data:`FULL` cases each, or ``GPUCX_FUZZ_CASES``).  Tests count the cases
they ran and report them through :func:`report`, so a run records its
counts (``-s`` shows them; ``GPUCX_FUZZ_LOG`` appends them to a file).
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings

#: Cases per parser in the default run.
SAMPLE = 200
#: Cases per parser in the ``fuzz`` run.
FULL = int(os.environ.get("GPUCX_FUZZ_CASES", "10000"))

_COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
settings.register_profile("gpucx-sample", max_examples=SAMPLE, **_COMMON)
settings.register_profile("gpucx-fuzz", max_examples=FULL, **_COMMON)

#: Decorator: run a test under the sample profile and, marked ``fuzz``, the
#: full one; the test receives the profile name as ``profile``.
fuzzed = pytest.mark.parametrize(
    "profile",
    [
        pytest.param("gpucx-sample", id="sample"),
        pytest.param("gpucx-fuzz", id="full", marks=pytest.mark.fuzz),
    ],
)


class Counter:
    """Counts the cases a hypothesis run fed to its body."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def run(name: str, profile: str, strategy, body) -> int:
    """Run ``body(case)`` for each case ``strategy`` draws under the named
    profile; report and return how many cases ran; fail if fewer than asked."""
    cfg = settings.get_profile(profile)
    count = Counter()

    def one(case):
        count()
        body(case)

    start = time.monotonic()
    settings(cfg)(given(strategy)(one))()
    report(name, count.n, time.monotonic() - start)
    assert count.n >= cfg.max_examples, f"{name}: only {count.n} cases ran"
    return count.n


def report(name: str, cases: int, seconds: float) -> None:
    line = f"fuzz {name}: {cases} cases in {seconds:.1f} s"
    print(line)
    log = os.environ.get("GPUCX_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")
