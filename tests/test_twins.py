"""Every blocking operation and its ``_nb`` twin answer the same input alike.

Many blocking calls are fast paths written beside their non-blocking twin
(``send`` posts and waits in one C call where ``send_nb`` returns a
request), so the two can drift: one maps an error the other does not, one
checks an argument the other lets through.  This module is the rule that
keeps them together: each pair is called with the same arguments, good and
bad, and must raise the same exception type with the same message, or give
the same result (``twin(...).wait()`` against the blocking call).

Pairs that take device memory or ``stream=`` are also called with (fake)
device memory and bad streams (the last section), so the CUDA door's checks
answer alike too.

Add a pair here when you add a blocking call with a non-blocking twin.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpucx

from conftest import spin

pytestmark = pytest.mark.timeout(60)

BAD_TAGS = [-1, 2**64, "7", 1.5, None]
BAD_BUFFERS = [
    3,
    "text",
    object(),
    np.zeros((4, 4), np.uint8)[:, ::2],  # not contiguous
]
#: Buffers a twin may take or refuse, as long as both do the same: the raw
#: bytes of an object array are pointers, meaningless to a peer.
ODD_BUFFERS = [np.zeros(4, dtype=object)]


def _outcome(call):
    """``("ok", value)`` or ``("raise", type, message)`` of ``call()``."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return ("raise", type(exc), str(exc))
    return ("ok", value)


#: How long a twin may wait: an operation both twins accept that needs the
#: peer (which nobody progresses here) ends in TimeoutError on both sides.
T = 0.3


def _nb_outcome(call):
    """The outcome of posting ``call()`` and waiting for its request: an
    error raised when posting and one raised by the wait count alike."""

    def post_and_wait():
        return call().wait(T)

    return _outcome(post_and_wait)


def same(blocking, nb):
    """Assert ``blocking()`` and ``nb().wait()`` end alike; return it."""
    a = _outcome(blocking)
    b = _nb_outcome(nb)
    assert a == b, f"blocking: {a}\nnon-blocking: {b}"
    return a


# -- tag ----------------------------------------------------------------------


@pytest.mark.parametrize("tag", BAD_TAGS, ids=repr)
def test_send_and_send_nb_refuse_a_bad_tag_alike(pair, tag):
    buf = np.zeros(8, np.uint8)
    r = same(lambda: pair.ab.send(buf, tag), lambda: pair.ab.send_nb(buf, tag))
    assert r[0] == "raise"


@pytest.mark.parametrize("buf", BAD_BUFFERS, ids=lambda b: type(b).__name__)
def test_send_and_send_nb_refuse_a_bad_buffer_alike(pair, buf):
    r = same(lambda: pair.ab.send(buf, 1), lambda: pair.ab.send_nb(buf, 1))
    assert r[0] == "raise"


@pytest.mark.parametrize("buf", ODD_BUFFERS, ids=lambda b: str(b.dtype))
def test_send_twins_treat_an_object_array_alike(pair, buf):
    same(lambda: pair.ab.send(buf, 1, timeout=T), lambda: pair.ab.send_nb(buf, 1))
    same(
        lambda: pair.ab.am_send(3, buf, timeout=T),
        lambda: pair.ab.am_send_nb(3, buf),
    )
    same(
        lambda: pair.ab.stream_send(buf, timeout=T),
        lambda: pair.ab.stream_send_nb(buf),
    )


@pytest.mark.parametrize("tag", BAD_TAGS, ids=repr)
def test_recv_and_recv_nb_refuse_a_bad_tag_alike(pair, tag):
    buf = np.zeros(8, np.uint8)
    r = same(
        lambda: pair.b.recv(buf, tag, timeout=0.01),
        lambda: pair.b.recv_nb(buf, tag),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize(
    "buf", BAD_BUFFERS + [b"read-only"], ids=lambda b: type(b).__name__
)
def test_recv_and_recv_nb_refuse_a_bad_buffer_alike(pair, buf):
    r = same(
        lambda: pair.b.recv(buf, 1, timeout=0.01),
        lambda: pair.b.recv_nb(buf, 1),
    )
    assert r[0] == "raise"


def test_recv_and_recv_nb_truncate_alike(pair):
    """Both messages wait in UCX's unexpected queue when each receive is
    posted, so both twins meet the same case (UCX reports the message's
    size only for a receive that was posted before the message came)."""
    big = np.arange(64, dtype=np.uint8)
    small = np.zeros(8, np.uint8)
    pair.ab.send(big, 5)
    pair.ab.send(big, 5)
    spin(pair)
    r = same(
        lambda: pair.b.recv(small, 5, timeout=10),
        lambda: pair.b.recv_nb(small, 5),
    )
    assert r[0] == "raise" and r[1] is gpucx.MessageTruncatedError


def test_send_and_recv_twins_deliver_alike(pair):
    got = []
    for i in range(2):
        src = np.full(16, i + 1, np.uint8)
        dst = np.zeros(16, np.uint8)
        send = [pair.ab.send, lambda b, t: pair.ab.send_nb(b, t).wait(10)][i]
        recv = [
            lambda b, t: pair.b.recv(b, t, timeout=10),
            lambda b, t: pair.b.recv_nb(b, t).wait(10),
        ][i]
        send(src, 9)
        info = recv(dst, 9)
        got.append((tuple(info), bytes(dst)))
    assert got[0][0] == got[1][0]
    assert got[0][1] == bytes([1] * 16) and got[1][1] == bytes([2] * 16)


# -- stream -------------------------------------------------------------------


@pytest.mark.parametrize("buf", BAD_BUFFERS, ids=lambda b: type(b).__name__)
def test_stream_send_twins_refuse_a_bad_buffer_alike(pair, buf):
    r = same(lambda: pair.ab.stream_send(buf), lambda: pair.ab.stream_send_nb(buf))
    assert r[0] == "raise"


@pytest.mark.parametrize(
    "buf", BAD_BUFFERS + [b"read-only"], ids=lambda b: type(b).__name__
)
def test_stream_recv_twins_refuse_a_bad_buffer_alike(pair, buf):
    r = same(
        lambda: pair.ba.stream_recv(buf, timeout=0.01),
        lambda: pair.ba.stream_recv_nb(buf),
    )
    assert r[0] == "raise"


# -- active messages ----------------------------------------------------------


@pytest.mark.parametrize("am_id", [-1, 2**16, 2**32, "1", 1.0], ids=repr)
def test_am_send_twins_refuse_a_bad_id_alike(pair, am_id):
    buf = np.zeros(8, np.uint8)
    r = same(
        lambda: pair.ab.am_send(am_id, buf),
        lambda: pair.ab.am_send_nb(am_id, buf),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize("buf", BAD_BUFFERS, ids=lambda b: type(b).__name__)
def test_am_send_twins_refuse_a_bad_buffer_alike(pair, buf):
    r = same(lambda: pair.ab.am_send(3, buf), lambda: pair.ab.am_send_nb(3, buf))
    assert r[0] == "raise"


@pytest.mark.parametrize("header", [3, "text", object()], ids=repr)
def test_am_send_twins_refuse_a_bad_header_alike(pair, header):
    buf = np.zeros(8, np.uint8)
    r = same(
        lambda: pair.ab.am_send(3, buf, header),
        lambda: pair.ab.am_send_nb(3, buf, header),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize(
    "buf", BAD_BUFFERS + [b"read-only"], ids=lambda b: type(b).__name__
)
def test_am_recv_twins_refuse_a_bad_buffer_alike(pair, buf):
    r = same(
        lambda: pair.b.am_recv(4, buf, timeout=0.01),
        lambda: pair.b.am_recv_nb(4, buf),
    )
    assert r[0] == "raise"


# -- arrays -------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [np.zeros(4, dtype=object), np.zeros((4, 4))[:, ::2], 3, "text", object()],
    ids=["object", "strided", "int", "str", "not-an-array"],
)
def test_send_array_twins_take_or_refuse_alike(pair, arr):
    same(
        lambda: pair.ab.send_array(arr, timeout=T),
        lambda: pair.ab.send_array_nb(arr),
    )


# -- RMA ----------------------------------------------------------------------


@pytest.fixture
def key(pair):
    region = pair.ctx.register(np.zeros(64, np.uint8))
    k = pair.ab.unpack(region.remote())
    yield k
    k.close()
    region.close()


@pytest.mark.parametrize("offset", [-1, 64, 60, 2**64, "0", 1.5], ids=repr)
def test_put_and_put_nb_refuse_a_bad_offset_alike(pair, key, offset):
    buf = np.ones(8, np.uint8)
    r = same(
        lambda: pair.ab.put(buf, key, offset),
        lambda: pair.ab.put_nb(buf, key, offset),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize("offset", [-1, 64, 60, 2**64, "0", 1.5], ids=repr)
def test_get_and_get_nb_refuse_a_bad_offset_alike(pair, key, offset):
    buf = np.ones(8, np.uint8)
    r = same(
        lambda: pair.ab.get(buf, key, offset),
        lambda: pair.ab.get_nb(buf, key, offset),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize("buf", BAD_BUFFERS, ids=lambda b: type(b).__name__)
def test_put_twins_refuse_a_bad_buffer_alike(pair, key, buf):
    r = same(lambda: pair.ab.put(buf, key), lambda: pair.ab.put_nb(buf, key))
    assert r[0] == "raise"


@pytest.mark.parametrize(
    "buf", BAD_BUFFERS + [b"read-only"], ids=lambda b: type(b).__name__
)
def test_get_twins_refuse_a_bad_buffer_alike(pair, key, buf):
    r = same(lambda: pair.ab.get(buf, key), lambda: pair.ab.get_nb(buf, key))
    assert r[0] == "raise"


@pytest.mark.parametrize("rkey", [None, 3, b"not a key"], ids=repr)
def test_put_twins_refuse_a_bad_key_alike(pair, rkey):
    buf = np.ones(8, np.uint8)
    r = same(lambda: pair.ab.put(buf, rkey), lambda: pair.ab.put_nb(buf, rkey))
    assert r[0] == "raise"


def test_rma_twins_on_a_closed_key_alike(pair, key):
    buf = np.ones(8, np.uint8)
    key.close()
    same(lambda: pair.ab.put(buf, key), lambda: pair.ab.put_nb(buf, key))
    same(lambda: pair.ab.get(buf, key), lambda: pair.ab.get_nb(buf, key))


# -- atomics ------------------------------------------------------------------

ATOMICS = [
    ("atomic_add", (1,)),
    ("fetch_add", (1,)),
    ("swap", (1,)),
    ("compare_swap", (0, 1)),
]


@pytest.mark.parametrize("name,operands", ATOMICS, ids=[a[0] for a in ATOMICS])
@pytest.mark.parametrize(
    "offset,nbytes",
    [(-1, 8), (64, 8), (60, 8), (1, 8), (0, 3), (0, 16), ("0", 8)],
    ids=repr,
)
def test_atomic_twins_refuse_alike(pair, key, name, operands, offset, nbytes):
    blocking = getattr(pair.ab, name)
    nb = getattr(pair.ab, name + "_nb")
    r = same(
        lambda: blocking(key, *operands, offset, nbytes),
        lambda: nb(key, *operands, offset, nbytes),
    )
    assert r[0] == "raise"


@pytest.mark.parametrize("name,operands", ATOMICS, ids=[a[0] for a in ATOMICS])
@pytest.mark.parametrize("operand", ["1", 1.5, 2**64, -(2**63) - 1], ids=repr)
def test_atomic_twins_refuse_a_bad_operand_alike(pair, key, name, operands, operand):
    blocking = getattr(pair.ab, name)
    nb = getattr(pair.ab, name + "_nb")
    args = (operand,) * len(operands)
    r = same(lambda: blocking(key, *args), lambda: nb(key, *args))
    assert r[0] == "raise"


# -- a closed endpoint --------------------------------------------------------


def test_every_twin_refuses_a_closed_endpoint_alike(pair, key):
    buf = np.zeros(8, np.uint8)
    pair.ab.close()
    cases = [
        ("send", (buf, 1), ()),
        ("stream_send", (buf,), ()),
        ("stream_recv", (buf,), ()),
        ("am_send", (3, buf), ()),
        ("send_array", (buf,), ()),
        ("put", (buf, key), ()),
        ("get", (buf, key), ()),
        ("fetch_add", (key, 1), ()),
    ]
    for name, args, _ in cases:
        blocking = getattr(pair.ab, name)
        nb = getattr(pair.ab, name + "_nb")
        r = same(lambda: blocking(*args), lambda: nb(*args))  # noqa: B023
        assert r[0] == "raise" and issubclass(r[1], gpucx.ClosedError), (name, r)


# -- device memory ------------------------------------------------------------
# Test doubles: the CUDA driver is tests/fakegpu.FakeDriver and the "device"
# memory is host memory behind a fake ``__cuda_array_interface__`` (this
# machine has no GPU).  What is compared is what the twins do before UCX
# sees the memory: the CUDA door's checks, the stream argument.

#: (name, blocking call, non-blocking call) of every pair that takes
#: ``stream=``; ``b`` is the buffer, ``k`` a remote key.
DEVICE_TWINS = [
    (
        "send",
        lambda p, b, k, **kw: p.ab.send(b, tag=1, **kw),
        lambda p, b, k, **kw: p.ab.send_nb(b, tag=1, **kw),
    ),
    (
        "recv",
        lambda p, b, k, **kw: p.b.recv(b, tag=1, timeout=T, **kw),
        lambda p, b, k, **kw: p.b.recv_nb(b, tag=1, **kw),
    ),
    (
        "stream_send",
        lambda p, b, k, **kw: p.ab.stream_send(b, **kw),
        lambda p, b, k, **kw: p.ab.stream_send_nb(b, **kw),
    ),
    (
        "am_send",
        lambda p, b, k, **kw: p.ab.am_send(7, b, **kw),
        lambda p, b, k, **kw: p.ab.am_send_nb(7, b, **kw),
    ),
    (
        "put",
        lambda p, b, k, **kw: p.ab.put(b, k, **kw),
        lambda p, b, k, **kw: p.ab.put_nb(b, k, **kw),
    ),
    (
        "get",
        lambda p, b, k, **kw: p.ab.get(b, k, **kw),
        lambda p, b, k, **kw: p.ab.get_nb(b, k, **kw),
    ),
]


def _device_buffer(drv, nbytes: int = 8):
    """A fake device buffer the fake driver reports as device 0's memory."""
    from fakegpu import FakeCudaArrayV2

    mem = np.zeros(nbytes, np.uint8)
    drv.pointers[mem.__array_interface__["data"][0]] = (
        gpucx.MemoryType.CUDA.value,
        0,
        0xC0,
    )
    return FakeCudaArrayV2(mem)


@pytest.mark.parametrize(
    "name,blocking,nb", DEVICE_TWINS, ids=[t[0] for t in DEVICE_TWINS]
)
def test_device_twins_refuse_a_context_without_cuda_alike(
    fake_driver, pair, key, name, blocking, nb
):
    """A context that cannot move device memory (this host's UCX has no
    CUDA transports): both twins refuse the fake device buffer with the
    same error, before UCX sees it."""
    buf = _device_buffer(fake_driver)
    r = same(lambda: blocking(pair, buf, key), lambda: nb(pair, buf, key))
    assert r[0] == "raise" and r[1] is gpucx.UnsupportedError, r


@pytest.mark.parametrize(
    "name,blocking,nb", DEVICE_TWINS, ids=[t[0] for t in DEVICE_TWINS]
)
@pytest.mark.parametrize("stream", ["7", 1.5, -1, object()], ids=repr)
def test_device_and_host_twins_refuse_a_bad_stream_alike(
    fake_driver, pair, key, name, blocking, nb, stream
):
    """A bad ``stream=`` is refused alike by both twins, for host memory and
    for (fake) device memory."""
    for buf in (np.zeros(8, np.uint8), _device_buffer(fake_driver)):
        r = same(
            lambda buf=buf: blocking(pair, buf, key, stream=stream),
            lambda buf=buf: nb(pair, buf, key, stream=stream),
        )
        assert r[0] == "raise", (buf, r)
