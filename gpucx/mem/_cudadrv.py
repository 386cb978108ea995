"""The CUDA driver ABI: :class:`Driver`, the ctypes bindings of the driver
API functions gpucx uses (``libcuda.so.1``), each failure mapped to a
:class:`DriverError` naming the call and the ``CUresult``, and the cuda.h
values they need.

Nothing here decides anything: which driver is loaded, contexts, streams
and the CUDA door are :mod:`gpucx.mem.cuda`'s, which re-exports these names
(``gpucx.mem.cuda.Driver``, ``DriverError``...).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .memtype import HOST_INT as _HOST
from .memtype import MemoryType

#: ``CU_STREAM_LEGACY``: the legacy default stream (CAI and DLPack value 1).
LEGACY_STREAM = 1
#: ``CU_STREAM_PER_THREAD``: the per-thread default stream (value 2).
PER_THREAD_STREAM = 2

# cuda.h values (CUresult, CUpointer_attribute, CUmemorytype, event flags).
_SUCCESS = 0
_NOT_READY = 600
_ATTR_CONTEXT = 1
_ATTR_MEMORY_TYPE = 2
_ATTR_IS_MANAGED = 8
_ATTR_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2
_CU_MEMORYTYPE_UNIFIED = 4
_EVENT_DISABLE_TIMING = 0x2


class DriverError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the error).

    Attributes
    ----------
    code : int
        The ``CUresult`` (0 when unknown).
    """

    code = 0


#: ``CU_IPC_HANDLE_SIZE``: bytes of a ``CUipcMemHandle``.
IPC_HANDLE_SIZE = 64
#: ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``.
IPC_LAZY_ENABLE_PEER_ACCESS = 0x1
#: ``CU_MEMHOSTALLOC_PORTABLE``: page-locked for every CUDA context.
HOSTALLOC_PORTABLE = 0x1


class IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class Driver:
    """The CUDA driver API functions gpucx uses, over ``libcuda.so.1``.

    Every method raises :class:`DriverError` naming the driver call and
    the ``CUresult`` name when the call fails.

    Parameters
    ----------
    lib : ctypes.CDLL
        The loaded driver library (``cuInit`` already called).
    """

    def __init__(self, lib: Any):
        self._lib = lib
        self._primary: dict[int, int] = {}
        self._lock = threading.Lock()
        vp = ctypes.c_void_p
        u = ctypes.c_uint
        i = ctypes.c_int
        sig = {
            "cuDriverGetVersion": [ctypes.POINTER(i)],
            "cuDeviceGetCount": [ctypes.POINTER(i)],
            "cuDeviceGet": [ctypes.POINTER(i), i],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
            "cuDevicePrimaryCtxGetState": [i, ctypes.POINTER(u), ctypes.POINTER(i)],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuCtxGetDevice": [ctypes.POINTER(i)],
            "cuPointerGetAttributes": [u, ctypes.POINTER(i), ctypes.POINTER(vp), vp],
            "cuStreamQuery": [vp],
            "cuEventCreate": [ctypes.POINTER(vp), u],
            "cuEventRecord": [vp, vp],
            "cuEventQuery": [vp],
            "cuEventSynchronize": [vp],
            "cuEventDestroy_v2": [vp],
            "cuMemcpy": [vp, vp, ctypes.c_size_t],
            "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
            # Copy figures of gpucx.bench.limits: allocations, streams, timing.
            "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
            "cuMemFree_v2": [ctypes.c_uint64],
            "cuMemAllocHost_v2": [ctypes.POINTER(vp), ctypes.c_size_t],
            "cuMemFreeHost": [vp],
            "cuMemcpyAsync": [vp, vp, ctypes.c_size_t, vp],
            "cuStreamCreate": [ctypes.POINTER(vp), u],
            "cuStreamDestroy_v2": [vp],
            "cuStreamSynchronize": [vp],
            "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), vp, vp],
            # gpucx's own same-host RMA path (gpucx.mem.ipc, gpucx.ops.ipc).
            "cuMemGetAddressRange_v2": [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ],
            "cuIpcGetMemHandle": [ctypes.POINTER(IpcMemHandle), ctypes.c_uint64],
            "cuIpcOpenMemHandle_v2": [
                ctypes.POINTER(ctypes.c_uint64),
                IpcMemHandle,
                u,
            ],
            "cuIpcCloseMemHandle": [ctypes.c_uint64],
            "cuStreamWaitEvent": [vp, vp, u],
            # Receiver-side staging of host payloads into device memory
            # (gpucx.ops._staging): pinned bounce buffers and their copy.
            "cuMemHostAlloc": [ctypes.POINTER(vp), ctypes.c_size_t, u],
            "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, vp, ctypes.c_size_t, vp],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = i

    @classmethod
    def load(cls, name: str = "libcuda.so.1") -> Driver:
        """Load the driver library ``name`` and call ``cuInit(0)``.

        Raises
        ------
        OSError
            If the library is missing.
        DriverError
            If ``cuInit`` fails (no device, driver/library mismatch).
        """
        lib = ctypes.CDLL(name)
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuInit.restype = ctypes.c_int
        drv = cls(lib)
        drv._check(lib.cuInit(0), "cuInit")
        return drv

    def _check(self, rc: int, what: str) -> None:
        if rc != _SUCCESS:
            name = ctypes.c_char_p()
            if self._lib.cuGetErrorName(rc, ctypes.byref(name)) == _SUCCESS:
                text = (name.value or b"").decode()
            else:
                text = f"CUresult {rc}"
            err = DriverError(f"{what}: {text}")
            err.code = rc
            raise err

    def version(self) -> int:
        """``cuDriverGetVersion`` (e.g. 12040 for CUDA 12.4)."""
        out = ctypes.c_int()
        self._check(
            self._lib.cuDriverGetVersion(ctypes.byref(out)), "cuDriverGetVersion"
        )
        return out.value

    def device_count(self) -> int:
        """Number of CUDA devices (``cuDeviceGetCount``)."""
        out = ctypes.c_int()
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(out)), "cuDeviceGetCount")
        return out.value

    def pointer(self, ptr: int) -> tuple[int, int, int]:
        """``(memory_type, device, context)`` of an address.

        ``memory_type`` is a :class:`MemoryType` value (``HOST`` for memory
        the driver does not know), ``device`` the ordinal (-1 for host) and
        ``context`` the owning ``CUcontext`` (0 for host).
        """
        attrs = (ctypes.c_int * 4)(
            _ATTR_MEMORY_TYPE, _ATTR_IS_MANAGED, _ATTR_DEVICE_ORDINAL, _ATTR_CONTEXT
        )
        mtype, managed, ordinal = ctypes.c_uint(), ctypes.c_uint64(), ctypes.c_int(-1)
        ctx = ctypes.c_void_p()
        data = (ctypes.c_void_p * 4)(
            ctypes.addressof(mtype),
            ctypes.addressof(managed),
            ctypes.addressof(ordinal),
            ctypes.addressof(ctx),
        )
        self._check(
            self._lib.cuPointerGetAttributes(4, attrs, data, ctypes.c_void_p(ptr)),
            "cuPointerGetAttributes",
        )
        if managed.value:
            return int(MemoryType.CUDA_MANAGED), ordinal.value, ctx.value or 0
        if mtype.value in (_CU_MEMORYTYPE_DEVICE, _CU_MEMORYTYPE_UNIFIED):
            return int(MemoryType.CUDA), ordinal.value, ctx.value or 0
        return _HOST, -1, 0

    def current_context(self) -> int:
        """The calling thread's current ``CUcontext`` (0 for none)."""
        out = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(out)), "cuCtxGetCurrent")
        return out.value or 0

    def context_device(self) -> int:
        """Ordinal of the current context's device (``cuCtxGetDevice``)."""
        out = ctypes.c_int()
        self._check(self._lib.cuCtxGetDevice(ctypes.byref(out)), "cuCtxGetDevice")
        return out.value

    def primary_context(self, device: int) -> int:
        """The device's primary context, retained once for the process."""
        with self._lock:
            ctx = self._primary.get(device)
            if ctx is None:
                dev = ctypes.c_int()
                self._check(
                    self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet"
                )
                out = ctypes.c_void_p()
                self._check(
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(out), dev.value),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = self._primary[device] = out.value or 0
            return ctx

    def primary_active(self, device: int) -> bool:
        """Whether the device's primary context is active
        (``cuDevicePrimaryCtxGetState``); creates nothing."""
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        flags, active = ctypes.c_uint(), ctypes.c_int()
        self._check(
            self._lib.cuDevicePrimaryCtxGetState(
                dev.value, ctypes.byref(flags), ctypes.byref(active)
            ),
            "cuDevicePrimaryCtxGetState",
        )
        return bool(active.value)

    def set_current(self, ctx: int) -> None:
        """``cuCtxSetCurrent``."""
        self._check(self._lib.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")

    def push(self, ctx: int) -> None:
        """``cuCtxPushCurrent``."""
        self._check(
            self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent"
        )

    def pop(self) -> None:
        """``cuCtxPopCurrent``."""
        out = ctypes.c_void_p()
        self._check(self._lib.cuCtxPopCurrent_v2(ctypes.byref(out)), "cuCtxPopCurrent")

    def stream_query(self, stream: int) -> bool:
        """Whether all the work queued on ``stream`` has finished
        (``cuStreamQuery``: no wait, no work queued).  False when work is
        pending, and also when the driver refuses the query: callers then
        take the event path, which reports such a stream's error."""
        return self._lib.cuStreamQuery(ctypes.c_void_p(stream)) == 0

    def event_create(self) -> int:
        """A new event without timing (``cuEventCreate``)."""
        out = ctypes.c_void_p()
        self._check(
            self._lib.cuEventCreate(ctypes.byref(out), _EVENT_DISABLE_TIMING),
            "cuEventCreate",
        )
        return out.value or 0

    def event_record(self, event: int, stream: int) -> None:
        """``cuEventRecord(event, stream)``."""
        self._check(
            self._lib.cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)),
            "cuEventRecord",
        )

    def event_query(self, event: int) -> bool:
        """Whether the work before the event has finished (``cuEventQuery``)."""
        rc = self._lib.cuEventQuery(ctypes.c_void_p(event))
        if rc == _NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        """Block until the event has completed (``cuEventSynchronize``)."""
        self._check(
            self._lib.cuEventSynchronize(ctypes.c_void_p(event)), "cuEventSynchronize"
        )

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy between any two addresses (unified addressing), returning
        once the bytes are in ``dst`` (``cuMemcpy``)."""
        self._check(
            self._lib.cuMemcpy(
                ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes)
            ),
            "cuMemcpy",
        )

    def event_destroy(self, event: int) -> None:
        """``cuEventDestroy``."""
        self._check(
            self._lib.cuEventDestroy_v2(ctypes.c_void_p(event)), "cuEventDestroy"
        )

    # -- CUDA IPC and stream order (gpucx's own same-host RMA path) ------------

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation holding ``ptr``
        (``cuMemGetAddressRange``)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._lib.cuMemGetAddressRange_v2(
                ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
            ),
            "cuMemGetAddressRange",
        )
        return base.value, size.value

    def ipc_get_handle(self, base: int) -> bytes:
        """The 64-byte ``CUipcMemHandle`` of the allocation at ``base``
        (``cuIpcGetMemHandle``)."""
        h = IpcMemHandle()
        self._check(
            self._lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base)),
            "cuIpcGetMemHandle",
        )
        # All 64 bytes (the field's .value would stop at the first NUL).
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_SIZE)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation in the current context
        (``cuIpcOpenMemHandle`` with ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``);
        returns its address here."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise ValueError(f"a CUDA IPC handle is 64 bytes, not {len(handle)}")
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
        out = ctypes.c_uint64()
        self._check(
            self._lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(out), h, IPC_LAZY_ENABLE_PEER_ACCESS
            ),
            "cuIpcOpenMemHandle",
        )
        return out.value

    def ipc_close(self, ptr: int) -> None:
        """Unmap what :meth:`ipc_open` mapped (``cuIpcCloseMemHandle``)."""
        self._check(
            self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle"
        )

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make work queued on ``stream`` after this call wait for ``event``
        (``cuStreamWaitEvent``); the host does not wait."""
        self._check(
            self._lib.cuStreamWaitEvent(
                ctypes.c_void_p(stream), ctypes.c_void_p(event), 0
            ),
            "cuStreamWaitEvent",
        )

    # -- copies timed on a stream (gpucx.bench.limits) -------------------------

    def mem_alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory in the current context (``cuMemAlloc``)."""
        out = ctypes.c_uint64()
        self._check(
            self._lib.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(nbytes)),
            "cuMemAlloc",
        )
        return out.value

    def mem_free(self, ptr: int) -> None:
        """Free what :meth:`mem_alloc` returned (``cuMemFree``)."""
        self._check(self._lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")

    def mem_alloc_host(self, nbytes: int) -> int:
        """``nbytes`` of page-locked host memory (``cuMemAllocHost``)."""
        out = ctypes.c_void_p()
        self._check(
            self._lib.cuMemAllocHost_v2(ctypes.byref(out), ctypes.c_size_t(nbytes)),
            "cuMemAllocHost",
        )
        return out.value or 0

    def mem_free_host(self, ptr: int) -> None:
        """Free what :meth:`mem_alloc_host` returned (``cuMemFreeHost``)."""
        self._check(self._lib.cuMemFreeHost(ctypes.c_void_p(ptr)), "cuMemFreeHost")

    def mem_host_alloc(self, nbytes: int, flags: int = 0) -> int:
        """``nbytes`` of page-locked host memory (``cuMemHostAlloc``; free
        with :meth:`mem_free_host`).  ``flags``: ``CU_MEMHOSTALLOC_*``
        (:data:`HOSTALLOC_PORTABLE`: pinned for every context)."""
        out = ctypes.c_void_p()
        self._check(
            self._lib.cuMemHostAlloc(
                ctypes.byref(out), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)
            ),
            "cuMemHostAlloc",
        )
        return out.value or 0

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of host memory at ``src`` into device memory at
        ``dst`` on ``stream`` (``cuMemcpyHtoDAsync``: asynchronous to the
        host when ``src`` is page-locked)."""
        self._check(
            self._lib.cuMemcpyHtoDAsync_v2(
                ctypes.c_uint64(dst),
                ctypes.c_void_p(src),
                ctypes.c_size_t(nbytes),
                ctypes.c_void_p(stream),
            ),
            "cuMemcpyHtoDAsync",
        )

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy between any two addresses on ``stream``
        (``cuMemcpyAsync``, unified addressing)."""
        self._check(
            self._lib.cuMemcpyAsync(
                ctypes.c_void_p(dst),
                ctypes.c_void_p(src),
                ctypes.c_size_t(nbytes),
                ctypes.c_void_p(stream),
            ),
            "cuMemcpyAsync",
        )

    def stream_create(self) -> int:
        """A new stream that does not wait for the legacy default stream
        (``cuStreamCreate``, ``CU_STREAM_NON_BLOCKING``)."""
        out = ctypes.c_void_p()
        self._check(
            self._lib.cuStreamCreate(ctypes.byref(out), 0x1),  # NON_BLOCKING
            "cuStreamCreate",
        )
        return out.value or 0

    def stream_destroy(self, stream: int) -> None:
        """``cuStreamDestroy``."""
        self._check(
            self._lib.cuStreamDestroy_v2(ctypes.c_void_p(stream)), "cuStreamDestroy"
        )

    def stream_synchronize(self, stream: int) -> None:
        """Block until the work queued on ``stream`` has finished."""
        self._check(
            self._lib.cuStreamSynchronize(ctypes.c_void_p(stream)),
            "cuStreamSynchronize",
        )

    def timing_event_create(self) -> int:
        """A new event that records a time stamp (``cuEventCreate`` with
        ``CU_EVENT_DEFAULT``), for :meth:`event_elapsed_ms`."""
        out = ctypes.c_void_p()
        self._check(
            self._lib.cuEventCreate(ctypes.byref(out), 0x0),  # CU_EVENT_DEFAULT
            "cuEventCreate",
        )
        return out.value or 0

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between two completed timing events
        (``cuEventElapsedTime``)."""
        out = ctypes.c_float()
        self._check(
            self._lib.cuEventElapsedTime(
                ctypes.byref(out), ctypes.c_void_p(start), ctypes.c_void_p(end)
            ),
            "cuEventElapsedTime",
        )
        return float(out.value)
