"""Soak: repeat each kind of operation many times and watch for leaks.

Phases (counts at ``--scale 1``):

* ``tag``      -- 10^6 small (8-byte) tag send/recv between two workers;
* ``connect``  -- 10^4 endpoint connect/close cycles between two workers;
* ``register`` -- 10^4 ``ctx.register`` / region close cycles;
* ``am``       -- 10^4 rendezvous active messages received with
  ``receive_into``;
* ``connect-procs`` -- 10^3 connect/close cycles to a worker in another
  process.

Each phase runs a warm-up (a tenth of its count, at least 100 and at most
10,000 iterations), then measures resident memory (``VmRSS`` of
``/proc/self/status``) and open file descriptors (``/proc/self/fd``), runs
its count, and measures again.  The target is less than 1 MiB of RSS
growth and no new descriptor per phase.

Usage::

    .venv/bin/python benchmarks/soak.py [--scale S] [--phases a,b] [--json F]

``--check`` exits 1 if a phase misses the target.  Timings are printed for
orientation only (the machine may be shared).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable

import numpy as np

import gpucx

COUNTS = {
    "tag": 1_000_000,
    "connect": 10_000,
    "register": 10_000,
    "am": 10_000,
    "connect-procs": 1_000,
}
#: Drift targets after warm-up.
RSS_LIMIT = 1 << 20
FD_LIMIT = 0

AM_ID = 7
AM_BYTES = 64 * 1024


def rss() -> int:
    """Resident set size of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def _measure() -> tuple[int, int]:
    gc.collect()
    return rss(), fds()


def _soak(name: str, count: int, step: Callable[[int], None]) -> dict:
    warm = min(10_000, max(100, count // 10))
    for i in range(warm):
        step(i)
    rss0, fd0 = _measure()
    start = time.monotonic()
    for i in range(count):
        step(i)
    seconds = time.monotonic() - start
    rss1, fd1 = _measure()
    return {
        "phase": name,
        "count": count,
        "warmup": warm,
        "seconds": round(seconds, 2),
        "rss_before": rss0,
        "rss_after": rss1,
        "rss_drift": rss1 - rss0,
        "fds_before": fd0,
        "fds_after": fd1,
        "fd_drift": fd1 - fd0,
    }


def _pair(ctx):
    a = ctx.create_worker()
    b = ctx.create_worker()
    return a, b, a.connect(b.address)


def soak_tag(count: int) -> dict:
    with gpucx.Context(features={"tag"}) as ctx:
        a, b, ab = _pair(ctx)
        src = np.arange(1, dtype=np.int64)
        dst = np.empty(1, np.int64)

        def step(i: int) -> None:
            src[0] = i
            req = ab.send_nb(src, tag=5)
            b.recv(dst, tag=5)
            while not req.done():
                a.progress()
            if dst[0] != i:
                raise AssertionError(f"tag: got {dst[0]}, sent {i}")

        return _soak("tag", count, step)


def soak_connect(count: int) -> dict:
    with gpucx.Context(features={"tag"}) as ctx:
        a = ctx.create_worker()
        b = ctx.create_worker()
        addr = b.address

        def step(i: int) -> None:
            ep = a.connect(addr)
            b.progress()
            ep.close()

        return _soak("connect", count, step)


def soak_register(count: int) -> dict:
    with gpucx.Context(features={"rma"}) as ctx:
        arr = np.zeros(4096, np.uint8)

        def step(i: int) -> None:
            region = ctx.register(arr)
            region.close()

        return _soak("register", count, step)


def soak_am(count: int) -> dict:
    with gpucx.Context(features={"am"}) as ctx:
        a, b, ab = _pair(ctx)
        src = np.ones(AM_BYTES, np.uint8)
        dst = np.zeros(AM_BYTES, np.uint8)
        got: list = []
        b.set_am_handler(AM_ID, got.append)

        def step(i: int) -> None:
            req = ab.am_send_nb(AM_ID, src, proto="rndv")
            while not got:
                a.progress()
                b.progress()
            msg = got.pop()
            if not msg.is_rndv:
                raise AssertionError("am: expected a rendezvous message")
            recv = msg.receive_into(dst)
            while not (recv.done() and req.done()):
                a.progress()
                b.progress()
            if recv.result() != AM_BYTES:
                raise AssertionError("am: short receive")

        result = _soak("am", count, step)
        b.set_am_handler(AM_ID, None)
        return result


def _serve(conn) -> None:
    """The peer of ``connect-procs``: progress a worker until told to stop."""
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        conn.send(w.address)
        while not conn.poll(0):
            w.progress()
        conn.recv()


def soak_connect_procs(count: int) -> dict:
    here, there = mp.get_context("spawn").Pipe()
    peer = mp.get_context("spawn").Process(target=_serve, args=(there,), daemon=True)
    peer.start()
    try:
        if not here.poll(60):
            raise RuntimeError("connect-procs: the peer did not start")
        addr = here.recv()
        with gpucx.Context(features={"tag"}) as ctx:
            a = ctx.create_worker()

            def step(i: int) -> None:
                a.connect(addr).close()

            result = _soak("connect-procs", count, step)
        here.send("stop")
        peer.join(30)
        if peer.exitcode != 0:
            raise RuntimeError(f"connect-procs: the peer exited with {peer.exitcode}")
        return result
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join(5)
        here.close()
        there.close()


PHASES = {
    "tag": soak_tag,
    "connect": soak_connect,
    "register": soak_register,
    "am": soak_am,
    "connect-procs": soak_connect_procs,
}


def run(scale: float = 1.0, phases=None) -> list[dict]:
    """Run the named phases (all by default) at ``scale`` x their counts."""
    out = []
    for name in phases or PHASES:
        count = max(1, int(COUNTS[name] * scale))
        out.append(PHASES[name](count))
    return out


def within_target(result: dict) -> bool:
    return result["rss_drift"] < RSS_LIMIT and result["fd_drift"] <= FD_LIMIT


def _row(r: dict) -> str:
    ok = "ok" if within_target(r) else "OVER"
    return (
        f"{r['phase']:<14} {r['count']:>9,} {r['seconds']:>8.1f} s "
        f"RSS {r['rss_before'] / 2**20:8.1f} -> {r['rss_after'] / 2**20:8.1f} MiB "
        f"({r['rss_drift'] / 1024:+8.0f} KiB)  fds {r['fds_before']} -> "
        f"{r['fds_after']} ({r['fd_drift']:+d})  {ok}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiply every count")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)}",
    )
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    names = [n for n in args.phases.split(",") if n]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}")
    results = []
    for name in names:
        r = run(args.scale, [name])[0]
        print(_row(r), flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.check and not all(within_target(r) for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
