"""Which gpucx calls wait for a kernel running on an unrelated stream (GPU).

    python benchmarks/cuda_setup_waits.py [--tls default|ipc|tcp-staged] [--hold S]

A process makes a context and sends one tag message, then, twice: queues a
kernel held at a gate for ``--hold`` seconds on a non-blocking stream and
times each step of setting up and using a new context while it is held,
printing whether the stream had finished after the step.  A step that took
about ``--hold`` seconds waited for the kernel.  (docs/gpu.md, "Streams";
the figures of 2026-11-26 are in benchmarks/RESULTS.md.)  Needs a GPU,
CuPy and a UCX with CUDA transports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_cuda import CUDA_TLS, _Gate  # noqa: E402

import gpucx  # noqa: E402

from conftest import Pair  # noqa: E402


def tag(pair: Pair, src, dst) -> None:
    dst[:] = 0
    pair.drive(pair.ab.send_nb(src, tag=31), pair.b.recv_nb(dst, tag=31), timeout=30)
    assert (dst == src).all()


def one_round(label: str, cfg, first, cupy, scratch, hold: float) -> None:
    """Time each step of a new context's setup and use, a kernel held."""
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    stream = cupy.cuda.Stream(non_blocking=True)
    gate = _Gate(cupy, scratch, 3, stream, limit_s=hold)

    def step(name, fn):
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{label}: {name:24s} {ms:9.2f} ms  stream done after it: {stream.done}")
        return out

    try:
        ctx = step("Context()", lambda: gpucx.Context(config=cfg))
        a = step("create_worker a", ctx.create_worker)
        b = step("create_worker b", ctx.create_worker)
        ab = step("a.connect(b)", lambda: a.connect(b.address))
        step("b.connect(a)", lambda: b.connect(a.address))
        pair = Pair.__new__(Pair)
        pair.a, pair.b, pair.ab = a, b, ab
        step("first tag 4 KiB host", lambda: tag(pair, src, dst))
        step("second tag 4 KiB host", lambda: tag(pair, src, dst))
        step("first context, new pair", lambda: tag(Pair(first), src, dst))
        step("close", ctx.close)
    finally:
        gate.open()
        stream.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tls", choices=sorted(CUDA_TLS), default="default")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds (default 3)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import cupy

    cfg = CUDA_TLS[args.tls]
    first = gpucx.Context(config=cfg)
    src = np.arange(4096, dtype=np.uint8)
    tag(Pair(first), src, np.zeros_like(src))
    scratch = cupy.zeros(1024, cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    for rnd in range(1, args.rounds + 1):
        one_round(f"{args.tls} round {rnd}", cfg, first, cupy, scratch, args.hold)
    first.close()


if __name__ == "__main__":
    main()
