"""Prepared batches of active messages (``ep.prepare_am``): delivery, order,
headers, protocols, repeated and overlapping runs, every error path; two
workers in one process over each transport family and a peer process."""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucx
from gpucx.ops.am_batch import AmBatch

from conftest import channel_pair, join_ok, spawn
from peers_am import BACK, ECHO, am_echo_peer

pytestmark = pytest.mark.timeout(60)

ID = 11


def _inbox(worker, am_id=ID):
    """(header, payload) of each eager message to ``am_id``, in order."""
    got: list = []

    def handler(msg):
        got.append((bytes(msg.header), bytes(msg.data)))

    worker.set_am_handler(am_id, handler)
    return got


def _until(pair, cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end, "timed out"


def test_batch_delivers_in_order_with_header(pair, tls):
    got = _inbox(pair.b)
    bufs = [np.full(8 + i, i, np.uint8) for i in range(20)]
    batch = pair.ab.prepare_am(ID, bufs, header=b"hdr")
    assert isinstance(batch, AmBatch)
    assert len(batch) == 20 and batch.nbytes == sum(b.nbytes for b in bufs)
    assert batch.am_id == ID and "20 messages" in repr(batch)
    pair.drive(batch.run_nb())
    _until(pair, lambda: len(got) == 20)
    assert got == [(b"hdr", b.tobytes()) for b in bufs]
    batch.close()
    assert batch.closed and "closed" in repr(batch)
    batch.close()  # twice is fine


def test_batch_runs_again_sends_current_contents(pair):
    got = _inbox(pair.b)
    buf = np.zeros(16, np.uint8)
    hdr = bytearray(b"v1")
    with pair.ab.prepare_am(ID, [buf, buf, buf], header=hdr) as batch:
        pair.drive(batch.run_nb())
        buf[:] = 7
        hdr[:] = b"v2"  # the header was copied when the batch was prepared
        # Two runs in flight at once, each with its own completion.
        pair.drive(batch.run_nb(), batch.run_nb())
        _until(pair, lambda: len(got) == 9)
    assert got[:3] == [(b"v1", bytes(16))] * 3
    assert got[3:] == [(b"v1", bytes([7]) * 16)] * 6


def test_batch_into_posted_receives(pair, tls):
    n = 64
    src = [np.full(8, i, np.uint8) for i in range(n)]
    dst = [np.zeros(8, np.uint8) for _ in range(n)]
    req = pair.b.am_recv_many_nb(ID, dst)
    batch = pair.ab.prepare_am(ID, src)
    sent = batch.run_nb()
    pair.drive(req, sent)
    assert req.result() == [8] * n
    assert [int(d[0]) for d in dst] == list(range(n))


@pytest.mark.parametrize("proto", [None, "eager", "rndv"])
def test_batch_large_messages_and_protocols(pair, tls, proto):
    size = 1 << 20
    bufs = [np.full(size, i + 1, np.uint8) for i in range(3)] + [b""]
    dst = [np.zeros(size, np.uint8) for _ in bufs]
    back = pair.b.am_recv_many_nb(ID, dst)
    batch = pair.ab.prepare_am(ID, bufs, proto=proto)
    sent = batch.run_nb()
    pair.drive(back, sent, timeout=30)
    assert back.result() == [size] * 3 + [0]
    assert all(np.array_equal(d, b) for d, b in zip(dst, bufs[:3], strict=False))


def test_blocking_run(pair):
    got = _inbox(pair.b)
    # The receiver is this thread's other worker: small messages complete
    # locally without it, so the blocking run returns.
    batch = pair.ab.prepare_am(ID, [b"abc"] * 10)
    batch.run(timeout=10)
    _until(pair, lambda: len(got) == 10)
    assert got == [(b"", b"abc")] * 10


def test_reply_flag_gives_reply_endpoint(pair):
    eps: list = []
    pair.b.set_am_handler(ID, lambda msg: eps.append(msg.reply_ep))
    pair.drive(pair.ab.prepare_am(ID, [b"x", b"y"], reply=True).run_nb())
    _until(pair, lambda: len(eps) == 2)
    assert all(ep is not None for ep in eps)


# -- errors --------------------------------------------------------------------


def test_bad_arguments_refused(pair):
    ep = pair.ab
    with pytest.raises(ValueError):
        ep.prepare_am(-1, [b"x"])
    with pytest.raises(ValueError):
        ep.prepare_am(0xFFFF, [b"x"])  # reserved for gpucx
    with pytest.raises(ValueError, match="proto"):
        ep.prepare_am(ID, [b"x"], proto="bogus")
    with pytest.raises(ValueError, match="empty"):
        ep.prepare_am(ID, [])
    with pytest.raises(TypeError, match="iterable"):
        ep.prepare_am(ID, 5)
    with pytest.raises(TypeError, match="entry 1"):
        ep.prepare_am(ID, [b"x", object()])
    big = pair.a.max_am_header + 1 if hasattr(pair.a, "max_am_header") else 1 << 20
    with pytest.raises(ValueError, match="header"):
        ep.prepare_am(ID, [b"x"], header=bytes(big))


def test_closed_batch_and_endpoint_refused(pair):
    batch = pair.ab.prepare_am(ID, [b"x"])
    batch.close()
    with pytest.raises(gpucx.ClosedError, match="AmBatch is closed"):
        batch.run_nb()
    with pytest.raises(gpucx.ClosedError):
        batch.run()
    batch2 = pair.ab.prepare_am(ID, [b"x"])
    pair.ab.close(force=True)
    with pytest.raises(gpucx.ClosedError):
        batch2.run_nb()
    with pytest.raises(gpucx.ClosedError):
        pair.ab.prepare_am(ID, [b"x"])


def test_needs_am_feature():
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        with pytest.raises(gpucx.UnsupportedError):
            ep.prepare_am(ID, [b"x"])
        ep.close(force=True)


# -- another process -------------------------------------------------------------


def test_batch_to_peer_process_and_back(tls):
    """The peer echoes each message of a batch (eager and rendezvous sizes)
    back through its reply endpoint; posted receives take the echoes."""
    from conftest import transport_config

    q, theirs = channel_pair()
    child = spawn(am_echo_peer, tls, theirs, False)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            kind, address = q.get(60)
            ep = w.connect(address)
            q.put(w.address)
            sizes = [8, 100, 9000, 1 << 20, 0, 8]
            src = [np.full(n, i + 1, np.uint8) for i, n in enumerate(sizes)]
            dst = [np.zeros(max(n, 1), np.uint8) for n in sizes]
            back = w.am_recv_many_nb(BACK, dst)
            with ep.prepare_am(ECHO, src, header=b"h", reply=True) as batch:
                sent = batch.run_nb()
                assert back.wait(30) == sizes
                sent.wait(30)
            for s, d, n in zip(src, dst, sizes, strict=True):
                assert np.array_equal(d[:n], s)
            q.put(("bye", None))
            assert q.get(60)[0] == "done"
            q.put("ok")
            ep.close(force=True)
    finally:
        join_ok(child, 60)


def test_batch_to_dead_peer_fails(tls):
    from conftest import transport_config

    q, theirs = channel_pair()
    child = spawn(am_echo_peer, tls, theirs, False)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            kind, address = q.get(60)
            ep = w.connect(address)
            q.put(w.address)
            batch = ep.prepare_am(ECHO, [np.ones(1 << 20, np.uint8)] * 4)
            child.kill()
            child.join(10)
            end = time.monotonic() + 20
            with pytest.raises((gpucx.PeerError, gpucx.ClosedError)):
                while time.monotonic() < end:
                    batch.run(timeout=5)
                    time.sleep(0.05)
            ep.close(force=True)
    finally:
        child.join(10)


def test_posted_group_with_repeated_buffers(pair):
    """am_recv_many_nb checks a repeated buffer once; each entry still gets
    its message, and a bad buffer is named by its first position."""
    one = np.zeros(8, np.uint8)
    two = np.zeros(8, np.uint8)
    with pytest.raises(BufferError, match="buffer 1"):
        pair.b.am_recv_many_nb(ID, [one, b"read-only", one, b"read-only"])
    req = pair.b.am_recv_many_nb(ID, [one, two, one, two])
    batch = pair.ab.prepare_am(ID, [np.full(8, i, np.uint8) for i in range(4)])
    pair.drive(req, batch.run_nb())
    assert req.result() == [8] * 4
    assert (int(one[0]), int(two[0])) == (2, 3)  # each overwritten in order
