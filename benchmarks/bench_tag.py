"""Tag ping-pong between two processes: gpucx's public blocking API against
UCX's own ``ucx_perftest`` in the same run.

    python benchmarks/bench_tag.py [--iters N] [--tls TLS]

gpucx side: ``ep.send`` + ``worker.recv`` (peer error handling on, as
gpucx's default).  perftest side: ``ucx_perftest -e -t tag_lat`` (peer
error handling on) with ``UCX_MM_ERROR_HANDLING=y``.  Both report the
one-way latency (half the round trip) and the ping-pong bandwidth.  Prints a
table with the gpucx/perftest ratio.  The VM this was written on flips
between fast and slow periods: compare ratios from one run only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import bench_rma
import numpy as np

SIZES = [8, 1 << 20, 16 << 20]


def _iters(size: int, base: int) -> int:
    return max(50, min(base, int(base * 64 / max(64, size / 1024))))


def _alloc(size: int) -> np.ndarray:
    # Large NumPy allocations get transparent huge pages, as perftest's do.
    return np.ones(size, np.uint8)


def _pong(conn, config):
    import gpucx

    with gpucx.Context(features={"tag"}, config=config) as ctx:
        w = ctx.create_worker()
        conn.send(w.address)
        ep = w.connect(conn.recv())
        for size, iters in conn.recv():
            buf = _alloc(size)
            for _ in range(iters):
                w.recv(buf, tag=1)
                ep.send(buf, tag=2)
        ep.close()


def gpucx_pingpong(config, plan):
    import gpucx

    parent, child = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=_pong, args=(child, config))
    p.start()
    out = {}
    with gpucx.Context(features={"tag"}, config=config) as ctx:
        w = ctx.create_worker()
        ep = w.connect(parent.recv())
        parent.send(w.address)
        parent.send(plan)
        for size, iters in plan:
            buf = _alloc(size)
            send, recv = ep.send, w.recv
            for _ in range(max(10, iters // 10)):  # warm-up
                send(buf, tag=1)
                recv(buf, tag=2)
            t0 = time.perf_counter()
            for _ in range(iters - max(10, iters // 10)):
                send(buf, tag=1)
                recv(buf, tag=2)
            dt = time.perf_counter() - t0
            n = iters - max(10, iters // 10)
            out[size] = dt / n / 2  # one-way
        lanes = ep.transports
        ep.close()
    p.join(60)
    return out, lanes


def perftest(size: int, iters: int, tls: str | None) -> float:
    """``ucx_perftest -e -t tag_lat``: the average one-way latency, seconds
    (run by bench_rma.perftest, the one runner of these scripts)."""
    res = bench_rma.perftest("tag_lat", size, iters, tls or "default", eh=True)
    return res["avg"] * 1e-6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--tls", default=None, help="UCX TLS for both sides")
    args = ap.parse_args(argv)
    plan = [(s, _iters(s, args.iters)) for s in SIZES]
    config = {"TLS": args.tls} if args.tls else None
    ours, lanes = gpucx_pingpong(config, plan)
    theirs = {s: perftest(s, n, args.tls) for s, n in plan}
    print(f"gpucx lanes: {lanes}")
    print(
        f"{'size':>10} {'gpucx us':>10} {'perftest us':>12} {'ratio':>7} "
        f"{'gpucx GB/s':>11} {'perftest GB/s':>14} {'bw ratio':>9}"
    )
    for s, _ in plan:
        g, p = ours[s], theirs[s]
        print(
            f"{s:>10} {g * 1e6:>10.3f} {p * 1e6:>12.3f} {g / p:>7.2f} "
            f"{s / g / 1e9:>11.2f} {s / p / 1e9:>14.2f} {p / g:>9.2%}"
        )


if __name__ == "__main__":
    sys.exit(main())
