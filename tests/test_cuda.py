"""GPU suite: CuPy memory through gpucx on a real GPU (marker ``cuda``).

Skipped without an NVIDIA GPU and CuPy (conftest); on a GPU machine it runs
as is: ``pip install -e '.[test,cuda12]' && python -m pytest -q -m cuda``.
Every transfer is checked byte by byte.  Two processes on one GPU move data
with CUDA IPC (``cuda_ipc``); ``tcp,cuda_copy`` stages through host memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpucx

from conftest import Pair, channel_pair, join_ok, spawn
from peers_cuda import (
    array_echo,
    cuda_am_posted,
    cuda_echo,
    cuda_ipc_owner,
    cuda_region_owner,
    pattern,
)
from test_rma import background

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

#: UCX transport sets for CUDA memory: default choice, CUDA IPC on one node
#: (shared memory for host control data), host staging over TCP.
CUDA_TLS = {
    "default": None,
    "ipc": {"TLS": "cuda_copy,cuda_ipc,sm,self,tcp"},
    "tcp-staged": {"TLS": "tcp,cuda_copy,self"},
}


@pytest.fixture(scope="module")
def cupy():
    import cupy

    return cupy


@pytest.fixture(params=sorted(CUDA_TLS))
def cuda_cfg(request):
    return CUDA_TLS[request.param]


@pytest.fixture
def cuda_ctx(cuda_cfg):
    c = gpucx.Context(config=cuda_cfg)
    yield c
    c.close()


@pytest.fixture
def cpair(cuda_ctx):
    return Pair(cuda_ctx)


def _last_device(cupy) -> int:
    # Never device 0 by assumption: use the last one (0 on a one-GPU host).
    return cupy.cuda.runtime.getDeviceCount() - 1


def same_bytes(a, b) -> None:
    """Byte-by-byte comparison of two arrays (host or device)."""
    import cupy

    ha = cupy.asnumpy(a).view(np.uint8).ravel()
    hb = cupy.asnumpy(b).view(np.uint8).ravel()
    assert ha.size == hb.size
    diff = np.flatnonzero(ha != hb)
    assert diff.size == 0, f"{diff.size} bytes differ, first at {diff[:5]}"


def test_context_can_move_cuda(cuda_ctx):
    assert cuda_ctx.cuda_available, cuda_ctx.cuda_problem
    assert gpucx.MemoryType.CUDA in cuda_ctx.memory_types


def test_as_buffer_resolves_device_and_type(cupy):
    from gpucx.mem import as_buffer
    from gpucx.mem import cuda as gcuda

    dev = _last_device(cupy)
    with cupy.cuda.Device(dev):
        x = cupy.arange(100, dtype=cupy.float32)
        managed = cupy.ndarray((64,), cupy.uint8, cupy.cuda.malloc_managed(64))
    buf = as_buffer(x)
    assert buf.memory_type is gpucx.MemoryType.CUDA and buf.nbytes == 400
    assert gcuda.device_of(buf.ptr) == dev
    drv = gcuda.driver()
    assert drv.pointer(buf.ptr)[:2] == (int(gpucx.MemoryType.CUDA), dev)
    assert drv.pointer(managed.data.ptr)[0] == int(gpucx.MemoryType.CUDA_MANAGED)


@pytest.mark.parametrize("nbytes", [1, 8191, 4 * 2**20 + 3])
def test_tag_cupy_one_process(cupy, cpair, nbytes):
    src = pattern(cupy, nbytes, 1)
    dst = cupy.zeros(nbytes, cupy.uint8)
    cpair.drive(cpair.ab.send_nb(src, tag=5), cpair.b.recv_nb(dst, tag=5))
    same_bytes(dst, src)


@pytest.mark.parametrize("direction", ["host-to-cuda", "cuda-to-host"])
@pytest.mark.parametrize("nbytes", [100, 3 * 2**20])
def test_host_cuda_transfers(cupy, cpair, direction, nbytes):
    host = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    if direction == "host-to-cuda":
        src, dst = host, cupy.zeros(nbytes, cupy.uint8)
    else:
        src, dst = cupy.asarray(host), np.zeros(nbytes, np.uint8)
    cpair.drive(cpair.ab.send_nb(src, tag=6), cpair.b.recv_nb(dst, tag=6))
    same_bytes(dst, host)


def test_tag_cupy_two_processes(cupy, cuda_cfg):
    sizes = [1, 4096, 65537, 8 * 2**20 + 5]
    dev = _last_device(cupy)
    ours, theirs = channel_pair()
    child = spawn(cuda_echo, cuda_cfg, theirs, sizes, dev)
    with cupy.cuda.Device(dev), gpucx.Context(config=cuda_cfg) as ctx:
        w = ctx.create_worker()
        ep = w.connect(ours.get())
        ours.put(w.address)
        for k, n in enumerate(sizes):
            src = pattern(cupy, n, k)
            back = cupy.zeros(n, cupy.uint8)
            req = w.recv_nb(back, tag=k | 1 << 32)
            ep.send(src, tag=k)
            req.wait(60)
            same_bytes(back, src)
        kind, bad, transports = ours.get()
        assert kind == "checked" and bad == []
        ours.put("bye")
    join_ok(child)
    if cuda_cfg is not None and "cuda_ipc" in cuda_cfg["TLS"]:
        assert any("cuda_ipc" in t for t, _ in transports), transports


def test_am_posted_receives_cupy_two_processes(cupy, cuda_cfg):
    """Posted AM receives take CuPy buffers: eager and rendezvous payloads
    land in device memory with no handler, and an eager message kept
    before the receive is copied in when it is posted."""
    sizes = [1, 4096, 65537, 8 * 2**20 + 5]
    dev = _last_device(cupy)
    ours, theirs = channel_pair()
    child = spawn(cuda_am_posted, cuda_cfg, theirs, sizes, dev)
    with cupy.cuda.Device(dev), gpucx.Context(config=cuda_cfg) as ctx:
        w = ctx.create_worker()
        ep = w.connect(ours.get())
        ours.put(w.address)
        assert ours.get() == "posted"
        for k, n in enumerate(sizes):
            ep.am_send(40, pattern(cupy, n, k), timeout=60)
        kind, got, bad = ours.get()
        assert kind == "group" and got == sizes and bad == [0] * len(sizes)
        ep.am_send(40, pattern(cupy, 100, 9), proto="eager", timeout=60)
        ours.put("sent")
        kind, n, bad = ours.get()
        assert (kind, n, bad) == ("kept", 100, 0)
        ours.put("bye")
    join_ok(child)


def test_send_array_two_processes(cupy, cuda_cfg):
    dev = _last_device(cupy)
    with cupy.cuda.Device(dev):
        arrays = [
            cupy.arange(12, dtype=cupy.float32).reshape(3, 4),
            cupy.arange(2**20, dtype=cupy.int64) * -3,
            (cupy.arange(1000) + 1j * cupy.arange(1000)).astype(cupy.complex128),
            cupy.zeros((0, 5), cupy.float64),
        ]
    ours, theirs = channel_pair()
    child = spawn(array_echo, cuda_cfg, theirs, len(arrays), dev)
    with cupy.cuda.Device(dev), gpucx.Context(config=cuda_cfg) as ctx:
        w = ctx.create_worker()
        ep = w.connect(ours.get())
        ours.put(w.address)
        for a in arrays:
            ep.send_array(a)
            back = ep.recv_array(timeout=60)
            assert isinstance(back, cupy.ndarray)
            assert back.dtype == a.dtype and back.shape == a.shape
            assert back.device.id == dev
            same_bytes(back, a)
        kind, kinds = ours.get()
        assert kinds == [("cupy", dev)] * len(arrays)
        ours.put("bye")
    join_ok(child)


def test_put_get_peer_cuda_region(cupy, cuda_cfg):
    nbytes = 2 * 2**20
    dev = _last_device(cupy)
    ours, theirs = channel_pair()
    child = spawn(cuda_region_owner, cuda_cfg, theirs, nbytes, dev)
    with cupy.cuda.Device(dev), gpucx.Context(config=cuda_cfg) as ctx:
        w = ctx.create_worker()
        address, blob, view_module = ours.get()
        assert view_module.startswith("cupy")
        ep = w.connect(address)
        ours.put(w.address)
        rkey = ep.unpack(blob)
        # get the owner's initial bytes into CUDA and into host memory
        got = cupy.zeros(nbytes, cupy.uint8)
        ep.get(got, rkey)
        same_bytes(got, pattern(cupy, nbytes, 3))
        host = np.zeros(4096, np.uint8)
        ep.get(host, rkey, offset=nbytes - 4096)
        same_bytes(host, pattern(cupy, nbytes, 3)[-4096:])
        # put CUDA data at an offset, then from host memory, then notify
        src = pattern(cupy, nbytes // 2, 9)
        ep.put(src, rkey, offset=nbytes // 4)
        ep.put(np.full(16, 0xAB, np.uint8), rkey, offset=0, notify=b"done")
        kind, note, owner_bytes = ours.get()
        ours.put("bye")
    join_ok(child)
    assert note == b"done"
    want = cupy.asnumpy(pattern(cupy, nbytes, 3))
    want[nbytes // 4 : nbytes // 4 + nbytes // 2] = cupy.asnumpy(src)
    want[:16] = 0xAB
    same_bytes(np.frombuffer(owner_bytes, np.uint8), want)


def test_own_path_put_get_between_processes(cupy, cuda_cfg):
    """gpucx's own CUDA IPC path (gpucx.ops.ipc): put/get between host
    memory and a peer's CUDA region, and get into CuPy memory, are
    copy-engine copies that complete while the owner does not progress."""
    nbytes = 4 * 2**20
    dev = _last_device(cupy)
    ours, theirs = channel_pair()
    child = spawn(cuda_ipc_owner, cuda_cfg, theirs, nbytes, dev)
    try:
        with cupy.cuda.Device(dev), gpucx.Context(config=cuda_cfg) as ctx:
            w = ctx.create_worker()
            address, blob = ours.get()
            remote = gpucx.RemoteMemory.from_bytes(blob)
            assert remote.ipc is not None  # CuPy memory exports a handle
            ep = w.connect(address)
            key = ep.unpack(remote, device=dev)
            got = cupy.zeros(nbytes, cupy.uint8)
            ep.get(got, key, timeout=30)
            same_bytes(got, pattern(cupy, nbytes, 3))
            assert key.cuda_ipc == "open"
            host = np.zeros(nbytes, np.uint8)
            ep.get_nb(host, key).wait(30)
            same_bytes(host, pattern(cupy, nbytes, 3))
            src = cupy.asnumpy(pattern(cupy, nbytes // 2, 9))
            s = cupy.cuda.Stream(non_blocking=True)
            # A blocking put on the own path returns once its copy is done:
            # the bytes are in the owner's memory, no flush needed (a UCX
            # flush would also wait for the endpoint's wireup, which over
            # TCP needs the owner to progress).
            ep.put(src, key, offset=nbytes // 4, stream=s, timeout=30)
            row = ep.protocol("put", nbytes, ("host", "cuda"), rkey=key)
            assert row.description == "gpucx cuda_ipc copy"
            ours.put("read")
            owner_bytes = ours.get()
            key.close()
            ours.put("bye")
    finally:
        join_ok(child)
    want = cupy.asnumpy(pattern(cupy, nbytes, 3))
    want[nbytes // 4 : nbytes // 4 + nbytes // 2] = src
    same_bytes(np.frombuffer(owner_bytes, np.uint8), want)


def test_prepared_transfers_into_a_cuda_region(cupy, cpair):
    """Prepared put/get lists mixing CuPy and host entries, into and out of
    a CUDA region, with a stream that orders the run after a kernel."""
    dev = _last_device(cupy)
    n = 1 << 20
    with cupy.cuda.Device(dev):
        target = cupy.zeros(4 * n, cupy.uint8)
        srcs = [pattern(cupy, n, 30 + i) for i in range(3)]
        s = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.deviceSynchronize()
    region = cpair.ctx.register(target)
    key = cpair.ab.unpack(region.remote())
    host = np.full(n, 0x5A, np.uint8)
    entries = [(srcs[0], key, 3 * n), (host, key, n), (srcs[1], key, 0)]
    entries.append((srcs[2], key, 2 * n))
    with cpair.ab.prepare_put(entries) as x:
        _late_write(cupy, srcs[2], 9, s)
        req = x.run_nb(notify=b"cuda", stream=s)
        notes = []
        end = time.monotonic() + 60
        while not notes and time.monotonic() < end:
            cpair.a.progress()
            notes = cpair.b.notifications()
        cpair.drive(req, timeout=60)
    assert [note for _, note in notes] == [b"cuda"]
    got = cupy.asnumpy(target)
    same_bytes(got[:n], cupy.asnumpy(srcs[1]))
    same_bytes(got[n : 2 * n], host)
    assert (got[2 * n : 3 * n] == 9).all(), "the run did not wait for the stream"
    same_bytes(got[3 * n :], cupy.asnumpy(srcs[0]))
    with cupy.cuda.Device(dev):
        back = [cupy.zeros(n, cupy.uint8) for _ in range(2)]
    hback = np.zeros(n, np.uint8)
    g = cpair.ab.prepare_get(
        [(back[0], key, 3 * n), (hback, key, n), (back[1], key, 0)]
    )
    cpair.drive(g.run_nb(), timeout=60)
    same_bytes(cupy.asnumpy(back[0]), cupy.asnumpy(srcs[0]))
    same_bytes(hback, host)
    same_bytes(cupy.asnumpy(back[1]), cupy.asnumpy(srcs[1]))
    g.close()
    key.close()
    region.close()


def test_region_allocate_and_register_on_device(cupy, cuda_ctx):
    dev = _last_device(cupy)
    region = cuda_ctx.allocate(4096, gpucx.MemoryType.CUDA, device=dev)
    view = region.as_array(np.float32)
    assert isinstance(view, cupy.ndarray) and view.device.id == dev
    assert region.memory_type is gpucx.MemoryType.CUDA
    calls = []

    def allocator(nbytes, memory_type):
        calls.append((nbytes, memory_type, cupy.cuda.runtime.getDevice()))
        return cupy.zeros(nbytes, cupy.uint8)

    r2 = cuda_ctx.allocate(100, gpucx.MemoryType.CUDA, device=dev, allocator=allocator)
    assert calls == [(100, int(gpucx.MemoryType.CUDA), dev)]
    assert r2.nbytes == 100
    with cupy.cuda.Device(dev):
        arr = cupy.ones(1000, cupy.uint8)
    r3 = cuda_ctx.register(arr)
    assert r3.memory_type is gpucx.MemoryType.CUDA and r3.address == arr.data.ptr


def test_post_from_a_thread_with_no_current_context(cupy, cpair):
    # A fresh thread has no CUDA context current: gpucx makes the owner's
    # device current around the post itself.
    dev = _last_device(cupy)
    with cupy.cuda.Device(dev):
        src = pattern(cupy, 1 << 20, 4)
        dst = cupy.zeros(1 << 20, cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
    errors = []

    def post():
        try:
            reqs.append(cpair.ab.send_nb(src, tag=8))
            reqs.append(cpair.b.recv_nb(dst, tag=8))
        except Exception as exc:  # reported below
            errors.append(exc)

    reqs: list = []
    t = threading.Thread(target=post)
    t.start()
    t.join(30)
    assert errors == []
    cpair.drive(*reqs)
    same_bytes(dst, src)


_SPIN_WRITE = r"""
extern "C" __global__
void spin_write(unsigned char *out, long long n, long long cycles, unsigned char v)
{
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        out[i] = v;
}
"""


def _late_write(cupy, out, value, stream):
    """Queue a kernel on ``stream`` that spins ~1 s, then fills ``out``."""
    kernel = cupy.RawKernel(_SPIN_WRITE, "spin_write")
    rate = cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrClockRate, out.device.id
    )  # kHz
    cycles = int(rate * 1000)  # about one second
    with stream:
        kernel(
            (1,), (256,), (out, np.int64(out.size), np.int64(cycles), np.uint8(value))
        )


_GATED_WRITE = r"""
extern "C" __global__
void gated_write(unsigned char *out, long long n, volatile int *gate,
                 long long cycles, unsigned char v)
{
    long long start = clock64();
    while (*gate == 0 && clock64() - start < cycles) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        out[i] = v;
}
"""


class _Gate:
    """A kernel queued on a stream that fills ``out`` only once the test opens
    the gate (a flag in pinned host memory the kernel polls; at most ~20 s).

    The controls that show a call does *not* wait for a stream use it: until
    :meth:`open`, the stream is busy however long the call takes, so the
    control cannot lose a race against a timed spin on a loaded machine."""

    def __init__(self, cupy, out, value, stream, limit_s: float = 20.0):
        self._mem = cupy.cuda.alloc_pinned_memory(8)
        self._flag = np.frombuffer(self._mem, np.int32, 2)
        self._flag[:] = 0
        # Pinned memory is mapped for the device at the same address (unified
        # addressing, on every 64-bit CUDA platform).
        dev_ptr = self._mem.ptr
        rate = cupy.cuda.runtime.deviceGetAttribute(
            cupy.cuda.runtime.cudaDevAttrClockRate, out.device.id
        )  # kHz
        kernel = cupy.RawKernel(_GATED_WRITE, "gated_write")
        with stream:
            kernel(
                (1,),
                (256,),
                (
                    out,
                    np.int64(out.size),
                    np.uint64(dev_ptr),
                    np.int64(rate * 1000 * limit_s),
                    np.uint8(value),
                ),
            )

    def open(self, after: float = 0.0) -> None:
        """Let the kernel go, now or from a timer thread ``after`` seconds on."""
        if after:
            threading.Timer(after, self.open).start()
        else:
            self._flag[0] = 1


@pytest.mark.parametrize("use_stream", [True, False], ids=["stream", "no-stream"])
def test_stream_ordering_race(cupy, cpair, use_stream):
    n = 1 << 16
    src = cupy.zeros(n, cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    gate = _Gate(cupy, src, 7, s)
    got = np.zeros(n, np.uint8)
    if use_stream:
        gate.open(after=0.2)  # the send waits for it
    # Sent from outside the stream's block: CuPy's CAI names the legacy
    # default stream, which does not wait for a non-blocking stream.
    req = cpair.ab.send_nb(src, tag=11, stream=s if use_stream else None)
    cpair.drive(req, cpair.b.recv_nb(got, tag=11), timeout=30)
    gate.open()
    s.synchronize()
    if use_stream:
        assert (got == 7).all(), f"{int((got != 7).sum())} stale bytes"
    else:
        # Control: without the stream the send does not wait for the kernel,
        # which is still held at its gate: every byte is stale.
        assert (got == 0).all(), "the send waited for a stream it was not given"


def test_recv_with_stream_is_visible_to_later_kernels(cupy, cpair):
    n = 1 << 20
    s = cupy.cuda.Stream(non_blocking=True)
    dst = cupy.zeros(n, cupy.uint8)
    src = pattern(cupy, n, 2)
    cupy.cuda.runtime.deviceSynchronize()
    req = cpair.b.recv_nb(dst, tag=12, stream=s)
    cpair.drive(cpair.ab.send_nb(src, tag=12), req)
    with s:
        total = int(dst.astype(cupy.uint64).sum())  # a kernel on s after the recv
    assert total == int(src.astype(cupy.uint64).sum())


def test_dlpack_producer_gets_consumer_stream(cupy, cpair):
    class OnlyDLPack:
        def __init__(self, arr):
            self.arr = arr
            self.streams = []

        def __dlpack_device__(self):
            return self.arr.__dlpack_device__()

        def __dlpack__(self, **kw):
            self.streams.append(kw.get("stream"))
            return self.arr.__dlpack__(**kw)

    s = cupy.cuda.Stream(non_blocking=True)
    src = OnlyDLPack(pattern(cupy, 5000, 6))
    dst = cupy.zeros(5000, cupy.uint8)
    cpair.drive(cpair.ab.send_nb(src, tag=13, stream=s), cpair.b.recv_nb(dst, tag=13))
    # (twice if this CuPy predates max_version: gpucx retries without it)
    assert src.streams and set(src.streams) == {s.ptr}
    same_bytes(dst, src.arr)


# -- stream= on atomics and probed receives, unpack(device=) ----------------------


def _amo_pair(ctx):
    """Pair of workers whose a->b endpoint has no peer error handling (UCX
    offers atomic protocols only there); a host counter on b's side."""
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address, error_handling=False)
    mem = np.zeros(2, np.uint64)
    region = ctx.register(mem)
    return a, b, ab, mem, region, ab.unpack(region.remote())


@pytest.mark.parametrize("form", ["blocking", "nb"])
def test_atomic_with_stream_waits_for_the_stream(cupy, cuda_ctx, form):
    a, b, ab, mem, region, key = _amo_pair(cuda_ctx)
    dev = _last_device(cupy)
    with cupy.cuda.Device(dev):
        scratch = cupy.zeros(1 << 10, cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
        s = cupy.cuda.Stream(non_blocking=True)
        # The blocking form needs the target worker progressing.
        with background(b):
            # The endpoint's first atomic, before any kernel is queued: UCX
            # sets up its CUDA resources on first use, which can wait for the
            # device to idle (docs/gpu.md, "Streams").
            assert ab.fetch_add(key, 0) == 0
            # Control: without stream= the atomic does not wait for the
            # kernel queued on s, which waits at its gate until opened.
            gate = _Gate(cupy, scratch, 1, s)
            assert ab.fetch_add(key, 1) == 0
            assert not s.done, "the atomic waited for a stream it was not given"
            gate.open()
            s.synchronize()
            _late_write(cupy, scratch, 2, s)
            if form == "blocking":
                old = ab.fetch_add(key, 1, stream=s)
            else:
                req = ab.fetch_add_nb(key, 1, stream=s)
                # Posted only once the kernel finished, before returning.
                assert s.done
                old = req.wait(30)
            assert s.done and old == 1
            ab.atomic_add(key, 5, offset=8, stream=s)
            ab.flush()
    assert list(mem) == [2, 5]
    assert int(scratch[0]) == 2
    region.close()


def test_calls_without_stream_do_not_wait_for_other_streams(cupy, cuda_ctx):
    """An operation given no ``stream=`` never waits for the GPU: with a
    kernel held on a non-blocking stream, host-memory tag, AM, put + flush
    and atomics, and a new endpoint of a worker that has endpoints, all
    complete while the kernel waits.  (Each kind runs once before the kernel
    is queued.  Setting up is not covered: UCX's CUDA setup when a context is
    created, or a new context's workers first connect, can wait for the
    device, as it did on the H200; see docs/gpu.md, "Streams".)
    """
    pair = Pair(cuda_ctx)
    a, b, ab, mem, region, key = _amo_pair(cuda_ctx)
    hsrc = np.arange(4096, dtype=np.uint64).astype(np.uint8)
    hdst = np.zeros_like(hsrc)
    one = np.ones(1, np.uint64)

    def tag(p=pair):
        hdst[:] = 0
        p.drive(p.ab.send_nb(hsrc, tag=31), p.b.recv_nb(hdst, tag=31), timeout=30)
        assert (hdst == hsrc).all()

    def am():
        hdst[:] = 0
        pair.drive(
            pair.b.am_recv_nb(32, hdst), pair.ab.am_send_nb(32, hsrc), timeout=30
        )
        assert (hdst == hsrc).all()

    def put_flush():
        ab.put(one, key, offset=8)
        ab.flush()

    def atomic():
        ab.fetch_add(key, 1)

    def new_endpoint():
        ep = pair.a.connect(pair.b.address)
        hdst[:] = 0
        pair.drive(ep.send_nb(hsrc, tag=33), pair.b.recv_nb(hdst, tag=33), timeout=30)
        assert (hdst == hsrc).all()

    calls = [tag, am, put_flush, atomic, new_endpoint]
    dev = _last_device(cupy)
    # Put, flush and atomics need b's worker progressing.
    with background(b), cupy.cuda.Device(dev):
        scratch = cupy.zeros(1 << 10, cupy.uint8)
        for call in calls[:4]:
            call()
        cupy.cuda.runtime.deviceSynchronize()
        s = cupy.cuda.Stream(non_blocking=True)
        gate = _Gate(cupy, scratch, 3, s)
        try:
            for call in calls:
                call()
                assert not s.done, f"{call.__name__} waited for an unrelated stream"
        finally:
            gate.open()
            s.synchronize()
    assert list(mem) == [2, 1]
    assert int(scratch[0]) == 3
    region.close()


def test_an_idle_stream_is_not_waited_on_with_an_event(cupy, cpair, monkeypatch):
    """CuPy names its current stream in every CAI export, so every operation
    on a CuPy array waits for a stream: an idle one is answered by
    ``cuStreamQuery`` on the real driver, and only a busy one gets an event
    (docs/gpu.md, "Streams")."""
    from gpucx.mem import cuda as gcuda

    drv = gcuda.driver()
    recorded: list = []
    record = drv.event_record

    def counting(event, stream):
        recorded.append(stream)
        record(event, stream)

    monkeypatch.setattr(drv, "event_record", counting)
    n = 1 << 12
    src = pattern(cupy, n, 7)
    dst = cupy.zeros(n, cupy.uint8)
    scratch = cupy.zeros(1 << 10, cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    cpair.drive(cpair.ab.send_nb(src, tag=41), cpair.b.recv_nb(dst, tag=41), timeout=30)
    same_bytes(dst, src)
    assert recorded == []
    # A kernel held on s: the send given stream=s waits for it with an event.
    dst[:] = 0
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    gate = _Gate(cupy, scratch, 1, s)
    gate.open(after=0.2)
    req = cpair.ab.send_nb(src, tag=42, stream=s)
    assert s.done
    cpair.drive(req, cpair.b.recv_nb(dst, tag=42), timeout=30)
    same_bytes(dst, src)
    assert recorded == [s.ptr]
    assert int(scratch[0]) == 1


@pytest.mark.parametrize("form", ["blocking", "nb"])
def test_probed_recv_with_stream_lands_after_queued_work(cupy, cpair, form):
    n = 1 << 16
    src = pattern(cupy, n, 5)
    dst = cupy.zeros(n, cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    req = cpair.ab.send_nb(src, tag=21)
    msg = None
    while msg is None:
        cpair.a.progress()
        msg = cpair.b.probe(tag=21, remove=True)
    s = cupy.cuda.Stream(non_blocking=True)
    # A kernel queued on s overwrites dst (after ~1 s); the receive must be
    # posted after it, so the received bytes win.
    _late_write(cupy, dst, 7, s)
    if form == "blocking":
        with background(cpair.a):  # the sender answers the rendezvous meanwhile
            info = msg.recv(dst, timeout=30, stream=s)
        cpair.drive(req)
    else:
        rreq = msg.recv_nb(dst, stream=s)
        assert s.done
        info = cpair.drive(rreq, req)[0]
    assert info.nbytes == n
    same_bytes(dst, src)


def test_unpack_device_from_a_thread_without_context(cupy, cuda_cfg):
    nbytes = 1 << 20
    dev = _last_device(cupy)
    count = cupy.cuda.runtime.getDeviceCount()
    ours, theirs = channel_pair()
    child = spawn(cuda_region_owner, cuda_cfg, theirs, nbytes, dev)
    with gpucx.Context(config=cuda_cfg) as ctx:
        w = ctx.create_worker()
        address, blob, _ = ours.get()
        ep = w.connect(address)
        ours.put(w.address)
        with pytest.raises(ValueError, match=f"has {count} CUDA device"):
            ep.unpack(blob, device=count)
        keys, errors = [], []

        def unpack():  # a fresh thread: no CUDA context is current
            try:
                keys.append(ep.unpack(blob, device=dev))
            except Exception as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=unpack)
        t.start()
        t.join(60)
        assert errors == [] and len(keys) == 1
        with cupy.cuda.Device(dev):
            got = cupy.zeros(nbytes, cupy.uint8)
            ep.get(got, keys[0])
            same_bytes(got, pattern(cupy, nbytes, 3))
            ep.put(np.zeros(1, np.uint8), keys[0], notify=b"done")
        kind, note, _bytes = ours.get()
        assert note == b"done"
        ours.put("bye")
    join_ok(child)


def _bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "gpucx.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.parametrize("memory", ["cuda", "host:cuda", "ucx:cuda"])
def test_bench_cuda_vs_perftest(tmp_path, memory):
    out = tmp_path / "bench.json"
    p = _bench(
        "-m", memory, "-t", "tag_bw,put_bw,am_bw", "-s", "64K,4M", "-n", "100", "-w",
        "10", "--no-progress", "--timeout", "120", "--vs-perftest", "--json", str(out),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    results = json.loads(out.read_text())["results"]
    assert {r["memory"] for r in results} == {memory if ":" in memory else "cuda:cuda"}
    for r in results:
        assert r["bandwidth_gbs"] > 0
        assert r["perftest"]["bandwidth_gbs"] > 0
        assert r["ratio"] > 0
        # The machine's copy beside each row (gpucx.bench.limits).
        limit = r["limit"]
        kinds = {"cuda": "d2d", "host:cuda": "h2d_pageable", "ucx:cuda": "h2d_pinned"}
        assert limit["kind"] == kinds[memory]
        assert limit["gbps"] > 0 and limit["fraction"] > 0
        if memory == "host:cuda":
            assert limit["pinned"]["kind"] == "h2d_pinned"
            assert limit["pinned"]["gbps"] > 0
    assert "of limit" in p.stdout
    print(p.stdout)  # the figures, for benchmarks/RESULTS.md (pytest -s)


def test_bench_ucx_memory_beside_a_gpu_is_pinned(cupy):
    """The bench's ``ucx`` memory facing a GPU is mapped with a CUDA context
    current, so UCX pins it (``ucx_perftest``'s host memory is); facing host
    memory it is plain UCX-mapped memory."""
    from gpucx.bench.memory import alloc

    host = getattr(cupy.cuda.runtime, "memoryTypeHost", 1)  # cudaMemoryTypeHost
    with gpucx.Context() as ctx:
        pinned = alloc("ucx", 1 << 20, 0, 0, ctx, gpu_peer=True)
        attrs = cupy.cuda.runtime.pointerGetAttributes(pinned.ctypes.data)
        assert attrs.type == host


def test_copy_limits_on_the_gpu():
    """gpucx.bench.limits on the real driver: every copy has a positive
    figure, device to device beats host to device at 1 MiB and up, and a
    figure is measured once (tests/test_bench_limits.py runs the same over
    the fake libcuda)."""
    from gpucx.bench import limits

    limits.clear_cache()
    sizes = (4096, 1 << 20, 16 << 20)
    figures = {(k, n): limits.measure(k, n, 0) for k in limits.KINDS for n in sizes}
    assert all(v is not None and v > 0 for v in figures.values()), figures
    for n in sizes[1:]:
        assert figures["d2d", n] > figures["h2d_pinned", n], figures
        assert figures["d2d", n] > figures["d2h_pinned", n], figures
    assert limits.measure("d2d", 1 << 20, 0) == figures["d2d", 1 << 20]
    with pytest.raises(limits.LimitError, match="device 99"):
        limits.measure("d2d", 1 << 20, 99)
    print(figures)
