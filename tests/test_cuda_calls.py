"""Driver calls per operation through the CUDA door, and posted active
message receives into (fake) CUDA memory.

Test doubles only: the CUDA driver is tests/fakegpu.FakeDriver, which logs
every call, and "device" memory is host memory behind a fake
``__cuda_array_interface__``.  Posts that would hand such memory to UCX as
CUDA memory are replaced by a spy (UCX here cannot write CUDA memory); the
C matching of device receives runs with ``UCS_MEMORY_TYPE_UNKNOWN``, which
takes the same C branch (every payload through ``ucp_am_recv_data_nbx``
with the buffer's memory type) while UCX detects host memory.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_layer import CUDA, PostSpy, _cuda_capable, _Posted

import gpucx
from gpucx._internal import am_recv_registration
from gpucx._lib import ffi, lib
from gpucx.mem import cuda as gcuda
from gpucx.ops.am import _recv as _am_recv
from gpucx.ops.am import _send as _am_send

from fakegpu import FakeCudaArrayV2, FakeCudaArrayV3, FakeDriver

pytestmark = pytest.mark.timeout(60)


DRIVER_QUERIES = {"pointer", "current_context", "stream_query"}


def _address(arr):
    return arr.__array_interface__["data"][0]


def _one_device(pair, arr):
    """A one-device host (test double) whose primary context is current."""
    drv = FakeDriver(devices=1, idle=True)
    drv.pointers[_address(arr)] = (CUDA, 0, 0xC0)
    drv.current = 0xC0
    _cuda_capable(pair.ctx)
    return drv


def _queries(drv, since=0):
    names = [c[0] for c in drv.calls[since:]]
    return {n: names.count(n) for n in DRIVER_QUERIES | {"push", "pop"}}


def _spy(monkeypatch, names):
    events = []
    monkeypatch.setattr(_am_send, "lib", PostSpy(lib, set(names), events, 6))
    return events


@pytest.mark.parametrize("version", [2, 3])
def test_one_device_primary_current_costs_one_context_query(pair, monkeypatch, version):
    arr = np.arange(64, dtype=np.uint8)
    drv = _one_device(pair, arr)
    previous = gcuda.set_driver(drv)
    try:
        fake = FakeCudaArrayV3(arr) if version == 3 else FakeCudaArrayV2(arr)
        _spy(monkeypatch, {"gpucx_am_send"})
        with pytest.raises(_Posted):  # warm: the one-device check runs once
            pair.ab.am_send_nb(7, fake)
        since = len(drv.calls)
        with pytest.raises(_Posted):
            pair.ab.am_send_nb(7, fake)
        got = _queries(drv, since)
    finally:
        gcuda.restore_driver(previous)
    # Before: 2 pointer queries, 3 current-context queries, 1 stream query.
    assert got == {
        "pointer": 0,
        "current_context": 1,
        "stream_query": 1 if version == 3 else 0,
        "push": 0,
        "pop": 0,
    }


def test_multi_device_owner_pushed_costs_one_pointer_query(pair, monkeypatch):
    arr = np.arange(64, dtype=np.uint8)
    drv = FakeDriver(devices=2, idle=True)
    drv.pointers[_address(arr)] = (CUDA, 1, 0xC1)
    drv.current = 0xC0  # another device current: the owner is pushed, popped
    _cuda_capable(pair.ctx)
    previous = gcuda.set_driver(drv)
    try:
        _spy(monkeypatch, {"gpucx_am_send"})
        with pytest.raises(_Posted):
            pair.ab.am_send_nb(7, FakeCudaArrayV3(arr))
        names = drv.names()
        got = _queries(drv)
    finally:
        gcuda.restore_driver(previous)
    assert got == {
        "pointer": 1,
        "current_context": 1,
        "stream_query": 1,
        "push": 1,
        "pop": 1,
    }
    # The producer stream is queried in the owner's context, pushed first.
    assert names.index("push") < names.index("stream_query") < names.index("pop")
    assert drv.current == 0xC0


def test_deferred_stream_waits_with_progress_when_busy(pair, monkeypatch):
    arr = np.arange(64, dtype=np.uint8)
    drv = FakeDriver(devices=2, idle=False, polls=2)
    drv.pointers[_address(arr)] = (CUDA, 0, 0xC0)
    drv.current = 0xC0
    _cuda_capable(pair.ctx)
    events = []
    drv.observer = events.append
    # The door progresses the worker's engine while it waits.
    from gpucx._engine import Engine

    mine, progress = pair.a._engine, Engine.progress
    monkeypatch.setattr(
        Engine,
        "progress",
        lambda e: events.append(("progress",)) or 0 if e is mine else progress(e),
    )
    previous = gcuda.set_driver(drv)
    try:
        _spy(monkeypatch, {"gpucx_am_send"})
        with pytest.raises(_Posted):
            pair.ab.am_send_nb(7, FakeCudaArrayV3(arr, stream=0x99))
    finally:
        gcuda.restore_driver(previous)
    names = [e[0] for e in events]
    assert ("event_record", 0xE1, 0x99) in events
    assert names.count("progress") == 2  # the worker moved while it waited
    assert names[-1] == "event_query"


def test_user_hook_still_runs_in_acquire(pair, monkeypatch):
    from gpucx.mem import buffer as _buffer

    arr = np.arange(8, dtype=np.uint8)
    seen = []
    old = _buffer.set_stream_sync_hook(lambda s, b: seen.append(s))
    try:
        ptr, n, mt, keep = _buffer.acquire(FakeCudaArrayV3(arr), False, None, True)
    finally:
        _buffer.set_stream_sync_hook(old)
    assert seen == [0x5EED] and type(keep) is not gcuda.Deferred


def test_fake_libcuda_counts(tmp_path, pair, monkeypatch):
    """The real ctypes bindings over the fake libcuda: one device, its
    primary current; an operation asks for the current context once and
    never for the pointer."""
    import ctypes

    from fakegpu import build_fake_libcuda

    path = build_fake_libcuda(tmp_path / "libcuda.so.1")
    fake = ctypes.CDLL(path)
    fake.fake_reset()
    fake.fake_set_devices(1)
    fake.fake_set_idle(1)
    drv = gcuda.Driver.load(path)
    arr = np.arange(64, dtype=np.uint8)
    fake.fake_register(ctypes.c_size_t(_address(arr)), 0, 0)
    _cuda_capable(pair.ctx)
    previous = gcuda.set_driver(drv)
    try:
        drv.set_current(drv.primary_context(0))
        _spy(monkeypatch, {"gpucx_am_send"})
        with pytest.raises(_Posted):
            pair.ab.am_send_nb(7, FakeCudaArrayV3(arr))
        p0, c0, s0 = (
            fake.fake_pointer_queries(),
            fake.fake_ctx_queries(),
            fake.fake_stream_queries(),
        )
        with pytest.raises(_Posted):
            pair.ab.am_send_nb(7, FakeCudaArrayV3(arr))
        got = (
            fake.fake_pointer_queries() - p0,
            fake.fake_ctx_queries() - c0,
            fake.fake_stream_queries() - s0,
        )
    finally:
        gcuda.restore_driver(previous)
        fake.fake_reset()
    assert got == (0, 1, 1)


# -- posted AM receives into CUDA memory ----------------------------------------


def test_posted_cuda_receive_passes_the_door_and_posts_cuda(pair, monkeypatch):
    arr = np.zeros(64, np.uint8)
    drv = _one_device(pair, arr)
    previous = gcuda.set_driver(drv)
    try:
        events = []
        monkeypatch.setattr(
            _am_recv, "lib", PostSpy(lib, {"gpucx_am_post_mt"}, events, 3)
        )
        with pytest.raises(_Posted):
            pair.b.am_recv_nb(21, FakeCudaArrayV3(arr))
        events2 = []
        monkeypatch.setattr(
            _am_recv, "lib", PostSpy(lib, {"gpucx_am_post_group"}, events2, 4)
        )
        with pytest.raises(_Posted):
            pair.b.am_recv_many_nb(21, [FakeCudaArrayV3(arr)] * 3)
        names = drv.names()
    finally:
        gcuda.restore_driver(previous)
    assert events == [("post", "gpucx_am_post_mt", CUDA)]
    assert events2[0][:2] == ("post", "gpucx_am_post_group")
    assert list(ffi.unpack(events2[0][2], 1)) == [CUDA]
    assert "stream_query" in names  # the CAI v3 stream, before posting


def test_posted_cuda_receive_takes_kept_eager_message(pair, fake_driver):
    """An eager message kept before a CUDA buffer is posted is copied in
    by the driver (FakeDriver.memcpy) when the buffer is posted."""
    _cuda_capable(pair.ctx)
    am_recv_registration(pair.b, 22)
    pair.drive(pair.ab.am_send_nb(22, b"kept-eager", proto="eager"))
    for _ in range(50):
        pair.b.progress()
    arr = np.zeros(16, np.uint8)
    fake_driver.pointers[_address(arr)] = (CUDA, 0, 0xC0)
    req = pair.b.am_recv_nb(22, FakeCudaArrayV2(arr))
    assert req.wait(5) == 10
    assert bytes(arr[:10]) == b"kept-eager"
    assert "memcpy" in fake_driver.names()
    # Two kept messages, a group of CUDA buffers: both copied in, in order.
    pair.drive(pair.ab.am_send_nb(22, b"one", proto="eager"))
    pair.drive(pair.ab.am_send_nb(22, b"two!", proto="eager"))
    for _ in range(50):
        pair.b.progress()
    a1, a2 = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    for a in (a1, a2):
        fake_driver.pointers[_address(a)] = (CUDA, 0, 0xC0)
    req = pair.b.am_recv_many_nb(22, [FakeCudaArrayV2(a1), FakeCudaArrayV2(a2)])
    assert req.wait(5) == [3, 4]
    assert bytes(a1[:3]) == b"one" and bytes(a2[:4]) == b"two!"


def test_posted_cuda_receive_kept_message_too_large(pair, fake_driver):
    _cuda_capable(pair.ctx)
    am_recv_registration(pair.b, 23)
    pair.drive(pair.ab.am_send_nb(23, b"x" * 32, proto="eager"))
    for _ in range(50):
        pair.b.progress()
    arr = np.zeros(8, np.uint8)
    fake_driver.pointers[_address(arr)] = (CUDA, 0, 0xC0)
    with pytest.raises(gpucx.MessageTruncatedError):
        pair.b.am_recv_nb(23, FakeCudaArrayV2(arr)).wait(5)
    assert "memcpy" not in fake_driver.names()


def _post_unknown(pair, am_id, arr):
    """Post ``arr`` in C as non-host memory (UNKNOWN: UCX detects host)."""
    reg = am_recv_registration(pair.b, am_id)
    slot = ffi.new("gpucx_slot_t *")
    out = ffi.new("gpucx_am_msg_t *")
    ptr = ffi.from_buffer(arr)
    st = lib.gpucx_am_post_mt(
        reg, ptr, arr.nbytes, lib.UCS_MEMORY_TYPE_UNKNOWN, slot, out
    )
    return st, slot, (ptr, out)


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_c_match_of_device_receive(pair, proto):
    """A receive posted with a device memory type gets both protocols
    through ucp_am_recv_data_nbx in the UCX callback, never a memcpy."""
    arr = np.zeros(4096, np.uint8)
    st, slot, keep = _post_unknown(pair, 24, arr)
    assert st == lib.UCS_INPROGRESS
    payload = bytes(range(256)) * 8
    pair.drive(pair.ab.am_send_nb(24, payload, proto=proto))
    for _ in range(10000):
        if slot.status != lib.UCS_INPROGRESS:
            break
        pair.a.progress()
        pair.b.progress()
    assert slot.status == lib.UCS_OK
    assert slot.length == len(payload)
    assert bytes(arr[: len(payload)]) == payload


def test_c_match_of_device_receive_too_large(pair):
    arr = np.zeros(8, np.uint8)
    st, slot, keep = _post_unknown(pair, 25, arr)
    pair.drive(pair.ab.am_send_nb(25, b"y" * 64, proto="eager"))
    for _ in range(1000):
        if slot.status != lib.UCS_INPROGRESS:
            break
        pair.b.progress()
    assert slot.status == lib.UCS_ERR_MESSAGE_TRUNCATED
    assert not arr.any()


def test_posted_receive_refuses_other_device_memory(pair):
    from fakegpu import FakeDLPackCuda

    arr = np.zeros(8, np.uint8)
    rocm = FakeDLPackCuda(arr, device=(10, 0))  # kDLROCM
    with pytest.raises(gpucx.UnsupportedError, match="ROCM"):
        pair.b.am_recv_nb(26, rocm)
    with pytest.raises(gpucx.UnsupportedError, match="buffer 0: .*ROCM"):
        pair.b.am_recv_many_nb(26, [rocm])
