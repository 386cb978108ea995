"""CUDA IPC for gpucx's own same-host RMA path.

UCX 1.20 and 1.21 move ``put``/``get`` between host and GPU memory by
software emulation (about 1 GB/s, and the target must progress); gpucx
instead copies with the copy engines into the owner's allocation, mapped
here with CUDA IPC (:mod:`gpucx.ops.ipc` decides when).  This module is the
memory side of that path:

* :func:`export` -- the CUDA IPC block (:class:`~gpucx.mem.remote.CudaIpc`)
  a CUDA region's token carries: the handle of the allocation holding it
  (``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``), the region's offset in
  it, and the owner's host identity (boot id, pid namespace, pid -- the
  identity gpucx's worker addresses carry, :mod:`gpucx._address`).
* :func:`mapping` -- the allocation opened on a :class:`RemoteKey`, once,
  lazily (``cuIpcOpenMemHandle`` with lazy peer access, in the key's device
  context), or None with the reason kept on the key when it cannot be
  opened (another host or pid namespace, the driver refuses): the caller
  then uses UCX.
* :class:`Copy` -- one copy-engine copy in flight on a mapping: an event
  recorded after it; its completion slot turns ``UCS_OK`` when the event
  has fired.  :meth:`Mapping.close` (run by the key's close) waits for the
  copies still in flight, then closes the handle (``cuIpcCloseMemHandle``).
"""

from __future__ import annotations

import os
from typing import Any

from .. import _address
from .._lib import lib
from . import cuda as _cuda
from .memtype import MemoryType
from .remote import CudaIpc

__all__ = ["export", "mapping", "is_local", "Mapping", "Copy", "OPEN", "UNOPENED"]

#: :attr:`RemoteKey.cuda_ipc` of a key whose handle is not opened yet.
UNOPENED = "unopened"
#: :attr:`RemoteKey.cuda_ipc` of a key whose handle is open.
OPEN = "open"

_INPROGRESS = lib.UCS_INPROGRESS
_OK = lib.UCS_OK
_IO_ERROR = lib.UCS_ERR_IO_ERROR


def export(ptr: int, nbytes: int, memory_type: MemoryType) -> CudaIpc | None:
    """The CUDA IPC block for a region of ``nbytes`` at ``ptr``, or None
    when there is none to give: not plain device memory (managed memory
    has no IPC handle), no driver with IPC, or memory the driver cannot
    export (pool and VMM allocations): peers then use UCX alone."""
    if memory_type != MemoryType.CUDA:
        return None
    drv = _cuda.driver()
    if drv is None or not hasattr(drv, "ipc_get_handle"):
        return None
    try:
        with _cuda.device_context(ptr=ptr):
            base, size = drv.address_range(ptr)
            handle = drv.ipc_get_handle(base)
    except _cuda.DriverError:
        return None
    if not (base <= ptr and ptr + nbytes <= base + size):
        return None
    me = _address.own_identity()
    return CudaIpc(handle, ptr - base, size, me.boot_id, me.pidns, me.pid)


def is_local(ipc: CudaIpc) -> str | None:
    """None when ``ipc`` was made by another process of this host and pid
    namespace (its handle may open here); otherwise why not."""
    ident = _address.Identity(ipc.pid, 0, ipc.boot_id, ipc.pidns)
    if not _address.is_local(ident):
        return "the owner is on another host or in another pid namespace"
    if ipc.pid == os.getpid():
        # CUDA refuses to open a handle in the process that made it.
        return "the owner is this process"
    return None


class Copy:
    """One copy-engine copy in flight on a :class:`Mapping`.

    Attributes
    ----------
    slot : cdata
        A ``gpucx_slot_t`` whose status is ``UCS_INPROGRESS`` until the
        event fires (then ``UCS_OK``; ``UCS_ERR_IO_ERROR`` if the driver
        reports an error for it).
    """

    __slots__ = ("slot", "event", "ctx", "mapping", "error")

    def __init__(self, slot: Any, event: int, ctx: int, mapping: Mapping):
        self.slot = slot
        self.event = event
        self.ctx = ctx
        self.mapping = mapping
        self.error: str | None = None
        slot.status = _INPROGRESS
        mapping.copies.append(self)

    def poll(self) -> bool:
        """True when the copy has finished (query the event once)."""
        if self.slot.status != _INPROGRESS:
            return True
        try:
            fired = _cuda.driver().event_query(self.event)
        except _cuda.DriverError as exc:
            self._end(_IO_ERROR, str(exc))
            return True
        if fired:
            self._end(_OK)
        return fired

    def wait(self) -> None:
        """Block until the copy has finished (``cuEventSynchronize``): the
        copy engine needs nobody's progress, so this always returns."""
        if self.slot.status != _INPROGRESS:
            return
        try:
            _cuda.driver().event_synchronize(self.event)
        except _cuda.DriverError as exc:
            self._end(_IO_ERROR, str(exc))
            return
        self._end(_OK)

    def _end(self, status: int, error: str | None = None) -> None:
        self.error = error
        if error is None:
            _cuda._events.give(self.ctx, self.event)
        self.slot.status = status
        try:
            self.mapping.copies.remove(self)
        except ValueError:
            pass  # already removed by a mapping's close


class Mapping:
    """A peer's allocation mapped into this process (one opened handle).

    Attributes
    ----------
    base : int
        Address here of the allocation's first byte.
    ptr : int
        Address here of the region's first byte (``base`` + the offset).
    ctx : int
        The context it was opened in (copies run in it).
    device : int
        That context's device.
    copies : list of Copy
        Copies on it still in flight.
    """

    __slots__ = ("base", "ptr", "ctx", "device", "copies")

    def __init__(self, base: int, ptr: int, ctx: int, device: int):
        self.base = base
        self.ptr = ptr
        self.ctx = ctx
        self.device = device
        self.copies: list[Copy] = []

    def close(self) -> None:
        """Wait for the copies still in flight, then close the handle."""
        drv = _cuda.driver()
        for copy in list(self.copies):
            copy.wait()
        self.copies.clear()
        if drv is None:
            return
        with _cuda.device_context(device=self.device):
            try:
                drv.ipc_close(self.base)
            except _cuda.DriverError:
                pass  # nothing to undo: the mapping is gone with the driver's error


def mapping(rkey: Any) -> Mapping | None:
    """The key's remote allocation mapped here, opened at the first call;
    None (and the reason in ``rkey.cuda_ipc``) when it cannot be opened.

    Raises
    ------
    ValueError
        When the handle opens but names an allocation smaller than the
        token says (a forged or corrupted token): the mapping is closed
        again and the key never uses the path; the put or get is refused.
    """
    state = rkey._ipc
    if type(state) is Mapping:
        return state
    if state != UNOPENED:
        return None
    ipc = rkey.remote.ipc
    why = is_local(ipc)
    drv = _cuda.driver()
    if why is None and (drv is None or not hasattr(drv, "ipc_open")):
        why = "no CUDA driver with IPC here"
    if why is not None:
        rkey._ipc = why
        return None
    device = rkey._ipc_device
    if device is None:
        device = _cuda.current_device()
    with _cuda.device_context(device=device) as ctx:
        try:
            base = drv.ipc_open(ipc.handle)
        except _cuda.DriverError as exc:
            # Another container, no peer access, a handle of a freed
            # allocation: UCX can still serve the key.
            rkey._ipc = f"cannot open the CUDA IPC handle ({exc})"
            return None
        try:
            got_base, size = drv.address_range(base)
        except _cuda.DriverError:
            got_base, size = base, ipc.alloc_size
        if got_base != base or size < ipc.offset + rkey.remote.nbytes:
            drv.ipc_close(base)
            rkey._ipc = "the CUDA IPC handle names a smaller allocation"
            raise ValueError(
                f"remote-memory token: its CUDA IPC handle maps {size} bytes, "
                f"the token claims a region at offset {ipc.offset} of "
                f"{rkey.remote.nbytes} bytes (a forged or corrupted token)"
            )
    m = Mapping(base, base + ipc.offset, ctx, device)
    rkey._ipc = m
    return m
