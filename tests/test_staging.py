"""Receiver-side staging (gpucx.ops._staging): host arrays into device
memory through the worker's pinned bounce buffers.

Test doubles for the missing GPU: tests/fakecuda/libcuda_fake.c is the CUDA
driver (its "device" allocations are host memory in its pointer table, its
``cuMemcpyHtoDAsync`` is a memmove it counts, its events report "not ready"
a set number of times), and the receiver's allocator returns such memory
behind a fake ``__cuda_array_interface__``.  UCX here has no CUDA
transport: UCX itself cannot write that memory, so an array that arrives
intact came through the staging path.  The same on a GPU, with CuPy:
tests/test_cuda_staging.py.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx.mem import cuda as gcuda
from gpucx.ops import _staging
from gpucx.request import in_flight

from conftest import Pair, channel_pair, join_ok, pump, spawn, transport_config
from fakegpu import FakeCudaArrayV2, FakeCupyStream

pytestmark = pytest.mark.timeout(90)

CUDA = int(gpucx.MemoryType.CUDA)
HOST = int(gpucx.MemoryType.HOST)
#: Sizes across UCX's protocols: short, eager, rendezvous.
SIZES = [8, 5000, 1 << 20]


@pytest.fixture
def drv(fake_libcuda):
    fake_libcuda._lib.fake_set_polls(2)  # every copy's event: "not ready" twice
    return fake_libcuda


def device_allocator(drv, made=None):
    """An allocator of fake device memory (cuMemAlloc'd, in the driver's
    pointer table), behind a fake CUDA array interface."""

    def allocate(nbytes, memory_type):
        size = max(nbytes, 1)
        base = drv.mem_alloc(size)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))
        view[:] = 0xEE
        fake = FakeCudaArrayV2(view[:nbytes] if nbytes else view[:0])
        if made is not None:
            made.append((memory_type, view, fake))
        return fake

    return allocate


def counts(drv) -> dict:
    lib = drv._lib
    return {
        "host_allocs": lib.fake_host_allocs(),
        "htod": lib.fake_htod_copies(),
        "htod_bytes": lib.fake_htod_bytes(),
    }


def sender_thread(pair, arrs, **kw):
    """Send ``arrs`` from a thread that progresses worker a until stopped."""
    stop = threading.Event()
    errors: list = []

    def run():
        try:
            for a in arrs:
                pair.ab.send_array(a, timeout=30, **kw)
            while not stop.is_set():  # rendezvous fetches need the sender
                pair.a.progress()
                time.sleep(0.0005)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def finish():
        stop.set()
        t.join(30)
        assert not errors, errors

    return finish


def pool(w):
    return w._engine.am.staging


@pytest.mark.parametrize("nbytes", SIZES)
def test_host_array_into_device_memory_is_staged(drv, ctx, nbytes):
    pair = Pair(ctx)
    want = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    made: list = []
    done = sender_thread(pair, [want])
    try:
        out = pair.ba.recv_array(timeout=30, allocator=device_allocator(drv, made))
    finally:
        done()
    assert isinstance(out, FakeCudaArrayV2)  # no CuPy here: the allocator's object
    ((memory_type, view, _fake),) = made
    assert memory_type == HOST  # the allocator is asked for the sender's type
    assert view[:nbytes].tobytes() == want.tobytes()
    assert counts(drv) == {"host_allocs": 1, "htod": 1, "htod_bytes": nbytes}
    assert drv._lib.fake_htod_last_stream() >= 0x5000  # gpucx's own stream
    p = pool(pair.b)
    assert p.lent == 0 and p.total == max(_staging.MIN_BLOCK, nbytes)


def test_bounce_buffers_are_reused(drv, ctx):
    pair = Pair(ctx)
    sizes = [1 << 20, 100, 1 << 19, 5000, 1 << 20, 1]
    arrs = [np.full(n, i, np.uint8) for i, n in enumerate(sizes)]
    done = sender_thread(pair, arrs)
    try:
        alloc = device_allocator(drv)
        outs = [pair.ba.recv_array(timeout=30, allocator=alloc) for _ in arrs]
    finally:
        done()
    for a, o in zip(arrs, outs, strict=True):
        assert np.asarray(o.array).tobytes() == a.tobytes()
    # One buffer of 1 MiB serves them all, one after the other.
    assert counts(drv)["host_allocs"] == 1 and counts(drv)["htod"] == len(arrs)
    assert pool(pair.b).total == 1 << 20


def test_host_to_host_never_touches_the_driver(lib_path, ctx):
    class NoDriver:
        def __getattr__(self, name):
            raise AssertionError(f"host to host called the driver: {name}")

    previous = gcuda.set_driver(NoDriver())
    try:
        pair = Pair(ctx)
        arrs = [np.arange(n, dtype=np.uint8) for n in SIZES]
        done = sender_thread(pair, arrs + arrs)
        try:
            for a in arrs:  # the default allocator: NumPy
                assert pair.ba.recv_array(timeout=30).tobytes() == a.tobytes()
            for a in arrs:  # a custom host allocator

                def host(n, m):
                    return bytearray(n)

                out = pair.ba.recv_array(timeout=30, allocator=host)
                assert out.tobytes() == a.tobytes()
        finally:
            done()
        assert pool(pair.b) is None  # never made
    finally:
        gcuda.restore_driver(previous)


def test_device_data_is_not_staged(drv, ctx):
    # An array whose header says CUDA memory: the staging path is for host
    # payloads only (UCX moves device data itself, here into host memory).
    from gpucx.ops import am as _am
    from gpucx.ops import arrays as _arrays

    pair = Pair(ctx)
    header = _arrays._pack("|u1", (64,), CUDA)
    flags = _am.send_flags(True, "rndv")
    send = _am._send_nb(pair.ab, _am.ARRAY_AM_ID, bytes(range(64)), header, flags)
    pump(pair, lambda: pair.b._engine.am.arrays)
    req = pair.ba.recv_array_nb(lambda n, mt: bytearray(n))
    pair.drive(send, req)
    assert bytes(req.result()) == bytes(range(64))
    assert counts(drv)["htod"] == 0 and pool(pair.b) is None


def test_option_off_takes_the_direct_path(drv):
    # GPUCX_STAGING_BYTES=0: UCX is handed the device memory, which this
    # context cannot move (no CUDA transport): refused, the array stays.
    with gpucx.Context(config={"GPUCX_STAGING_BYTES": 0}) as ctx:
        pair = Pair(ctx)
        want = np.arange(100, dtype=np.uint8)
        done = sender_thread(pair, [want])
        try:
            with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot"):
                pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
            assert counts(drv)["htod"] == 0 and counts(drv)["host_allocs"] == 0
            out = pair.ba.recv_array(timeout=30, allocator=lambda n, m: bytearray(n))
            assert out.tobytes() == want.tobytes()
        finally:
            done()


def test_option_from_the_environment(drv, monkeypatch):
    monkeypatch.setenv("GPUCX_STAGING_BYTES", "0")
    with gpucx.Context() as ctx:
        pair = Pair(ctx)
        done = sender_thread(pair, [np.ones(100, np.uint8)])
        try:
            with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot"):
                pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
            pair.ba.recv_array(timeout=30)
        finally:
            done()
    assert counts(drv)["htod"] == 0
    with gpucx.Context(config={"GPUCX_STAGING_BYTES": 1 << 20}) as ctx:
        assert ctx._options["STAGING_BYTES"] == 1 << 20  # config wins


def test_option_is_validated():
    with pytest.raises(ValueError, match="whole number"):
        gpucx.Context(config={"GPUCX_STAGING_BYTES": 1.5})


def test_payload_over_the_cap_takes_the_direct_path(drv):
    with gpucx.Context(config={"GPUCX_STAGING_BYTES": 1 << 16}) as ctx:
        pair = Pair(ctx)
        small, big = np.ones(1 << 16, np.uint8), np.ones((1 << 16) + 1, np.uint8)
        done = sender_thread(pair, [small, big])
        try:
            out = pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
            assert np.asarray(out.array).tobytes() == small.tobytes()
            with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot"):
                pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
            assert counts(drv)["htod"] == 1
            assert pool(pair.b).total == 1 << 16  # bounded
            pair.ba.recv_array(timeout=30)  # take it (the sender completes)
        finally:
            done()


def test_no_pinned_memory_takes_the_direct_path(drv, ctx):
    pair = Pair(ctx)
    done = sender_thread(pair, [np.ones(1 << 20, np.uint8)])
    try:
        target = device_allocator(drv)(1 << 20, HOST)
        drv._lib.fake_set_alloc_limit(1 << 19)  # cuMemHostAlloc of 1 MiB fails
        with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot"):
            pair.ba.recv_array(timeout=30, allocator=lambda n, m: target)
        assert counts(drv)["host_allocs"] == 0 and pool(pair.b).total == 0
        pair.ba.recv_array(timeout=30)  # the array stayed queued
    finally:
        done()


def test_pool_bounded_while_lent(drv):
    p = _staging.Pool(1 << 17)
    with gcuda.device_context(device=0):
        a = p.take(1 << 16)
        b = p.take(1 << 16)
        assert a is not None and b is not None and p.lent == 2
        assert p.take(1) is None  # every byte lent: the direct path
        p.give(a)
        c = p.take(100)
        assert c is a and p.allocs == 2  # reused, nothing made
        p.give(b)
        assert p.take(1 << 17) is None  # c is still lent
        p.give(c)
        d = p.take(1 << 17)
        assert d is not None  # the idle buffers freed to make room
        assert p.total == 1 << 17 and p.allocs == 3
        p.close()
        assert p.take(1) is None
        assert p.total == 1 << 17  # what is still lent
        p.give(d)  # lent at close: freed when given back
    assert p.total == 0 and p.lent == 0
    assert p.take(0) is None and _staging.Pool(0).take(1) is None


def test_stream_order(drv, ctx):
    pair = Pair(ctx)
    want = np.arange(1 << 20, dtype=np.uint8)
    made: list = []
    done = sender_thread(pair, [want])
    try:
        alloc = device_allocator(drv, made)
        pair.ba.recv_array(timeout=30, allocator=alloc, stream=FakeCupyStream(0x77))
    finally:
        done()
    lib = drv._lib
    assert made[0][1].tobytes() == want.tobytes()
    # gpucx's stream waited for an event recorded on the caller's stream
    # before the copy was queued on it.
    assert lib.fake_stream_waits() == 1
    assert lib.fake_wait_stream() == lib.fake_htod_last_stream() >= 0x5000
    assert lib.fake_seq_wait() < lib.fake_seq_htod()


def test_bad_stream_fails_before_a_buffer_is_taken(drv, ctx):
    pair = Pair(ctx)
    done = sender_thread(pair, [np.ones(1 << 20, np.uint8)])
    try:
        with pytest.raises(TypeError, match="stream must be"):
            pair.ba.recv_array(
                timeout=30, allocator=device_allocator(drv), stream=object()
            )
        assert pool(pair.b).lent == 0
        pair.ba.recv_array(timeout=30)  # the array stayed queued
    finally:
        done()


def test_driver_failure_during_the_copy(drv, ctx):
    pair = Pair(ctx)
    a, b = np.ones(1 << 20, np.uint8), np.full(5000, 7, np.uint8)
    done = sender_thread(pair, [a, b])
    try:
        drv._lib.fake_htod_fail(1)  # CUDA_ERROR_INVALID_VALUE
        failed = "cuMemcpyHtoDAsync: CUDA_ERROR_INVALID"
        with pytest.raises(gpucx.UCXError, match=failed):
            pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
        assert pool(pair.b).lent == 0  # the buffer went back
        drv._lib.fake_htod_fail(0)
        made: list = []
        pair.ba.recv_array(timeout=30, allocator=device_allocator(drv, made))
        assert made[0][1].tobytes() == b.tobytes()
    finally:
        done()


def test_pool_freed_at_worker_close(drv, ctx):
    pair = Pair(ctx)
    live = drv._lib.fake_allocs_live()
    done = sender_thread(pair, [np.ones(1 << 20, np.uint8)])
    try:
        pair.ba.recv_array(timeout=30, allocator=device_allocator(drv))
    finally:
        done()
    assert drv._lib.fake_allocs_live() == live + 2  # the target and the bounce
    assert drv._lib.fake_streams_live() == 1
    pair.b.close()
    assert drv._lib.fake_allocs_live() == live + 1  # the target only
    assert drv._lib.fake_streams_live() == 0


def test_recv_array_nb_many_posted_staged(drv, ctx):
    pair = Pair(ctx)
    arrs = [np.full(n, i, np.uint8) for i, n in enumerate(SIZES * 4)]
    made: list = []
    alloc = device_allocator(drv, made)
    reqs = [pair.ba.recv_array_nb(alloc) for _ in arrs]
    sends = [pair.ab.send_array_nb(a) for a in arrs]
    pair.drive(*sends, *reqs, timeout=30)
    for a, (_mt, view, _f) in zip(arrs, made, strict=True):
        assert view[: a.nbytes].tobytes() == a.tobytes()
    assert counts(drv)["htod"] == len(arrs)
    assert pool(pair.b).lent == 0


def matched(pair, req, done: bool = False) -> None:
    """Progress until ``req`` took its array (and its receive is over)."""
    pump(pair, lambda: req._inner is not None and not (done and in_flight(req)))


def test_dropped_request_gives_its_bounce_buffer_back(drv, ctx):
    pair = Pair(ctx)
    req = pair.ba.recv_array_nb(device_allocator(drv))
    send = pair.ab.send_array_nb(np.ones(1 << 20, np.uint8))
    pair.drive(send)
    matched(pair, req, done=True)
    p = pool(pair.b)
    assert p.lent == 1  # received into the bounce buffer, never waited for
    del req
    assert p.lent == 0 and len(p.free) == 1 and counts(drv)["htod"] == 0


def test_dropped_request_in_flight_gives_its_buffer_up(drv, ctx):
    pair = Pair(ctx)
    req = pair.ba.recv_array_nb(device_allocator(drv))
    send = pair.ab.send_array_nb(np.ones(1 << 20, np.uint8), proto="rndv")
    matched(pair, req)  # the fetch posted
    p = pool(pair.b)
    if not in_flight(req):
        pytest.skip("the transfer finished before it could be dropped")
    assert p.lent == 1 and p.total == 1 << 20
    del req
    assert p.lent == 0 and p.total == 0  # given up, not reused
    pair.drive(send)


def test_recv_array_nb_copy_failure_fails_the_request(drv, ctx):
    pair = Pair(ctx)
    req = pair.ba.recv_array_nb(device_allocator(drv))
    drv._lib.fake_htod_fail(1)
    pair.drive(pair.ab.send_array_nb(np.ones(1 << 20, np.uint8)))
    pump(pair, req.done)
    with pytest.raises(gpucx.UCXError, match="recv_array_nb: copying the staged"):
        req.result()


# -- across processes -------------------------------------------------------------


def _host_sender(chan, tls: str, sizes) -> None:
    """A plain host process (no CUDA driver): send NumPy arrays."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        chan.put(w.address)
        ep = w.connect(chan.get(60))
        for i, n in enumerate(sizes):
            ep.send_array(np.full(n, i + 1, np.uint8), timeout=60)
        while chan.get(60) != "bye":
            pass


@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_staging_across_processes(drv, tls):
    sizes = [8, 5000, 1 << 16, 1 << 20, 4 << 20]
    q, theirs = channel_pair()
    child = spawn(_host_sender, theirs, tls, sizes)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)
            made: list = []
            alloc = device_allocator(drv, made)
            window = [ep.recv_array_nb(alloc) for _ in range(2)]
            for i in range(len(sizes)):
                window.pop(0).wait(60)
                if i + 2 < len(sizes):
                    window.append(ep.recv_array_nb(alloc))
            for i, (n, (_mt, view, _f)) in enumerate(zip(sizes, made, strict=True)):
                assert (view[:n] == i + 1).all() and view[n:].tobytes() == b""
            assert counts(drv)["htod"] == len(sizes)
            q.put("bye")
    finally:
        join_ok(child, 60)
