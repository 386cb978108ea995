"""Two real processes talking over real UCX transports."""

from __future__ import annotations

import contextlib
import time
import weakref

import numpy as np
import pytest

import gpucx

from conftest import (
    channel_pair,
    check_transports,
    join_ok,
    spawn,
    transport_config,
)
from peers import connect_then_die, die_before_receiving, echo_server

pytestmark = pytest.mark.timeout(120)

SIZES = [0, 8, 1000, 65536, 1 << 20, 9 << 20]


@pytest.mark.parametrize("via_listener", [False, True], ids=["address", "listener"])
def test_echo_across_processes(tls, via_listener):
    q, theirs = channel_pair()
    child = spawn(echo_server, tls, theirs, len(SIZES), via_listener)
    try:
        with gpucx.Context(config=transport_config(tls, via_listener)) as ctx:
            w = ctx.create_worker()
            kind, where = q.get(60)
            if via_listener:
                ep = w.connect(("127.0.0.1", where))
            else:
                ep = w.connect(where)
                q.put(w.address)
            for i, n in enumerate(SIZES):
                src = np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8)
                back = np.zeros(n, np.uint8)
                req = w.recv_nb(back, tag=i | 1 << 32)
                ep.send(src, tag=i)
                assert req.wait(60) == (i | 1 << 32, n)
                assert np.array_equal(src, back)
            tag, transports = q.get(60)
            check_transports(tls, transports, ep.transports)
            q.put("bye")
    finally:
        join_ok(child, 60)


def test_peer_death_fails_pending_send():
    """Over TCP a killed peer fails the pending rendezvous send at once.

    Shared memory (UCX 1.22 with MM_ERROR_HANDLING=y) does not report a dead
    peer at all; gpucx's own liveness checks do (tests/faults).
    """
    q, theirs = channel_pair()
    child = spawn(die_before_receiving, theirs)
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(q.get(60))
        q.put(w.address)
        w.recv(bytearray(5), tag=1, timeout=30)
        req = ep.send_nb(np.ones(16 << 20, np.uint8), tag=2)  # rendezvous
        q.put("die")
        child.join(30)
        with pytest.raises(gpucx.PeerError):
            req.wait(timeout=30)
        assert isinstance(ep.error, gpucx.PeerError)
        with pytest.raises(gpucx.PeerError):
            ep.send(b"x" * 100, tag=3)
        ep.close()
    assert child.exitcode is not None and child.exitcode < 0


@contextlib.contextmanager
def _peer_process(tls, progress=False):
    """A spawned :func:`peers.connect_then_die`, connected both ways:
    yields ``(chan, process, worker, endpoint)``."""
    q, theirs = channel_pair()
    child = spawn(connect_then_die, tls, theirs, progress)
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        ep = w.connect(q.get(60))
        q.put(w.address)
        yield q, child, w, ep


@pytest.mark.parametrize("tls", ["default", "tcp", "shm"])
def test_a_send_failed_by_a_dead_peer_frees_its_buffer_under_progress(tls):
    """A rendezvous send the peer never received fails with PeerError when
    the peer dies.  UCX may let go of it only after that (gpucx then keeps
    the buffer parked): a loop of ``progress()`` alone, with no blocking
    wait, still frees the buffer."""
    with _peer_process(tls, progress=True) as (q, child, w, ep):
        buf = np.ones(8 << 20, np.uint8)  # rendezvous on every transport
        freed = weakref.ref(buf)
        req = ep.send_nb(buf, tag=1)
        del buf
        end = time.monotonic() + 0.2  # the peer sees the message arrive
        while time.monotonic() < end:
            w.progress()
        q.put("die")
        child.join(30)
        assert child.exitcode is not None
        end = time.monotonic() + 30
        while not req.done():
            w.progress()
            assert time.monotonic() < end, "the send did not fail"
        with pytest.raises(gpucx.PeerError):
            req.result()
        del req
        while freed() is not None:
            w.progress()
            assert time.monotonic() < end, "the failed send's buffer is still held"


@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_send_to_a_peer_that_just_died_raises_peer_error(tls):
    """A 64 KiB send posted right after the peer died, before gpucx's
    liveness check looked: over TCP UCX reports the peer; over shared memory
    it fails with "Shared memory error" (the dead peer's segment is gone),
    which gpucx reports as the PeerError it is once /proc confirms it."""
    with _peer_process(tls) as (q, child, _w, ep):
        q.put("die")
        child.join(30)
        assert child.exitcode is not None
        with pytest.raises(gpucx.PeerError, match="peer process|Endpoint timeout"):
            ep.send(np.ones(1 << 16, np.uint8), tag=1, timeout=30)
        assert isinstance(ep.error, gpucx.PeerError)
        with pytest.raises(gpucx.PeerError):
            ep.send(b"x" * 100, tag=2)
