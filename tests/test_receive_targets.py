"""Receives write only into the buffers posted for them, and sends return
with their buffer reusable (docs/reliability.md)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)

GUARD = 16


def _guarded(n):
    """A buffer of n bytes with GUARD bytes of 0xEE on either side."""
    outer = np.full(n + 2 * GUARD, 0xEE, np.uint8)
    return outer, outer[GUARD : GUARD + n]


def _guards_intact(outer):
    return (outer[:GUARD] == 0xEE).all() and (outer[-GUARD:] == 0xEE).all()


@pytest.mark.parametrize("nbytes", [64, 1 << 20])
def test_tag_receive_writes_only_its_buffer(pair, tls, nbytes):
    outer, inner = _guarded(16)
    r = pair.b.recv_nb(inner, tag=1)
    s = pair.ab.send_nb(np.ones(nbytes, np.uint8), tag=1)
    with pytest.raises(gpucx.MessageTruncatedError):
        pair.drive(r, s)
    pair.drive(s)
    assert _guards_intact(outer)


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_am_receives_write_only_their_buffer(pair, tls, proto):
    outer, inner = _guarded(16)
    r = pair.b.am_recv_nb(3, inner)
    s = pair.ab.am_send_nb(3, np.ones(4096, np.uint8), proto=proto)
    with pytest.raises(gpucx.MessageTruncatedError):
        pair.drive(r, s)
    pair.drive(s)
    got = []
    pair.b.set_am_handler(4, got.append)
    s = pair.ab.am_send_nb(4, np.ones(4096, np.uint8), proto=proto)
    while not got:
        pair.a.progress()
        pair.b.progress()
    with pytest.raises(gpucx.MessageTruncatedError):
        got[0].receive_into(inner)
    assert _guards_intact(outer)
    pair.drive(s, got[0].receive_into(np.empty(4096, np.uint8)))


def test_stream_receive_writes_only_its_buffer(pair, tls):
    outer, inner = _guarded(16)
    s = pair.ab.stream_send_nb(np.ones(64, np.uint8))
    r = pair.ba.stream_recv_nb(inner)
    pair.drive(r, s)
    assert (inner == 1).all() and _guards_intact(outer)
    rest = np.zeros(48, np.uint8)
    pair.drive(pair.ba.stream_recv_nb(rest))
    assert (rest == 1).all()


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_am_send_and_send_array_return_with_the_buffer_reusable(pair, proto):
    got = []
    pair.b.set_am_handler(5, got.append)
    data = np.full(1 << 16, 7, np.uint8)
    req = pair.ab.am_send_nb(5, data, proto=proto)
    while not got:
        pair.a.progress()
        pair.b.progress()
    out = np.zeros_like(data)
    pair.drive(req, got[0].receive_into(out))
    data[:] = 9  # reusable once the send is done
    assert (out == 7).all()
    arr = np.arange(1 << 14, dtype=np.int32)
    req = pair.ab.send_array_nb(arr, proto=proto)
    while not pair.b._engine.am.arrays:
        pair.a.progress()
        pair.b.progress()
    res = []
    t = threading.Thread(target=lambda: res.append(pair.ba.recv_array(timeout=10)))
    t.start()
    while t.is_alive():
        pair.a.progress()
    t.join()
    back = res[0]
    pair.drive(req)
    arr[:] = -1
    assert np.array_equal(back, np.arange(1 << 14, dtype=np.int32))
