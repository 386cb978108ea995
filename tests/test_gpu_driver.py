"""The real ctypes bindings of gpucx.mem.cuda.Driver, over a fake libcuda.

``tests/fakecuda/libcuda_fake.c`` is a test double for the missing GPU: a
shared library with the CUDA driver API's C signatures over host memory.
Compiling it here and loading it with ``Driver.load`` runs gpucx's real
argument types, pointer plumbing and error naming end to end -- the code
that otherwise first runs on a GPU machine.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

import gpucx
from gpucx.mem import cuda as gcuda

from conftest import Pair
from fakegpu import FakeCudaArrayV2, FakeCupyStream, build_fake_libcuda

pytestmark = pytest.mark.timeout(60)

CUDA = int(gpucx.MemoryType.CUDA)


@pytest.fixture(scope="module")
def fake_lib_path(tmp_path_factory):
    return build_fake_libcuda(tmp_path_factory.mktemp("fakecuda") / "libcuda_fake.so")


@pytest.fixture
def drv(fake_lib_path):
    d = gcuda.Driver.load(fake_lib_path)
    d._lib.fake_reset()
    previous = gcuda.set_driver(d)
    yield d
    d._lib.fake_reset()
    gcuda.restore_driver(previous)


def _register(d, ptr, dev, managed=False):
    d._lib.fake_register(ctypes.c_size_t(ptr), dev, int(managed))


def test_device_queries(drv):
    assert drv.version() == 12040
    assert drv.device_count() == 2
    first = drv.primary_context(1)
    assert first == 0xC1 and drv.primary_context(1) == first
    assert drv._primary == {1: 0xC1}


def test_pointer_attributes(drv):
    host = np.zeros(8, np.uint8)
    dev = np.zeros(8, np.uint8)
    managed = np.zeros(8, np.uint8)
    _register(drv, dev.ctypes.data, 1)
    _register(drv, managed.ctypes.data, 0, managed=True)
    assert drv.pointer(host.ctypes.data) == (int(gpucx.MemoryType.HOST), -1, 0)
    assert drv.pointer(dev.ctypes.data) == (CUDA, 1, 0xC1)
    assert drv.pointer(managed.ctypes.data) == (
        int(gpucx.MemoryType.CUDA_MANAGED),
        0,
        0xC0,
    )
    assert gcuda.device_of(dev.ctypes.data) == 1


def test_context_stack(drv):
    assert drv.current_context() == 0
    drv.set_current(0xC0)
    assert drv.current_context() == 0xC0 and drv.context_device() == 0
    drv.push(0xC1)
    assert drv.context_device() == 1
    drv.pop()
    assert drv.current_context() == 0xC0
    drv.pop()
    with pytest.raises(gcuda.DriverError, match="cuCtxPopCurrent: CUDA_ERROR_INVALID"):
        drv.pop()


def test_errors_name_the_call(drv):
    # No context current: the fake refuses to create an event, like CUDA.
    with pytest.raises(gcuda.DriverError, match="cuEventCreate: CUDA_ERROR_INVALID"):
        drv.event_create()
    with pytest.raises(gcuda.DriverError, match="cuEventQuery"):
        drv.event_query(0x9999)


def test_stream_query(drv):
    # Without a context the driver refuses: False, so the event path runs
    # and reports the error (test_errors_name_the_call).
    assert drv.stream_query(0x5) is False
    drv.set_current(0xC0)
    assert drv.stream_query(0x5) is False  # work pending
    drv._lib.fake_set_idle(1)
    assert drv.stream_query(0x6) is True
    assert drv._lib.fake_stream_queries() == 3
    assert drv._lib.fake_last_stream() == 0x6


def test_wait_stream_on_an_idle_stream_records_no_event(drv):
    drv.set_current(0xC1)
    drv._lib.fake_set_idle(1)
    drv._lib.fake_set_polls(4)
    polls = []
    gcuda.wait_stream(0x77, lambda: polls.append(1), "test")
    gcuda.wait_stream(0x78, None, "test")  # blocking form
    assert drv._lib.fake_stream_queries() == 2
    assert drv._lib.fake_records() == 0 and drv._lib.fake_events() == 0
    assert polls == []
    # Work pending: queried, then an event recorded and polled.
    drv._lib.fake_set_idle(0)
    gcuda.wait_stream(0x79, lambda: polls.append(1), "test")
    assert drv._lib.fake_stream_queries() == 3
    assert drv._lib.fake_records() == 1 and len(polls) == 4


def test_events_and_wait_stream(drv):
    drv.set_current(0xC1)
    drv._lib.fake_set_polls(4)
    polls = []
    gcuda.wait_stream(0x77, lambda: polls.append(1), "test")
    assert len(polls) == 4
    assert drv._lib.fake_records() == 1
    assert drv._lib.fake_last_stream() == 0x77
    gcuda.wait_stream(0x78, None, "test")  # blocking form
    assert drv._lib.fake_records() == 2
    assert drv._lib.fake_events() == 1  # the event was reused
    # No context was current: the only way to pick a device is to ask.
    with pytest.raises(ValueError, match="2 CUDA devices"):
        drv._lib.fake_reset()
        import sys

        saved = sys.modules.pop("cupy", None)
        try:
            gcuda.wait_stream(0x79, None, "test")
        finally:
            if saved is not None:
                sys.modules["cupy"] = saved


def test_device_context_over_the_bindings(drv):
    with gcuda.device_context(device=1) as ctx:
        assert ctx == 0xC1 and drv.current_context() == 0xC1
    # Nothing was current: the device is left current, as cudaSetDevice does.
    # (fake_depth counts the current context: 1 set, 2 with one pushed)
    assert drv.current_context() == 0xC1 and drv._lib.fake_depth() == 1
    with gcuda.device_context(device=0) as ctx:
        assert ctx == 0xC0 and drv.current_context() == 0xC0
        assert drv._lib.fake_depth() == 2
    assert drv.current_context() == 0xC1  # pushed and popped
    with (
        pytest.raises(ValueError, match="has 2 CUDA device"),
        gcuda.device_context(device=5),
    ):
        pass
    buf = np.zeros(4, np.uint8)
    _register(drv, buf.ctypes.data, 0)
    with gcuda.device_context(ptr=buf.ctypes.data) as ctx:
        assert ctx == 0xC0 and drv.current_context() == 0xC0
    assert drv.current_context() == 0xC1 and drv._lib.fake_depth() == 1


def test_cai_stream_hook_over_the_bindings(drv):
    drv._lib.fake_set_polls(3)
    arr = np.arange(16, dtype=np.uint8)
    _register(drv, arr.ctypes.data, 1)
    from fakegpu import FakeCudaArrayV3

    buf = gpucx.mem.as_buffer(FakeCudaArrayV3(arr, stream=0x4444))
    assert buf.stream == 0x4444
    assert drv._lib.fake_last_stream() == 0x4444
    assert drv.current_context() == 0xC1  # the owner's device was made current


def test_transfers_with_streams_over_the_bindings(drv, ctx):
    ctx._cuda_problem = None  # capability forced on (no CUDA transports here)
    drv._lib.fake_set_polls(2)
    drv.set_current(0xC0)
    pair = Pair(ctx)
    out = bytearray(5)
    req = pair.b.recv_nb(out, tag=2, stream=FakeCupyStream(0x51))
    pair.drive(pair.ab.send_nb(b"hello", tag=2, stream=0x52), req)
    assert out == b"hello"
    assert drv._lib.fake_records() == 2 and drv._lib.fake_last_stream() == 0x52
    # An eager active message copied into "device" memory with cuMemcpy.
    msgs = []
    pair.b.set_am_handler(3, msgs.append)
    pair.drive(pair.ab.am_send_nb(3, b"0123456789", proto="eager"))
    end = time.monotonic() + 10
    while not msgs:
        pair.b.progress()
        assert time.monotonic() < end
    target = np.zeros(10, np.uint8)
    _register(drv, target.ctypes.data, 1)
    assert msgs[0].receive_into(FakeCudaArrayV2(target), stream=0x53).wait(5) == 10
    assert target.tobytes() == b"0123456789"
    assert drv._lib.fake_memcpys() == 1 and drv._lib.fake_last_stream() == 0x53
    assert drv.current_context() == 0xC0  # device 1 was pushed, then popped


def test_atomic_and_probed_recv_with_streams_over_the_bindings(drv, ctx):
    drv._lib.fake_set_polls(2)
    drv.set_current(0xC0)
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address, error_handling=False)
    mem = np.array([7], np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    req = ab.fetch_add_nb(key, 3, stream=0x54)
    while not req.done():
        b.progress()
    assert req.result() == 7 and mem[0] == 10
    assert drv._lib.fake_records() == 1 and drv._lib.fake_last_stream() == 0x54
    # A probed message received with a stream.
    pair = Pair(ctx)
    pair.drive(pair.ab.send_nb(b"probe", tag=0x55))
    msg = None
    end = time.monotonic() + 10
    while msg is None:
        msg = pair.b.probe(tag=0x55, remove=True)
        assert time.monotonic() < end
    out = bytearray(5)
    assert msg.recv(out, timeout=5, stream=FakeCupyStream(0x56)).nbytes == 5
    assert out == b"probe"
    assert drv._lib.fake_records() == 2 and drv._lib.fake_last_stream() == 0x56
    assert drv.current_context() == 0xC0
    region.close()


def test_allocations_and_queued_copies_over_the_bindings(drv):
    """The calls gpucx.bench.limits times copies with: device and
    page-locked allocations, a stream, cuMemcpyAsync, timing events."""
    with pytest.raises(gcuda.DriverError, match="cuMemAlloc: CUDA_ERROR_INVALID_CON"):
        drv.mem_alloc(16)  # no context current, as CUDA refuses
    drv.set_current(0xC1)
    dev = drv.mem_alloc(16)
    host = drv.mem_alloc_host(16)
    assert dev and host and drv._lib.fake_allocs_live() == 2
    assert drv.pointer(dev) == (CUDA, 1, 0xC1)  # device memory of device 1
    stream = drv.stream_create()
    assert stream and drv._lib.fake_streams_live() == 1
    src = np.arange(16, dtype=np.uint8)
    drv.memcpy_async(dev, src.ctypes.data, 16, stream)
    drv.memcpy_async(host, dev, 16, stream)
    drv.stream_synchronize(stream)
    assert ctypes.string_at(host, 16) == src.tobytes()
    assert drv._lib.fake_async_copies() == 2
    assert drv._lib.fake_async_last_stream() == stream
    start, end = drv.timing_event_create(), drv.timing_event_create()
    drv._lib.fake_set_elapsed(ctypes.c_float(2.5))
    with pytest.raises(gcuda.DriverError, match="cuEventElapsedTime: CUDA_ERROR_INV"):
        drv.event_elapsed_ms(start, end)  # not recorded yet
    drv.event_record(start, stream)
    drv.event_record(end, stream)
    assert drv.event_elapsed_ms(start, end) == 2.5
    untimed = drv.event_create()
    drv.event_record(untimed, stream)
    with pytest.raises(gcuda.DriverError, match="CUDA_ERROR_INVALID_HANDLE"):
        drv.event_elapsed_ms(start, untimed)  # created without timing
    for e in (start, end, untimed):
        drv.event_destroy(e)
    drv.stream_destroy(stream)
    drv.mem_free(dev)
    drv.mem_free_host(host)
    assert drv._lib.fake_allocs_live() == 0 and drv._lib.fake_streams_live() == 0
    assert drv._lib.fake_events_live() == 0
    with pytest.raises(gcuda.DriverError, match="cuMemFree: CUDA_ERROR_INVALID_VALUE"):
        drv.mem_free(dev)  # twice
    drv._lib.fake_set_alloc_limit(ctypes.c_size_t(8))
    with pytest.raises(gcuda.DriverError, match="cuMemAllocHost: CUDA_ERROR_OUT_OF"):
        drv.mem_alloc_host(16)
