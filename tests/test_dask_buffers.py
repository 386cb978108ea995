"""The cache of large host receive buffers (gpucx.dask._buffers)."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import dask.config  # noqa: E402
from distributed.comm import connect, listen  # noqa: E402
from distributed.protocol import to_serialize  # noqa: E402
from distributed.utils_test import gen_test  # noqa: E402

from gpucx.dask import _runtime as rt  # noqa: E402
from gpucx.dask._buffers import ReceiveCache  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _addr(view) -> int:
    return np.frombuffer(view, "u1").ctypes.data


def test_dropped_buffer_is_reused_and_writable():
    cache = ReceiveCache(8 * MiB, MiB, 10.0)
    a = cache.get(2 * MiB)
    assert isinstance(a, memoryview) and not a.readonly and a.nbytes == 2 * MiB
    a[:3] = b"abc"
    where = _addr(a)
    del a
    gc.collect()
    assert cache.cached == 2 * MiB and cache.outstanding == 0
    b = cache.get(2 * MiB)
    assert _addr(b) == where and cache.reused == 1 and cache.cached == 0
    c = cache.get(3 * MiB)  # another size: a new block
    assert cache.allocated == 2 and _addr(c) != where


def test_a_block_comes_back_only_when_its_last_view_is_gone():
    cache = ReceiveCache(8 * MiB, MiB, 10.0)
    view = cache.get(2 * MiB)
    where = _addr(view)
    arr = np.frombuffer(view, "u1")[10:20]  # what Dask keeps of a frame
    part = view[5:9]
    part[:] = b"wxyz"
    del view
    gc.collect()
    assert cache.cached == 0  # still in use
    arr[:] = 7
    other = cache.get(2 * MiB)
    assert _addr(other) != where
    del arr
    gc.collect()
    assert cache.cached == 0  # the slice still holds it
    assert bytes(part) == b"wxyz"
    del part
    gc.collect()
    assert cache.cached == 2 * MiB
    assert _addr(cache.get(2 * MiB)) == where


def test_small_frames_and_disabled_cache_get_plain_buffers():
    cache = ReceiveCache(8 * MiB, MiB, 10.0)
    small = cache.get(MiB - 1)
    assert small.nbytes == MiB - 1 and not small.readonly
    del small
    assert cache.allocated == 0 and cache.cached == 0
    off = ReceiveCache(0, MiB, 10.0)
    view = off.get(2 * MiB)
    del view
    gc.collect()
    assert off.cached == 0 and off.allocated == 0


def test_the_cache_stays_within_its_cap_and_forgets_old_blocks():
    cache = ReceiveCache(5 * MiB, MiB, 0.2)
    views = [cache.get(2 * MiB) for _ in range(3)]
    del views
    gc.collect()
    assert cache.cached == 4 * MiB  # the third did not fit
    one = cache.get(3 * MiB)
    del one
    gc.collect()
    assert cache.cached <= 5 * MiB
    time.sleep(0.25)
    cache.trim()
    assert cache.cached == 0
    views = [cache.get(2 * MiB)]
    del views
    gc.collect()
    assert cache.cached == 2 * MiB
    cache.clear()
    assert cache.cached == 0


@gen_test()
async def test_idle_process_gives_the_memory_back():
    cache = ReceiveCache(8 * MiB, MiB, 0.1)
    view = cache.get(2 * MiB)
    cache.schedule_trim(asyncio.get_running_loop())
    await asyncio.sleep(0.15)
    del view  # returned after the first trim ran
    gc.collect()
    assert cache.cached == 2 * MiB
    await asyncio.sleep(0.35)
    assert cache.cached == 0


@gen_test()
async def test_large_frames_over_a_comm_reuse_dropped_buffers():
    """The second of two large messages lands in the first one's memory once
    the reader dropped it; a message still held keeps its own."""
    got: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        while True:
            try:
                await got.put(await comm.read())
            except Exception:
                await comm.close()
                return

    async with listen("gpucx://127.0.0.1:0", handle) as lst:
        comm = await connect(lst.contact_address)
        cache = rt.receive_cache(rt.settings())
        before = cache.reused
        a = np.arange(4 * MiB, dtype="u1")
        await comm.write({"x": to_serialize(a)})
        first = (await got.get())["x"]
        assert np.array_equal(first, a)
        await comm.write({"x": to_serialize(a[::-1].copy())})
        second = (await got.get())["x"]
        assert np.array_equal(second, a[::-1]) and np.array_equal(first, a)
        where = second.ctypes.data
        del second
        gc.collect()
        await comm.write({"x": to_serialize(a)})
        third = (await got.get())["x"]
        assert third.ctypes.data == where and np.array_equal(third, a)
        assert cache.reused > before
        assert np.array_equal(first, a)
        await comm.close()


@gen_test()
async def test_receive_cache_follows_the_config():
    with dask.config.set(
        {
            "distributed-gpucx.receive-cache": 0,
            "distributed-gpucx.receive-cache-ttl": "50ms",
        }
    ):
        s = rt.settings()
        assert s.receive_cache == 0 and s.receive_cache_ttl == 0.05
        assert rt.receive_cache(s).cap == 0
    with (
        dask.config.set({"distributed-gpucx.receive-cache-ttl": 0}),
        pytest.raises(ValueError),
    ):
        rt.settings()
