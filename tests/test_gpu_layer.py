"""The CUDA layer on a machine without a GPU (gpucx.mem.cuda).

What can be proven here is proven here: stream arguments are normalised,
a context that cannot move CUDA memory says why and every operation on a
CUDA buffer raises ``UnsupportedError`` before UCX sees it, received arrays
are allocated where the allocator says, and -- with :class:`FakeDriver`
standing in for ``libcuda`` and the context's capability forced on (both
test doubles for the missing GPU) -- that the device is made current and the
stream waited for (while the worker progresses) *before* the operation is
posted with the CUDA memory type.  The real thing runs in tests/test_cuda.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx.mem import as_buffer
from gpucx.mem import cuda as gcuda
from gpucx.mem import region as _region
from gpucx.ops import am as _am
from gpucx.ops import arrays as _arrays
from gpucx.ops import tag as _tag
from gpucx.ops.am import _send as _am_send

from conftest import TRANSPORTS, Pair
from fakegpu import (
    FakeCudaArrayV2,
    FakeCudaArrayV3,
    FakeCupyStream,
    FakeDLPackCuda,
    FakeNumbaStream,
    FakeTorchStream,
)

pytestmark = pytest.mark.timeout(60)

CUDA = int(gpucx.MemoryType.CUDA)
HOST = int(gpucx.MemoryType.HOST)
NO_DRIVER = "no CUDA driver (test double: the driver is hidden)"


@pytest.fixture
def no_driver():
    """Hide any CUDA driver, so the result is the same on a GPU machine."""
    previous = gcuda.set_driver(None, NO_DRIVER)
    yield
    gcuda.restore_driver(previous)


# -- stream arguments -------------------------------------------------------------


class IntLike:
    """A stream object that only converts with int() (Numba's __int__)."""

    def __init__(self, handle):
        self._handle = handle

    def __int__(self):
        return self._handle


@pytest.mark.parametrize(
    "stream,handle",
    [
        (None, None),
        (0, gcuda.LEGACY_STREAM),
        (1, 1),
        (2, 2),
        (0x7F00_1234, 0x7F00_1234),
        (FakeCupyStream(0x55), 0x55),
        (FakeCupyStream(0), gcuda.LEGACY_STREAM),
        (FakeTorchStream(0x66), 0x66),
        (FakeNumbaStream(0x77), 0x77),
        (FakeNumbaStream(None), gcuda.LEGACY_STREAM),
        (IntLike(0x88), 0x88),
    ],
)
def test_as_stream_normalises(stream, handle):
    assert gcuda.as_stream(stream) == handle


@pytest.mark.parametrize("stream", [True, 1.5, "1", object(), b"\x01"])
def test_as_stream_rejects_non_streams(stream):
    with pytest.raises(TypeError, match="stream"):
        gcuda.as_stream(stream)


@pytest.mark.parametrize("stream", [-1, FakeCupyStream(-5), IntLike(-2)])
def test_as_stream_rejects_negative_handles(stream):
    with pytest.raises(ValueError, match=">= 0"):
        gcuda.as_stream(stream)


# -- capability ---------------------------------------------------------------------


def test_context_says_why_it_cannot_move_cuda(no_driver):
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        assert ctx.cuda_available is False
        text = ctx.cuda_problem
        assert NO_DRIVER in text
        if gpucx.MemoryType.CUDA not in ctx.memory_types:
            assert "cuda_copy" in text and "UCX_TLS" in text and "TLS=tcp" in text
    with pytest.raises(gpucx.ClosedError):
        _ = ctx.cuda_problem


def test_real_driver_loading_reports_missing_library_here():
    # The real loader, on this machine: no libcuda, so a reason, no crash.
    previous = gcuda.set_driver(gcuda._UNLOADED)
    try:
        drv = gcuda.driver()
        if drv is None:
            assert "libcuda.so.1" in gcuda.driver_problem() or "driver" in (
                gcuda.driver_problem() or ""
            )
        else:  # a GPU machine
            assert drv.device_count() >= 1
    finally:
        gcuda.restore_driver(previous)


def _host_region_key(pair):
    region = pair.ctx.register(bytearray(64))
    return region, pair.ab.unpack(region.remote())


def _op(name, pair, rkey):
    ab, ba, b = pair.ab, pair.ba, pair.b
    return {
        "send": lambda x: ab.send(x, tag=1),
        "send_nb": lambda x: ab.send_nb(x, tag=1),
        "send_list": lambda x: ab.send_nb([x], tag=1),
        "recv": lambda x: b.recv(x, tag=1, timeout=1),
        "recv_nb": lambda x: b.recv_nb(x, tag=1),
        "recv_list": lambda x: b.recv_nb([x], tag=1),
        "am_send": lambda x: ab.am_send(5, x),
        "am_send_nb": lambda x: ab.am_send_nb(5, x),
        "stream_send": lambda x: ab.stream_send(x),
        "stream_send_nb": lambda x: ab.stream_send_nb(x),
        "stream_recv": lambda x: ba.stream_recv(x, timeout=1),
        "stream_recv_nb": lambda x: ba.stream_recv_nb(x),
        "put": lambda x: ab.put(x, rkey),
        "put_nb": lambda x: ab.put_nb(x, rkey),
        "put_notify": lambda x: ab.put(x, rkey, notify=b"n"),
        "get": lambda x: ab.get(x, rkey),
        "get_nb": lambda x: ab.get_nb(x, rkey),
        "send_array": lambda x: ab.send_array(x),
        "send_array_nb": lambda x: ab.send_array_nb(x),
        "register": lambda x: pair.ctx.register(x),
    }[name]


OPS = [
    "send",
    "send_nb",
    "send_list",
    "recv",
    "recv_nb",
    "recv_list",
    "am_send",
    "am_send_nb",
    "stream_send",
    "stream_send_nb",
    "stream_recv",
    "stream_recv_nb",
    "put",
    "put_nb",
    "put_notify",
    "get",
    "get_nb",
    "send_array",
    "send_array_nb",
    "register",
]


def _still_works(pair):
    out = bytearray(3)
    pair.drive(pair.ab.send_nb(b"abc", tag=9), pair.b.recv_nb(out, tag=9))
    assert out == b"abc"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("tls", sorted(TRANSPORTS))
def test_cuda_buffer_on_context_without_cuda_is_refused(no_driver, tls, name):
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        pair = Pair(ctx)
        _region_, rkey = _host_region_key(pair)
        fake = FakeCudaArrayV2(np.zeros(16, np.uint8))
        with pytest.raises(gpucx.UnsupportedError) as err:
            _op(name, pair, rkey)(fake)
        assert NO_DRIVER in str(err.value)
        assert "CUDA memory cannot be moved here" in str(err.value)
        _still_works(pair)


@pytest.mark.parametrize(
    "name", ["send", "recv_nb", "put", "get_nb", "am_send", "stream_recv"]
)
def test_stream_without_driver_is_refused(no_driver, pair, name):
    _region_, rkey = _host_region_key(pair)
    ab, b = pair.ab, pair.b
    call = {
        "send": lambda: ab.send(b"x" * 8, tag=1, stream=1),
        "recv_nb": lambda: b.recv_nb(bytearray(8), tag=1, stream=FakeCupyStream(9)),
        "put": lambda: ab.put(b"x" * 8, rkey, stream=2),
        "get_nb": lambda: ab.get_nb(bytearray(8), rkey, stream=FakeTorchStream(7)),
        "am_send": lambda: ab.am_send(5, b"x" * 8, stream=FakeNumbaStream(3)),
        "stream_recv": lambda: pair.ba.stream_recv(bytearray(8), stream=1),
    }[name]
    with pytest.raises(gpucx.UnsupportedError, match="CUDA stream needs no CUDA"):
        call()
    _still_works(pair)


@pytest.mark.parametrize("stream,exc", [(object(), TypeError), (-3, ValueError)])
@pytest.mark.parametrize("name", ["send", "send_nb", "recv", "stream_send", "put"])
def test_bad_stream_is_refused_before_posting(pair, name, stream, exc):
    _region_, rkey = _host_region_key(pair)
    ab, b = pair.ab, pair.b
    call = {
        "send": lambda: ab.send(b"x" * 8, tag=1, stream=stream),
        "send_nb": lambda: ab.send_nb(b"x" * 8, tag=1, stream=stream),
        "recv": lambda: b.recv(bytearray(8), tag=1, stream=stream),
        "stream_send": lambda: ab.stream_send(b"x" * 8, stream=stream),
        "put": lambda: ab.put(b"x" * 8, rkey, stream=stream),
    }[name]
    with pytest.raises(exc, match="stream"):
        call()
    _still_works(pair)


def test_allocate_cuda_without_cuda_refused_allocator_not_called(no_driver, ctx):
    calls = []
    with pytest.raises(gpucx.UnsupportedError, match="allocate: CUDA memory"):
        ctx.allocate(64, gpucx.MemoryType.CUDA, allocator=lambda *a: calls.append(a))
    with pytest.raises(gpucx.UnsupportedError, match="no CUDA driver"):
        ctx.allocate(64, gpucx.MemoryType.CUDA_MANAGED)
    assert calls == []


def test_allocate_host_rejects_device_and_allocator(ctx):
    with pytest.raises(ValueError, match="apply to CUDA memory"):
        ctx.allocate(64, device=0)
    with pytest.raises(ValueError, match="apply to CUDA memory"):
        ctx.allocate(64, allocator=bytearray)


# -- received arrays: where they are allocated ------------------------------------


def _send_cuda_labelled(pair, nbytes=64):
    """An array message whose header says CUDA (the payload is host bytes)."""
    header = _arrays._pack("<u1", (nbytes,), CUDA)
    payload = bytes(range(nbytes))
    flags = _am.send_flags(True, "rndv")
    # Rendezvous: the send completes once the receiver took the data.
    send = _am._send_nb(pair.ab, _am.ARRAY_AM_ID, payload, header, flags)
    end = time.monotonic() + 10
    while not pair.b._engine.am.arrays:
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    pair.sends = [send]
    return payload


def _recv_while_sending(pair, allocator, **kw):
    """recv_array on b while a thread progresses a (the rendezvous sender)."""
    import threading

    stop = threading.Event()

    def progress_sender():
        while not stop.is_set():
            pair.a.progress()
            time.sleep(0.0005)

    t = threading.Thread(target=progress_sender, daemon=True)
    t.start()
    try:
        return pair.ba.recv_array(timeout=5, allocator=allocator, **kw)
    finally:
        stop.set()
        t.join(5)


def test_recv_array_routes_cuda_data_to_the_allocator(pair):
    payload = _send_cuda_labelled(pair)
    calls = []

    def allocator(nbytes, memory_type):
        calls.append((nbytes, memory_type))
        return bytearray(nbytes)  # host memory: allowed, the array lands here

    out = _recv_while_sending(pair, allocator)
    assert calls == [(len(payload), CUDA)]
    assert bytes(out) == payload


def test_recv_array_into_cuda_here_is_refused_and_stays_queued(no_driver, pair):
    payload = _send_cuda_labelled(pair)
    fake = []

    def cuda_allocator(nbytes, memory_type):
        fake.append(FakeCudaArrayV2(np.zeros(nbytes, np.uint8)))
        return fake[-1]

    with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot be moved"):
        pair.ba.recv_array(timeout=5, allocator=cuda_allocator)
    assert len(fake) == 1
    out = _recv_while_sending(pair, lambda n, mt: bytearray(n))
    assert bytes(out) == payload


def test_recv_array_device_needs_a_driver(no_driver, pair):
    payload = _send_cuda_labelled(pair)
    with pytest.raises(gpucx.UnsupportedError, match="device"):
        pair.ba.recv_array(timeout=5, allocator=lambda n, mt: bytearray(n), device=0)
    # The refused message stays queued; taking it completes the rendezvous
    # send (the context's close would otherwise wait for it).
    assert bytes(_recv_while_sending(pair, lambda n, mt: bytearray(n))) == payload


# -- with a fake driver: what happens before the post ------------------------------


class _Posted(Exception):
    """Raised by the post spy instead of handing fake device memory to UCX."""


class PostSpy:
    """Wraps the extension module of an ops module: records the post calls
    named in ``names`` with their memory type and raises :class:`_Posted`
    (host memory posing as CUDA must not reach UCX); passes the rest on.
    With ``returns`` given, a post reports that status instead of raising
    (``0``: finished, ``UCS_INPROGRESS``: handed to UCX), and the operation
    goes on past it."""

    _RAISE = object()

    def __init__(self, lib, names, events, mt_index, returns=_RAISE):
        self._lib = lib
        self._names = names
        self._events = events
        self._mt_index = mt_index
        self._returns = returns

    def __getattr__(self, name):
        attr = getattr(self._lib, name)
        if name not in self._names:
            return attr

        def post(*args):
            self._events.append(("post", name, args[self._mt_index]))
            if self._returns is PostSpy._RAISE:
                raise _Posted(name)
            return self._returns

        return post


def _cuda_capable(ctx):
    """Force the capability on (double for a GPU machine's context)."""
    ctx._cuda_problem = None


def _address(arr):
    return arr.__array_interface__["data"][0]


def _setup_fake(fake_driver, pair, monkeypatch, arr, device=1, polls=3):
    _cuda_capable(pair.ctx)
    fake_driver.pointers[_address(arr)] = (CUDA, device, 0xC0 + device)
    fake_driver.polls = polls
    events = []
    fake_driver.observer = lambda call: events.append(call)
    _spy_progress(monkeypatch, pair.a, events, real=False)
    return events


def _spy_progress(monkeypatch, worker, events, real=True):
    """Record each progress call of ``worker``'s engine in ``events`` (the
    CUDA door progresses the engine while it waits for a stream); with
    ``real=False`` the worker is not progressed at all."""
    from gpucx._engine import Engine

    progress = Engine.progress
    mine = worker._engine

    def spy(e):
        if e is not mine:
            return progress(e)
        events.append(("progress",))
        return progress(e) if real else 0

    monkeypatch.setattr(Engine, "progress", spy)


@pytest.mark.parametrize(
    "stream,handle", [(FakeCupyStream(0x77), 0x77), (FakeNumbaStream(None), 1), (2, 2)]
)
@pytest.mark.parametrize("blocking", [True, False])
def test_send_waits_for_stream_with_progress_then_posts_cuda(
    fake_driver, pair, monkeypatch, stream, handle, blocking
):
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr)
    names = {"gpucx_tag_send_wait", "gpucx_tag_send"}
    monkeypatch.setattr(
        _tag, "lib", PostSpy(_tag.lib, names, events, 5 if blocking else 4)
    )
    call = pair.ab.send if blocking else pair.ab.send_nb
    with pytest.raises(_Posted):
        call(FakeCudaArrayV2(arr), tag=3, stream=stream)
    kinds = [e[0] for e in events]
    # The owner's context became current (none was), then the stream was
    # waited for with progress between polls, then the post, with CUDA.
    assert ("set_current", 0xC1) in events
    assert kinds.index("set_current") < kinds.index("event_record")
    record = next(e for e in events if e[0] == "event_record")
    assert record[2] == handle
    queries = [e for e in events if e[0] == "event_query"]
    assert [q[2] for q in queries] == [False, False, False, True]
    assert kinds.count("progress") == 3
    post = kinds.index("post")
    assert post == len(kinds) - 1 and post > kinds.index("event_query") + 3
    assert events[post][2] == CUDA


def test_other_current_context_is_pushed_and_popped(fake_driver, pair, monkeypatch):
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, device=1, polls=0)
    fake_driver.current = 0xC0  # device 0 current in this thread
    names = {"gpucx_tag_send_wait"}
    monkeypatch.setattr(_tag, "lib", PostSpy(_tag.lib, names, events, 5))
    with pytest.raises(_Posted):
        pair.ab.send(FakeCudaArrayV2(arr), tag=3)
    kinds = [e[0] for e in events]
    assert ("push", 0xC1) in events
    assert kinds.index("push") < kinds.index("post") < kinds.index("pop")
    assert "event_record" not in kinds  # no stream given, none waited for
    assert fake_driver.current == 0xC0


def test_cai_v3_stream_is_synchronized_before_the_post(fake_driver, pair, monkeypatch):
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, polls=2)
    names = {"gpucx_tag_send_wait"}
    monkeypatch.setattr(_tag, "lib", PostSpy(_tag.lib, names, events, 5))
    with pytest.raises(_Posted):
        pair.ab.send(FakeCudaArrayV3(arr, stream=0x99), tag=3)
    kinds = [e[0] for e in events]
    record = next(e for e in events if e[0] == "event_record")
    assert record[2] == 0x99
    # Waited for inside the CUDA door (polled, the worker progressing
    # between polls) before the post.
    waits = [
        i for i, k in enumerate(kinds) if k in ("event_query", "event_synchronize")
    ]
    assert waits and max(waits) < kinds.index("post")
    assert events[-1] == ("post", "gpucx_tag_send_wait", CUDA)


def test_an_idle_stream_costs_one_query_and_no_event(fake_driver, pair, monkeypatch):
    # CuPy names its current stream in every CAI v3 export, so each
    # operation on a CuPy array waits for a stream: one that has nothing
    # pending is answered by cuStreamQuery, with no event through the GPU.
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, polls=2)
    fake_driver.idle = True
    names = {"gpucx_tag_send_wait"}
    monkeypatch.setattr(_tag, "lib", PostSpy(_tag.lib, names, events, 5))
    with pytest.raises(_Posted):
        pair.ab.send(FakeCudaArrayV3(arr, stream=0x99), tag=3)
    kinds = [e[0] for e in events]
    assert ("stream_query", 0x99, True) in events
    assert kinds.index("stream_query") < kinds.index("post")
    assert not {"event_create", "event_record", "event_synchronize"} & set(kinds)
    assert events[-1] == ("post", "gpucx_tag_send_wait", CUDA)
    # Work pending: the query says so, and the event path waits as before.
    fake_driver.idle = False
    del events[:]
    with pytest.raises(_Posted):
        pair.ab.send(FakeCudaArrayV3(arr, stream=0x98), tag=3)
    kinds = [e[0] for e in events]
    assert ("stream_query", 0x98, False) in events
    assert (
        kinds.index("stream_query")
        < kinds.index("event_record")
        < kinds.index("event_query")
        < kinds.index("post")
    )


def test_dlpack_gets_the_consumer_stream_not_minus_one(fake_driver, pair, monkeypatch):
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, polls=0)
    names = {"gpucx_tag_send"}
    monkeypatch.setattr(_tag, "lib", PostSpy(_tag.lib, names, events, 4))
    producer = FakeDLPackCuda(arr, device=(2, 1))
    with pytest.raises(_Posted):
        pair.ab.send_nb(producer, tag=3, stream=FakeTorchStream(0x4242))
    assert producer.streams == [0x4242]
    recorded = [e[2] for e in events if e[0] == "event_record"]
    assert recorded and set(recorded) == {0x4242}
    assert events[-1] == ("post", "gpucx_tag_send", CUDA)


def test_events_are_reused(fake_driver, pair, monkeypatch):
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, polls=0)
    monkeypatch.setattr(_tag, "lib", PostSpy(_tag.lib, {"gpucx_tag_send"}, events, 4))
    for _ in range(3):
        with pytest.raises(_Posted):
            pair.ab.send_nb(FakeCudaArrayV2(arr), stream=5)
    kinds = [e[0] for e in events]
    assert kinds.count("event_record") == 3
    assert kinds.count("event_create") == 1


def test_host_buffer_with_stream_waits_then_posts_host(fake_driver, pair):
    # A host receive target still waits for the stream (a kernel or copy may
    # be reading it); the transfer is real and completes.
    _cuda_capable(pair.ctx)
    fake_driver.polls = 2
    fake_driver.devices = 1
    out = bytearray(4)
    req = pair.b.recv_nb(out, tag=4, stream=FakeCupyStream(0x31))
    pair.drive(pair.ab.send_nb(b"wxyz", tag=4, stream=0x32), req)
    assert out == b"wxyz"
    records = [c[2] for c in fake_driver.calls if c[0] == "event_record"]
    assert records == [0x31, 0x32]
    # No context was current and no device owns host memory: with one
    # device there is no ambiguity; with two (and no CuPy) gpucx asks.
    assert ("set_current", 0xC0) in fake_driver.calls
    fake_driver.devices, fake_driver.current = 2, 0
    import sys

    saved = sys.modules.pop("cupy", None)
    try:
        with pytest.raises(ValueError, match="none is current"):
            pair.ab.send_nb(b"wxyz", tag=4, stream=0x33)
    finally:
        if saved is not None:
            sys.modules["cupy"] = saved


def test_allocate_routes_to_allocator_on_the_device(fake_driver, ctx, monkeypatch):
    _cuda_capable(ctx)
    seen = []

    def allocator(nbytes, memory_type):
        seen.append((nbytes, memory_type, fake_driver.current))
        return FakeCudaArrayV2(np.zeros(nbytes, np.uint8))

    def register(context, obj):
        seen.append(("register", as_buffer(obj).memory_type))
        return _region.MemoryRegion(
            context, 0, 0, gpucx.MemoryType.CUDA, False, obj, False
        )

    monkeypatch.setattr(_region, "register", register)
    region = ctx.allocate(48, gpucx.MemoryType.CUDA, device=1, allocator=allocator)
    assert seen == [(48, CUDA, 0xC1), ("register", gpucx.MemoryType.CUDA)]
    assert region._alloc is True
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        ctx.allocate(48, gpucx.MemoryType.CUDA, device=2, allocator=allocator)


def test_allocator_returning_too_little_is_refused(fake_driver, ctx):
    _cuda_capable(ctx)
    with pytest.raises(ValueError, match="returned 8 bytes; 48"):
        ctx.allocate(
            48,
            gpucx.MemoryType.CUDA,
            device=0,
            allocator=lambda n, mt: FakeCudaArrayV2(np.zeros(8, np.uint8)),
        )


def test_current_device_never_assumes_device_zero(fake_driver):
    fake_driver.current = 0xC1
    assert gcuda.current_device() == 1
    fake_driver.current = 0
    fake_driver.devices = 1
    assert gcuda.current_device() == 0
    fake_driver.devices = 3
    import sys

    saved = sys.modules.pop("cupy", None)
    try:
        with pytest.raises(ValueError, match="3 CUDA devices and none is current"):
            gcuda.current_device()
    finally:
        if saved is not None:
            sys.modules["cupy"] = saved


def test_aio_passes_stream_through(no_driver, ctx):
    import asyncio

    import gpucx.aio

    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            ep = await w.aconnect(w.worker.address)
            with pytest.raises(gpucx.UnsupportedError, match="CUDA stream"):
                await ep.asend(b"abc", tag=1, stream=FakeCupyStream(5))
            with pytest.raises(gpucx.UnsupportedError, match="CUDA stream"):
                await w.arecv(bytearray(3), tag=1, stream=1)
            got = bytearray(3)
            recv = asyncio.ensure_future(w.arecv(got, tag=2))
            await ep.asend(b"xyz", tag=2)
            await recv
            assert got == b"xyz"

    asyncio.run(main())


def _eager_message(pair, payload):
    msgs = []
    pair.b.set_am_handler(7, msgs.append)
    pair.drive(pair.ab.am_send_nb(7, payload, proto="eager"))
    end = time.monotonic() + 10
    while not msgs:
        pair.b.progress()
        assert time.monotonic() < end
    assert not msgs[0].is_rndv
    return msgs[0]


def test_eager_am_into_cuda_here_is_refused_and_kept(no_driver, pair):
    msg = _eager_message(pair, b"0123456789")
    fake = FakeCudaArrayV2(np.zeros(10, np.uint8))
    with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot be moved"):
        msg.receive_into(fake)
    out = bytearray(10)
    assert msg.receive_into(out).wait(5) == 10
    assert out == b"0123456789"


def test_eager_am_into_cuda_is_copied_by_the_driver(fake_driver, pair):
    _cuda_capable(pair.ctx)
    msg = _eager_message(pair, b"0123456789")
    arr = np.zeros(10, np.uint8)
    fake_driver.pointers[_address(arr)] = (CUDA, 1, 0xC1)
    fake_driver.polls = 1
    assert msg.receive_into(FakeCudaArrayV2(arr), stream=0x5A).wait(5) == 10
    assert arr.tobytes() == b"0123456789"
    kinds = fake_driver.names()
    # device current, stream waited for, then the copy
    assert kinds.index("set_current") < kinds.index("event_record")
    assert kinds.index("event_record") < kinds.index("memcpy")
    assert ("memcpy", _address(arr)) == fake_driver.calls[kinds.index("memcpy")][:2]
    with pytest.raises(gpucx.AlreadyReceivedError, match="already received"):
        msg.receive_into(bytearray(10))


# -- atomics, probed messages and unpack: streams and devices ---------------------


class PassSpy:
    """Wraps an extension module: records the calls named in ``names`` into
    ``events`` as ``("post", name)`` and then makes them for real."""

    def __init__(self, lib, names, events):
        self._lib = lib
        self._names = names
        self._events = events

    def __getattr__(self, name):
        attr = getattr(self._lib, name)
        if name not in self._names:
            return attr

        def post(*args):
            self._events.append(("post", name))
            return attr(*args)

        return post


def _amo_endpoints(ctx):
    """Workers a, b and endpoint a->b without peer error handling (UCX offers
    atomic protocols only there), plus a counter on b's side and its key."""
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address, error_handling=False)
    mem = np.array([40, 0], np.uint64)
    region = ctx.register(mem)
    return a, b, ab, mem, region, ab.unpack(region.remote())


_ATOMICS = {
    "atomic_add": lambda ep, k, s: ep.atomic_add(k, 2, stream=s),
    "fetch_add": lambda ep, k, s: ep.fetch_add(k, 2, stream=s),
    "swap": lambda ep, k, s: ep.swap(k, 42, stream=s),
    "compare_swap": lambda ep, k, s: ep.compare_swap(k, 40, 42, stream=s),
    "atomic_xor_nb": lambda ep, k, s: ep.atomic_xor_nb(k, 1, 8, stream=s),
    "fetch_or_nb": lambda ep, k, s: ep.fetch_or_nb(k, 1, 8, stream=s),
    "compare_swap_nb": lambda ep, k, s: ep.compare_swap_nb(k, 0, 1, 8, stream=s),
}


@pytest.mark.parametrize("name", sorted(_ATOMICS))
def test_atomic_waits_for_stream_with_progress_then_posts(
    fake_driver, ctx, monkeypatch, name
):
    from gpucx.ops import atomic as _atomic

    a, b, ab, mem, region, key = _amo_endpoints(ctx)
    fake_driver.polls = 3
    fake_driver.devices = 1
    events: list = []
    fake_driver.observer = events.append
    _spy_progress(monkeypatch, a, events)
    names = {"gpucx_atomic_wait", "gpucx_atomic"}
    monkeypatch.setattr(_atomic, "lib", PassSpy(_atomic.lib, names, events))
    stop = threading.Event()

    def serve():  # the blocking forms need the target worker progressing
        while not stop.is_set():
            b.progress()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        result = _ATOMICS[name](ab, key, FakeCupyStream(0x61))
        if isinstance(result, gpucx.Request):
            result.wait(10)
        ab.flush()  # a non-fetching atomic is done locally before it lands
    finally:
        stop.set()
        t.join(10)
    kinds = [e[0] for e in events]
    record = next(e for e in events if e[0] == "event_record")
    assert record[2] == 0x61
    queries = [e[2] for e in events if e[0] == "event_query"]
    assert queries == [False, False, False, True]
    # The stream was waited for, the worker progressing between polls, and
    # only then the atomic was posted -- once.
    assert kinds.count("progress") >= 3
    assert kinds.count("post") == 1
    assert kinds.index("post") > max(
        i for i, e in enumerate(events) if e[0] == "event_query"
    )
    # Host operands: no device context was pushed for them.
    assert "push" not in kinds
    assert list(mem) != [40, 0]  # the atomic really happened
    region.close()


def test_atomic_stream_without_driver_is_refused(no_driver, ctx):
    a, b, ab, mem, region, key = _amo_endpoints(ctx)
    with pytest.raises(gpucx.UnsupportedError, match="CUDA stream needs no CUDA"):
        ab.fetch_add(key, 1, stream=1)
    with pytest.raises(gpucx.UnsupportedError, match="CUDA stream needs no CUDA"):
        ab.compare_swap_nb(key, 0, 1, stream=FakeCupyStream(3))
    assert list(mem) == [40, 0]  # nothing was posted
    region.close()


@pytest.mark.parametrize("stream,exc", [(object(), TypeError), (-3, ValueError)])
def test_atomic_bad_stream_is_refused_before_posting(ctx, stream, exc):
    a, b, ab, mem, region, key = _amo_endpoints(ctx)
    with pytest.raises(exc, match="stream"):
        ab.atomic_add(key, 1, stream=stream)
    with pytest.raises(exc, match="stream"):
        ab.swap_nb(key, 1, stream=stream)
    assert list(mem) == [40, 0]
    region.close()


def _probed(pair, payload, tag=0x71):
    pair.drive(pair.ab.send_nb(payload, tag=tag))
    end = time.monotonic() + 10
    while True:
        msg = pair.b.probe(tag=tag, remove=True)
        if msg is not None:
            return msg
        assert time.monotonic() < end, "the message never arrived"


@pytest.mark.parametrize("blocking", [True, False])
def test_probed_recv_waits_for_stream_then_posts(
    fake_driver, pair, monkeypatch, blocking
):
    msg = _probed(pair, b"probed!")
    fake_driver.polls = 2
    fake_driver.devices = 1
    events: list = []
    fake_driver.observer = events.append
    monkeypatch.setattr(_tag, "lib", PassSpy(_tag.lib, {"gpucx_tag_msg_recv"}, events))
    out = bytearray(7)
    if blocking:
        info = msg.recv(out, timeout=10, stream=FakeTorchStream(0x62))
    else:
        info = msg.recv_nb(out, stream=0x62).wait(10)
    assert out == b"probed!" and info.nbytes == 7
    kinds = [e[0] for e in events]
    assert next(e for e in events if e[0] == "event_record")[2] == 0x62
    assert [e[2] for e in events if e[0] == "event_query"] == [False, False, True]
    assert kinds.index("post") > kinds.index("event_query") + 2


def test_probed_recv_stream_without_driver_keeps_the_message(no_driver, pair):
    msg = _probed(pair, b"kept")
    with pytest.raises(gpucx.UnsupportedError, match="CUDA stream needs no CUDA"):
        msg.recv(bytearray(4), timeout=5, stream=1)
    with pytest.raises(TypeError, match="stream"):
        msg.recv_nb(bytearray(4), stream=object())
    out = bytearray(4)
    assert msg.recv(out, timeout=5).nbytes == 4
    assert out == b"kept"


def _cuda_token(pair):
    """A token that says CUDA over a host region's key (the fake driver's
    "device memory" is host memory; UCX unpacks the host key)."""
    region = pair.ctx.register(bytearray(64))
    rem = region.remote()
    return region, gpucx.RemoteMemory(
        rem.address, rem.nbytes, gpucx.MemoryType.CUDA, rem.rkey
    )


def test_unpack_device_makes_that_device_current(fake_driver, pair):
    region, token = _cuda_token(pair)
    fake_driver.current = 0xC0  # device 0 current in this thread
    key = pair.ab.unpack(token, device=1)
    assert key.memory_type == gpucx.MemoryType.CUDA
    names = fake_driver.names()
    assert ("push", 0xC1) in fake_driver.calls
    assert names.index("push") < names.index("pop")
    assert fake_driver.current == 0xC0  # restored
    # Without device=: the thread's current device, nothing pushed.
    fake_driver.calls.clear()
    pair.ab.unpack(token)
    assert "push" not in fake_driver.names()
    # A host key ignores a valid device=: nothing is made current.
    fake_driver.calls.clear()
    host = pair.ab.unpack(region.remote(), device=1)
    assert host.memory_type == gpucx.MemoryType.HOST
    assert not {"push", "set_current"} & set(fake_driver.names())
    region.close()


@pytest.mark.parametrize(
    "device,exc,match",
    [
        (-1, ValueError, "device must be >= 0, not -1"),
        (2, ValueError, "device=2: this host has 2 CUDA device"),
        ("0", TypeError, "device must be an int, not str"),
        (True, TypeError, "not bool"),
        (1.0, TypeError, "not float"),
    ],
)
def test_unpack_device_checked(fake_driver, pair, device, exc, match):
    region, token = _cuda_token(pair)
    with pytest.raises(exc, match=match):
        pair.ab.unpack(token, device=device)
    with pytest.raises(exc, match=match):  # host keys are checked the same way
        pair.ab.unpack(region.remote(), device=device)
    assert "push" not in fake_driver.names()
    region.close()


def test_unpack_device_without_driver(no_driver, pair):
    region, token = _cuda_token(pair)
    with pytest.raises(gpucx.UnsupportedError, match="device=0 for a CUDA key needs"):
        pair.ab.unpack(token, device=0)
    # Without device= a CUDA key still unpacks (it may serve RDMA), and a
    # host key takes any device >= 0: nothing is made current for it.
    assert pair.ab.unpack(token).memory_type == gpucx.MemoryType.CUDA
    assert pair.ab.unpack(region.remote(), device=3).memory_type == (
        gpucx.MemoryType.HOST
    )
    with pytest.raises(ValueError, match=">= 0"):
        pair.ab.unpack(region.remote(), device=-2)
    region.close()


@pytest.mark.parametrize(
    "module, names, mt_index, send",
    [
        (_tag, {"gpucx_tag_send_wait"}, 5, lambda ep, a: ep.send(a, tag=3)),
        (_tag, {"gpucx_tag_send"}, 4, lambda ep, a: ep.send_nb(a, tag=3)),
        (_am_send, {"gpucx_am_send_wait"}, 7, lambda ep, a: ep.am_send(4, a)),
        (_am_send, {"gpucx_am_send"}, 6, lambda ep, a: ep.am_send_nb(4, a)),
    ],
    ids=["send", "send_nb", "am_send", "am_send_nb"],
)
def test_device_sends_look_up_their_protocol_once(
    fake_driver, pair, monkeypatch, module, names, mt_index, send
):
    """The slow-path check (gpucx.protocols.first_use) runs on an endpoint's
    first send of device memory, once per memory type, and never for host
    memory (no host send has a slow path by its rules)."""
    arr = np.arange(32, dtype=np.uint8)
    events = _setup_fake(fake_driver, pair, monkeypatch, arr, polls=0)
    monkeypatch.setattr(
        module, "lib", PostSpy(module.lib, names, events, mt_index, returns=0)
    )
    looked = []

    def first_use(ep, op, bit, *args):
        looked.append((op, bit))
        ep._proto_seen |= 1 << bit  # as the real one records it

    monkeypatch.setattr(module._protocols, "first_use", first_use)
    op = "am" if module is _am_send else "tag"
    bit = (48 if module is _am_send else 32) + CUDA
    for _ in range(3):
        req = send(pair.ab, FakeCudaArrayV2(arr))
        if req is not None:
            req.wait(5)
    assert [e for e in events if e[0] == "post"] == [("post", *names, CUDA)] * 3
    assert looked == [(op, bit)]
    host = np.zeros(8, np.uint8)
    monkeypatch.setattr(module, "lib", module.lib._lib)
    del looked[:]
    req = send(pair.ba, host)
    if req is not None:
        pair.drive(req)
    assert looked == []
