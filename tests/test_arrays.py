"""send_array / recv_array between workers of one process."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx.ops import am as _am
from gpucx.ops import arrays as _arrays

from conftest import Pair

pytestmark = pytest.mark.timeout(120)

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    ">i4",
    ">f8",
]
SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 0, 5), (2, 3, 4), (1, 1, 1, 1, 5)]


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, dtype=dt.newbyteorder("="))


def transfer(pair, arr, **kw):
    """Send from a thread driving worker a; receive here on worker b."""
    errors = []

    def send():
        try:
            pair.ab.send_array(arr, **kw)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    try:
        out = pair.ba.recv_array(timeout=120)
    finally:
        t.join(120)
    assert not t.is_alive()
    if errors:
        raise errors[0]
    return out


def check(out, arr):
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    assert out.flags.c_contiguous and out.flags.writeable
    assert np.array_equal(out, arr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(pair, dtype):
    arr = sample(dtype, (5, 3))
    check(transfer(pair, arr), arr)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(pair, tls, shape):
    arr = sample("float32", shape, 1)
    check(transfer(pair, arr), arr)


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_forced_protocols(pair, proto):
    arr = sample("int64", (100,), 2)
    check(transfer(pair, arr, proto=proto), arr)


@pytest.mark.parametrize("mib", [1, 16, 256])
def test_large_sizes(pair, tls, mib):
    if mib == 256 and tls != "default":
        pytest.skip("256 MiB once (default transports) keeps the suite short")
    arr = np.arange(mib << 18, dtype=np.float32)  # mib MiB
    out = transfer(pair, arr)
    check(out, arr)


def test_non_contiguous_is_sent_contiguous(pair):
    base = sample("float64", (8, 10), 3)
    for view in (base[::2, 1::3], base.T, np.asfortranarray(base)):
        check(transfer(pair, view), np.ascontiguousarray(view))


def test_per_endpoint_queues(ctx):
    recv = ctx.create_worker()
    s1, s2 = ctx.create_worker(), ctx.create_worker()
    e1, e2 = s1.connect(recv.address), s2.connect(recv.address)
    r1, r2 = recv.connect(s1.address), recv.connect(s2.address)
    reqs = []
    for i in range(3):
        reqs.append(e1.send_array_nb(np.full(4, i, np.int32)))
        reqs.append(e2.send_array_nb(np.full(2, 10 + i, np.int64)))
    end = time.monotonic() + 20
    while (
        not all(r.done() for r in reqs)
        or sum(len(q) for q in recv._engine.am.arrays.values()) < 6
    ):
        for w in (s1, s2, recv):
            w.progress()
        assert time.monotonic() < end
    # Read s2's arrays first: s1's stay queued for r1.
    assert [r2.recv_array(timeout=5).tolist() for _ in range(3)] == [
        [10, 10],
        [11, 11],
        [12, 12],
    ]
    got = [r1.recv_array(timeout=5) for _ in range(3)]
    assert [a.dtype for a in got] == [np.int32] * 3
    assert [a.tolist() for a in got] == [[0] * 4, [1] * 4, [2] * 4]


def test_recv_timeout_loses_nothing(pair):
    with pytest.raises(gpucx.TimeoutError):
        pair.ba.recv_array(timeout=0.2)
    arr = np.arange(3)
    check(transfer(pair, arr), arr)


def test_custom_allocator(pair):
    calls = []

    def alloc(nbytes, memory_type):
        calls.append((nbytes, memory_type))
        return bytearray(nbytes)

    arr = sample("float64", (4, 4), 4)
    pair.drive(pair.ab.send_array_nb(arr))
    end = time.monotonic() + 10
    while not pair.b._engine.am.arrays:
        pair.b.progress()
        assert time.monotonic() < end
    out = pair.ba.recv_array(timeout=5, allocator=alloc)
    assert calls == [(arr.nbytes, int(gpucx.MemoryType.HOST))]
    check(out, arr)


def _send_raw(pair, header, payload=b"\0" * 8):
    req = _am._send_nb(
        pair.ab, _am.ARRAY_AM_ID, payload, header, _am.send_flags(True, None)
    )
    pair.drive(req)
    end = time.monotonic() + 10
    while not pair.b._engine.am.arrays:
        pair.b.progress()
        assert time.monotonic() < end


def test_cuda_data_without_cupy_raises_and_stays_queued(pair, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy is absent
    header = _arrays._pack("<f4", (2,), int(gpucx.MemoryType.CUDA))
    _send_raw(pair, header)
    with pytest.raises(gpucx.UnsupportedError, match="CuPy"):
        pair.ba.recv_array(timeout=5)
    out = pair.ba.recv_array(timeout=5, allocator=lambda n, mt: bytearray(n))
    assert out.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "header,match",
    [
        (b"XXXX\x01\x00\x3c\x01\x03<f8" + b"\0" * 8, "magic"),
        (b"GXAR\x09\x00\x3c\x01\x03<f8" + b"\0" * 8, "version 9"),
        (b"GXAR\x01\x00\x3c\x02\x03<f8" + b"\0" * 8, "length"),
        (b"GXA", "too short"),
    ],
)
def test_malformed_header_is_dropped(pair, header, match):
    _send_raw(pair, header)
    with pytest.raises(ValueError, match=match):
        pair.ba.recv_array(timeout=5)
    with pytest.raises(gpucx.TimeoutError):
        pair.ba.recv_array(timeout=0.1)


def test_object_and_structured_dtypes_rejected(pair):
    with pytest.raises(TypeError, match="objects"):
        pair.ab.send_array(np.array([object(), 1]))
    with pytest.raises(TypeError, match="structured"):
        pair.ab.send_array(np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]))


def test_non_contiguous_device_array_rejected(pair):
    from fakegpu import FakeCudaArrayV2

    fake = FakeCudaArrayV2(np.zeros((4, 4), np.float32).T)
    with pytest.raises(ValueError, match="not C-contiguous"):
        pair.ab.send_array(fake)


def test_handler_error_reaches_recv_array(pair):
    def boom(msg):
        raise OSError("handler error while waiting")

    pair.b.set_am_handler(1, boom)
    pair.drive(pair.ab.am_send_nb(1, b"x"))
    with pytest.raises(OSError, match="while waiting"):
        pair.ba.recv_array(timeout=5)


def test_closed(pair):
    pair.ab.close()
    with pytest.raises(gpucx.ClosedError):
        pair.ab.send_array(np.zeros(2))
    with pytest.raises(gpucx.ClosedError):
        pair.ab.recv_array(timeout=1)


@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_arrays_across_processes(tls_name):
    from conftest import channel_pair, join_ok, spawn, transport_config
    from peers_am import am_echo_peer

    arrays = [sample(dt, (3, 2), i) for i, dt in enumerate(DTYPES)]
    arrays += [sample("float16", ()), np.zeros((0, 4), np.complex64)]
    arrays += [np.arange(16 << 20, dtype=np.int32)]  # 64 MiB, rendezvous
    q, theirs = channel_pair()
    child = spawn(am_echo_peer, tls_name, theirs, True)
    try:
        with gpucx.Context(config=transport_config(tls_name, True)) as ctx:
            w = ctx.create_worker()
            _, port = q.get(60)
            ep = w.connect(("127.0.0.1", port))
            q.put(("arrays", len(arrays)))
            for arr in arrays:
                ep.send_array(arr)
                check(ep.recv_array(timeout=60), arr)
            q.put(("bye", None))
            q.get(60)
            q.put("ok")
    finally:
        join_ok(child, 90)


# -- the size limit (max_bytes / GPUCX_MAX_ARRAY_BYTES) ---------------------------


def _send_in_thread(pair, arr, proto):
    """Start a blocking send_array on worker a; return (thread, outcome list)."""
    seen: list = []

    def send():
        try:
            pair.ab.send_array(arr, proto=proto)
            seen.append("ok")
        except BaseException as exc:  # reported to the test
            seen.append(exc)

    t = threading.Thread(target=send)
    t.start()
    return t, seen


def _transfer_kw(pair, arr, proto=None, **kw):
    t, seen = _send_in_thread(pair, arr, proto)
    try:
        out = pair.ba.recv_array(timeout=30, **kw)
    finally:
        t.join(30)
    assert seen == ["ok"]
    return out


# eager: a few KiB forced eager; rndv: 1 MiB forced rendezvous.
LIMIT_CASES = [("eager", 4096), ("rndv", 1 << 20)]


@pytest.mark.parametrize("proto,nbytes", LIMIT_CASES)
@pytest.mark.parametrize("how", ["keyword", "config"])
def test_max_bytes_refuses_one_byte_over(tls, proto, nbytes, how):
    from conftest import TRANSPORTS

    cfg = dict(TRANSPORTS[tls] or {})
    if how == "config":
        cfg["GPUCX_MAX_ARRAY_BYTES"] = nbytes - 1
    kw = {"max_bytes": nbytes - 1} if how == "keyword" else {}
    with gpucx.Context(config=cfg) as ctx:
        from conftest import Pair

        pair = Pair(ctx)
        big = np.arange(nbytes, dtype=np.uint8)
        t, seen = _send_in_thread(pair, big, proto)
        try:
            with pytest.raises(ValueError) as info:
                pair.ba.recv_array(timeout=30, **kw)
        finally:
            t.join(30)
        assert not t.is_alive()
        msg = str(info.value)
        assert f"{nbytes} bytes" in msg and f"max_bytes={nbytes - 1}" in msg
        # The sender's request completed, without an error: dropping the
        # message released its data (rendezvous: the sender is told done).
        assert seen == ["ok"]
        # Nothing of the refused array is left: the next one arrives.
        small = np.arange(nbytes - 1, dtype=np.uint8)[::-1].copy()
        assert np.array_equal(_transfer_kw(pair, small, proto, **kw), small)


@pytest.mark.parametrize("proto,nbytes", LIMIT_CASES)
def test_max_bytes_exactly_at_limit_is_received(pair, proto, nbytes):
    arr = np.arange(nbytes, dtype=np.uint8)
    t, seen = _send_in_thread(pair, arr, proto)
    try:
        out = pair.ba.recv_array(timeout=30, max_bytes=nbytes)
    finally:
        t.join(30)
    assert seen == ["ok"]
    assert np.array_equal(out, arr)


def test_max_bytes_keyword_overrides_context_option():
    with gpucx.Context(config={"GPUCX_MAX_ARRAY_BYTES": 8}) as ctx:
        from conftest import Pair

        pair = Pair(ctx)
        arr = np.arange(4, dtype=np.int64)  # 32 bytes
        out = _transfer_kw(pair, arr, max_bytes=0)  # 0: no limit for this call
        assert np.array_equal(out, arr)
        out = _transfer_kw(pair, arr, max_bytes=32)
        assert np.array_equal(out, arr)
        t, seen = _send_in_thread(pair, arr, None)
        try:
            with pytest.raises(ValueError, match="32 bytes.*max_bytes=8"):
                pair.ba.recv_array(timeout=30)
        finally:
            t.join(30)
        assert seen == ["ok"]


def test_max_bytes_default_is_4_gib_and_zero_is_unlimited(pair):
    assert pair.ctx.max_array_bytes == 4 << 30
    arr = np.arange(1 << 20, dtype=np.int64)
    assert np.array_equal(transfer(pair, arr), arr)
    with gpucx.Context(config={"GPUCX_MAX_ARRAY_BYTES": 0}) as ctx:
        p = Pair(ctx)
        assert np.array_equal(transfer(p, arr), arr)


def test_max_bytes_refuses_a_malformed_header_first_by_size(pair):
    # The size check needs no header: a 16-byte payload with garbage header
    # over a 15-byte limit is refused for its size, and dropped.
    _send_raw(pair, b"garbage", payload=b"\0" * 16)
    with pytest.raises(ValueError, match="16 bytes, more than max_bytes=15"):
        pair.ba.recv_array(timeout=5, max_bytes=15)
    with pytest.raises(gpucx.TimeoutError):
        pair.ba.recv_array(timeout=0.1)


@pytest.mark.parametrize(
    "value,exc,match",
    [
        ("10", TypeError, "max_bytes must be an int or None, not str"),
        (1.5, TypeError, "not float"),
        (True, TypeError, "not bool"),
        (-1, ValueError, "max_bytes must be >= 0, not -1"),
    ],
)
def test_max_bytes_invalid(pair, value, exc, match):
    with pytest.raises(exc, match=match):
        pair.ba.recv_array(timeout=0.1, max_bytes=value)


@pytest.mark.parametrize("value", [-1, 1.5, "x"])
def test_max_array_bytes_option_invalid(value):
    with pytest.raises(ValueError, match="GPUCX_MAX_ARRAY_BYTES"):
        gpucx.Context(config={"GPUCX_MAX_ARRAY_BYTES": value})


def test_max_array_bytes_option_accepts_whole_numbers():
    with gpucx.Context(config={"GPUCX_MAX_ARRAY_BYTES": "4096"}) as ctx:
        assert ctx.max_array_bytes == 4096
    with gpucx.Context(config={"gpucx_max_array_bytes": 2.0}) as ctx:
        assert ctx.max_array_bytes == 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_max_bytes_across_processes(tls_name):
    from conftest import channel_pair, join_ok, spawn, transport_config
    from peers_am import array_sender_peer

    limit = 4096
    sends = [
        (limit + 1, "eager"),  # refused
        (limit, "eager"),  # at the limit: received
        (4 << 20, "rndv"),  # refused, 4 MiB never moves
        (limit + 1, "rndv"),  # refused
        (limit, "rndv"),  # received
        (limit - 1, None),  # received
    ]
    q, theirs = channel_pair()
    child = spawn(array_sender_peer, tls_name, theirs, sends)
    try:
        cfg = dict(transport_config(tls_name, True) or {})
        cfg["GPUCX_MAX_ARRAY_BYTES"] = limit
        with gpucx.Context(config=cfg) as ctx:
            w = ctx.create_worker()
            _, port = q.get(60)
            ep = w.connect(("127.0.0.1", port))
            for i, (nbytes, _) in enumerate(sends):
                if nbytes > limit:
                    with pytest.raises(ValueError, match=f"{nbytes} bytes"):
                        ep.recv_array(timeout=60)
                else:
                    out = ep.recv_array(timeout=60)
                    assert out.shape == (nbytes,)
                    assert (out == i).all()
            tag, seen = q.get(60)
            assert tag == "sent"
            # The sender cannot tell: every send completed without error.
            assert seen == ["ok"] * len(sends)
            q.put("bye")
    finally:
        join_ok(child, 90)


# -- one bad array fails one receive, never the endpoint (issue 16) ------------


@pytest.mark.parametrize("memtype", ["ROCM", "ZE_DEVICE", "RDMA", "UNKNOWN"])
def test_memory_type_other_than_host_or_cuda_fails_one_receive(pair, memtype):
    header = _arrays._pack("<f4", (2,), int(gpucx.MemoryType[memtype]))
    _send_raw(pair, header)
    with pytest.raises(ValueError, match=f"memory type {memtype} is not host or CUDA"):
        pair.ba.recv_array(timeout=5)
    assert pair.b.stats()["arrays"].count == 0
    pair.ab.send_array(np.arange(4))
    assert pair.ba.recv_array(timeout=5).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("shape", [(1 << 40,), (1 << 20, 1 << 20, 1 << 20)])
def test_header_claiming_a_huge_size_fails_one_receive(pair, shape):
    _send_raw(pair, _arrays._pack("<f8", shape, int(gpucx.MemoryType.HOST)))
    with pytest.raises(ValueError, match="malformed array message"):
        pair.ba.recv_array(timeout=5)
    pair.ab.send_array(np.arange(3))
    assert pair.ba.recv_array(timeout=5).tolist() == [0, 1, 2]


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_allocation_failure_drops_one_array(pair, proto):
    def no_memory(nbytes, memory_type):
        raise MemoryError("no room")

    req = pair.ab.send_array_nb(np.ones(1 << 16, np.uint8), proto=proto)
    end = time.monotonic() + 10
    while not pair.b._engine.am.arrays:
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    with pytest.raises(MemoryError, match="cannot allocate 65536 bytes.*dropped"):
        pair.ba.recv_array(timeout=5, allocator=no_memory)
    assert pair.b.stats()["arrays"].count == 0
    pair.drive(req)  # a dropped rendezvous completes its sender
    pair.ab.send_array(np.arange(3))
    assert pair.ba.recv_array(timeout=5).tolist() == [0, 1, 2]
