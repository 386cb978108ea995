"""Registered memory: :class:`MemoryRegion` (``ucp_mem_map``).

A region is memory UCX has mapped for remote access: existing memory
(:func:`register`, which holds the object alive while mapped) or memory UCX
allocates (:func:`allocate`).  Its :meth:`~MemoryRegion.remote` token lets a
peer put, get and run atomics on it.  Regions are children of their
:class:`~gpucx.Context`: closing the context unmaps every region.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any

import numpy

from .._handle import Handle, raise_closed
from .._internal import amo_exports, handle
from .._lib import ffi, lib
from ..errors import UnsupportedError, check
from . import cuda as _cuda
from . import ipc as _ipc
from .buffer import as_buffer
from .memtype import CUDA_TYPES, MemoryType
from .remote import RemoteMemory

__all__ = ["MemoryRegion", "register", "allocate"]

_UNSET = object()


class _Memory:
    """What the views of a region hold: the registered object, whose memory
    stays valid while a view exists even after the region is closed; for
    memory UCX allocated, the mapping itself, which a close leaves mapped
    until the last view is gone (see :meth:`MemoryRegion._release`)."""

    __slots__ = ("obj", "__weakref__")

    def __init__(self, obj):
        self.obj = obj


class _HostView:
    """Exports region memory to NumPy and keeps the memory alive."""

    __slots__ = ("__array_interface__", "_memory")

    def __init__(self, memory, address, readonly, typestr, shape):
        self._memory = memory
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": typestr,
            "data": (address, readonly),
        }


#: The open host regions each context allocated (``allocate``), by context:
#: ``register`` of memory inside one shares its mapping.
_host_allocations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MemoryRegion(Handle):
    """Memory mapped by UCX for remote access.

    Made by :meth:`Context.register` or :meth:`Context.allocate`; close it
    (or the context) to unmap.  Unmapping waits for nothing: peers holding
    a key to it must stop using it first (their later accesses fail or hit
    whatever the memory holds by then).

    Attributes
    ----------
    address : int
        Address of the first byte.
    nbytes : int
        Size in bytes.
    memory_type : MemoryType
        Where the memory lives.
    readonly : bool
        Registered read-only: the token forbids remote writes.
    obj : object or None
        The registered object (held while mapped); None for allocations.
    """

    def __init__(
        self,
        context,
        address,
        nbytes,
        memory_type,
        readonly,
        obj,
        alloc,
        within=None,
        h=None,
        own_map=None,
    ):
        self._init_handle()
        #: The ``ucp_mem_h`` (this region's own mapping, or the containing
        #: region's: ``own_map``).
        self._h = h
        # Parents close children newest first; a negative serial puts regions
        # after every worker, so operations into region memory are drained
        # (workers closed) before the memory is unmapped.
        self._serial = -self._serial
        self._context = context
        self.address = address
        self.nbytes = nbytes
        self.memory_type = memory_type
        self.readonly = readonly
        self.obj = obj
        self._alloc = alloc
        self._packed: bytes | None = None
        self._ipc_block: object = _UNSET  # the token's CUDA IPC block, once made
        self._memory_ref = None  # weakref to the _Memory views hold
        #: The allocated region whose mapping this one shares (register()
        #: of memory inside it), or None: it closes this one first and
        #: unmaps; this one's close unmaps nothing.
        self._within = within
        #: Whether ``_h`` is this region's own mapping (False when it shares
        #: the containing region's); by default, when it is in none.
        self._own_map = within is None if own_map is None else own_map
        (within if within is not None else context)._adopt(self)

    def __repr__(self) -> str:
        kind = "allocated" if self._alloc else "registered"
        if self._within is not None:
            kind += " (in an allocated region)"
        state = "closed" if self._h is None else f"{self.address:#x}+{self.nbytes}"
        return f"<gpucx.MemoryRegion {kind} {self.memory_type.name} {state}>"

    def ucx_rkey(self) -> bytes:
        """The bare packed UCX remote key of this region (``ucp_rkey_pack``),
        for a peer that does not use gpucx.

        Not what :meth:`Endpoint.unpack` takes: that is the self-describing
        :meth:`remote` token (address, size, memory type and this key).
        ``pack_rkey()`` is the older name of this method.

        Raises
        ------
        gpucx.ClosedError
            If the region is closed.
        """
        if self._h is None:
            raise_closed(self)
        if self._packed is None:
            out = ffi.new("void **")
            n = ffi.new("size_t *")
            ctx = self._context
            ctx_h = handle(ctx)
            if ctx_h is None:
                raise_closed(ctx)
            check(lib.gpucx_rkey_pack(ctx_h, self._h, out, n), "ucp_rkey_pack")
            try:
                packed = bytes(ffi.buffer(out[0], n[0]))
            finally:
                lib.gpucx_free(out[0])
            if not self.readonly:
                # Exported: gpucx's emulated atomics (gpucx.ops.atomic) may
                # reach this region from now until it is closed.
                check(
                    lib.gpucx_amo_export_add(
                        amo_exports(ctx),
                        id(self),
                        self.address,
                        self.nbytes,
                        1 if self.memory_type == MemoryType.HOST else 0,
                    ),
                    "export",
                )
            self._packed = packed
        return self._packed

    #: Older name of :meth:`ucx_rkey`.
    pack_rkey = ucx_rkey

    def remote(self) -> RemoteMemory:
        """The token a peer unpacks with :meth:`Endpoint.unpack`.

        The token of a CUDA region also carries the CUDA IPC handle of the
        allocation holding it and this process's host identity (made once,
        at the first call), so that a peer on this host can copy with the
        copy engines itself (docs/rma.md, "gpucx's own path for CUDA
        regions"); memory the driver cannot export gets a token without.

        Raises
        ------
        gpucx.ClosedError
            If the region is closed.
        """
        rkey = self.ucx_rkey()
        block = self._ipc_block
        if block is _UNSET:
            block = self._ipc_block = _ipc.export(
                self.address, self.nbytes, self.memory_type
            )
        return RemoteMemory(
            self.address,
            self.nbytes,
            self.memory_type,
            rkey,
            self.readonly,
            block,  # type: ignore[arg-type]
        )

    def as_array(self, dtype=numpy.uint8, shape=None):
        """A NumPy (host) or CuPy (CUDA) array viewing the region.

        The view keeps the memory alive: after :meth:`close` (or the
        context's close) it still reads and writes the region's memory,
        which is unmapped (memory UCX allocated) or released (the registered
        object) only once the last view is gone.  Peers cannot reach the
        memory of a closed region through gpucx's emulated atomics; what
        they reach by RMA is UCX's matter (docs/rma.md).

        Parameters
        ----------
        dtype : numpy dtype, optional
            Element type (default ``uint8``).
        shape : int or tuple of int, optional
            Default: as many elements as fit in the region.

        Raises
        ------
        ValueError
            If the shape needs more bytes than the region has, or the region
            size is not a multiple of the item size (without ``shape``).
        gpucx.UnsupportedError
            For device memory without CuPy, or memory types without a view.
        gpucx.ClosedError
            If the region is closed.
        """
        if self._h is None:
            raise_closed(self)
        dt = numpy.dtype(dtype)
        if shape is None:
            if self.nbytes % dt.itemsize:
                raise ValueError(
                    f"the region's {self.nbytes} bytes are not a whole number of "
                    f"{dt} items; pass shape="
                )
            shape = (self.nbytes // dt.itemsize,)
        elif isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(s) for s in shape)
        need = dt.itemsize * int(numpy.prod(shape, dtype=numpy.int64))
        if any(s < 0 for s in shape) or need > self.nbytes:
            raise ValueError(
                f"shape {shape} of {dt} needs {need} bytes; the region has "
                f"{self.nbytes}"
            )
        memory = self._memory_ref() if self._memory_ref is not None else None
        if memory is None:
            memory = _Memory(self.obj)
            self._memory_ref = weakref.ref(memory)
        if self.memory_type == MemoryType.HOST:
            view = _HostView(memory, self.address, self.readonly, dt.str, shape)
            return numpy.asarray(view)
        if self.memory_type in CUDA_TYPES:
            return _cupy_view(self, memory, dt, shape, need)
        from ..errors import UnsupportedError

        raise UnsupportedError(
            f"no array view for {self.memory_type.name} memory regions"
        )

    def _release(self) -> None:
        ctx = self._context
        ctx_h = handle(ctx)
        if ctx_h is not None:
            if self._packed is not None and not self.readonly:
                # No emulated atomic touches the memory once this returns.
                lib.gpucx_amo_export_remove(amo_exports(ctx), id(self))
            memory = self._memory_ref() if self._memory_ref is not None else None
            if not self._own_map:
                pass  # the mapping is the containing region's to unmap
            elif memory is not None and self.obj is None:
                # Memory UCX allocated, still viewed: unmap it when the last
                # view is gone (the context's cleanup waits for that too).
                ctx._unmap_when_gone(memory, self._h)
            else:
                lib.gpucx_mem_unmap(ctx_h, self._h)
        self.obj = None
        self._within = None


def _allocated_host_regions(ctx):
    """The open host regions ``ctx`` allocated (a weak set, made at the
    first)."""
    regions = _host_allocations.get(ctx)
    if regions is None:
        regions = _host_allocations[ctx] = weakref.WeakSet()
    return regions


def _containing(ctx, ptr: int, nbytes: int):
    """The open host region ``ctx`` allocated that holds ``[ptr, ptr+nbytes)``."""
    regions = _host_allocations.get(ctx)
    if not regions:
        return None
    for r in list(regions):
        if not r.closed and r.address <= ptr <= r.address + r.nbytes - nbytes:
            return r
    return None


def _cupy_view(region, memory, dt, shape, need):
    from ..errors import UnsupportedError

    try:
        import cupy
    except ImportError:
        raise UnsupportedError("viewing a CUDA region as an array needs CuPy") from None
    mem = cupy.cuda.UnownedMemory(region.address, need, memory)
    return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0))


def _map(ctx, ptr, nbytes: int, memory_type: int, alloc: bool, readonly=False):
    memh = ffi.new("ucp_mem_h *")
    addr = ffi.new("uint64_t *")
    length = ffi.new("size_t *")
    mtype = ffi.new("int *")
    st = lib.gpucx_mem_map(
        handle(ctx),
        ptr,
        nbytes,
        memory_type,
        1 if alloc else 0,
        1 if readonly else 0,
        memh,
        addr,
        length,
        mtype,
    )
    check(st, "ucp_mem_map")
    return memh[0], addr[0], length[0], mtype[0]


def register(ctx, obj, *, writable: bool = True) -> MemoryRegion:
    """Map existing memory for remote access (``ucp_mem_map``).

    Parameters
    ----------
    obj : object
        Anything :func:`gpucx.mem.as_buffer` accepts (host or device
        memory, one contiguous block, at least one byte).  It is held alive
        while the region is mapped.
    writable : bool, optional
        ``True`` (default): peers may put and run atomics; the memory must
        be writable.  ``False``: the token is read-only (gets only).

    Returns
    -------
    MemoryRegion

    Raises
    ------
    BufferError
        If ``obj`` is not contiguous, or read-only with ``writable=True``.
    ValueError
        If ``obj`` has no bytes.
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it (the message names
        what is missing; see :attr:`Context.cuda_problem`).
    gpucx.UCXError
        If UCX cannot map it (``UnsupportedError`` for a memory type no
        transport of this context handles).
    gpucx.ClosedError
        If the context is closed.
    """
    if ctx.closed:
        raise_closed(ctx)
    buf = as_buffer(obj, writable)
    if buf.nbytes == 0:
        raise ValueError("cannot register an empty buffer (0 bytes)")
    parent = None
    if buf.memory_type == MemoryType.HOST:
        parent = _containing(ctx, buf.ptr, buf.nbytes)
    if parent is not None and writable:
        # Memory UCX allocated (shared memory a peer on this host maps):
        # share its mapping, so the token carries the same keys and peers
        # write into it directly instead of through emulation.  Only a
        # writable registration shares the (writable) mapping: a read-only
        # one gets its own, mapped without remote write permission, and
        # still closes with the allocation, whose memory it is.
        memh, own = parent._h, False
    else:
        current: Any = nullcontext()
        if buf.memory_type in CUDA_TYPES:
            # UCX registers device memory in the current context: make the
            # owner of the pointer current.
            _cuda.check(ctx, "register")
            current = _cuda.device_context(ptr=buf.ptr)
        with current:
            memh, _addr, _len, _mt = _map(
                ctx,
                ffi.cast("void *", buf.ptr),
                buf.nbytes,
                int(buf.memory_type),
                False,
                not writable,
            )
        own = True
    region = MemoryRegion(
        ctx,
        buf.ptr,
        buf.nbytes,
        buf.memory_type,
        not writable,
        buf.owner,
        False,
        within=parent,
        h=memh,
        own_map=own,
    )
    return region


def allocate(
    ctx,
    nbytes: int,
    memory_type: MemoryType = MemoryType.HOST,
    *,
    device: int | None = None,
    allocator=None,
) -> MemoryRegion:
    """Allocate ``nbytes`` of ``memory_type`` and map them for remote access.

    Host memory is allocated by UCX (``UCP_MEM_MAP_ALLOCATE``).  CUDA memory
    (``CUDA`` or ``CUDA_MANAGED``) is allocated on ``device`` by CuPy, or by
    ``allocator``, and registered; the region holds the allocation.

    Parameters
    ----------
    nbytes : int
        Size in bytes (positive).
    memory_type : MemoryType
        Where to allocate.
    device : int or None
        CUDA device ordinal; None: the current device (CuPy's current
        device or the calling thread's context; see
        :func:`gpucx.mem.cuda.current_device`).  Only for CUDA memory.
    allocator : callable or None
        ``allocator(nbytes, memory_type) -> buffer`` called with ``device``
        current, instead of CuPy; used for CUDA memory only.

    Raises
    ------
    ValueError
        If ``nbytes`` is not positive, or ``device``/``allocator`` is given
        for host memory.
    TypeError
        If ``nbytes`` is not an int.
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it (naming what is
        missing), or without CuPy and without ``allocator``.
    gpucx.UCXError
        If UCX cannot allocate that memory type here.
    gpucx.ClosedError
        If the context is closed.
    """
    if ctx.closed:
        raise_closed(ctx)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"nbytes must be an int, not {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, not {nbytes}")
    mt = MemoryType(memory_type)
    if mt in CUDA_TYPES:
        return _allocate_cuda(ctx, nbytes, mt, device, allocator)
    if device is not None or allocator is not None:
        raise ValueError(
            f"device= and allocator= apply to CUDA memory, not {mt.name} memory"
        )
    memh, addr, _length, got = _map(ctx, ffi.NULL, nbytes, int(mt), True)
    try:
        got_mt = MemoryType(got)
    except ValueError:
        got_mt = mt
    region = MemoryRegion(ctx, addr, nbytes, got_mt, False, None, True, h=memh)
    if got_mt == MemoryType.HOST:
        _allocated_host_regions(ctx).add(region)
    return region


def _cupy_allocator(nbytes: int, memory_type: int, device: int):
    try:
        import cupy
    except ImportError:
        raise UnsupportedError(
            "allocating CUDA memory needs CuPy (pip install 'gpucx[cuda12]') "
            "or an allocator="
        ) from None
    with cupy.cuda.Device(device):
        if memory_type == int(MemoryType.CUDA_MANAGED):
            mem = cupy.cuda.malloc_managed(nbytes)
            return cupy.ndarray((nbytes,), cupy.uint8, mem)
        return cupy.empty(nbytes, cupy.uint8)


def _allocate_cuda(ctx, nbytes, mt, device, allocator) -> MemoryRegion:
    _cuda.check(ctx, "allocate")
    if device is None:
        device = _cuda.current_device()
    with _cuda.device_context(device=device):
        if allocator is None:
            obj = _cupy_allocator(nbytes, int(mt), device)
        else:
            obj = allocator(nbytes, int(mt))
    buf = as_buffer(obj, True)
    if buf.nbytes < nbytes:
        raise ValueError(
            f"allocator returned {buf.nbytes} bytes; {nbytes} were asked for"
        )
    region = register(ctx, obj)
    region._alloc = True
    return region
