"""How soon a blocking wait sees a local peer process die.

    python benchmarks/blocking_peer_death.py [-n 9] [--tls shm] [--interval S]

A spawned peer (``tests/peers_aio.py``) hands out its worker address and
kills itself with SIGKILL when told; this process sits in a blocking
``ep.stream_recv`` on its endpoint and prints the median and range of the
time from telling it to the wait raising ``PeerError``.  Over shared memory
UCX reports nothing: before blocking waits slept on the watched peers'
pidfds, gpucx's liveness check between wait slices (every
``GPUCX_PEER_CHECK_INTERVAL``, 0.1 s by default) was what noticed.
``--interval`` sets that interval.  (``aio_peer_death.py`` measures the
same for ``gpucx.aio``.)
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from aio_peer_death import options, peer_to_kill  # noqa: E402

import gpucx  # noqa: E402


def once(tls: str, interval: float | None) -> float:
    """Seconds from the kill order to the blocking wait's PeerError."""
    ch, child, cfg = peer_to_kill(tls, interval)
    told = []

    def tell() -> None:
        told.append(time.monotonic())
        ch.put("die")

    try:
        with gpucx.Context(config=cfg) as ctx:
            w = ctx.create_worker()
            ep = w.connect(ch.get(60))
            ep.send(b"hello", tag=7)
            # A random phase against the periodic check's interval.
            timer = threading.Timer(0.2 + random.random() * 0.1, tell)
            timer.start()
            try:
                ep.stream_recv(bytearray(8), timeout=60)
            except gpucx.PeerError:
                took = time.monotonic() - told[0]
            else:
                raise AssertionError("the stream receive completed")
            timer.join()
            w.close()
    finally:
        child.join(10)
    return took


def main() -> None:
    args = options(__doc__)
    ms = sorted(once(args.tls, args.interval) * 1e3 for _ in range(args.n))
    print(
        f"gpucx {gpucx.__version__}, tls {args.tls}, interval "
        f"{args.interval if args.interval is not None else 'default'}: "
        f"PeerError {statistics.median(ms):.1f} ms after the kill order "
        f"(median of {args.n}; {ms[0]:.1f}-{ms[-1]:.1f})"
    )


if __name__ == "__main__":
    main()
