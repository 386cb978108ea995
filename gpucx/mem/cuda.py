"""The CUDA layer: driver loading, capability, devices, streams and contexts.

gpucx talks to the CUDA *driver* API (``libcuda.so.1``) through ctypes,
loaded on first use, so that gpucx imports and works on machines without a
GPU, a driver, CuPy, Numba or PyTorch.  Nothing here runs for host memory
unless a ``stream=`` is given.

What it provides to the rest of gpucx: two ways in, and no third
(docs/layout.md, "One CUDA door"; ``tests/test_layout.py`` fails when code
outside :mod:`gpucx.mem` calls anything of this module's but the names it
allows):

* :class:`door` -- for an operation that posts memory that may be on a
  device, or receives into it, or that waits for a ``stream=`` first.
  ``with door(engine, ptr, memory_type, stream, what, keep):`` checks that
  the worker's context can move the memory (:func:`problem`), makes the
  device that owns the pointer current (pushed only if another context is
  current; never device 0 by assumption), waits for the streams while
  progressing the worker, and pops what it pushed when the block ends.
  Two modes go through the same door without a post inside it:
  :meth:`door.ready` (check and wait, nothing left current) and
  :meth:`door.copy_in` (host bytes into the device memory).  Host memory
  without a stream skips the door: callers test first, so the host fast
  path pays for no context manager.
* :class:`device_context` -- for everything else that needs a device
  context current without posting an operation: registration, allocation,
  CUDA IPC open and close, staging copies (:func:`copy_start`), the
  benchmark's copy limits.  ``with device_context(ptr=..., device=...) as
  ctx:`` makes the owner of ``ptr`` (or ``device``'s primary context)
  current and always pops what it pushed, whatever fails.

Around them, functions that make nothing current: :func:`problem` and
:func:`check` (why a :class:`~gpucx.Context` cannot move CUDA memory),
:func:`as_stream` (a CuPy, Numba or PyTorch stream, a raw handle or
``None`` turned into a ``CUstream`` handle), :func:`copy_start` and
:func:`event_wait` (a copy queued in the current context, and its wait),
:func:`destroy_streams`, :func:`current_device`, :func:`device_of`, and
:func:`sync_stream`, the stream-sync hook :func:`gpucx.mem.as_buffer` runs
for a CAI v3 ``stream`` or a DLPack consumer stream (the default hook of
:mod:`gpucx.mem.buffer` calls it when a driver is present; ``buffer``
builds on this module, never the reverse).

The driver's ABI (the ctypes bindings of :class:`Driver`, ``CUresult`` ->
:class:`DriverError`, the cuda.h values) is :mod:`gpucx.mem._cudadrv`;
this module is the policy over it, and re-exports its public names.  Which
driver is in use is decided here (:func:`driver`, loaded on first use), and
the object is replaceable (:func:`set_driver`) so that the logic can be
tested on machines without a GPU; tests do that with a named double.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._names import rehome
from ..errors import UnsupportedError

# The driver ABI, re-exported: gpucx.mem.cuda.Driver, DriverError... stay
# where callers and tests have always found them.
from ._cudadrv import HOSTALLOC_PORTABLE as HOSTALLOC_PORTABLE
from ._cudadrv import IPC_HANDLE_SIZE as IPC_HANDLE_SIZE
from ._cudadrv import IPC_LAZY_ENABLE_PEER_ACCESS as IPC_LAZY_ENABLE_PEER_ACCESS
from ._cudadrv import LEGACY_STREAM, PER_THREAD_STREAM, Driver, DriverError
from ._cudadrv import IpcMemHandle as IpcMemHandle
from .memtype import CUDA_INTS as _CUDA_INTS
from .memtype import MemoryType

# The driver's classes read as gpucx.mem.cuda's (repr, tracebacks,
# pickling), as they did before the ABI moved to _cudadrv.
rehome(__name__, Driver, DriverError, IpcMemHandle)

__all__ = [
    "Driver",
    "DriverError",
    "driver",
    "driver_problem",
    "set_driver",
    "restore_driver",
    "problem",
    "check",
    "door",
    "device_context",
    "as_stream",
    "copy_start",
    "event_wait",
    "destroy_streams",
    "sync_stream",
    "wait_stream",
    "device_of",
    "current_device",
    "Deferred",
    "LEGACY_STREAM",
    "PER_THREAD_STREAM",
]

_UNLOADED: Any = object()
_driver: Any = _UNLOADED
_driver_problem: str | None = None
_load_lock = threading.Lock()


def driver() -> Any:
    """The loaded driver, loading it on first use; ``None`` without one.

    When this returns ``None``, :func:`driver_problem` says why.
    """
    global _driver, _driver_problem
    if _driver is _UNLOADED:
        with _load_lock:
            if _driver is _UNLOADED:
                try:
                    drv = Driver.load()
                    if drv.device_count() < 1:
                        raise DriverError("cuDeviceGetCount: no CUDA device")
                except OSError as exc:
                    _driver_problem = f"no CUDA driver (libcuda.so.1: {exc})"
                    _driver = None
                except (DriverError, AttributeError) as exc:
                    _driver_problem = f"the CUDA driver is unusable ({exc})"
                    _driver = None
                else:
                    _driver = drv
    return _driver


def driver_problem() -> str | None:
    """Why :func:`driver` returns ``None`` (``None`` when it does not)."""
    return None if driver() is not None else _driver_problem


def set_driver(drv: Any, problem_text: str | None = None) -> Any:
    """Replace the driver object (tests use a double); returns the previous.

    ``drv=None`` with ``problem_text`` says there is no driver; pass the
    previous value back to restore it.
    """
    global _driver, _driver_problem, _sole, _count
    previous = (_driver, _driver_problem)
    _driver = drv
    _driver_problem = problem_text
    _sole = _count = None
    _events.forget()
    return previous


def restore_driver(previous: Any) -> None:
    """Undo :func:`set_driver` with the value it returned."""
    global _driver, _driver_problem, _sole, _count
    _driver, _driver_problem = previous
    _sole = _count = None
    _events.forget()


# -- capability -----------------------------------------------------------------

_NO_UCX_CUDA = (
    "this UCX context has no CUDA transport loaded, so UCX cannot move CUDA "
    "memory: use a UCX built with CUDA (the libucx-cu12/-cu13 wheel, or "
    "GPUCX_UCX_PREFIX pointing at one), a CUDA driver, and a UCX_TLS that "
    "includes cuda_copy (and cuda_ipc between processes on one node), e.g. "
    "UCX_TLS=sm,cuda_copy,cuda_ipc,tcp"
)


def problem(context: Any) -> str | None:
    """Why ``context`` cannot move CUDA memory, or ``None`` when it can.

    Both must hold: UCX reports CUDA among the context's memory types
    (``UCP_ATTR_FIELD_MEMORY_TYPES``: a UCX built with CUDA whose
    ``cuda_copy`` transport loaded under this ``UCX_TLS``), and a CUDA
    driver with at least one device is present.  Cached on the context.
    """
    cached = context.__dict__.get("_cuda_problem", _UNLOADED)
    if cached is not _UNLOADED:
        return cached
    reasons = []
    if MemoryType.CUDA not in context.memory_types:
        import os

        tls = context.config.get("TLS") or os.environ.get("UCX_TLS")
        reasons.append(_NO_UCX_CUDA + (f" (this context: TLS={tls})" if tls else ""))
    drv_problem = driver_problem()
    if drv_problem is not None:
        reasons.append(drv_problem)
    text = "; ".join(reasons) if reasons else None
    context._cuda_problem = text
    return text


def _unsupported(context: Any, what: str) -> UnsupportedError:
    return UnsupportedError(
        f"{what}: CUDA memory cannot be moved here: {problem(context)}"
    )


def check(context: Any, what: str) -> None:
    """Raise :class:`~gpucx.UnsupportedError` if ``context`` cannot move CUDA.

    Raises
    ------
    gpucx.UnsupportedError
        Naming what is missing (see :func:`problem`).
    """
    if problem(context) is not None:
        raise _unsupported(context, what)


# -- streams --------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_stream(stream: Any) -> int | None:
    """Turn a stream argument into a ``CUstream`` handle.

    Accepts ``None`` (no stream), a raw int handle (0 and 1 both mean the
    legacy default stream, 2 the per-thread default stream), a CuPy stream
    (``.ptr``), a PyTorch stream (``.cuda_stream``), a Numba stream
    (``.handle.value``, or ``int(stream)``).

    Returns
    -------
    int or None
        The handle; 0 becomes :data:`LEGACY_STREAM` so that the handle means
        the same whatever the caller's compilation mode.

    Raises
    ------
    TypeError
        For anything else (the message names the attributes looked for).
    ValueError
        For a negative handle.
    """
    if stream is None:
        return None
    if _is_int(stream):
        handle = stream
    elif isinstance(stream, (bool, float)):
        raise TypeError(
            f"stream must be None, an int handle or a stream, not {stream!r}"
        )
    else:
        handle = None
        for attr in ("ptr", "cuda_stream"):
            value = getattr(stream, attr, None)
            if _is_int(value):
                handle = value
                break
        if handle is None:
            inner = getattr(stream, "handle", None)
            value = getattr(inner, "value", None)
            if inner is not None and (value is None or _is_int(value)):
                handle = value or 0
        if handle is None and hasattr(stream, "__int__"):
            handle = int(stream)
        if handle is None:
            raise TypeError(
                "stream must be None, an int handle, or a CUDA stream object "
                "with .ptr (CuPy), .cuda_stream (PyTorch) or .handle (Numba); "
                f"got {type(stream).__name__}"
            )
    if handle < 0:
        raise ValueError(f"stream handle must be >= 0, not {handle}")
    return handle or LEGACY_STREAM


class Deferred:
    """The keepalive :func:`gpucx.mem.buffer.acquire` returns with
    ``defer=True`` for device memory whose producer stream it did not
    synchronize: the :class:`door` (and its :meth:`door.ready`) waits
    for ``stream`` once the owner's context is current, so that one
    operation asks the driver for the current context once.

    Attributes
    ----------
    owner : object
        What keeps the memory alive (see :class:`gpucx.mem.buffer.Buffer`).
    stream : int
        The producer stream still to wait for.
    """

    __slots__ = ("owner", "stream")

    def __init__(self, owner: Any, stream: int):
        self.owner = owner
        self.stream = stream

    def __repr__(self) -> str:
        return f"Deferred(stream={self.stream:#x}, owner={self.owner!r})"


class _Events:
    """Free events per context, so no event is created per operation."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def take(self, drv: Any, ctx: int) -> int:
        with self._lock:
            free = self._free.get(ctx)
            if free:
                return free.pop()
        return drv.event_create()

    def give(self, ctx: int, event: int) -> None:
        with self._lock:
            self._free.setdefault(ctx, []).append(event)

    def forget(self) -> None:
        """Drop every pooled event (they belong to the previous driver)."""
        with self._lock:
            self._free.clear()


_events = _Events()


def _need_driver(what: str) -> Any:
    drv = driver()
    if drv is None:
        raise UnsupportedError(f"{what}: a CUDA stream needs {driver_problem()}")
    return drv


def wait_stream(
    stream: int,
    progress: Callable[[], object] | None = None,
    what: str = "stream",
    ctx: int = 0,
) -> None:
    """Return when the work queued on ``stream`` before the call has finished.

    A stream with nothing pending (``cuStreamQuery``) returns at once: the
    common case of an operation per message on an idle stream costs one
    query, not a trip through the GPU.  Otherwise it records an event on
    the stream (in the current context) and polls it; between polls
    ``progress()`` runs, so a worker keeps moving other operations while
    this one waits.  Without ``progress`` it blocks in
    ``cuEventSynchronize``.

    ``ctx``, when not 0, is the context the caller knows to be current (it
    just made it so), which spares asking the driver again.

    Raises
    ------
    gpucx.UnsupportedError
        Without a usable CUDA driver.
    DriverError
        If the driver rejects the stream (a handle from another context, a
        destroyed stream).
    """
    drv = _need_driver(what)
    if ctx == 0:
        ctx = drv.current_context()
    if ctx == 0:
        ctx = drv.primary_context(current_device())
        drv.set_current(ctx)
    if drv.stream_query(stream):
        return
    event = _events.take(drv, ctx)
    try:
        drv.event_record(event, stream)
        if progress is None:
            drv.event_synchronize(event)
    except BaseException:
        drv.event_destroy(event)
        raise
    if progress is None:
        _events.give(ctx, event)
    else:
        # The caller's progress callable moves its worker while the GPU
        # finishes (event_wait: not a worker wait, no deadline to keep).
        event_wait(ctx, event, progress)


def sync_stream(stream: int, buf: Any) -> None:
    """Stream-sync hook for :func:`gpucx.mem.as_buffer` (blocking).

    Makes the buffer's device current when the driver knows the pointer,
    then waits for the work queued on ``stream`` before the call.
    """
    pushed, ctx = False, 0
    if buf.memory_type is not MemoryType.HOST and buf.nbytes:
        pushed, ctx = _enter(_need_driver(buf.protocol), buf.ptr, buf.device)
    try:
        wait_stream(stream, None, buf.protocol, ctx)
    finally:
        if pushed:
            _need_driver(buf.protocol).pop()


# -- devices and contexts ---------------------------------------------------------


def current_device() -> int:
    """The device of the calling thread's current context.

    Without a current context: the only device when there is one, else
    the device CuPy considers current (when CuPy is imported).

    Raises
    ------
    gpucx.UnsupportedError
        Without a driver.
    ValueError
        With several devices, no current context and no CuPy device.
    """
    drv = _need_driver("device")
    if drv.current_context():
        return int(drv.context_device())
    count = drv.device_count()
    if count == 1:
        return 0
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return int(cupy.cuda.Device().id)
    raise ValueError(
        f"this host has {count} CUDA devices and none is current in this "
        "thread: pass device= or make one current first"
    )


def device_of(ptr: int) -> int:
    """Ordinal of the device that owns ``ptr`` (-1 for host memory).

    Raises
    ------
    gpucx.UnsupportedError
        Without a driver.
    """
    return int(_need_driver("pointer").pointer(ptr)[1])


# The primary context of the only device of a one-device host, once known
# and active (0: not such a host, or not known); reset with the driver.
_sole: int | None = None


def _sole_primary(drv: Any) -> int:
    """The one device's primary context on a one-device host, else 0.

    Decided once per driver, at the first device-memory operation made
    with a context current: the device count and the primary context's
    state (``cuDevicePrimaryCtxGetState``) are asked once; the primary is
    retained only when it is already active (so gpucx never creates one
    here), and kept for the process, as :meth:`Driver.primary_context`
    keeps every primary it retains.
    """
    global _sole
    sole = _sole
    if sole is None:
        sole = 0
        active = getattr(drv, "primary_active", None)
        if active is not None and _device_count(drv) == 1 and active(0):
            sole = drv.primary_context(0)
        _sole = sole
    return sole


def _enter(drv: Any, ptr: int, device: int) -> tuple[bool, int]:
    """Make the owner of ``ptr`` (or ``device``'s primary context) current.

    Returns ``(pushed, ctx)``: whether a context was pushed (pop it after),
    and the context current now (0 when none is and none was wanted).

    Driver calls: one ``cuCtxGetCurrent``, then one
    ``cuPointerGetAttributes`` unless the answer is known: on a host with
    one device whose primary context is current, device memory is taken
    to be that context's (every allocator of CuPy, Numba, PyTorch and RMM
    allocates in the primary context; memory of a context made with
    ``cuCtxCreate`` is found by the query whenever that context, not the
    primary, is current).  Nothing about a pointer is cached between
    operations: memory may be freed and its address reused by another
    device's allocation.
    """
    have = drv.current_context()
    if ptr:
        if have and have == (_sole if _sole is not None else _sole_primary(drv)):
            return False, have
        want = drv.pointer(ptr)[2]
    else:
        want = 0
    if not want:
        if device < 0:
            return False, have
        want = drv.primary_context(device)
    if have == want:
        return False, have
    if have == 0:
        # Nothing current in this thread (a progress thread, a fresh thread):
        # leave the owner current, as cudaSetDevice would.
        drv.set_current(want)
        return False, want
    drv.push(want)
    return True, want


# The device count of the driver in use, once asked (reset with the driver):
# CUDA fixes it at cuInit, so device_context(device=) and the door's
# one-device shortcut (_sole_primary) ask the driver once between them.
_count: int | None = None


def _device_count(drv: Any) -> int:
    global _count
    count = _count
    if count is None:
        count = _count = int(drv.device_count())
    return count


class device_context:
    """The allocation context: ``with device_context(ptr=..., device=...) as
    ctx:`` makes a device context current for code that needs one without
    posting an operation (registration, allocation, CUDA IPC open and
    close, staging copies, the benchmark's copy limits), and pops what it
    pushed when the block ends, whatever fails inside.

    Which context: the one that owns device memory at ``ptr``; for a
    ``ptr`` the driver does not know as device memory (or none), the
    primary context of ``device``; without ``ptr`` and ``device``, the
    primary context of the thread's device (:func:`current_device`).
    Nothing is pushed when that context is current already; when no
    context is current (a progress thread, a fresh thread) it is made
    current and left so, as ``cudaSetDevice`` would, not pushed.

    Operations that post memory go through :class:`door` instead.

    Parameters
    ----------
    ptr : int, optional
        An address whose owner is wanted (0: none).
    device : int, optional
        A device ordinal (``ptr``'s fallback; without ``ptr``, the device).

    Returns
    -------
    int
        On entry: the context current inside the block (0 only when
        ``ptr`` is host memory and no ``device`` was given, with no
        context current).

    Raises
    ------
    gpucx.UnsupportedError
        Without a usable CUDA driver (on entry).
    ValueError
        On entry, for a ``device`` this host does not have (or that is not
        an int); without either argument, for a host with several devices
        and none current (see :func:`current_device`).
    DriverError
        If the driver refuses the context (on entry).
    """

    __slots__ = ("_ptr", "_device", "_pushed")

    def __init__(self, ptr: int = 0, device: int | None = None) -> None:
        self._ptr = ptr
        self._device = device
        self._pushed: Any = None

    def __enter__(self) -> int:
        drv = _need_driver("device")
        device = self._device
        if device is None:
            device = -1 if self._ptr else current_device()
        else:
            count = _device_count(drv)
            if not _is_int(device) or not 0 <= device < count:
                raise ValueError(
                    f"device={device!r}: this host has {count} CUDA device(s)"
                )
        pushed, ctx = _enter(drv, self._ptr, device)
        if pushed:
            # Popped from the driver that pushed (tests swap drivers).
            self._pushed = drv
        return ctx

    def __exit__(self, *exc: object) -> None:
        drv = self._pushed
        if drv is not None:
            self._pushed = None
            drv.pop()


def _prepare(
    engine: Any,
    ptr: Any,
    memory_type: int,
    stream: Any,
    what: str,
    keep: Any = None,
) -> bool:
    """What the :class:`door` does on entry (its parameters and errors).

    For CUDA memory: check that the worker's context can move it, make the
    owning device current.  For a ``stream``, and the producer's stream a
    :class:`Deferred` ``keep`` carries (CAI v3 ``stream``, DLPack consumer
    stream): wait, progressing the worker, until the work queued on it
    before the call has finished, in the owner's context made current here.

    Driver calls for device memory whose owner is current and streams that
    are idle: one ``cuCtxGetCurrent``, one ``cuPointerGetAttributes``
    (none on a one-device host with its primary context current, see
    :func:`_enter`) and one ``cuStreamQuery`` per stream to wait for.

    Returns True when a context was pushed (pop it after posting).
    """
    handle = None if stream is None else as_stream(stream)
    held = keep.stream if type(keep) is Deferred else None
    pushed, ctx = False, 0
    if memory_type in _CUDA_INTS:
        check(engine.context, what)
        if not isinstance(ptr, int):
            ptr = int(_ffi().cast("uintptr_t", ptr))
        pushed, ctx = _enter(driver(), ptr, -1)
    if handle is not None or held is not None:
        try:
            if held is not None:
                wait_stream(held, engine.progress, what, ctx)
            if handle is not None and handle != held:
                wait_stream(handle, engine.progress, what, ctx)
        except BaseException:
            if pushed:
                driver().pop()
            raise
    return pushed


def copy_start(
    ctx: int,
    streams: dict,
    dst: int,
    src: int,
    nbytes: int,
    after: Any = (),
    host_src: bool = False,
) -> int:
    """Queue a copy of ``nbytes`` from ``src`` to ``dst`` in the current
    context ``ctx`` (call it inside :class:`device_context`); return the
    event recorded after it (wait for it with :func:`event_wait`, or query
    it: it is ``ctx``'s pooled event, given back by :func:`event_wait`).

    The copy runs on ``streams[ctx]``, a non-blocking stream of the
    caller's (made here on first use; the caller destroys it with
    :func:`destroy_streams`), after the work queued on each stream of
    ``after`` now (``cuStreamWaitEvent``: stream order without the host
    waiting).  ``host_src``: ``src`` is page-locked host memory
    (``cuMemcpyHtoDAsync``); otherwise the driver tells the direction from
    the addresses (``cuMemcpyAsync``).

    Raises
    ------
    gpucx.UnsupportedError
        Without a usable CUDA driver.
    DriverError
        If the driver refuses a call (nothing is left queued).
    """
    drv = _need_driver("copy to device memory")
    s = streams.get(ctx)
    if s is None:
        s = streams[ctx] = drv.stream_create()
    for h in after:
        # The pooled event goes back at once: a later record of it does not
        # change this wait.
        ev = _events.take(drv, ctx)
        try:
            drv.event_record(ev, h)
            drv.stream_wait_event(s, ev)
        finally:
            _events.give(ctx, ev)
    if host_src:
        drv.memcpy_htod_async(dst, src, nbytes, s)
    else:
        drv.memcpy_async(dst, src, nbytes, s)
    ev = _events.take(drv, ctx)
    try:
        drv.event_record(ev, s)
    except BaseException:
        drv.event_destroy(ev)
        raise
    return ev


def event_wait(ctx: int, event: int, progress: Callable[[], object]) -> None:
    """Poll ``event`` (from :func:`copy_start`, :func:`wait_stream`) until
    it fired, calling ``progress()`` between polls (a worker keeps moving
    meanwhile), then give it back to the pool of ``ctx``.

    Not a worker wait: the copy engine finishes on its own, so there is no
    deadline to keep.

    Raises
    ------
    DriverError
        If the driver reports an error for the copy (the event is destroyed).
    """
    drv = _need_driver("copy to device memory")
    try:
        while not drv.event_query(event):
            progress()
    except BaseException:
        drv.event_destroy(event)
        raise
    _events.give(ctx, event)


def destroy_streams(streams: dict) -> None:
    """Destroy the streams of ``streams`` (``ctx -> stream``: those
    :func:`copy_start` made, gpucx's CUDA IPC copy streams), each in its
    context, and empty it; a context already gone took its streams with
    it."""
    drv = driver()
    for ctx, s in list(streams.items()):
        if drv is None:
            break
        pushed = False
        try:
            if drv.current_context() != ctx:
                drv.push(ctx)
                pushed = True
            drv.stream_destroy(s)
        except DriverError:
            pass  # the context is gone, and its streams with it
        finally:
            if pushed:
                drv.pop()
    streams.clear()


class door:
    """The one door for an operation that posts (or receives into) memory
    that may be on a device, or that waits for a ``stream=`` first.

    ``with door(engine, ptr, memory_type, stream, what, keep):`` runs on
    entry what the operation needs before it posts: for CUDA memory, checks
    that the worker's context can move it and makes the owning device
    current; for a ``stream`` (and the producer stream a
    :class:`Deferred` ``keep`` carries), waits for it, progressing the
    worker.  On exit it pops what it pushed, whatever happens in between,
    so that a failure can never leave a device context pushed.  The wait
    for the posted operation belongs after the block: no context stays
    pushed while a wait runs handlers (user code).

    Two modes pass the same door without a post inside it:
    :meth:`ready` and :meth:`copy_in`.

    Operations test ``mt != HOST or stream is not None`` first and post host
    memory without it: the host fast path pays for no context manager.

    Parameters
    ----------
    engine : gpucx._engine.Engine
        The worker's progress engine: its context says what it can move,
        and it is progressed while a stream is waited for.
    ptr : int or cdata
        Address of the buffer.
    memory_type : int
        Its ``ucs_memory_type_t``.
    stream : object
        As for :func:`as_stream`.
    what : str
        The operation, for error messages.
    keep : object, optional
        The keepalive :func:`gpucx.mem.buffer.acquire` returned with
        ``defer=True``.

    Raises
    ------
    gpucx.UnsupportedError
        On entry: CUDA memory on a context that cannot move it (the message
        names what is missing), or a stream without a CUDA driver.
    TypeError, ValueError
        On entry, for a bad ``stream`` (see :func:`as_stream`).
    """

    __slots__ = ("_args", "_pushed")

    def __init__(
        self,
        engine: Any,
        ptr: Any,
        memory_type: int,
        stream: Any,
        what: str,
        keep: Any = None,
    ) -> None:
        self._args = (engine, ptr, memory_type, stream, what, keep)
        self._pushed = False

    def __enter__(self) -> None:
        self._pushed = _prepare(*self._args)

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            driver().pop()

    def ready(self) -> None:
        """Pass the door without posting through it: check that the context
        can move the memory and wait for the streams, leaving no context
        pushed (for operations that post later, or not to UCX).

        Raises
        ------
        gpucx.UnsupportedError, TypeError, ValueError
            As on entry.
        """
        if _prepare(*self._args):
            driver().pop()

    def copy_in(self, src: Any, nbytes: int) -> None:
        """Copy ``nbytes`` of host memory at ``src`` into the door's CUDA
        memory, inside the door (``cuMemcpy``, which returns once the bytes
        are in device memory): where gpucx itself delivers bytes UCX already
        received into host memory (an eager active message).

        Raises
        ------
        gpucx.UnsupportedError, TypeError, ValueError
            As on entry.
        DriverError
            If the driver refuses the copy.
        """
        with self:
            ffi = _ffi()
            driver().memcpy(
                int(ffi.cast("uintptr_t", self._args[1])),
                int(ffi.cast("uintptr_t", src)),
                nbytes,
            )


def _ffi() -> Any:
    from .._lib import ffi

    return ffi
