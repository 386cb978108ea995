"""gpucx's own same-host path for put and get on CUDA regions.

UCX 1.20 and 1.21 have no fast protocol for ``put``/``get`` between host
and GPU memory (software emulation, about 1 GB/s, progressed by the
target); UCX 1.22's pipeline is a rendezvous the target must progress too.
When a region's token carries a CUDA IPC handle (:mod:`gpucx.mem.ipc`) and
its owner is a process of this host, gpucx copies itself:

* the peer maps the owner's allocation once, at the first put or get that
  can use it (``cuIpcOpenMemHandle``), and keeps it with the
  :class:`~gpucx.RemoteKey` until the key closes;
* ``put`` from host memory, ``get`` into host memory and ``get`` into CUDA
  memory (on the device the handle was opened on) become one
  ``cuMemcpyAsync`` on a non-blocking stream gpucx owns (one per worker
  and context), followed by an event; the :class:`~gpucx.Request`
  completes when the event has fired.  One-sided: the owner need not
  progress;
* ``stream=`` (and a CAI v3 / DLPack producer stream of a local CUDA
  buffer) orders the copy without blocking the host: an event recorded on
  that stream, waited for by gpucx's stream (``cuStreamWaitEvent``);
* :meth:`Endpoint.flush` / :meth:`Worker.flush` wait for these copies as
  for UCX's; ``notify=`` sends its notification once the copy finished.

Everything else (GPU-to-GPU put, keys without a handle, owners on another
host, a handle the driver cannot open, ``GPUCX_CUDA_IPC_RMA=0``) stays
with UCX.  docs/rma.md, "gpucx's own path for CUDA regions".
"""

from __future__ import annotations

import threading
from typing import Any

from .. import protocols as _protocols
from .._engine import INPROGRESS, new_slot
from .._lib import ffi, lib
from ..mem import cuda as _cuda
from ..mem import ipc as _ipc
from ..mem.memtype import HOST_INT as _HOST
from ..mem.memtype import MemoryType
from ..request import Request

__all__ = [
    "route",
    "would_route",
    "takes",
    "post",
    "drain",
    "in_flight",
    "poll",
    "CopyRequest",
    "DESCRIPTION",
]

_CUDA = int(MemoryType.CUDA)
_OK = lib.UCS_OK
#: How :mod:`gpucx.protocols` names this path.
DESCRIPTION = "gpucx cuda_ipc copy"
_ITEMS = ffi.typeof("gpucx_xfer_item_t[]")
_OP = ffi.typeof("gpucx_notify_op_t *")


def route(ep, rkey, mt: int, ptr: Any, is_get: bool) -> Any:
    """The :class:`~gpucx.mem.ipc.Mapping` to copy through, or None for UCX.

    Opens the key's handle at its first use (a failure to open is kept on
    the key and this returns None from then on).

    Raises
    ------
    ValueError
        A handle that maps less than its token claims (forged or corrupted
        token), see :func:`gpucx.mem.ipc.mapping`.
    """
    state = rkey._ipc
    if type(state) is str and state != _ipc.UNOPENED:
        return None
    if mt != _HOST and (mt != _CUDA or not is_get):
        return None  # GPU to GPU puts stay with UCX (CUDA IPC at full speed)
    if not ep.worker.context.cuda_ipc_rma:
        return None
    m = _ipc.mapping(rkey)
    if m is None:
        return None
    if not isinstance(ptr, int):
        ptr = int(ffi.cast("uintptr_t", ptr))
    if mt != _HOST and _cuda.device_of(ptr) != m.device:
        return None  # a device the handle was not opened on: UCX
    return m


def would_route(rkey, local_memory: str, op: str) -> bool:
    """Whether a ``put``/``get`` with this key and local memory type takes
    gpucx's own path, without opening anything (for gpucx.protocols): the
    key's handle is open or not tried yet, and the direction is one the
    path serves."""
    state = rkey._ipc
    if type(state) is str and state != _ipc.UNOPENED:
        return False
    if not rkey.endpoint.worker.context.cuda_ipc_rma:
        return False
    return local_memory == "host" or (local_memory == "cuda" and op == "get")


def takes(ep, op: str, local: str, remote: str, rkey) -> bool:
    """Whether gpucx's own path takes ``op`` ("put" or "get") with these
    memory types: with ``rkey``, for that key; without, for a key of ``ep``
    whose CUDA IPC handle is open.  What :func:`gpucx.protocols.protocol`
    asks before UCX's tables (registered with it as a hook at import: the
    protocols layer imports no operation)."""
    if op not in ("put", "get") or remote not in ("cuda", ""):
        return False
    if rkey is not None:
        return rkey.memory_type.name == "CUDA" and would_route(rkey, local, op)
    if not remote:
        return False
    for child in list(getattr(ep, "_children", ())):
        if getattr(child, "cuda_ipc", None) == "open" and would_route(child, local, op):
            return True
    return False


_protocols.set_own_route(takes)


class _CopyStreams:
    """A worker's copy streams (one non-blocking stream per context), the
    engine's ``copy_streams``."""

    __slots__ = ("engine", "streams", "lock")

    def __init__(self, e):
        self.engine = e
        self.streams: dict[int, int] = {}
        # Held while a copy request looks at its copy: with
        # thread_mode="multi" several threads progress the worker, and a
        # finished copy must turn its request final (and send its
        # notification) once.
        self.lock = threading.Lock()
        e.on_close.append(self.close)

    def close(self) -> None:
        """The worker closes: finish every copy, destroy the streams."""
        copies = self.engine.copies
        for req in list(copies):
            copy = req._copy
            if copy is not None:
                copy.wait()
        copies.clear()
        _cuda.destroy_streams(self.streams)


def _streams(e) -> _CopyStreams:
    cs = e.copy_streams
    if cs is None:
        cs = e.copy_streams = _CopyStreams(e)
    return cs


def post(
    ep,
    m,
    rkey,
    ptr: Any,
    n: int,
    raddr: int,
    is_get: bool,
    stream,
    keep,
    what: str,
    note: bytes | None = None,
) -> CopyRequest:
    """Queue the copy of a put or get on gpucx's stream; its request.

    ``note``: a put-with-notify's notification, sent once the copy
    finished.

    Raises
    ------
    gpucx.mem.cuda.DriverError
        If the driver refuses the copy (the request is not made).
    TypeError, ValueError
        For a bad ``stream`` (see :func:`gpucx.mem.cuda.as_stream`).
    """
    handle = None if stream is None else _cuda.as_stream(stream)
    held = keep.stream if type(keep) is _cuda.Deferred else None
    e = ep._engine
    if not isinstance(ptr, int):
        ptr = int(ffi.cast("uintptr_t", ptr))
    remote = m.ptr + (raddr - rkey.address)
    src, dst = (remote, ptr) if is_get else (ptr, remote)
    waits = [] if held is None else [held]
    if handle is not None and handle != held:
        waits.append(handle)
    # Stream order without blocking the host: gpucx's stream waits for what
    # is queued on the caller's streams now.  The mapping's context is the
    # device's primary, which device_context makes current.
    ctx = m.ctx
    with _cuda.device_context(device=m.device):
        ev = _cuda.copy_start(ctx, _streams(e).streams, dst, src, n, waits)
    copy = _ipc.Copy(new_slot(), ev, ctx, m)
    then = None
    if note is not None:

        def then():
            return _notify(ep, note)

    return CopyRequest(e, copy, keep, what, ep, then, rkey)


def _notify(ep, note: bytes):
    """Send a put-with-notify's notification (an endpoint flush, then the
    notify active message, as for UCX's puts): ``(slot, what to hold)``."""
    op = ffi.new(_OP)
    items = ffi.new(_ITEMS, 1)
    h = ep._h
    if h is None:
        op.slot.status = lib.UCS_ERR_CANCELED
    else:
        lib.gpucx_xfer_run(ep._engine.state, h, 0, items, 0, 1, note, len(note), op, 0)
    # C reads the notification when the flush completes: held until then.
    return ffi.addressof(op, "slot"), (op, note, items)


class CopyRequest(Request):
    """The :class:`~gpucx.Request` of a put or get gpucx copies itself.

    Done when the event recorded after the copy has fired (with
    ``notify=``: once the notification was sent too).  It cannot be
    canceled (the copy engine runs it to the end): :meth:`cancel` returns
    False, a ``wait`` that times out leaves it running.
    """

    __slots__ = ("_copy", "_then", "_lock")
    _cancelable = False

    def __init__(self, e, copy, keep, what, ep, then=None, holds=None):
        # The fields of Request, for a slot gpucx (not UCX) completes.
        self._slot = copy.slot
        self._engine = e
        self._keep = keep
        self._holds = holds
        self._what = what
        self._finish = None
        self._ep = ep
        self._nbytes = None
        self._state = 0
        self._value = None
        self._copy = copy
        self._then = then
        self._lock = _streams(e).lock
        e.pending.add(self)
        e.copies.append(self)

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<gpucx.Request {self._what} (cuda_ipc copy) {state}>"

    @property
    def protocol(self):
        """gpucx's own path (:data:`DESCRIPTION`) while the copy runs."""
        if self._state != 0:
            return None
        return _protocols.own_path(self._what, self._ep)

    def _advance(self) -> bool:
        """Look at the copy once; True when the slot is final."""
        if self._copy is None:
            return self._slot.status != INPROGRESS
        with self._lock:
            return self._advance_locked()

    def _advance_locked(self) -> bool:
        copy = self._copy
        if copy is None:  # another thread finished it meanwhile
            return self._slot.status != INPROGRESS
        if not copy.poll():
            return False
        then, self._then = self._then, None
        if copy.error is not None:
            self._value = copy.error
        elif then is not None and copy.slot.status == _OK:
            slot, held = then()
            self._keep = (*self._keep, held)
            self._slot = slot
            # Last: a thread that reads _copy unlocked (_advance) then
            # finds the notification's slot, not the copy's finished one.
            self._copy = None
            return slot.status != INPROGRESS
        self._copy = None
        return True

    def _complete(self) -> None:
        error = self._value if type(self._value) is str else None
        super()._complete()
        if error is not None and self._state == 2:
            self._value.args = (f"{self._what}: {error}",)

    def done(self) -> bool:
        if self._state:
            return True
        if not self._advance():
            e = self._engine
            if e.h is None:
                return False
            e.progress()
            if not self._advance():
                return False
        self._complete()
        return True

    def wait(
        self, timeout: float | None = None, on_timeout: str | None = None, ep=None
    ):
        """Progress the worker until the copy finished; return None.

        ``on_timeout`` and ``ep`` change nothing: the copy runs on the GPU
        from the peer's memory mapped here (CUDA IPC), which no endpoint
        close stops, so a passed deadline always leaves it going on.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first (the copy goes on).
        gpucx.UCXError
            ``UCS_ERR_IO_ERROR`` naming the driver's error for the copy.
        """
        if not self._state:
            e = self._engine
            if e.h is None:
                e.raise_closed()
            what = f"{self._what} (cuda_ipc copy)"
            e.wait_for(self.done, timeout, what, poll=True)
        if self._state == 1:
            return self._value
        raise self._value

    def __await__(self):
        return self._await().__await__()

    async def _await(self):
        import asyncio

        copy = self._copy
        if copy is not None and not self._state:
            # The event fires without any fd to wake the loop: wait for it
            # in a thread (cuEventSynchronize), not by polling the loop.
            await asyncio.get_running_loop().run_in_executor(
                None, _cuda.driver().event_synchronize, copy.event
            )
        if not self.done():
            from ..request import _awaiter

            return await _awaiter(self)
        return self.wait(0)


def poll(e) -> None:
    """Look at the worker's copies once (the engine's ``on_copies`` hook,
    which its progress calls while some are in flight): a finished copy's
    slot turns final, a put-with-notify sends its notification."""
    copies = e.copies
    for req in list(copies):
        if req._state or req._advance() or req._copy is None:
            try:
                copies.remove(req)
            except ValueError:
                pass  # taken by another thread progressing this worker (multi)


def in_flight(e, ep=None) -> list:
    """The copies in flight on the worker of engine ``e`` issued through
    ``ep`` (every endpoint when None): what a flush waits for first."""
    return [r for r in e.copies if ep is None or r.endpoint is ep]


def drain(e, ep=None, timeout: float | None = None) -> None:
    """Wait, progressing the worker of engine ``e``, until the copies issued
    through ``ep`` (every endpoint of the worker when None) finished: the
    part of a flush that is gpucx's own.

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` passes first.
    """
    mine = in_flight(e, ep)
    if not mine:
        return

    def finished() -> bool:
        nonlocal mine
        mine = [r for r in mine if not r._advance()]
        return not mine

    what = "flush (cuda_ipc copies)"
    e.wait_for(finished, timeout, what, poll=True)
