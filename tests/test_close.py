"""Close semantics: what happens to outstanding operations when an endpoint,
a worker or a context closes, and how a peer's close is reported.

Promises tested here (docs/guide.md, "Reliability"):

* a flush close completes every operation issued on the endpoint, or, at its
  deadline, cancels what is left (``CanceledError``);
* a force close cancels outstanding operations at once;
* closing a worker or context with anything outstanding is bounded by one
  deadline for the whole tree (``CLOSE_TIMEOUT_S`` plus a short grace);
* a peer whose worker went away is reported on the next operation that needs
  the peer, as ``PeerError``, not by a hang.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucx
from gpucx import _handle

from conftest import TRANSPORTS, Pair, spin

BIG = 4 << 20  # rendezvous on every transport family


def _warm(pair: Pair) -> None:
    """One eager message each way, so both endpoints are wired up."""
    pair.drive(pair.b.recv_nb(bytearray(8), tag=99), pair.ab.send_nb(b"w" * 8, tag=99))
    pair.drive(pair.a.recv_nb(bytearray(8), tag=99), pair.ba.send_nb(b"w" * 8, tag=99))


def _outcome(req, worker):
    """``"ok"`` or the exception class name, after a bounded wait."""
    end = time.monotonic() + 5
    while not req.done() and time.monotonic() < end:
        worker.progress()
    try:
        req.result()
    except gpucx.UCXError as exc:
        return type(exc).__name__
    return "ok"


def test_flush_close_completes_outstanding_sends(tls, pair):
    """The peer receives everything: every send completes, data intact."""
    _warm(pair)
    data = [np.full(64, i, np.uint8) for i in range(5)]
    data.append(np.arange(BIG, dtype=np.uint8))
    bufs = [np.zeros(d.size, np.uint8) for d in data]
    recvs = [pair.b.recv_nb(buf, tag=i) for i, buf in enumerate(bufs)]
    sends = [pair.ab.send_nb(d, tag=i) for i, d in enumerate(data)]
    pair.ab.close()  # progresses the sibling worker b while it waits
    assert [_outcome(s, pair.a) for s in sends] == ["ok"] * len(sends)
    pair.drive(*recvs)
    for d, buf in zip(data, bufs, strict=True):
        np.testing.assert_array_equal(d, buf)


def test_flush_close_cancels_what_is_left_at_its_deadline(tls, pair):
    """A rendezvous send nobody receives: the flush close waits ``timeout``,
    then cancels it (never a request that stays pending for ever)."""
    _warm(pair)
    big = pair.ab.send_nb(np.ones(BIG, np.uint8), tag=5)
    small = pair.ab.send_nb(b"s" * 8, tag=6)
    spin(pair)
    t0 = time.monotonic()
    pair.ab.close(timeout=0.5)
    took = time.monotonic() - t0
    assert 0.4 < took < 0.5 + _handle.CLOSE_GRACE_S + 1.0, took
    assert _outcome(big, pair.a) == "CanceledError"
    assert _outcome(small, pair.a) == "ok"
    assert big.cancelled()
    pending = gpucx.request.INPROGRESS
    assert not [r for r in pair.a._engine.pending if r._slot.status == pending]


def test_force_close_cancels_at_once(tls, pair):
    _warm(pair)
    big = pair.ab.send_nb(np.ones(BIG, np.uint8), tag=5)
    srecv = pair.ab.stream_recv_nb(bytearray(16))
    spin(pair)
    t0 = time.monotonic()
    pair.ab.close(force=True)
    assert time.monotonic() - t0 < 1.0
    assert _outcome(big, pair.a) == "CanceledError"
    assert _outcome(srecv, pair.a) == "CanceledError"
    with pytest.raises(gpucx.CanceledError):
        big.wait(timeout=1)


def test_flush_close_does_not_wait_for_a_pending_stream_receive(tls, pair):
    """Receives wait for the peer, which may never send: a close cancels
    them instead of waiting out its deadline."""
    _warm(pair)
    srecv = pair.ab.stream_recv_nb(bytearray(16))
    spin(pair)
    t0 = time.monotonic()
    pair.ab.close()
    assert time.monotonic() - t0 < 2.0
    assert _outcome(srecv, pair.a) == "CanceledError"


def test_close_twice_and_use_after_close(pair):
    pair.ab.close(timeout=1)
    pair.ab.close(force=True)
    with pytest.raises(gpucx.ClosedError):
        pair.ab.send(b"x", tag=1)


def test_close_rejects_negative_timeout(pair):
    for obj in (pair.ab, pair.a, pair.ctx):
        with pytest.raises(ValueError, match="timeout"):
            obj.close(timeout=-1)
        assert not obj.closed


@pytest.mark.timeout(60)
def test_worker_close_is_bounded_as_a_whole(monkeypatch):
    """Ten endpoints, each with a send its peer never receives: closing the
    worker takes one deadline, not ten, and cancels every send."""
    monkeypatch.setattr(_handle, "CLOSE_TIMEOUT_S", 1.0)
    with gpucx.Context(config=TRANSPORTS["shm"]) as ctx:
        a = ctx.create_worker()
        peers = [ctx.create_worker() for _ in range(10)]
        eps = [a.connect(p.address) for p in peers]
        backs = [p.connect(a.address) for p in peers]
        sends = [ep.send_nb(np.ones(BIG, np.uint8), tag=1) for ep in eps]
        recv = a.recv_nb(bytearray(8), tag=7)  # worker-wide, never matched
        for _ in range(100):
            a.progress()
        t0 = time.monotonic()
        a.close()
        took = time.monotonic() - t0
        assert took < 1.0 + 2 * _handle.CLOSE_GRACE_S + 1.0, took
        for s in sends:
            with pytest.raises(gpucx.CanceledError):
                s.result()
        with pytest.raises((gpucx.CanceledError, gpucx.ClosedError)):
            recv.result()
        with pytest.raises((gpucx.CanceledError, gpucx.ClosedError)):
            recv.wait(timeout=1)  # settled: its outcome, not a hang
        assert all(ep.closed for ep in eps)
        assert not backs[0].closed  # the peers' own endpoints are theirs


@pytest.mark.timeout(60)
def test_context_close_with_everything_outstanding(tls):
    """Sends, receives, stream receives and RMA outstanding on two workers:
    ``ctx.close(timeout=1)`` closes within that deadline, nothing crashes,
    every request is settled and later use says ClosedError."""
    ctx = gpucx.Context(config=TRANSPORTS[tls])
    pair = Pair(ctx)
    _warm(pair)
    region = ctx.register(np.zeros(BIG, np.uint8))
    rkey = pair.ab.unpack(region.remote())
    reqs = [
        pair.ab.send_nb(np.ones(BIG, np.uint8), tag=5),
        pair.ab.stream_recv_nb(bytearray(8)),
        pair.a.recv_nb(bytearray(8), tag=12345),
        pair.ab.put_nb(np.ones(BIG, np.uint8), rkey, 0),
        pair.ab.get_nb(np.empty(BIG, np.uint8), rkey, 0),
    ]
    for _ in range(50):
        pair.a.progress()
    t0 = time.monotonic()
    ctx.close(timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + 3 * _handle.CLOSE_GRACE_S + 1.0
    for req in reqs:
        assert req.done()
        try:
            req.result()
        except (gpucx.CanceledError, gpucx.ClosedError, gpucx.PeerError):
            pass  # PeerError: worker b (the peer) closed first
    for obj in (pair.a, pair.b, pair.ab, region):
        assert obj.closed
    with pytest.raises(gpucx.ClosedError):
        pair.ab.send(b"x", tag=1)
    with pytest.raises(gpucx.ClosedError):
        pair.a.progress()


def _put_unserved(pair: Pair, region, nbytes: int) -> np.ndarray:
    """A put from worker a into b's region that completes at once (an
    emulated put under peer error handling, or a short one): b has served
    nothing yet, and a's flush needs b's answer.  Returns the source."""
    src = np.arange(nbytes, dtype=np.uint8)
    key = pair.ab.unpack(region.remote())
    pair.drive(pair.ab.put_nb(src, key, 0))
    key.close()
    return src


@pytest.mark.parametrize("nbytes", [8, 256 << 10])
def test_context_close_serves_a_put_between_its_own_workers(tls, nbytes):
    """Two workers of one context, a put from one into the other's NumPy
    region not yet served when the context closes: the close delivers it
    and stays far inside its deadline (it used to wait all of
    ``CLOSE_TIMEOUT_S`` for the worker it had destroyed first)."""
    ctx = gpucx.Context(config=TRANSPORTS[tls])
    pair = Pair(ctx)
    dst = np.zeros(nbytes, np.uint8)
    region = ctx.register(dst)
    src = _put_unserved(pair, region, nbytes)
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < _handle.CLOSE_TIMEOUT_S / 2
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("order", ["target-first", "source-first"])
def test_worker_close_serves_what_its_peers_sent(tls, order):
    """Closing the target worker of an unserved put first serves the put,
    so the source worker's flush close needs nobody: both closes are quick
    in either order and the data is there."""
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        pair = Pair(ctx)
        dst = np.zeros(4096, np.uint8)
        region = ctx.register(dst)
        src = _put_unserved(pair, region, 4096)
        first, second = (pair.b, pair.a)[:: 1 if order == "target-first" else -1]
        t0 = time.monotonic()
        first.close()
        second.close()
        assert time.monotonic() - t0 < _handle.CLOSE_TIMEOUT_S / 2
        assert np.array_equal(dst, src)


def _sent_unreceived(pair: Pair, what: str):
    """A rendezvous message from a that b queued and nobody received: an
    array for ``recv_array``, or an active message kept for the next posted
    receive of its id.  Returns a's pending send."""
    data = np.arange(256 << 10, dtype=np.uint8)
    if what == "array":
        send = pair.ab.send_array_nb(data, proto="rndv")
        queued = lambda: pair.b._engine.am.arrays  # noqa: E731
    else:  # a posted receive takes the first message, the second is kept
        first = pair.b.am_recv_nb(7, np.empty_like(data))
        pair.drive(pair.ab.am_send_nb(7, data, proto="rndv"), first)
        send = pair.ab.am_send_nb(7, data, proto="rndv")
        queued = lambda: pair.b.stats()["am_kept"].count  # noqa: E731
    end = time.monotonic() + 10
    while not queued():
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    assert not send.done()  # the sender waits for b to take it
    return send


@pytest.mark.parametrize("what", ["array", "kept-am"])
def test_context_close_gives_back_what_its_workers_did_not_receive(tls, what):
    """A rendezvous message one worker of a context sent another and nobody
    received: the close releases it at the receiver, so the sender's
    request completes and its flush close stays far inside its deadline
    (it used to wait all of ``CLOSE_TIMEOUT_S``)."""
    ctx = gpucx.Context(config=TRANSPORTS[tls])
    pair = Pair(ctx)
    send = _sent_unreceived(pair, what)
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < _handle.CLOSE_TIMEOUT_S / 2
    assert send.done() and send.exception() is None


def test_worker_close_gives_back_what_it_did_not_receive(tls):
    """Closing the receiver releases the message, and the sender, still
    open, sees its send complete."""
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        pair = Pair(ctx)
        send = _sent_unreceived(pair, "array")
        t0 = time.monotonic()
        pair.b.close()
        end = time.monotonic() + 5
        while not send.done() and time.monotonic() < end:
            pair.a.progress()
        assert send.done() and send.exception() is None
        pair.a.close()
        assert time.monotonic() - t0 < _handle.CLOSE_TIMEOUT_S / 2


@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_peer_worker_close_is_reported_on_the_next_operation(tls):
    """The peer closed its worker: the next operation that needs the peer
    fails with PeerError at once, and the endpoint says why."""
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        pair = Pair(ctx)
        _warm(pair)
        pair.b.close()
        t0 = time.monotonic()
        req = pair.ab.send_nb(np.ones(BIG, np.uint8), tag=2)
        with pytest.raises(gpucx.PeerError):
            req.wait(timeout=10)
        assert time.monotonic() - t0 < 5.0
        assert isinstance(pair.ab.error, gpucx.PeerError)
        with pytest.raises(gpucx.PeerError):
            pair.ab.send_nb(np.ones(BIG, np.uint8), tag=3).wait(timeout=10)
        t0 = time.monotonic()
        pair.ab.close()  # a failed endpoint is force-closed: no waiting
        assert time.monotonic() - t0 < 1.0


def test_peer_endpoint_close_alone_is_not_a_failure(tls, pair):
    """Tag matching is worker-wide: when the peer closes only its endpoint
    (its worker lives), messages still arrive, as in UCX."""
    _warm(pair)
    pair.ba.close()
    buf = bytearray(5)
    pair.drive(pair.b.recv_nb(buf, tag=3), pair.ab.send_nb(b"hello", tag=3))
    assert buf == b"hello"
    assert pair.ab.error is None


_GC_SCRIPT = r"""
import gc, sys, warnings
import numpy as np
import gpucx
from gpucx import _handle

_handle.CLOSE_TIMEOUT_S = 1.0  # the pending send is canceled after 1 s
warnings.simplefilter("ignore", ResourceWarning)
cfg = {"TLS": sys.argv[1]}
seen = []

def build():
    ctx = gpucx.Context(config=cfg)
    a, b = ctx.create_worker(), ctx.create_worker()
    ab, ba = a.connect(b.address), b.connect(a.address)
    rkey = ab.unpack(ctx.register(np.zeros(1 << 20, np.uint8)).remote())
    reqs = [ab.send_nb(np.ones(4 << 20, np.uint8), tag=5), a.recv_nb(bytearray(8))]
    seen.extend([ctx, a, ab, rkey])
    # A cycle holding everything, dropped unclosed (as a failing test does).
    holder = {"objs": [ctx, a, b, ab, ba, rkey, reqs]}
    holder["self"] = holder

build()
import weakref
refs = [weakref.ref(o) for o in seen]
seen.clear()
gc.collect()
print("alive", sum(r() is not None for r in refs))
"""


@pytest.mark.parametrize("tls", ["tcp", "sm,self"])
def test_garbage_collected_cycle_closes_in_order(tls):
    """Unclosed gpucx objects dropped in a reference cycle: the garbage
    collector finalizes them in no set order, with weak references already
    cleared.  That used to free the UCX context before its workers
    (a segfault); children now close first, the context last."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _GC_SCRIPT, tls],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive 0" in out.stdout, out.stdout


def test_dropped_endpoint_closes_within_the_short_drop_deadline():
    """An endpoint dropped without close() is closed by its finalizer, a
    flush close like any other, but within ``DROP_CLOSE_TIMEOUT_S``: here
    a client endpoint dropped before the server (another context, never
    progressed) answered its wireup would otherwise hold the collecting
    thread for ``CLOSE_TIMEOUT_S``."""
    import gc
    import warnings

    with gpucx.Context() as c1, gpucx.Context() as c2:
        a, b = c1.create_worker(), c2.create_worker()
        listener = b.listen()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            a.connect(("127.0.0.1", listener.port))  # dropped at once
            gc.collect()
            took = time.monotonic() - t0
        assert any(issubclass(r.category, ResourceWarning) for r in rec)
        assert _handle.DROP_CLOSE_TIMEOUT_S < _handle.CLOSE_TIMEOUT_S / 2
        # The drop deadline plus UCX's cancellation grace, not the close's
        # default deadline.
        limit = _handle.DROP_CLOSE_TIMEOUT_S + _handle.CLOSE_GRACE_S + 2.0
        assert took < limit, took
        assert not a._children or all(c.closed for c in a._children)


def test_close_deferred_by_collection_runs_when_the_last_child_closes():
    """A context garbage collection finalizes while workers are open is not
    closed under them (``__del__`` defers): the last child's close closes it."""
    ctx = gpucx.Context(features=["tag"])
    w1, w2 = ctx.create_worker(), ctx.create_worker()
    with pytest.warns(ResourceWarning, match="unclosed"):
        ctx.__del__()
    assert not ctx.closed
    w1.close()
    assert not ctx.closed
    w2.close()
    assert ctx.closed
