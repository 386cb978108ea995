"""``timeout=`` on the blocking sends and atomics.

The peer worker is never progressed, so a rendezvous send (or a software
atomic over TCP) cannot complete: the call raises ``gpucx.TimeoutError`` close
to its deadline, the worker stays usable, and the send, still owned by UCX,
completes once the peer progresses.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucx
from gpucx._lib import lib

from conftest import Pair

pytestmark = pytest.mark.timeout(60)

INPROGRESS = lib.UCS_INPROGRESS
BIG = 8 << 20  # rendezvous on every transport


def _timed(fn, timeout=0.3):
    t0 = time.monotonic()
    with pytest.raises(gpucx.TimeoutError) as info:
        fn(timeout)
    elapsed = time.monotonic() - t0
    assert timeout * 0.9 <= elapsed < timeout + 2.0, elapsed
    return info.value


@pytest.fixture(params=["default", "tcp"])
def stalled(request):
    cfg = {"TLS": "tcp"} if request.param == "tcp" else None
    with gpucx.Context(config=cfg) as ctx:
        pair = Pair(ctx)
        yield pair
        # A send that timed out is still in flight: drop it at once rather
        # than let the close wait for a peer that never receives it.
        pair.ab.close(force=True)


def test_send_timeout(stalled):
    buf = np.ones(BIG, np.uint8)
    exc = _timed(lambda t: stalled.ab.send(buf, tag=1, timeout=t))
    assert "within 0.3 s" in str(exc)
    # Not withdrawn: once the peer receives, the message is there whole.
    out = np.zeros(BIG, np.uint8)
    stalled.drive(stalled.b.recv_nb(out, tag=1), timeout=30)
    assert out.all()


def test_send_list_timeout(stalled):
    bufs = [np.ones(BIG // 2, np.uint8), np.ones(BIG // 2, np.uint8)]
    _timed(lambda t: stalled.ab.send(bufs, tag=2, timeout=t))


def test_am_send_timeout(stalled):
    buf = np.ones(BIG, np.uint8)
    _timed(lambda t: stalled.ab.am_send(7, buf, proto="rndv", timeout=t))


def test_send_array_timeout(stalled):
    arr = np.ones(BIG, np.uint8)
    _timed(lambda t: stalled.ab.send_array(arr, proto="rndv", timeout=t))


def test_stream_send_timeout(stalled):
    buf = np.ones(BIG, np.uint8)
    _timed(lambda t: stalled.ab.stream_send(buf, timeout=t))


def test_send_with_timeout_that_completes(stalled):
    """A timeout that does not pass changes nothing."""
    out = np.zeros(64, np.uint8)
    # Wire the endpoint up first (over TCP that needs the peer's progress).
    stalled.drive(stalled.ab.send_nb(out, tag=4), stalled.b.recv_nb(out, tag=4))
    req = stalled.b.recv_nb(out, tag=3)
    stalled.ab.send(np.full(64, 9, np.uint8), tag=3, timeout=10)
    stalled.drive(req)
    assert (out == 9).all()


def _progress_until(a, b, cond, seconds=20.0):
    """Progress both workers until ``cond()``; then until the parked (timed
    out) operations of ``a`` finished too, so the close finds none running."""
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        a.progress()
        b.progress()
    assert cond()
    while any(s.status == INPROGRESS for s, *_ in a._engine.parked):
        assert time.monotonic() < end, "timed-out operations never finished"
        a.progress()
        b.progress()


def test_atomic_timeout_over_tcp():
    """Over TCP UCX emulates atomics with messages the target must progress
    (a non-fetching one completes locally, so the fetching ones are timed)."""
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address, error_handling=False)
        mem = np.zeros(4, np.uint64)
        region = ctx.register(mem)
        key = ep.unpack(region.remote())
        _timed(lambda t: ep.fetch_add(key, 1, timeout=t))
        _timed(lambda t: ep.swap(key, 1, 8, timeout=t))
        _timed(lambda t: ep.compare_swap(key, 0, 5, 16, timeout=t))
        # Not withdrawn: they land once the target progresses, and the
        # worker goes on working.
        _progress_until(a, b, lambda: list(mem[:3]) == [1, 1, 5])
        req = ep.fetch_add_nb(key, 1, 24)
        _progress_until(a, b, req.done)
        assert req.result() == 0 and mem[3] == 1


def test_atomic_request_is_not_canceled():
    """UCX cannot cancel a software atomic (it aborts the process when asked
    to): a request's wait timeout and cancel() leave it running."""
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address, error_handling=False)
        mem = np.zeros(2, np.uint64)
        region = ctx.register(mem)
        key = ep.unpack(region.remote())
        req = ep.fetch_add_nb(key, 5)
        _timed(req.wait)
        assert req.cancel() is False and not req.cancelled()
        _progress_until(a, b, req.done)
        assert req.result() == 0 and mem[0] == 5
        assert not req.cancelled() and not req.canceled
