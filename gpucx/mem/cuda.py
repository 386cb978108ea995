"""The CUDA layer: driver loading, capability, devices, streams and contexts.

gpucx talks to the CUDA *driver* API (``libcuda.so.1``) through ctypes,
loaded on first use, so that gpucx imports and works on machines without a
GPU, a driver, CuPy, Numba or PyTorch.  Nothing here runs for host memory
unless a ``stream=`` is given.

What it provides to the rest of gpucx:

* :func:`problem` -- why a :class:`~gpucx.Context` cannot move CUDA memory
  (the UCX build or ``UCX_TLS`` lacks CUDA transports, no driver, no device),
  or ``None``.  Operations on CUDA buffers call :func:`prepare`, which raises
  :class:`~gpucx.UnsupportedError` with that text before UCX sees anything.
* :func:`as_stream` -- a CuPy, Numba or PyTorch stream, a raw handle or
  ``None`` turned into a ``CUstream`` handle.
* :func:`prepare` / :func:`leave` -- around posting an operation: make the
  device that owns the pointer current (the primary context, pushed only if
  another context is current; never device 0 by assumption), then record an
  event on the user's stream and progress the worker until the event has
  completed, so that other operations keep moving while gpucx waits.
* :func:`sync_stream` -- the stream-sync hook :func:`gpucx.mem.as_buffer`
  runs for a CAI v3 ``stream`` or a DLPack consumer stream: the default hook
  of :mod:`gpucx.mem.buffer` calls it when a driver is present (``buffer``
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
    "driver",
    "set_driver",
    "problem",
    "as_stream",
    "prepare",
    "leave",
    "htod_start",
    "event_wait",
    "destroy_streams",
    "door",
    "ready",
    "sync_stream",
    "device_of",
    "current_device",
    "on_device",
    "enter",
    "check",
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
    global _driver, _driver_problem, _sole
    previous = (_driver, _driver_problem)
    _driver = drv
    _driver_problem = problem_text
    _sole = None
    _events.forget()
    return previous


def restore_driver(previous: Any) -> None:
    """Undo :func:`set_driver` with the value it returned."""
    global _driver, _driver_problem, _sole
    _driver, _driver_problem = previous
    _sole = None
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
    synchronize: :func:`prepare` (the :class:`door`, :func:`ready`) waits
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
        if active is not None and drv.device_count() == 1 and active(0):
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


def _make_current(drv: Any, ptr: int, device: int) -> bool:
    """Make the owner of ``ptr`` current; True when a context was pushed."""
    return _enter(drv, ptr, device)[0]


def enter(ptr: int, device: int = -1) -> bool:
    """Make the context owning ``ptr`` (or ``device``'s primary) current.

    Returns True when a context was pushed: pass it to :func:`leave`.

    Raises
    ------
    gpucx.UnsupportedError
        Without a driver.
    """
    return _make_current(_need_driver("device"), ptr, device)


def on_device(device: int) -> Any:
    """Context manager: ``device``'s primary context current inside.

    Raises
    ------
    gpucx.UnsupportedError
        Without a driver.
    ValueError
        For a device ordinal this host does not have.
    """
    return _OnDevice(device)


class _OnDevice:
    __slots__ = ("_device", "_pushed")

    def __init__(self, device: int):
        drv = _need_driver("device")
        count = drv.device_count()
        if not _is_int(device) or not 0 <= device < count:
            raise ValueError(f"device={device!r}: this host has {count} CUDA device(s)")
        self._device = device
        self._pushed = False

    def __enter__(self) -> int:
        self._pushed = _make_current(driver(), 0, self._device)
        return self._device

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            driver().pop()


def prepare(
    engine: Any,
    ptr: Any,
    memory_type: int,
    stream: Any,
    what: str,
    keep: Any = None,
) -> bool:
    """Get ready to post an operation on ``ptr``; call before posting.

    For CUDA memory: check that the worker's context can move it, make the
    owning device current.  For a ``stream``: wait, progressing the worker,
    until the work queued on it before the call has finished.

    Parameters
    ----------
    engine : gpucx._engine.Engine
        The worker's progress engine: its context says what it can move,
        and it is progressed while waiting for the stream.
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
        ``defer=True``: when it is a :class:`~gpucx.mem.buffer.Deferred`,
        the producer's stream it carries (CAI v3 ``stream``, DLPack
        consumer stream) is waited for here too, in the owner's context
        this call made current, before the operation is posted.

    Driver calls for device memory whose owner is current and streams that
    are idle: one ``cuCtxGetCurrent``, one ``cuPointerGetAttributes``
    (none on a one-device host with its primary context current, see
    :func:`_enter`) and one ``cuStreamQuery`` per stream to wait for.

    Returns
    -------
    bool
        True when a context was pushed: call :func:`leave` after posting.

    Raises
    ------
    gpucx.UnsupportedError
        CUDA memory on a context that cannot move it (the message names
        what is missing), or a stream without a CUDA driver.
    TypeError, ValueError
        For a bad ``stream`` (see :func:`as_stream`).
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


def copy_in(
    engine: Any,
    dst: Any,
    memory_type: int,
    src: Any,
    nbytes: int,
    stream: Any,
    what: str,
    keep: Any = None,
) -> None:
    """Copy ``nbytes`` of host memory at ``src`` into CUDA memory at ``dst``.

    Used where gpucx itself must deliver bytes UCX already received into host
    memory (an eager active message) to a device buffer: :func:`prepare`
    (capability, device, stream), then ``cuMemcpy``, which returns once the
    bytes are in device memory.

    Raises
    ------
    gpucx.UnsupportedError
        As for :func:`prepare`.
    """
    pushed = prepare(engine, dst, memory_type, stream, what, keep)
    try:
        ffi = _ffi()
        driver().memcpy(
            int(ffi.cast("uintptr_t", dst)), int(ffi.cast("uintptr_t", src)), nbytes
        )
    finally:
        leave(pushed)


def leave(pushed: bool) -> None:
    """Undo what :func:`prepare` made current (when it pushed a context)."""
    if pushed:
        driver().pop()


def htod_start(
    dst: int, src: int, nbytes: int, streams: dict, after: tuple = ()
) -> tuple[int, int]:
    """Queue a copy of ``nbytes`` of page-locked host memory at ``src`` into
    device memory at ``dst``; return ``(ctx, event)``, the event recorded
    after the copy in ``dst``'s owner context ``ctx`` (wait for it with
    :func:`event_wait`).

    The copy runs on ``streams[ctx]``, a non-blocking stream of the caller's
    (made here on first use; the caller destroys it), after the work queued
    on each stream of ``after`` now (``cuStreamWaitEvent``: stream order
    without the host waiting).  The owner context is made current for the
    calls and left as it was.

    Raises
    ------
    gpucx.UnsupportedError
        Without a usable CUDA driver.
    DriverError
        If the driver refuses a call (nothing is left queued or pushed).
    """
    drv = _need_driver("copy to device memory")
    pushed, ctx = _enter(drv, dst, -1)
    try:
        s = streams.get(ctx)
        if s is None:
            s = streams[ctx] = drv.stream_create()
        for h in after:
            ev = _events.take(drv, ctx)
            try:
                drv.event_record(ev, h)
                drv.stream_wait_event(s, ev)
            finally:
                _events.give(ctx, ev)
        drv.memcpy_htod_async(dst, src, nbytes, s)
        ev = _events.take(drv, ctx)
        try:
            drv.event_record(ev, s)
        except BaseException:
            drv.event_destroy(ev)
            raise
    finally:
        if pushed:
            drv.pop()
    return ctx, ev


def event_wait(ctx: int, event: int, progress: Callable[[], object]) -> None:
    """Poll ``event`` (from :func:`htod_start`, :func:`wait_stream`) until
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
    :func:`htod_start` made, gpucx's CUDA IPC copy streams), each in its
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
    """The one door for posting an operation on CUDA memory, or one given a
    ``stream``: ``with door(engine, ptr, memory_type, stream, what):`` runs
    :func:`prepare` on entry and :func:`leave` on exit, whatever happens in
    between, so that a failure can never leave a device context pushed.

    Operations test ``mt != HOST or stream is not None`` first and post host
    memory without it: the host fast path pays for no context manager.
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
        self._pushed = prepare(*self._args)

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            driver().pop()


def ready(
    engine: Any, ptr: Any, memory_type: int, stream: Any, what: str, keep: Any = None
) -> None:
    """Pass the :class:`door` without posting through it: check that the
    context can move ``ptr``'s memory and wait for ``stream`` (and the
    stream a :class:`~gpucx.mem.buffer.Deferred` ``keep`` carries), leaving
    no context pushed (for operations that post later, or not to UCX)."""
    if prepare(engine, ptr, memory_type, stream, what, keep):
        driver().pop()


def _ffi() -> Any:
    from .._lib import ffi

    return ffi
