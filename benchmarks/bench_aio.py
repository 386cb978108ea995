"""Async vs blocking 8-byte tag round trip between two processes.

    python benchmarks/bench_aio.py [--iters N] [--tls TLS]

Runs, in one session: the blocking API (``ep.send`` + ``worker.recv``), the
asyncio API in event mode (``await ep.asend`` / ``await w.arecv``, progress
driven by the worker's fd) and in poll mode.  The peer echoes with the same
API as the measuring side.  Prints the one-way latency (half a round trip)
and the async/blocking ratios.  ucxx is not installable on the machine
these figures were recorded on, so it is not run here.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import numpy as np


def _echo(conn, config, mode, iters):
    import gpucx
    import gpucx.aio

    if mode == "blocking":
        with gpucx.Context(features={"tag"}, config=config) as ctx:
            w = ctx.create_worker()
            conn.send(w.address)
            ep = w.connect(conn.recv())
            buf = np.zeros(1, np.int64)
            for _ in range(iters):
                w.recv(buf, tag=1)
                ep.send(buf, tag=2)
            conn.recv()
        return

    async def main():
        with gpucx.Context(features={"tag"}, config=config) as ctx:
            async with gpucx.aio.Worker(ctx, progress=mode) as w:
                conn.send(w.address)
                ep = await w.aconnect(conn.recv())
                buf = np.zeros(1, np.int64)
                for _ in range(iters):
                    await w.arecv(buf, tag=1)
                    await ep.asend(buf, tag=2)
                conn.recv()

    asyncio.run(main())


def measure(mode: str, iters: int, config) -> float:
    import gpucx
    import gpucx.aio

    mpc = mp.get_context("spawn")
    parent, child = mpc.Pipe()
    p = mpc.Process(target=_echo, args=(child, config, mode, iters))
    p.start()
    warm = iters // 10
    buf = np.zeros(1, np.int64)
    if mode == "blocking":
        with gpucx.Context(features={"tag"}, config=config) as ctx:
            w = ctx.create_worker()
            ep = w.connect(parent.recv())
            parent.send(w.address)
            for i in range(iters):
                if i == warm:
                    t0 = time.perf_counter()
                ep.send(buf, tag=1)
                w.recv(buf, tag=2)
            dt = time.perf_counter() - t0
            parent.send("bye")
    else:

        async def main():
            with gpucx.Context(features={"tag"}, config=config) as ctx:
                async with gpucx.aio.Worker(ctx, progress=mode) as w:
                    ep = await w.aconnect(parent.recv())
                    parent.send(w.address)
                    t0 = 0.0
                    for i in range(iters):
                        if i == warm:
                            t0 = time.perf_counter()
                        await ep.asend(buf, tag=1)
                        await w.arecv(buf, tag=2)
                    dt = time.perf_counter() - t0
                    parent.send("bye")
                    return dt

        dt = asyncio.run(main())
    p.join(60)
    return dt / (iters - warm) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--tls", default=None)
    args = ap.parse_args(argv)
    config = {"TLS": args.tls} if args.tls else None
    res = {m: measure(m, args.iters, config) for m in ("blocking", "event", "poll")}
    base = res["blocking"]
    print(f"{'API':>10} {'one-way us':>11} {'vs blocking':>12}")
    for m, t in res.items():
        print(f"{m:>10} {t * 1e6:>11.2f} {t / base:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
