"""Deadlines are kept: a wait with ``timeout=`` on an operation UCX cannot
cancel (a send) returns on time, and the operation's buffer stays alive
until UCX lets go of it."""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucx

from .peers import BIG
from conftest import Pair

#: How late a deadline may be kept (one wait slice and some load).
SLACK_S = 0.5


def _timed(fn, timeout):
    t0 = time.monotonic()
    with pytest.raises(gpucx.TimeoutError):
        fn(timeout)
    late = time.monotonic() - t0 - timeout
    assert -0.05 < late < SLACK_S, f"deadline kept {late:.3f} s late"


def _deliver(pair, req, data):
    """Let the receiver progress: the parked send completes intact."""
    back = np.empty_like(data)
    rreq = pair.b.recv_nb(back, tag=5)
    end = time.monotonic() + 30
    while not rreq.done():
        pair.a.progress()
        assert time.monotonic() < end, "the parked send never completed"
    assert np.array_equal(back, data)
    end = time.monotonic() + 10
    while pair.a._engine.parked:  # the parked slot is freed once UCX lets go
        pair.a.progress()
        pair.a._engine.poll_events()
        assert time.monotonic() < end, "a completed send stayed parked"
    assert req.done()


def test_send_wait_timeout_is_kept(tls, ctx):
    pair = Pair(ctx)
    data = np.random.default_rng(1).integers(0, 255, BIG, dtype=np.uint8)
    req = pair.ab.send_nb(data, tag=5)  # rendezvous: waits for the receiver
    _timed(req.wait, 1.0)
    # The buffer is the request's (and the parked slot's) until UCX is done.
    _deliver(pair, req, data)


def test_flush_timeout_is_kept(tls, ctx):
    pair = Pair(ctx)
    data = np.random.default_rng(2).integers(0, 255, BIG, dtype=np.uint8)
    req = pair.ab.send_nb(data, tag=5)
    _timed(lambda t: pair.ab.flush(timeout=t), 1.0)
    _deliver(pair, req, data)


def test_recv_timeout_is_kept(tls, ctx):
    pair = Pair(ctx)
    buf = bytearray(64)
    _timed(lambda t: pair.a.recv(buf, tag=9, timeout=t), 0.5)
    assert not pair.a._engine.parked  # a receive cancels at once: nothing parked
