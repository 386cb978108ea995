"""The Python cost of a blocking 8-byte put and get, in one process.

Two workers of one context (``sm,self``), an endpoint without peer error
handling (UCX puts and gets one-sided there, so each call completes
without the target), a registered 64-byte region: the best of five loops
of 100,000 ``ep.put`` and ``ep.get``, in microseconds a call.  It measures
the Python layer in front of UCX's post (checks, routing), so compare
builds alternated in one session (``PYTHONPATH=<tree> python
benchmarks/rma_small_loop.py``).
"""

from __future__ import annotations

import time

import numpy as np

import gpucx


def main(n: int = 100_000, loops: int = 5) -> dict[str, float]:
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address, error_handling=False)
        dst = np.zeros(64, np.uint8)
        key = ep.unpack(ctx.register(dst).remote())
        src, out = np.ones(8, np.uint8), np.zeros(8, np.uint8)
        best = best_of(
            (("put", lambda: ep.put(src, key)), ("get", lambda: ep.get(out, key))),
            loops,
            n,
        )
        key.close()
    return best


def best_of(calls, loops: int, n: int) -> dict[str, float]:
    """``{name: microseconds a call}``, the best of ``loops`` loops of ``n``
    calls of each ``(name, call)``."""
    best: dict[str, float] = {}
    for name, call in calls:
        for _ in range(loops):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            us = (time.perf_counter() - t0) / n * 1e6
            best[name] = min(best.get(name, us), us)
    return best


if __name__ == "__main__":
    print(" ".join(f"{k} {v:.3f} us" for k, v in main().items()))
