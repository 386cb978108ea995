"""Where the time of one array goes: ``send_array``/``recv_array`` between
two processes, as ``gpucx bench -t array_bw`` sends them but one blocking
array at a time.

    python benchmarks/array_profile.py [cupy|numpy] [NBYTES] [ITERS] [WINDOW]

Prints the receiver's time per array (the peer sends with a blocking
``send_array``), the same peer's blocking tag send into one receive buffer
for comparison, the receiver's pieces timed alone (allocation, for CuPy
the views ``recv_array`` once built, the CUDA array interface and
``gpucx.mem.as_buffer``) and a cProfile of the receiver's loop, sorted by
own time.  On a GPU machine ``cupy`` (the default) measures device arrays;
``numpy`` runs anywhere.  WINDOW (default 0: blocking ``recv_array``)
keeps that many ``recv_array_nb`` posted instead, as ``gpucx bench -t
array_bw`` receives.
"""

from __future__ import annotations

import collections
import cProfile
import multiprocessing as mp
import pstats
import sys
import time


def _xp(name: str):
    if name == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def _sender(conn, name: str, n: int) -> None:
    import gpucx

    xp = _xp(name)
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        conn.send(w.address)
        ep = w.connect(conn.recv())
        x = xp.ones(n, xp.uint8)
        mode = conn.recv()
        while mode != "stop":
            if mode == "array":
                ep.send_array(x, timeout=30)
            else:
                ep.send(x, tag=5, timeout=30)
            if conn.poll():
                mode = conn.recv()


def _per_call(label: str, f, k: int) -> None:
    f()
    t0 = time.perf_counter()
    for _ in range(k):
        f()
    print(f"  {label}: {1e6 * (time.perf_counter() - t0) / k:.2f} us")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "cupy"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    window = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    import gpucx

    xp = _xp(name)
    ours, theirs = mp.Pipe()
    peer = mp.get_context("spawn").Process(
        target=_sender, args=(theirs, name, n), daemon=True
    )
    peer.start()
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(ours.recv())
        ours.send(w.address)
        ours.send("array")

        def arrays(k: int) -> None:
            if not window:
                for _ in range(k):
                    ep.recv_array(timeout=30)
                return
            posted: collections.deque = collections.deque()
            for i in range(k):
                while len(posted) < window and i + len(posted) < k:
                    posted.append(ep.recv_array_nb())
                posted.popleft().wait(30)

        arrays(300)
        t0 = time.perf_counter()
        arrays(iters)
        per = 1e6 * (time.perf_counter() - t0) / iters
        how = f"{window} recv_array_nb posted" if window else "recv_array"
        print(f"{name} {n} B: {how}: {per:.1f} us an array (blocking send_array)")
        prof = cProfile.Profile()
        prof.enable()
        arrays(iters)
        prof.disable()
        ours.send("tag")
        while True:  # the arrays still in flight
            try:
                ep.recv_array(timeout=0.2)
            except gpucx.TimeoutError:
                break
        buf = xp.empty(n, xp.uint8)

        def tags(k: int) -> None:
            for _ in range(k):
                w.recv(buf, tag=5, timeout=30)

        tags(300)
        t0 = time.perf_counter()
        tags(iters)
        per = 1e6 * (time.perf_counter() - t0) / iters
        print(f"  the same peer, blocking tag into one buffer: {per:.1f} us a message")
        ours.send("stop")
        _per_call("allocation (empty)", lambda: xp.empty(n, xp.uint8), iters)
        if name == "cupy":
            from gpucx.mem import as_buffer

            y = xp.empty(n, xp.uint8)
            _per_call(
                "asarray.ravel.view.slice.view.reshape",
                lambda: xp.asarray(y).ravel().view(xp.uint8)[:n].view("<f4"),
                iters,
            )
            _per_call(
                "__cuda_array_interface__", lambda: y.__cuda_array_interface__, iters
            )
            _per_call("gpucx.mem.as_buffer", lambda: as_buffer(y), iters)
        while True:  # tag messages still in flight
            try:
                w.recv(buf, tag=5, timeout=0.2)
            except gpucx.TimeoutError:
                break
    peer.join(10)
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
