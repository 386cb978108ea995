"""A peer flooding a receiver that stopped receiving cannot grow its memory
without bound (docs/reliability.md, "Bounded queues").

A second process sends many 8 KiB messages, eagerly, to an AM id the
receiver used once with a posted receive (then to the notification id, then
as arrays received once with ``recv_array``); the receiver only progresses.
Its resident memory must grow by less than 256 MiB, the drops are counted,
and a tag message sent after the flood still arrives.  The default run
sends 20,000 of each (past every default cap: 20,000 x 8 KiB = 156 MiB >
the 64 MiB byte caps); ``-m soak`` sends the 160,000 of issue 16.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from peers_flood import AFTER_TAG, FLOOD_AM_ID, flood

import gpucx

from conftest import channel_pair, join_ok, spawn, transport_config

SIZE = 8192
LIMIT = 256 << 20


def rss() -> int:
    """This process's resident memory in bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


_QUEUE = {"am": "am_kept", "notify": "notify", "arrays": "arrays"}


def run_flood(tls: str, kind: str, n: int, caps=None):
    """Flood this process from a child; return (RSS growth, stats).

    ``caps``: extra ``GPUCX_*`` options (``{"GPUCX_AM_KEPT_MAX_COUNT": 0,
    ...}`` measures the receiver without caps)."""
    ours, theirs = channel_pair()
    child = spawn(flood, theirs, tls, kind, n, SIZE)
    try:
        with (
            gpucx.Context(
                config=dict(transport_config(tls) or {}, **(caps or {}))
            ) as ctx,
            warnings.catch_warnings(record=True) as rec,
        ):
            warnings.simplefilter("always")
            w = ctx.create_worker()
            first = np.zeros(SIZE, np.uint8)
            req = w.am_recv_nb(FLOOD_AM_ID, first) if kind == "am" else None
            ours.put(w.address)
            ep = w.connect(ours.get())
            # The first message is taken as an application would; then the
            # receiver stops receiving and only progresses.
            if kind == "am":
                req.wait(30)
                left = n - 1
            elif kind == "notify":
                left = n - len(w.notifications(timeout=30))
            else:
                assert ep.recv_array(timeout=30).nbytes == SIZE
                left = n - 1
            base = rss()
            peak = base
            q = _QUEUE[kind]
            end = time.monotonic() + 120
            flooded = False
            while True:
                for _ in range(200):
                    w.progress()
                s = w.stats()[q]
                peak = max(peak, rss())
                flooded = flooded or ours.poll()
                if flooded and s.count + s.dropped >= left:
                    break
                assert time.monotonic() < end, f"flood not over: {s}"
            growth = peak - base
            buf = bytearray(64)
            info = w.recv(buf, tag=AFTER_TAG, timeout=30)
            assert bytes(buf[: info.nbytes]) == b"after the flood"
            s = w.stats()[q]
            drops = [
                r for r in rec if issubclass(r.category, gpucx.DroppedMessagesWarning)
            ]
            assert len(drops) == (1 if s.dropped else 0), [
                str(r.message) for r in drops
            ]
            ours.put("bye")
        join_ok(child, 60)
    finally:
        if child.is_alive():
            child.kill()
    return growth, s


def _check(growth, s, n):
    assert growth < LIMIT, f"RSS grew by {growth >> 20} MiB"
    assert s.dropped > 0 and s.count <= s.max_count and s.bytes <= s.max_bytes
    print(f"RSS growth {growth / 2**20:.1f} MiB; {s}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["am", "notify", "arrays"])
@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_flood_is_bounded(tls, kind):
    n = 20_000
    growth, s = run_flood(tls, kind, n)
    _check(growth, s, n)


@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["am", "notify", "arrays"])
@pytest.mark.parametrize("tls", ["default", "shm", "tcp"])
def test_flood_of_issue_16_is_bounded(tls, kind):
    n = 160_000
    growth, s = run_flood(tls, kind, n)
    _check(growth, s, n)
