"""How soon ``gpucx.aio`` sees a local peer process die.

    python benchmarks/aio_peer_death.py [-n 9] [--tls shm] [--interval S]

A spawned peer (``tests/peers_aio.py``) hands out its worker address and
kills itself with SIGKILL when told; this process awaits
``Endpoint.wait_closed()`` and prints the median and range of the time from
telling it to ``wait_closed`` returning the endpoint's ``PeerError``.  Over
shared memory UCX reports nothing: before the driver watched pidfds, gpucx's
liveness check (every ``GPUCX_PEER_CHECK_INTERVAL``, 0.1 s by default) was
what noticed.  ``--interval`` sets that interval.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import gpucx  # noqa: E402
import gpucx.aio  # noqa: E402

from conftest import channel_pair, spawn, transport_config  # noqa: E402
from peers_aio import aio_peer_to_kill  # noqa: E402


def peer_to_kill(tls: str, interval: float | None):
    """Spawn the peer; return its channel, its process and the context
    config for this side (``--tls``, ``--interval``)."""
    ch, theirs = channel_pair()
    child = spawn(aio_peer_to_kill, tls, "address", theirs)
    cfg = dict(transport_config(tls))
    if interval is not None:
        cfg["GPUCX_PEER_CHECK_INTERVAL"] = interval
    return ch, child, cfg


async def once(tls: str, interval: float | None) -> float:
    """Seconds from the kill order to ``wait_closed`` returning."""
    ch, child, cfg = peer_to_kill(tls, interval)
    try:
        with gpucx.Context(config=cfg) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                ep = w.connect(ch.get(60))
                await ep.asend(b"hello", tag=7)
                closed = asyncio.ensure_future(ep.wait_closed())
                await asyncio.sleep(0.2)
                ch.put("die")
                t0 = time.monotonic()
                err = await asyncio.wait_for(closed, 60)
                took = time.monotonic() - t0
                assert isinstance(err, gpucx.PeerError), err
                ep.close()
    finally:
        child.join(10)
    return took


def options(doc: str) -> argparse.Namespace:
    """The command line of this script and of blocking_peer_death.py."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("-n", type=int, default=9, help="trials (default 9)")
    ap.add_argument("--tls", default="shm", help="default, tcp or shm")
    ap.add_argument(
        "--interval", type=float, default=None, help="GPUCX_PEER_CHECK_INTERVAL"
    )
    return ap.parse_args()


def main() -> None:
    args = options(__doc__)
    ms = [asyncio.run(once(args.tls, args.interval)) * 1e3 for _ in range(args.n)]
    print(
        f"gpucx {gpucx.__version__}, tls {args.tls}: kill -> wait_closed "
        f"median {statistics.median(ms):.1f} ms, range {min(ms):.1f}-"
        f"{max(ms):.1f} ms (n={args.n})"
    )


if __name__ == "__main__":
    main()
