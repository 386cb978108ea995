"""Receiver-side staging: host payloads into device memory through pinned
host memory.

UCX moves a message from pageable host memory into a GPU receive buffer
by copy-in/copy-out over shared memory, at about 1 GB/s (benchmarks/
RESULTS.md, "The GPU paths after the engine refactor").  Where gpucx knows
that a payload is host memory and its target device memory (an array
whose header says host memory, received into device memory), it receives
the payload into a page-locked bounce buffer instead (host to host, at
the transport's speed), then queues ``cuMemcpyHtoDAsync`` on a stream of
its own and completes the operation once the event recorded after the copy
has fired.

The bounce buffers are one pool per worker (:class:`Pool`), made on first
use with ``cuMemHostAlloc`` (portable: pinned for every context), reused
from message to message, at most ``GPUCX_STAGING_BYTES`` bytes together,
and freed when the worker closes.  A payload the pool cannot take (larger
than the cap, or every byte of the cap lent to receives in flight) is
received as before, by UCX straight into device memory: staging never
waits for a buffer.

This module is the policy; the driver calls are :mod:`gpucx.mem.cuda`'s.
"""

from __future__ import annotations

import threading

from .._lib import ffi
from ..mem import cuda as _cuda

__all__ = ["Pool", "Bounce", "MIN_BLOCK"]

#: The smallest bounce buffer made: smaller payloads share its size, so
#: that one buffer serves messages of any small size.
MIN_BLOCK = 64 << 10


class Bounce:
    """One page-locked buffer of a :class:`Pool`.

    Attributes
    ----------
    ptr : int
        Its address.
    size : int
        Its size in bytes.
    view : buffer
        A writable buffer over it (what a receive is posted into).
    """

    __slots__ = ("ptr", "size", "view")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size
        self.view = ffi.buffer(ffi.cast("char *", ptr), size)


class Pool:
    """A worker's bounce buffers and copy streams.

    Parameters
    ----------
    cap : int
        The most bytes of page-locked memory it holds at once (0: staging
        off, :meth:`take` always returns None).

    Attributes
    ----------
    total : int
        Bytes it holds now (lent and free).
    allocs : int
        Buffers it made so far (``cuMemHostAlloc`` calls).
    lent : int
        Buffers lent to receives or copies in flight.
    """

    __slots__ = (
        "cap",
        "free",
        "total",
        "allocs",
        "lent",
        "streams",
        "closed",
        "lock",
    )

    def __init__(self, cap: int):
        self.cap = cap
        self.free: list[Bounce] = []
        self.total = 0
        self.allocs = 0
        self.lent = 0
        self.streams: dict = {}  # context -> gpucx's copy stream in it
        self.closed = False
        # Threads of a "multi" worker may stage at once.
        self.lock = threading.Lock()

    def take(self, nbytes: int, dst: int = 0) -> Bounce | None:
        """A free buffer of at least ``nbytes`` bytes, made if the cap
        allows (with the context owning device address ``dst`` current, as
        ``cuMemHostAlloc`` needs one); None when the pool cannot take the
        payload now.

        Raises
        ------
        gpucx.mem.cuda.DriverError
            If ``cuMemHostAlloc`` fails (out of page-locked memory).
        """
        if self.closed or not 0 < nbytes <= self.cap:
            return None
        with self.lock:
            return self._take(nbytes, dst)

    def _take(self, nbytes: int, dst: int) -> Bounce | None:
        best = None
        for b in self.free:
            if b.size >= nbytes and (best is None or b.size < best.size):
                best = b
        if best is not None:
            self.free.remove(best)
            self.lent += 1
            return best
        # Sizes in powers of two: a buffer serves every later payload of up
        # to its size, and the pool holds few sizes.
        size = max(MIN_BLOCK, 1 << (nbytes - 1).bit_length())
        if size > self.cap:
            size = nbytes
        if self.total + size > self.cap:
            self._trim()
            if self.total + size > self.cap:
                return None  # the rest is lent: take the direct path
        with _cuda.device_context(ptr=dst):
            ptr = _cuda.driver().mem_host_alloc(size, _cuda.HOSTALLOC_PORTABLE)
        self.total += size
        self.allocs += 1
        self.lent += 1
        return Bounce(ptr, size)

    def give(self, b: Bounce) -> None:
        """Take a buffer back (its receive and copy are over)."""
        with self.lock:
            self.lent -= 1
            if self.closed:
                self._free(b)
            else:
                self.free.append(b)

    def forfeit(self, b: Bounce) -> None:
        """Let a buffer go without reusing or freeing it: its receive
        failed and UCX may still hold it (a canceled transfer parked with
        the engine).  Its memory stays allocated, out of the pool's count."""
        with self.lock:
            self.lent -= 1
            self.total -= b.size

    def _trim(self) -> None:
        """Free the idle buffers (none fits the next payload)."""
        for b in self.free:
            self._free(b)
        self.free.clear()

    def _free(self, b: Bounce) -> None:
        drv = _cuda.driver()
        self.total -= b.size
        if drv is not None:
            drv.mem_free_host(b.ptr)

    def close(self) -> None:
        """The worker closes: free the idle buffers and the streams; a
        buffer still lent is freed when given back."""
        with self.lock:
            self.closed = True
            self._trim()
        _cuda.destroy_streams(self.streams)


def forfeit(pool: Pool | None, b: Bounce) -> None:
    """:meth:`Pool.forfeit` (``pool`` None: nothing to do)."""
    if pool is not None:
        pool.forfeit(b)


def copy_in(
    pool: Pool, b: Bounce, dst: int, nbytes: int, after: tuple, progress
) -> None:
    """Copy ``nbytes`` of bounce buffer ``b`` into device memory at ``dst``
    on the pool's stream (after the work queued on the streams ``after``),
    progressing the worker until the copy's event fired; ``b`` goes back
    to the pool either way.

    Raises
    ------
    gpucx.mem.cuda.DriverError
        If the driver refuses the copy or reports an error for it.
    """
    try:
        with _cuda.device_context(ptr=dst) as ctx:
            ev = _cuda.copy_start(
                ctx, pool.streams, dst, b.ptr, nbytes, after, host_src=True
            )
        _cuda.event_wait(ctx, ev, progress)
    finally:
        pool.give(b)
