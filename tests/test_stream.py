"""The stream API between two workers of one process, over each transport."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    "send_chunk,recv_chunk",
    [(1, 7), (7, 1), (100, 33), (4096, 65536), (65536, 1000), (1 << 20, 3 << 20)],
)
def test_reassembly(pair, tls, send_chunk, recv_chunk):
    total = 3 << 20 if send_chunk >= 4096 else 2000
    src = np.random.default_rng(send_chunk).integers(0, 255, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    sends = [
        pair.ab.stream_send_nb(src[i : i + send_chunk])
        for i in range(0, total, send_chunk)
    ]
    recvs = [
        pair.ba.stream_recv_nb(dst[i : i + recv_chunk])
        for i in range(0, total, recv_chunk)
    ]
    results = pair.drive(*recvs, *sends, timeout=60)
    assert results[: len(recvs)] == [
        min(recv_chunk, total - i) for i in range(0, total, recv_chunk)
    ]
    assert np.array_equal(src, dst)


def test_both_directions(pair):
    x, y = bytearray(3), bytearray(3)
    pair.drive(
        pair.ab.stream_recv_nb(x),
        pair.ba.stream_recv_nb(y),
        pair.ab.stream_send_nb(b"a2b"),
        pair.ba.stream_send_nb(b"b2a"),
    )
    assert (x, y) == (b"b2a", b"a2b")


def test_blocking_calls_two_threads(pair, tls):
    """Each worker driven by its own thread with the blocking calls."""
    src = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: rendezvous
    errors = []

    def sender():
        try:
            pair.ab.stream_send(src[:1000])
            pair.ab.stream_send(src[1000:])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=sender)
    t.start()
    out = np.empty_like(src)
    try:
        assert pair.ba.stream_recv(out, timeout=30) == src.nbytes
    finally:
        t.join(30)
    assert not errors and not t.is_alive()
    assert np.array_equal(out, src)


def test_recv_waits_for_all_bytes(pair):
    out = bytearray(10)
    req = pair.ba.stream_recv_nb(out)
    pair.drive(pair.ab.stream_send_nb(b"01234"))
    for _ in range(100):
        pair.a.progress()
        pair.b.progress()
    assert not req.done()
    pair.drive(req, pair.ab.stream_send_nb(b"56789"))
    assert req.result() == 10 and out == b"0123456789"


def test_recv_timeout(pair):
    with pytest.raises(gpucx.TimeoutError):
        pair.ba.stream_recv(bytearray(8), timeout=0.2)


def test_readonly_target(pair):
    with pytest.raises(BufferError):
        pair.ba.stream_recv(b"12345678")
    with pytest.raises(BufferError):
        pair.ba.stream_recv_nb(b"12345678")


def test_non_contiguous_rejected(pair):
    with pytest.raises(BufferError):
        pair.ab.stream_send(np.arange(10)[::2])


def test_closed(pair):
    pair.ab.close()
    for call in (pair.ab.stream_send, pair.ab.stream_send_nb):
        with pytest.raises(gpucx.ClosedError):
            call(b"x")
    for call in (pair.ab.stream_recv, pair.ab.stream_recv_nb):
        with pytest.raises(gpucx.ClosedError):
            call(bytearray(1))


@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_stream_across_processes(tls_name):
    from conftest import channel_pair, join_ok, spawn, transport_config
    from peers_am import am_echo_peer

    q, theirs = channel_pair()
    child = spawn(am_echo_peer, tls_name, theirs, False)
    try:
        with gpucx.Context(config=transport_config(tls_name)) as ctx:
            w = ctx.create_worker()
            _, where = q.get(60)
            ep = w.connect(where)
            q.put(w.address)
            total = 5 << 20
            src = np.random.default_rng(5).integers(0, 255, total, dtype=np.uint8)
            q.put(("stream", total))
            for i, step in enumerate([1, 1000, 65536, 1 << 20]):
                start = sum([1, 1000, 65536, 1 << 20][:i])
                ep.stream_send(src[start : start + step])
            ep.stream_send(src[start + step :])
            out = np.zeros(total, np.uint8)
            got = 0
            for chunk in (3, 1 << 20, 12345):
                got += ep.stream_recv(out[got : got + chunk], timeout=60)
            got += ep.stream_recv(out[got:], timeout=60)
            assert got == total and np.array_equal(out, src)
            q.put(("bye", None))
            q.get(60)
            q.put("ok")
    finally:
        join_ok(child, 60)


def test_context_without_stream_feature():
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(w.address)
        with pytest.raises(gpucx.UnsupportedError, match="stream"):
            ep.stream_send(b"x")
        with pytest.raises(gpucx.UnsupportedError, match="stream"):
            ep.stream_send_nb(b"x")
        with pytest.raises(gpucx.UnsupportedError, match="stream"):
            ep.stream_recv(bytearray(1), timeout=1)
        with pytest.raises(gpucx.UnsupportedError, match="stream"):
            ep.stream_recv_nb(bytearray(1))
