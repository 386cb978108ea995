"""Benchmark engine behind ``gpucx bench``."""
