"""The one door through which user memory enters gpucx.

:func:`as_buffer` turns any supported object into a :class:`Buffer`: its
address, size, memory type, whether it is read-only, and the object that
keeps the memory alive.  :func:`acquire` is the same door on the hot path of
every operation: it returns what a cffi call needs, with a fast path for the
common host types.

Protocols are tried in this order:

1. exact ``bytes``, ``bytearray``, ``memoryview`` and ``numpy.ndarray``: the
   buffer protocol, which is the fastest way to host memory (a NumPy array
   would also answer DLPack, at several times the cost);
2. ``__cuda_array_interface__``: it carries the producer's stream (CAI v3),
   so GPU arrays that speak both CAI and DLPack are read here;
3. ``__dlpack__`` / ``__dlpack_device__``;
4. the buffer protocol, for every other host object (``array.array``, ...).

Each protocol has a private reader module (:mod:`._bufproto`, :mod:`._cai`,
:mod:`._dlpack`) that raises ``NotImplementedError`` when the object does
not speak it and ``BufferError`` when it speaks it badly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy

from .._lib import ffi
from ..errors import UnsupportedError
from . import _bufproto, _cai, _dlpack
from .memtype import CUDA_TYPES, MemoryType
from .memtype import HOST_INT as _HOST

__all__ = ["Buffer", "as_buffer", "acquire", "set_stream_sync_hook"]


class Buffer:
    """A block of memory gpucx can hand to UCX.

    Built by :func:`as_buffer`; treat it as read-only.

    Attributes
    ----------
    ptr : int
        Address of the first byte (may be 0 when ``nbytes`` is 0).
    nbytes : int
        Size of the block in bytes.
    memory_type : MemoryType
        Where the memory lives (``HOST``, ``CUDA``, ``CUDA_MANAGED``, ...).
    readonly : bool
        Whether the producer marked the memory read-only.
    owner : object
        What keeps the memory alive: a ``memoryview`` (buffer protocol), the
        array itself (CAI) or a :class:`~gpucx.mem._dlpack.DLPackOwner`
        (DLPack, whose deleter runs when the owner is dropped).  Hold it
        until UCX is done with the memory.
    device : int
        CUDA (or ROCm) device ordinal, or -1 for host memory and for CAI
        arrays, whose device the CUDA layer resolves from the pointer.
    stream : int or None
        The stream the memory was ordered on: the CAI v3 ``stream``, or the
        DLPack consumer stream.  :func:`as_buffer` has already synchronized
        it through the stream-sync hook.
    protocol : str
        ``"buffer"``, ``"cai"`` or ``"dlpack"``.
    itemsize : int or None
        Bytes per element, when the protocol tells.
    format : str or None
        Element type as the protocol gives it: a PEP 3118 struct format
        (buffer protocol), the CAI ``typestr``, or a NumPy type string
        derived from the DLPack dtype (``None`` for types NumPy lacks).
    shape : tuple of int or None
        Extent of every dimension, when the protocol tells.
    """

    __slots__ = (
        "ptr",
        "nbytes",
        "memory_type",
        "readonly",
        "owner",
        "device",
        "stream",
        "protocol",
        "itemsize",
        "format",
        "shape",
    )

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        memory_type: MemoryType,
        readonly: bool,
        owner: object,
        device: int = -1,
        stream: int | None = None,
        protocol: str = "buffer",
        itemsize: int | None = None,
        format: str | None = None,
        shape: tuple[int, ...] | None = None,
    ):
        self.ptr = ptr
        self.nbytes = nbytes
        self.memory_type = memory_type
        self.readonly = readonly
        self.owner = owner
        self.device = device
        self.stream = stream
        self.protocol = protocol
        self.itemsize = itemsize
        self.format = format
        self.shape = shape

    def __repr__(self) -> str:
        stream = "" if self.stream is None else f", stream={self.stream:#x}"
        return (
            f"Buffer(ptr={self.ptr:#x}, nbytes={self.nbytes}, "
            f"memory_type={self.memory_type.name}, readonly={self.readonly}, "
            f"device={self.device}{stream}, protocol={self.protocol!r}, "
            f"format={self.format!r}, shape={self.shape})"
        )


StreamSyncHook = Callable[[int, Buffer], None]


def _no_stream_sync(stream: int, buf: Buffer) -> None:
    if buf.memory_type is MemoryType.HOST:
        return
    if buf.memory_type in CUDA_TYPES:
        # The CUDA layer loads the driver on first use; with one it waits.
        from . import cuda

        if cuda.driver() is not None:
            cuda.sync_stream(stream, buf)
            return
        why = f": {cuda.driver_problem()}"
    else:
        why = ""
    raise UnsupportedError(
        f"{buf.protocol}: {buf.memory_type.name} memory is ordered on stream "
        f"{stream:#x}, but no CUDA runtime layer is loaded to synchronize it"
        f"{why}"
    )


_stream_sync: StreamSyncHook = _no_stream_sync


def set_stream_sync_hook(fn: StreamSyncHook | None) -> StreamSyncHook:
    """Install the function that synchronizes a producer stream.

    :func:`as_buffer` calls ``fn(stream_handle, buffer)`` before it returns
    a buffer that carries a stream (a CAI v3 ``stream``, or the DLPack
    consumer stream).  ``fn`` must return only when work queued on that
    stream before the call has finished, or raise.  The default hook hands
    CUDA memory to :func:`gpucx.mem.cuda.sync_stream` when a CUDA driver
    loads, and raises :class:`~gpucx.UnsupportedError` for device memory
    otherwise.

    Parameters
    ----------
    fn : callable or None
        The new hook; ``None`` restores the default.

    Returns
    -------
    callable
        The hook that was installed before, so that callers can restore it.

    Raises
    ------
    TypeError
        ``fn`` is neither callable nor ``None``.
    """
    global _stream_sync
    if fn is not None and not callable(fn):
        raise TypeError(f"the stream-sync hook must be callable or None, got {fn!r}")
    previous = _stream_sync
    _stream_sync = _no_stream_sync if fn is None else fn
    return previous


# Exact types always read through the buffer protocol; acquire() hands them
# straight to ffi.from_buffer when C-contiguous.
_BUFFER_TYPES = frozenset({bytes, bytearray, memoryview, numpy.ndarray})


def as_buffer(obj: Any, writable: bool = False, *, stream: int | None = None) -> Buffer:
    """Describe the memory of ``obj`` for UCX.

    Parameters
    ----------
    obj : object
        Anything that speaks the buffer protocol, ``__cuda_array_interface__``
        (v0 to v3) or DLPack; the memory must be one C- or Fortran-contiguous
        block.  See the module docstring for the order protocols are tried.
    writable : bool, optional
        ``True`` when the memory is a receive target.
    stream : int or None, optional
        Consumer stream handle passed to a DLPack producer of device memory:
        ``None`` means 1 (CUDA's legacy default stream), ``-1`` asks for no
        synchronization.

    Returns
    -------
    Buffer
        The description.  If it carries a stream, the stream-sync hook (see
        :func:`set_stream_sync_hook`) has already run.

    Raises
    ------
    BufferError
        The memory is not contiguous, a protocol field is malformed (the
        message names the protocol, the key and its value), or ``writable``
        is true and the memory is read-only.
    TypeError
        ``obj`` speaks none of the protocols, or ``stream`` is not an int.
    ValueError
        ``stream`` is not a valid DLPack consumer stream for the device.
    gpucx.UnsupportedError
        The memory carries a stream and no CUDA layer is loaded to
        synchronize it (from the default stream-sync hook).
    """
    buf = _read(obj, writable, stream)
    if buf.stream is not None:
        _stream_sync(buf.stream, buf)
    return buf


def _read(obj: Any, writable: bool, stream: int | None) -> Buffer:
    """:func:`as_buffer` without the stream-sync hook."""
    if type(obj) in _BUFFER_TYPES:
        return Buffer(**_bufproto.read(obj, writable))
    try:
        fields = _cai.read(obj, writable)
    except NotImplementedError:
        try:
            fields = _dlpack.read(obj, writable, stream)
        except NotImplementedError:
            try:
                fields = _bufproto.read(obj, writable)
            except NotImplementedError:
                raise TypeError(
                    f"{type(obj).__name__} object is not a buffer: it supports "
                    "neither the buffer protocol, __cuda_array_interface__ nor "
                    "DLPack"
                ) from None
    return Buffer(**fields)


_from_buffer = ffi.from_buffer
_cast = ffi.cast
_CHAR_ARRAY = ffi.typeof("char[]")
_VOID_P = ffi.typeof("void *")


def acquire(
    obj: Any, writable: bool, stream: Any = None, defer: bool = False
) -> tuple[Any, int, int, object]:
    """Hot-path form of :func:`as_buffer` for cffi calls.

    Parameters
    ----------
    obj : object
        As for :func:`as_buffer`.
    writable : bool
        ``True`` when the memory is a receive target.
    stream : object, optional
        As for :func:`as_buffer`, or any stream object
        :func:`gpucx.mem.cuda.as_stream` accepts.
    defer : bool, optional
        For callers that pass the CUDA door next (``cuda.door``, or its
        ``ready()``, with this call's ``keepalive``): CUDA memory whose
        producer stream needs synchronizing comes back with a
        :class:`gpucx.mem.cuda.Deferred` keepalive instead of being
        synchronized here, and the door waits for that stream in the
        owner's context it makes current anyway (one context query for
        both).  Only while the default stream-sync hook is installed; a
        hook set with :func:`set_stream_sync_hook` always runs here.

    Returns
    -------
    cptr : cdata
        Pass it directly to a ``void *`` parameter.
    nbytes : int
        Size in bytes.
    memory_type : int
        A ``ucs_memory_type_t`` value.
    keepalive : object
        Hold it until UCX is done with the memory (for DLPack, dropping it
        runs the producer's deleter); with ``defer``, pass it to the door.

    Raises
    ------
    BufferError, TypeError, ValueError, gpucx.UnsupportedError
        As for :func:`as_buffer`.
    """
    if type(obj) in _BUFFER_TYPES:
        try:
            # The positional form with a ctype object: the keyword form
            # (require_writable=True) costs about 0.2 us more per call.
            cdata = (
                _from_buffer(_CHAR_ARRAY, obj, True) if writable else _from_buffer(obj)
            )
        except (ValueError, BufferError, TypeError):
            # Read-only, Fortran-order or non-contiguous: as_buffer accepts
            # the Fortran case and explains the others.
            pass
        else:
            # The cdata holds the buffer export, so it keeps obj alive.
            return cdata, len(cdata), _HOST, cdata
    if stream is not None:
        from .cuda import as_stream

        stream = as_stream(stream)
    buf = _read(obj, writable, stream)
    owner = buf.owner
    if buf.stream is not None:
        if defer and buf.memory_type in CUDA_TYPES and _stream_sync is _no_stream_sync:
            from .cuda import Deferred

            owner = Deferred(owner, buf.stream)
        else:
            _stream_sync(buf.stream, buf)
    return _cast(_VOID_P, buf.ptr), buf.nbytes, int(buf.memory_type), owner
