"""ucxx's active messages against ucx_perftest, for the comparison with gpucx.

ucxx (the RAPIDS UCX binding) is not a dependency of gpucx: it needs its
own ``libucx-cu12`` (1.21 for ucxx 0.52, while gpucx's default is 1.22), so
run this script from a separate venv::

    python -m venv /tmp/ucxxenv
    /tmp/ucxxenv/bin/pip install ucxx-cu12 numpy
    UCX_MM_ERROR_HANDLING=y /tmp/ucxxenv/bin/python benchmarks/ucxx_am.py

Each round measures, between two processes on this host, ucxx's AM
bandwidth (the client keeps ``--window`` ``ep.am_send`` in flight, the
server awaits ``ep.am_recv()`` for each message, as a Python program using
ucxx receives: ucxx's C++ layer takes each message in its UCX callback and
the await returns it in a buffer ucxx allocated) and ``ucx_perftest -t
ucp_am_bw -e`` from the same venv's libucx.  ucxx creates its endpoints
with peer error handling, so perftest gets ``-e``; set
``UCX_MM_ERROR_HANDLING=y`` as gpucx does, or both fall back to TCP.

The gpucx figures to set beside these come from ``benchmarks/compare.py``
(``--api python``: a handler and ``receive_into``) in the same session.
Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_rma


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(port: int, size: int, count: int) -> None:
    import ucxx

    done = asyncio.Event()

    async def handle(ep) -> None:
        for _ in range(count):
            msg = await ep.am_recv()
            if len(msg) != size:
                raise RuntimeError(f"got {len(msg)} bytes, sent {size}")
        await ep.am_send(np.ones(8, np.uint8))  # all arrived
        done.set()

    listener = ucxx.create_listener(handle, port)
    print("listening", flush=True)
    await done.wait()
    await asyncio.sleep(0.2)  # the acknowledgement leaves before the close
    listener.close()


async def _send(port: int, size: int, count: int, window: int) -> float:
    """Seconds for ``count`` messages after a warm-up window."""
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    buf = np.ones(size, np.uint8)
    await asyncio.gather(*[ep.am_send(buf) for _ in range(window)])  # warm-up
    t0 = time.perf_counter()
    pending: list = []
    for _ in range(count - window):
        pending.append(asyncio.ensure_future(ep.am_send(buf)))
        if len(pending) >= window:
            await pending.pop(0)
    await asyncio.gather(*pending)
    await ep.am_recv()  # the server's acknowledgement: everything arrived
    dt = time.perf_counter() - t0
    await ep.close()
    return dt


def ucxx_round(size: int, count: int, window: int) -> float:
    """One ucxx run: GB/s over ``count - window`` messages."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(size), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if server.stdout is None or server.stdout.readline().strip() != "listening":
            raise RuntimeError("the ucxx server did not start")
        dt = asyncio.run(_send(port, size, count, window))
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return (count - window) * size / dt / 1e9


def perftest_round(size: int, count: int) -> float:
    """One ``ucx_perftest -t ucp_am_bw -e`` run: GB/s (overall), through
    ``bench_rma.perftest`` (which imports nothing of gpucx at load)."""
    from bench_rma import perftest

    mib_s = perftest("ucp_am_bw", size, count, "default", eh=True)["bw"]
    return mib_s * (1 << 20) / 1e9


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        port, size, count = map(int, sys.argv[2:5])
        asyncio.run(_serve(port, size, count))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1 << 20, help="bytes a message")
    p.add_argument("--count", type=int, default=5000, help="messages a run")
    p.add_argument("--window", type=int, default=32, help="sends in flight")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import libucx
    import ucxx

    print(
        f"ucxx {ucxx.__version__}, libucx {libucx.__version__}, "
        f"{args.size} B, {args.count} messages, window {args.window}"
    )
    rows = []
    for i in range(args.rounds):
        u = ucxx_round(args.size, args.count, args.window)
        pt = perftest_round(args.size, args.count)
        rows.append((u, pt))
        print(f"round {i + 1}: ucxx {u:.3f} GB/s, perftest {pt:.3f} GB/s, {u / pt:.2f}")
    us = [u for u, _ in rows]
    pts = [pt for _, pt in rows]
    print(
        f"median: ucxx {statistics.median(us):.3f} GB/s, perftest "
        f"{statistics.median(pts):.3f} GB/s; best/best {max(us) / max(pts):.2f}; "
        f"median of ratios {statistics.median(u / p for u, p in rows):.2f}"
    )


if __name__ == "__main__":
    main()
