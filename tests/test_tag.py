"""Tag messaging between two workers of one process, over each transport."""

from __future__ import annotations

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)

SIZES = [0, 1, 8, 4096, 65536, 1 << 20, 8 << 20]


@pytest.mark.parametrize("nbytes", SIZES)
def test_send_recv_sizes(pair, tls, nbytes):
    src = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    info, _ = pair.drive(pair.b.recv_nb(dst, tag=7), pair.ab.send_nb(src, tag=7))
    assert info == gpucx.RecvInfo(7, nbytes)
    assert np.array_equal(src, dst)


def test_both_directions(pair, tls):
    x, y = bytearray(3), bytearray(3)
    pair.drive(
        pair.a.recv_nb(x, tag=1),
        pair.b.recv_nb(y, tag=2),
        pair.ab.send_nb(b"a2b", tag=2),
        pair.ba.send_nb(b"b2a", tag=1),
    )
    assert (x, y) == (b"b2a", b"a2b")


def test_blocking_send_then_recv_shared_memory(pair):
    # Eager shared-memory sends complete locally, so one thread can do both.
    src = np.arange(100, dtype=np.float32)
    pair.ab.send(src, tag=3)
    out = np.empty_like(src)
    assert pair.b.recv(out, tag=3, timeout=5) == (3, 400)
    assert np.array_equal(out, src)


def test_tag_mask_matching(pair):
    got = bytearray(1)
    req = pair.b.recv_nb(got, tag=0xAB00, tag_mask=0xFF00)
    pair.drive(pair.ab.send_nb(b"z", tag=0xAB42), req)
    assert req.result().tag == 0xAB42 and got == b"z"


def test_full_64_bit_tags(pair):
    tag = (1 << 64) - 2
    got = bytearray(2)
    info, _ = pair.drive(pair.b.recv_nb(got, tag=tag), pair.ab.send_nb(b"hi", tag=tag))
    assert info.tag == tag


@pytest.mark.parametrize("tag", [-1, 1 << 64])
def test_tag_out_of_range(pair, tag):
    with pytest.raises(ValueError, match="tag"):
        pair.ab.send(b"x", tag=tag)
    with pytest.raises(ValueError, match="tag"):
        pair.ab.send_nb(b"x", tag=tag)
    with pytest.raises(ValueError, match="tag"):
        pair.b.recv_nb(bytearray(1), tag=tag)
    with pytest.raises(ValueError, match="tag_mask"):
        pair.b.recv(bytearray(1), tag=0, tag_mask=tag, timeout=0.1)


def test_tag_wrong_type(pair):
    with pytest.raises(TypeError, match="tag"):
        pair.ab.send(b"x", tag="7")


def test_messages_in_order_per_tag(pair):
    n = 200
    outs = [np.zeros(1, np.int64) for _ in range(n)]
    recvs = [pair.b.recv_nb(o, tag=5) for o in outs]
    sends = [pair.ab.send_nb(np.array([i], np.int64), tag=5) for i in range(n)]
    pair.drive(*recvs, *sends)
    assert [int(o[0]) for o in outs] == list(range(n))


def test_thousand_outstanding_requests(pair, tls):
    n = 1000
    outs = np.zeros((n, 4), np.int32)
    recvs = [pair.b.recv_nb(outs[i], tag=i) for i in range(n)]
    sends = [
        pair.ab.send_nb(np.full(4, i, np.int32), tag=i) for i in reversed(range(n))
    ]
    results = pair.drive(*recvs, *sends, timeout=30)
    assert [r.tag for r in results[:n]] == list(range(n))
    assert np.array_equal(outs[:, 0], np.arange(n))
    assert not pair.a._engine.pending and not pair.b._engine.pending


def test_fire_and_forget_sends_are_swept(pair):
    """Requests nobody waits on are settled by a sweep, never piling up."""
    out = np.zeros(1 << 14, np.int32)
    peak = 0
    for i in range(5000):
        pair.ab.send_nb(np.full(1 << 14, i, np.int32), tag=99)  # rendezvous
        pair.drive(pair.b.recv_nb(out, tag=99))
        peak = max(peak, len(pair.a._engine.pending))
    assert out[0] == 4999
    assert peak <= 1024


def test_sync_send_completes_after_match(pair):
    req = pair.ab.send_nb(b"sync", tag=11, sync=True)
    for _ in range(200):
        pair.a.progress()
        pair.b.progress()
    assert not req.done()
    got = bytearray(4)
    pair.drive(pair.b.recv_nb(got, tag=11), req)
    assert got == b"sync"


def test_iov_send_as_one_message(pair, tls):
    parts = [b"head", np.arange(5, dtype=np.int16), bytearray(b"tail")]
    out = bytearray(4 + 10 + 4)
    info, _ = pair.drive(pair.b.recv_nb(out, tag=8), pair.ab.send_nb(parts, tag=8))
    assert info.nbytes == 18
    assert bytes(out) == b"head" + np.arange(5, dtype=np.int16).tobytes() + b"tail"


def test_iov_receive_scatters(pair):
    a, b = bytearray(3), np.zeros(2, np.int32)
    info, _ = pair.drive(
        pair.b.recv_nb([a, b], tag=2),
        pair.ab.send_nb(b"xyz" + np.array([7, 9], np.int32).tobytes(), tag=2),
    )
    assert info.nbytes == 11 and a == b"xyz" and b.tolist() == [7, 9]


def test_empty_iov_rejected(pair):
    with pytest.raises(ValueError, match="empty"):
        pair.ab.send_nb([], tag=1)


def test_truncated_receive_names_both_sizes(pair, tls):
    small = np.zeros(2, np.int64)
    req = pair.b.recv_nb(small, tag=6)
    with pytest.raises(gpucx.MessageTruncatedError) as exc:
        pair.drive(req, pair.ab.send_nb(np.arange(10, dtype=np.int64), tag=6))
    assert exc.value.buffer_size == 16
    assert exc.value.message_size == 80
    assert "16" in str(exc.value) and "80" in str(exc.value)


def test_recv_timeout_cancels_cleanly(pair):
    buf = bytearray(8)
    with pytest.raises(gpucx.TimeoutError):
        pair.b.recv(buf, tag=77, timeout=0.1)
    # The canceled receive must not match a later message.
    got = bytearray(3)
    pair.drive(pair.b.recv_nb(got, tag=77), pair.ab.send_nb(b"new", tag=77))
    assert got == b"new" and buf == bytearray(8)


def test_request_wait_timeout(pair):
    req = pair.b.recv_nb(bytearray(8), tag=1234)
    with pytest.raises(gpucx.TimeoutError):
        req.wait(timeout=0.05)
    assert req.done()
    assert isinstance(req.exception(), gpucx.CanceledError)


def test_cancel_pending_receive(pair):
    req = pair.b.recv_nb(bytearray(8), tag=55)
    assert req.cancel()
    with pytest.raises(gpucx.CanceledError):
        req.wait(5)
    assert req.cancelled()
    assert not req.cancel()


def test_result_before_done_raises(pair):
    from concurrent.futures import InvalidStateError

    req = pair.b.recv_nb(bytearray(8), tag=56)
    with pytest.raises(InvalidStateError):
        req.result()
    req.cancel()


def test_probe_peek_and_remove(pair):
    assert pair.b.probe(tag=21) is None
    pair.drive(pair.ab.send_nb(b"probe-me", tag=21))
    info = None
    for _ in range(1000):
        info = pair.b.probe(tag=21)
        if info:
            break
    assert isinstance(info, gpucx.ProbedMessage) and not info.removed
    assert (info.tag, info.nbytes) == tuple(info) == (21, 8)
    msg = pair.b.probe(tag=21, remove=True)
    assert isinstance(msg, gpucx.ProbedMessage) and msg.removed
    assert (msg.tag, msg.nbytes) == (21, 8)
    assert pair.b.probe(tag=21) is None
    out = bytearray(msg.nbytes)
    assert msg.recv(out, timeout=5) == (21, 8)
    assert out == b"probe-me"
    with pytest.raises(RuntimeError):
        msg.recv_nb(bytearray(8))


def test_read_only_receive_target(pair):
    with pytest.raises(BufferError, match="read-only"):
        pair.b.recv_nb(b"immutable", tag=1)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        pair.b.recv(ro, tag=1, timeout=0.1)


def test_non_contiguous_array_rejected(pair):
    strided = np.arange(20)[::2]
    with pytest.raises(BufferError, match="contiguous"):
        pair.ab.send(strided, tag=1)
    with pytest.raises(BufferError, match="contiguous"):
        pair.b.recv_nb(np.zeros((4, 4))[:, 1], tag=1)


def test_fortran_order_array_sends(pair):
    src = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    out = np.zeros(12)
    pair.drive(pair.b.recv_nb(out, tag=4), pair.ab.send_nb(src, tag=4))
    assert np.array_equal(out, src.ravel(order="F"))


def test_request_holds_buffers_until_done(pair):
    import gc
    import weakref

    class Buf(bytearray):
        pass

    target = Buf(1 << 16)
    ref = weakref.ref(target)
    req = pair.b.recv_nb(target, tag=31)
    del target
    gc.collect()
    assert ref() is not None
    pair.drive(req, pair.ab.send_nb(bytes(1 << 16), tag=31))
    gc.collect()
    assert ref() is None


def test_worker_close_with_pending_requests(ctx):
    a, b = ctx.create_worker(), ctx.create_worker()
    ep = a.connect(b.address)
    reqs = [b.recv_nb(bytearray(8), tag=i) for i in range(10)]
    big = ep.send_nb(np.zeros(4 << 20, np.uint8), tag=1000)  # rendezvous
    b.close()
    for r in reqs:
        assert r.done()
        with pytest.raises(gpucx.UCXError):
            r.result()
    # The flush close of a's endpoint can only end by its timeout: b is gone.
    a.close(timeout=1)
    assert big.done()


class _RaisingLib:
    """Stands in for gpucx.ops.tag's extension module: the named post calls
    raise ``TypeError("boom")`` (a fault that is not the tag's); the rest
    pass on."""

    def __init__(self, lib, names):
        self._lib, self._names = lib, names

    def __getattr__(self, name):
        if name in self._names:

            def post(*args):
                raise TypeError("boom")

            return post
        return getattr(self._lib, name)


_POSTS = {
    "gpucx_tag_send_wait",
    "gpucx_tag_send",
    "gpucx_tag_recv_wait",
    "gpucx_tag_recv",
}


@pytest.mark.parametrize(
    "call",
    [
        lambda p, tag: p.ab.send(b"x" * 8, tag=tag),
        lambda p, tag: p.ab.send_nb(b"x" * 8, tag=tag),
        lambda p, tag: p.b.recv(bytearray(8), tag=tag),
        lambda p, tag: p.b.recv(bytearray(8), tag=tag, timeout=1),
        lambda p, tag: p.b.recv_nb(bytearray(8), tag=tag),
    ],
    ids=["send", "send_nb", "recv", "recv-timeout", "recv_nb"],
)
def test_post_errors_are_named_alike_by_every_entry_point(pair, monkeypatch, call):
    """A TypeError of the post call is a bad tag only when the tag is bad:
    the blocking calls say what the non-blocking ones say."""
    from gpucx.ops import tag as _tag

    monkeypatch.setattr(_tag, "lib", _RaisingLib(_tag.lib, _POSTS))
    with pytest.raises(TypeError, match="boom"):
        call(pair, 5)
    with pytest.raises(ValueError, match=r"tag must be in \[0, 2\*\*64\)"):
        call(pair, -1)
    with pytest.raises(TypeError, match="tag must be an int"):
        call(pair, "5")
