"""Errors of the benchmark engine."""

from __future__ import annotations

__all__ = ["BenchSetupError"]


class BenchSetupError(Exception):
    """The benchmark cannot run as asked (bad arguments, missing API or GPU).

    The CLI prints the message on one line and exits with code 2.
    """
