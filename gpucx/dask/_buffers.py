"""Recycled host receive buffers for large frames.

A fresh multi-MiB NumPy buffer costs its page faults: the kernel zeroes
every page (huge pages included) before the frame's bytes land in it, so
receiving into fresh memory takes about twice as long as the copy alone.
:class:`ReceiveCache` keeps the memory of large receive buffers that Dask
has dropped and hands it out again for the next frame of the same size.

Each frame handed to Dask is a new ``memoryview`` whose memory nobody else
references: the block goes back to the cache only when the last reference
to it (the memoryview, any slice of it, any array made on it) is gone, as
cffi's ``ffi.gc`` destructor of the exporting object runs then.  The cache
is bounded in bytes (``receive-cache``) and forgets blocks unused for
``receive-cache-ttl`` seconds, so an idle process gives its memory back.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from gpucx._lib import ffi


class ReceiveCache:
    """Free blocks of large receive buffers, by exact size.

    Parameters
    ----------
    cap : int
        Most bytes kept while nobody uses them (0: keep nothing).
    min_bytes : int
        Frames smaller than this get plain ``np.empty`` buffers (malloc
        recycles those already).
    ttl : float
        Seconds an unused block is kept.
    """

    def __init__(self, cap: int, min_bytes: int, ttl: float):
        self.cap = cap
        self.min_bytes = min_bytes
        self.ttl = ttl
        self.cached = 0  # bytes in the free lists
        self._free: dict[int, list] = {}  # size -> [(time put, block)]
        # A destructor may run in any thread, or inside get() (a collection
        # during an allocation): a reentrant lock.
        self._lock = threading.RLock()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self.outstanding = 0  # blocks handed out, not yet back
        self.reused = 0  # counters, for tests and benchmarks
        self.allocated = 0

    def get(self, nbytes: int) -> memoryview:
        """A writable ``memoryview`` of ``nbytes`` bytes (contents undefined)."""
        if nbytes < self.min_bytes or nbytes > self.cap:
            return np.empty(nbytes, "u1").data
        blk = None
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                blk = lst.pop()[1]
                self.cached -= nbytes
                self.reused += 1
            self.outstanding += 1
        if blk is None:
            blk = np.empty(nbytes, "u1")  # huge pages: NumPy madvises
            self.allocated += 1
        owner = ffi.gc(ffi.from_buffer(blk), _Return(self, blk))
        return memoryview(ffi.buffer(owner, nbytes))

    def put_back(self, blk: np.ndarray) -> None:
        n = blk.nbytes
        now = time.monotonic()
        with self._lock:
            self.outstanding -= 1
            if self.cap <= 0 or n > self.cap:
                return
            self._expire(now)
            while self.cached + n > self.cap:
                self._drop_oldest()
            self._free.setdefault(n, []).append((now, blk))
            self.cached += n

    def _drop_oldest(self) -> None:
        size, lst = min(self._free.items(), key=lambda kv: kv[1][0][0])
        lst.pop(0)
        self.cached -= size
        if not lst:
            del self._free[size]

    def _expire(self, now: float) -> None:
        limit = now - self.ttl
        for size in list(self._free):
            lst = self._free[size]
            keep = [item for item in lst if item[0] > limit]
            self.cached -= size * (len(lst) - len(keep))
            if keep:
                self._free[size] = keep
            else:
                del self._free[size]

    def trim(self) -> None:
        """Forget the blocks unused for ``ttl`` seconds."""
        with self._lock:
            self._expire(time.monotonic())

    def clear(self) -> None:
        """Forget every free block."""
        with self._lock:
            self._free.clear()
            self.cached = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def schedule_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        """Trim from ``loop`` every ``ttl`` seconds while blocks are kept or
        handed out (a process that stops receiving gives the memory back)."""
        t, tl = self._timer, self._timer_loop
        if t is not None and not t.cancelled() and tl and not tl.is_closed():
            return
        self._timer_loop = loop
        self._timer = loop.call_later(self.ttl, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self.trim()
        if (self.cached or self.outstanding) and not loop.is_closed():
            self._timer = loop.call_later(self.ttl, self._on_timer, loop)


class _Return:
    """``ffi.gc`` destructor: the block goes back to its cache."""

    __slots__ = ("_cache", "_blk")

    def __init__(self, cache: ReceiveCache, blk: np.ndarray):
        self._cache = cache
        self._blk = blk

    def __call__(self, _cdata) -> None:
        self._cache.put_back(self._blk)
