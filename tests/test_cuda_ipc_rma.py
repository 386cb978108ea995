"""gpucx's own same-host path for put/get on CUDA regions (gpucx.ops.ipc).

Test doubles for the missing GPU: tests/fakecuda/libcuda_fake.c is the CUDA
driver in both processes (its allocations are POSIX shared memory that its
IPC handles name, so a handle opened in another process maps the same
bytes; copies are memmove; events report "not ready" a set number of
times), and the owner's region is registered with UCX as host memory and
relabelled CUDA (tests/peers_ipc.py).  What runs is gpucx's real code:
tokens, the lazy open, the copy, the events, flush, notify, fallbacks.
The same on a GPU, with CuPy: tests/test_cuda.py
``test_own_path_put_get_between_processes``.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time

import numpy as np
import pytest
from peers_ipc import LEAD, cuda_region, device_array, owner

import gpucx
from gpucx.mem.remote import CudaIpc, RemoteMemory

from conftest import channel_pair, join_ok, spawn
from fakegpu import FakeCudaArrayV2, FakeCupyStream

pytestmark = pytest.mark.timeout(90)

N = 1 << 16
#: Where gpucx falls back to UCX, UCX moves the relabelled host region (see
#: the module doc) by its emulation, which gpucx reports as a slow path to
#: CUDA memory: expected here.
FALLBACK = pytest.mark.filterwarnings("ignore::gpucx.SlowPathWarning")


@pytest.fixture
def drv(fake_libcuda):
    return fake_libcuda


def pattern(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.contextmanager
def session(lib_path, config=None, token=None, thread_mode="single"):
    """A peer owning an ``N``-byte CUDA region; yields ``(q, w, ep, key)``
    on this side (``token(remote) -> RemoteMemory`` may rewrite the token
    before it is unpacked; ``thread_mode`` is this side's worker's)."""
    q, theirs = channel_pair()
    child = spawn(owner, lib_path, theirs, N)
    try:
        cfg = {"TLS": "sm,self", **(config or {})}
        with gpucx.Context(config=cfg) as ctx:
            w = ctx.create_worker(thread_mode)
            _, address, blob = q.get(60)
            remote = RemoteMemory.from_bytes(blob)
            if token is not None:
                remote = token(remote)
            ep = w.connect(address)
            key = ep.unpack(remote)
            try:
                yield q, w, ep, key
            finally:
                q.put(("bye",))  # also when the test failed: no hung peer
            key.close()
            ep.close(force=True)
    finally:
        join_ok(child, 60)


def read(q, offset=0, n=N) -> bytes:
    q.put(("read", offset, n))
    kind, data = q.get(30)
    assert kind == "data"
    return data


def counts(drv) -> dict:
    lib = drv._lib
    return {
        "opens": lib.fake_ipc_opens(),
        "closes": lib.fake_ipc_closes(),
        "copies": lib.fake_async_copies(),
    }


# -- tokens ------------------------------------------------------------------------


def test_cuda_token_carries_ipc_handle(drv):
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        region, _ = cuda_region(ctx, drv, 256)
        remote = region.remote()
        ipc = remote.ipc
        assert isinstance(ipc, CudaIpc)
        assert ipc.offset == LEAD and ipc.alloc_size == 256 + LEAD + 64
        assert ipc.handle.startswith(b"FAKEIPC1")
        assert drv._lib.fake_ipc_gets() == 1
        me = gpucx._address.own_identity()
        assert (ipc.pid, ipc.boot_id, ipc.pidns) == (me.pid, me.boot_id, me.pidns)
        blob = remote.to_bytes()
        assert blob[4] == 2  # format version 2: with the IPC block
        again = RemoteMemory.from_bytes(blob)
        assert again == remote and again.ipc.pack() == ipc.pack()
        assert pickle.loads(pickle.dumps(remote)) == remote
        assert region.remote().ipc is ipc  # exported once
        assert drv._lib.fake_ipc_gets() == 1
        region.close()


def test_host_token_stays_version_1(drv):
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        region = ctx.register(np.zeros(64, np.uint8))
        remote = region.remote()
        assert remote.ipc is None and remote.to_bytes()[4] == 1
        region.close()


def test_memory_the_driver_cannot_export_gets_no_handle(drv):
    # Device memory the fake driver knows no allocation of (as pool or VMM
    # memory on a GPU): the token has no IPC block, peers use UCX.
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        region = ctx.register(np.zeros(64, np.uint8))
        region.memory_type = gpucx.MemoryType.CUDA
        assert region.remote().ipc is None
        region.close()


def _ipc_token(drv, **changes):
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        region, _ = cuda_region(ctx, drv, 256)
        remote = region.remote()
        region.close()
    ipc = remote.ipc
    fields = {
        "handle": ipc.handle,
        "offset": ipc.offset,
        "alloc_size": ipc.alloc_size,
        "boot_id": ipc.boot_id,
        "pidns": ipc.pidns,
        "pid": ipc.pid,
    }
    fields.update(changes)
    return remote, fields


def _reseal(blob: bytes) -> bytes:
    import zlib

    body = blob[:-4]
    return body + zlib.crc32(body).to_bytes(4, "little")


def test_malformed_ipc_blocks_are_refused(drv):
    remote, fields = _ipc_token(drv)
    blob = remote.to_bytes()
    rlen = len(remote.rkey)
    at = 28 + rlen
    # A block length other than 108.
    bad_len = blob[:at] + (107).to_bytes(2, "little") + blob[at + 2 :]
    with pytest.raises(ValueError, match="CUDA IPC block of 107 bytes"):
        RemoteMemory.from_bytes(_reseal(bad_len))
    # A region outside its allocation (offset past the end).
    off = at + 2 + 64
    big = blob[:off] + (1 << 40).to_bytes(8, "little") + blob[off + 8 :]
    with pytest.raises(ValueError, match="outside its allocation"):
        RemoteMemory.from_bytes(_reseal(big))
    # A flipped handle byte without a new checksum.
    flipped = bytearray(blob)
    flipped[at + 10] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        RemoteMemory.from_bytes(bytes(flipped))
    # An IPC block on a host region.
    host = bytearray(blob)
    host[5] = int(gpucx.MemoryType.HOST)
    with pytest.raises(ValueError, match="CUDA IPC block on a HOST region"):
        RemoteMemory.from_bytes(_reseal(bytes(host)))
    # Truncated inside the block.
    with pytest.raises(ValueError, match="truncated"):
        RemoteMemory.from_bytes(_reseal(blob[: at + 40] + b"\0\0\0\0"))
    with pytest.raises(ValueError, match="64"):
        CudaIpc(b"short", 0, 1, bytes(16), 0, 0)


# -- two processes -------------------------------------------------------------------


@pytest.mark.parametrize("blocking", [True, False])
def test_put_get_host_one_sided_open_once(drv, lib_path, blocking):
    with session(lib_path) as (q, w, ep, key):
        assert key.cuda_ipc == "unopened"
        q.put(("hold",))  # the owner stops progressing: one-sided from here
        data = pattern(1)
        for offset, n in [(0, N), (100, 1000), (N - 7, 7)]:
            src = data[offset : offset + n]
            if blocking:
                ep.put(src, key, offset, timeout=30)
            else:
                req = ep.put_nb(src, key, offset)
                assert req.protocol is None or "cuda_ipc" in req.protocol.short
                req.wait(30)
        out = np.zeros(N, np.uint8)
        if blocking:
            ep.get(out, key, timeout=30)
        else:
            ep.get_nb(out, key).wait(30)
        assert bytes(out) == bytes(data)
        c = counts(drv)
        assert c["opens"] == 1 and c["copies"] == 4  # opened once, cached
        assert drv._lib.fake_ipc_open_flags() == 1  # LAZY_ENABLE_PEER_ACCESS
        assert key.cuda_ipc == "open"
        assert read(q) == bytes(data)  # the owner sees the bytes
        row = ep.protocol("put", N, ("host", "cuda"))
        assert row is not None and row.description == "gpucx cuda_ipc copy"
        assert not row.slow and row.source == "gpucx"
        assert ep.protocol("get", N, rkey=key).config == "gpucx/cuda_ipc"
        # GPU to GPU puts stay with UCX.
        assert ep.protocol("put", N, ("cuda", "cuda"), rkey=key) is None
        key.close()
        assert counts(drv)["closes"] == 1
        assert key.cuda_ipc == "closed"


def test_probe_asked_for_ucx_bypasses_the_own_path(drv, lib_path):
    """``gpucx.ops.rma.probe(..., ucx=True)`` posts to UCX even where
    gpucx's own path would take the put (the bench's C loops post to UCX
    directly, and their rows must say what UCX did); without it the own
    path answers."""
    from gpucx.ops import rma as _rma

    with session(lib_path) as (q, w, ep, key):
        src = pattern(1)[:4096]
        own = _rma.probe(ep, "put", src, key, timeout=30)
        assert own.description == "gpucx cuda_ipc copy"
        before = counts(drv)["copies"]
        row = _rma.probe(ep, "put", src, key, 8192, timeout=30, ucx=True)
        assert counts(drv)["copies"] == before  # no copy-engine copy
        assert row is None or row.source != "gpucx"
        assert row is None or "cuda_ipc copy" not in row.description
        ep.flush(timeout=30)
        assert read(q, 8192, 4096) == bytes(src)  # UCX moved the bytes


def test_copy_completes_from_its_event_and_flush_waits(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_set_polls(5)  # each event: not ready 5 times
        data = pattern(2)
        reqs = [ep.put_nb(data[i : i + 1024], key, i) for i in range(0, 8192, 1024)]
        assert not reqs[0].done()  # the copy's event has not fired yet
        assert drv._lib.fake_events_pending() >= 1
        ep.flush(timeout=30)
        assert drv._lib.fake_events_pending() == 0
        assert all(r._slot.status == 0 for r in reqs)
        assert all(r.done() for r in reqs)
        reqs = [ep.put_nb(data[8192:], key, 8192)]
        w.flush(timeout=30)
        assert reqs[0].done() and read(q) == bytes(data)


def test_key_close_waits_for_copies_then_closes_handle(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_set_polls(1000)
        req = ep.put_nb(pattern(3), key)
        assert not req.done()
        key.close()
        # The handle closed after the copy's event fired, never before.
        assert drv._lib.fake_close_pending() == 0
        assert counts(drv)["closes"] == 1
        assert req.done() and req.result() is None
        with pytest.raises(gpucx.ClosedError):
            ep.put(pattern(3), key)


def test_stream_order_without_blocking_the_host(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        lib = drv._lib
        ep.put(pattern(4), key, stream=FakeCupyStream(0x77), timeout=30)
        assert lib.fake_stream_waits() == 1
        gpucx_stream = lib.fake_async_last_stream()
        assert gpucx_stream != 0x77 and lib.fake_wait_stream() == gpucx_stream
        # The event the gpucx stream waited on was recorded before the copy.
        assert lib.fake_seq_wait() < lib.fake_seq_copy() < lib.fake_seq_record()
        # No host wait on the caller's stream: no query, no synchronize.
        assert lib.fake_stream_queries() == 0
        ep.put(pattern(5), key, timeout=30)
        assert lib.fake_async_last_stream() == gpucx_stream  # one stream, reused
        assert lib.fake_streams_live() == 1
        assert read(q) == bytes(pattern(5))


def test_get_into_cuda_memory(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        w._context._cuda_problem = None  # test double: a CUDA-capable context
        q.put(("write", 0, bytes(pattern(6))))
        assert q.get(30) == ("written",)
        _, mem = device_array(drv, N)
        ep.get(FakeCudaArrayV2(mem), key, timeout=30)
        assert bytes(mem) == bytes(pattern(6))
        assert counts(drv)["copies"] == 1


def test_notify_after_the_copy(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_set_polls(20)
        for seed in (7, 8, 9):
            # One at a time: the next put would overwrite what the owner
            # checks when this notification arrives.
            q.put(("notes", 1))
            ep.put(pattern(seed), key, notify=b"seed=%d" % seed, timeout=30)
            kind, notes = q.get(60)
            assert notes == [(b"seed=%d" % seed, bytes(pattern(seed)))]
        assert counts(drv)["opens"] == 1


def test_threads_progressing_one_worker_finish_each_copy_once(drv, lib_path):
    """thread_mode="multi": two threads progress the worker while copies
    with notifications finish; each request completes and each
    notification is sent exactly once."""
    with session(lib_path, thread_mode="multi") as (q, w, ep, key):
        drv._lib.fake_set_polls(5)
        q.put(("notes", 8))
        reqs = [
            ep.put_nb(pattern(seed), key, notify=b"n%d" % seed) for seed in range(8)
        ]
        stop = threading.Event()
        errors: list = []

        def spin():
            try:
                while not stop.is_set():
                    w.progress()
            except BaseException as exc:  # reported below, not lost in a thread
                errors.append(exc)

        threads = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while not all(r.done() for r in reqs):
                assert time.monotonic() < deadline, reqs
                time.sleep(0.001)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        assert not errors
        for r in reqs:
            assert r.wait(5) is None
        kind, first = q.get(60)
        # A last notification: FIFO on the endpoint, so a duplicate of any
        # earlier one would arrive before it.
        q.put(("notes", 1))
        ep.put(pattern(99), key, notify=b"last", timeout=30)
        kind, rest = q.get(60)
        notes = [n for n, _ in first + rest]
        assert sorted(notes) == sorted([b"n%d" % i for i in range(8)] + [b"last"])
        assert not w._engine.copies


def _elsewhere(remote):
    ipc = remote.ipc
    other = CudaIpc(
        ipc.handle, ipc.offset, ipc.alloc_size, bytes(range(16)), ipc.pidns, ipc.pid
    )
    return RemoteMemory(
        remote.address, remote.nbytes, remote.memory_type, remote.rkey, False, other
    )


@FALLBACK
def test_owner_on_another_host_falls_back_to_ucx(drv, lib_path):
    with session(lib_path, token=_elsewhere) as (q, w, ep, key):
        ep.put(pattern(10), key, timeout=30)
        ep.flush(timeout=30)
        assert read(q) == bytes(pattern(10))
        assert counts(drv) == {"opens": 0, "closes": 0, "copies": 0}
        assert "another host" in key.cuda_ipc


@FALLBACK
def test_handle_that_cannot_open_falls_back_to_ucx(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_ipc_open_fail(205)  # CUDA_ERROR_MAP_FAILED
        ep.put(pattern(11), key, timeout=30)
        ep.flush(timeout=30)  # UCX: remote completion needs a flush
        out = np.zeros(N, np.uint8)
        ep.get(out, key, timeout=30)
        assert bytes(out) == bytes(pattern(11)) == read(q)
        assert "cannot open" in key.cuda_ipc and "MAP_FAILED" in key.cuda_ipc
        assert counts(drv)["copies"] == 0
        drv._lib.fake_ipc_open_fail(0)
        ep.put(pattern(12), key, timeout=30)  # not tried again
        assert counts(drv)["opens"] == 0


def _garbage_handle(remote):
    ipc = remote.ipc
    forged = CudaIpc(
        b"\xa5" * 64, ipc.offset, ipc.alloc_size, ipc.boot_id, ipc.pidns, ipc.pid
    )
    return RemoteMemory(
        remote.address, remote.nbytes, remote.memory_type, remote.rkey, False, forged
    )


@FALLBACK
def test_forged_handle_the_driver_rejects_falls_back(drv, lib_path):
    with session(lib_path, token=_garbage_handle) as (q, w, ep, key):
        ep.put(pattern(13), key, timeout=30)
        ep.flush(timeout=30)
        assert read(q) == bytes(pattern(13))
        assert "cannot open" in key.cuda_ipc


def _oversold(remote):
    # A handle of the real allocation, claiming a region past its end.
    ipc = remote.ipc
    forged = CudaIpc(
        ipc.handle, ipc.offset + 8192, 1 << 30, ipc.boot_id, ipc.pidns, ipc.pid
    )
    return RemoteMemory(
        remote.address, remote.nbytes, remote.memory_type, remote.rkey, False, forged
    )


@FALLBACK
def test_forged_handle_mapping_less_is_a_clear_error(drv, lib_path):
    with session(lib_path, token=_oversold) as (q, w, ep, key):
        with pytest.raises(ValueError, match="forged or corrupted"):
            ep.put(pattern(14), key, timeout=30)
        lib = drv._lib
        assert lib.fake_ipc_opens() == 1 and lib.fake_ipc_closes() == 1
        assert lib.fake_async_copies() == 0
        # The key does not try again: UCX serves it.
        ep.put(pattern(14), key, timeout=30)
        ep.flush(timeout=30)
        assert read(q) == bytes(pattern(14))


@FALLBACK
@pytest.mark.parametrize("how", ["config", "env"])
def test_switch_turns_the_path_off(drv, lib_path, monkeypatch, how):
    config = {}
    if how == "config":
        config = {"GPUCX_CUDA_IPC_RMA": 0}
    else:
        monkeypatch.setenv("GPUCX_CUDA_IPC_RMA", "0")
    with session(lib_path, config=config) as (q, w, ep, key):
        ep.put(pattern(15), key, timeout=30)
        ep.flush(timeout=30)
        assert read(q) == bytes(pattern(15))
        assert counts(drv) == {"opens": 0, "closes": 0, "copies": 0}
        assert key.cuda_ipc == "unopened"
        assert ep.protocol("put", N, rkey=key) is None or (
            ep.protocol("put", N, rkey=key).source != "gpucx"
        )


@pytest.mark.parametrize("value", [0, 1])
def test_context_says_whether_the_path_is_on(value):
    # Context.cuda_ipc_rma: what gpucx.ops.ipc.route reads of the switch.
    config = {"GPUCX_CUDA_IPC_RMA": value}
    with gpucx.Context(features=["rma"], config=config) as ctx:
        assert ctx.cuda_ipc_rma is bool(value)
        assert ctx.options["CUDA_IPC_RMA"] == value
        w = ctx.create_worker()
        assert w.context is ctx
        with pytest.raises(AttributeError):
            ctx.cuda_ipc_rma = True  # type: ignore[misc]


def test_unused_for_gpu_to_gpu_put(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        w._context._cuda_problem = None
        _, mem = device_array(drv, 64)
        from gpucx.ops import ipc as own

        assert (
            own.route(ep, key, int(gpucx.MemoryType.CUDA), mem.ctypes.data, False)
            is None
        )
        assert key.cuda_ipc == "unopened"


def test_wait_timeout_leaves_the_copy_running(drv, lib_path):
    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_set_polls(1 << 30)  # an event that does not fire by polling
        req = ep.put_nb(pattern(16), key)
        with pytest.raises(gpucx.TimeoutError, match="cuda_ipc copy"):
            req.wait(0.05)
        assert req.cancel() is False and not req.done()
        key.close()  # waits for it (cuEventSynchronize), then closes the handle
        assert req.done() and drv._lib.fake_close_pending() == 0


def test_worker_close_finishes_copies_and_streams(drv, lib_path):
    q, theirs = channel_pair()
    child = spawn(owner, lib_path, theirs, N)
    try:
        ctx = gpucx.Context(config={"TLS": "sm,self"})
        w = ctx.create_worker()
        _, address, blob = q.get(60)
        ep = w.connect(address)
        key = ep.unpack(blob)
        drv._lib.fake_set_polls(1 << 30)
        req = ep.put_nb(pattern(17), key)
        ctx.close()
        lib = drv._lib
        assert req.done() and req.result() is None
        assert lib.fake_ipc_closes() == 1 and lib.fake_close_pending() == 0
        assert lib.fake_streams_live() == 0
        q.put(("read", 0, N))
        assert q.get(30) == ("data", bytes(pattern(17)))
        q.put(("bye",))
    finally:
        join_ok(child, 60)


def test_await_a_copy(drv, lib_path):
    import asyncio

    with session(lib_path) as (q, w, ep, key):
        drv._lib.fake_set_polls(50)

        async def main():
            await ep.put_nb(pattern(18), key)
            await ep.put_nb(pattern(19)[:64], key, notify=b"n")

        q.put(("notes", 1))
        asyncio.run(asyncio.wait_for(main(), 30))
        assert q.get(60)[1][0][0] == b"n"
        assert read(q, 64, N - 64) == bytes(pattern(18))[64:]


def test_aio_flush_waits_for_copies(drv, lib_path):
    import asyncio

    import gpucx.aio

    q, theirs = channel_pair()
    child = spawn(owner, lib_path, theirs, N)
    try:
        with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
            _, address, blob = q.get(60)
            drv._lib.fake_set_polls(1 << 30)  # fires only when synchronized

            async def main():
                async with gpucx.aio.Worker(ctx) as aw:
                    aep = aw.connect(address)
                    key = aep.unpack(blob)
                    req = aep.put_nb(pattern(20), key)
                    await aep.aflush()
                    assert req.done()
                    key.close()

            asyncio.run(asyncio.wait_for(main(), 30))
            assert read(q) == bytes(pattern(20))
            assert drv._lib.fake_ipc_opens() == 1
            q.put(("bye",))
    finally:
        join_ok(child, 60)
