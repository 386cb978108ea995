"""Requests of non-blocking calls: settled at birth when UCX finished the
operation while it was posted, and never sharing a completion slot with
another operation."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from gpucx._internal import engine
from gpucx.request import Request

pytestmark = pytest.mark.timeout(60)


def _settled(req) -> bool:
    return type(req) is not Request


def test_sends_finished_at_post_are_settled_distinct_requests(pair, tls):
    """Small sends finish inside the call over shared memory (over TCP they
    may wait for the socket): each gives its own settled Request that behaves
    like any finished one."""
    reqs = [pair.ab.send_nb(b"x" * 8, tag=1) for _ in range(3)]
    reqs.append(pair.ab.am_send_nb(5, b"y", proto="eager"))
    if tls != "tcp":
        assert all(_settled(r) for r in reqs)
    pair.drive(*reqs)
    for r in reqs:
        assert isinstance(r, Request)
        assert r.done() and r.result() is None and r.wait() is None
        assert r.exception() is None and not r.cancelled() and not r.cancel()
        assert "done" in repr(r)
    assert len({id(r) for r in reqs}) == len(reqs)
    # The messages did go out.
    got = []
    pair.b.set_am_handler(5, got.append)
    bufs = [bytearray(8) for _ in range(3)]
    assert pair.drive(*[pair.b.recv_nb(b, tag=1) for b in bufs]) == [(1, 8)] * 3
    assert all(bytes(b) == b"x" * 8 for b in bufs)
    end = time.monotonic() + 10
    while not got:
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    assert bytes(got[0].data) == b"y"


def test_settled_request_can_be_awaited(pair):
    async def main():
        return await pair.ab.send_nb(b"z", tag=2)

    assert asyncio.run(main()) is None
    pair.drive(pair.b.recv_nb(bytearray(1), tag=2))


def test_pending_request_keeps_its_slot_while_later_ones_settle(pair):
    """A rendezvous send stays pending until the receiver asks for it; many
    sends that settle at once in the meantime must not disturb its slot."""
    big = np.arange(1 << 20, dtype=np.uint8)
    pending = pair.ab.send_nb(big, tag=3)
    assert not pending.done()
    small = [pair.ab.send_nb(np.full(8, i, np.uint8), tag=4) for i in range(50)]
    assert not pending.done()
    out = np.zeros(1 << 20, np.uint8)
    recv = pair.b.recv_nb(out, tag=3)
    pair.drive(pending, recv)
    assert np.array_equal(out, big)
    got = np.zeros(8, np.uint8)
    for i in range(50):
        pair.drive(pair.b.recv_nb(got, tag=4))
        assert (got == i).all()
    assert all(r.done() for r in small)


def test_request_endpoint_names_where_the_operation_runs(pair):
    """Request.endpoint: the endpoint of a send while it is pending, None for
    a worker-wide receive and for a request settled at birth; what an
    endpoint's close drains is its own requests (Engine.pending_on), not
    another endpoint's."""
    big = np.arange(1 << 20, dtype=np.uint8)
    send = pair.ab.send_nb(big, tag=7)
    assert not send.done() and send.endpoint is pair.ab
    out = np.zeros(1 << 20, np.uint8)
    recv = pair.b.recv_nb(out, tag=7)
    assert recv.endpoint is None
    pair.drive(send, recv)
    assert np.array_equal(out, big)
    done = pair.ab.send_nb(b"x", tag=8)
    if type(done) is not Request:  # finished when posted: no endpoint kept
        assert done.endpoint is None
    pair.drive(done, pair.b.recv_nb(bytearray(1), tag=8))
    # A pending send on another endpoint of the worker is not this one's.
    other = pair.a.connect(pair.b.address)
    try:
        pending = pair.ab.send_nb(big, tag=9)
        assert not pending.done()
        e = engine(pair.a)
        assert e.pending_on(pair.ab) == [pending] and e.pending_on(other) == []
        other.close(timeout=5)
        assert not pending.done() and pending.endpoint is pair.ab
        pair.drive(pending, pair.b.recv_nb(out, tag=9))
        assert e.pending_on(pair.ab) == []
    finally:
        other.close()


def test_put_and_get_nb_settle_or_track(pair, tls):
    """put_nb/get_nb: results land whether UCX finished them at post time
    (settled request) or later (tracked request)."""
    region = pair.ctx.register(np.zeros(4096, np.uint8))
    key = pair.ab.unpack(region.remote())
    src = np.arange(4096, dtype=np.uint8)
    reqs = [
        pair.ab.put_nb(src[i * 512 : (i + 1) * 512], key, i * 512) for i in range(8)
    ]
    pair.drive(*reqs)
    back = np.zeros(4096, np.uint8)
    pair.drive(pair.ab.get_nb(back, key, 0))
    assert np.array_equal(back, src)
    key.close()
    region.close()


def test_multi_thread_worker_requests(ctx):
    a = ctx.create_worker("multi")
    b = ctx.create_worker("multi")
    ep = a.connect(b.address)
    r = ep.send_nb(b"m", tag=1)
    buf = bytearray(1)
    rr = b.recv_nb(buf, tag=1)
    end = 200000
    while not (r.done() and rr.done()) and end:
        a.progress()
        b.progress()
        end -= 1
    assert rr.result() == (1, 1) and bytes(buf) == b"m"
    a.close()
    b.close()
