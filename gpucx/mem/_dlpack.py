"""Reader for DLPack (``__dlpack__`` / ``__dlpack_device__``).

:func:`read` asks the producer for a capsule (a versioned one first, then the
legacy ``"dltensor"``), validates the ``DLTensor`` in it, renames the capsule
to ``"used_dltensor"`` / ``"used_dltensor_versioned"`` as the protocol
requires of a consumer, and hands back a :class:`DLPackOwner` that calls the
producer's deleter exactly once when it is released or dropped.

The ctypes structures mirror ``dlpack.h`` (DLPack 1.x); the field order is the
ABI, so it must never be changed.

Reference: https://dmlc.github.io/dlpack/latest/ and the Python array API
standard's ``__dlpack__``.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from typing import Any

from ._bufproto import contiguous_order, describe
from .memtype import MemoryType

__all__ = ["read", "DLPackOwner", "DEVICE_TYPES"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1
_FLAG_IS_SUBBYTE_TYPE_PADDED = 1 << 2

#: DLPack major version this reader understands, and what it asks producers for.
MAX_VERSION = (1, 0)

# DLDeviceType -> (memory type, default consumer stream or None for host
# memory, whether device_id names a device).  The default stream follows the
# array API standard: 1 is CUDA's legacy default stream (0 is ambiguous
# there), 0 is ROCm's default stream.
DEVICE_TYPES: dict[int, tuple[MemoryType, int | None, bool]] = {
    1: (MemoryType.HOST, None, False),  # kDLCPU
    2: (MemoryType.CUDA, 1, True),  # kDLCUDA
    3: (MemoryType.HOST, None, False),  # kDLCUDAHost (pinned host memory)
    10: (MemoryType.ROCM, 0, True),  # kDLROCM
    11: (MemoryType.HOST, None, False),  # kDLROCMHost (pinned host memory)
    13: (MemoryType.CUDA_MANAGED, 1, True),  # kDLCUDAManaged
}
_CUDA_DEVICE_TYPES = frozenset({2, 13})

# DLDataTypeCode -> (name, allowed bits or None).  None: a multiple of 8, or
# a packed sub-byte width.
_DTYPE_CODES: dict[int, tuple[str, frozenset[int] | None]] = {
    0: ("kDLInt", None),
    1: ("kDLUInt", None),
    2: ("kDLFloat", frozenset({8, 16, 32, 64, 128})),
    3: ("kDLOpaqueHandle", None),
    4: ("kDLBfloat", frozenset({16})),
    5: ("kDLComplex", frozenset({32, 64, 128, 256})),
    6: ("kDLBool", frozenset({1, 8})),
    **{code: (f"kDLFloat8 ({code})", frozenset({8})) for code in range(7, 15)},
    15: ("kDLFloat6_e2m3fn", frozenset({6})),
    16: ("kDLFloat6_e3m2fn", frozenset({6})),
    17: ("kDLFloat4_e2m1fn", frozenset({4})),
}
# Codes with a NumPy array-interface type string (kind letter).
_NUMPY_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}
_BYTEORDER = "<" if sys.byteorder == "little" else ">"

_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Private prototypes: setting argtypes on ctypes.pythonapi's shared function
# objects would change them for every other user in the process.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p
)(("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi)
)
_incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_USED = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"
# PyCapsule_SetName keeps the char pointer, not a copy: the renamed capsule
# reads it (the producer's capsule destructor compares names) until it dies,
# possibly late in interpreter shutdown.  One deliberately leaked reference
# keeps these two small bytes objects alive for the life of the process.
_incref(_USED)
_incref(_USED_VERSIONED)


def _call_deleter(deleter: int, managed: int) -> None:
    _DELETER_T(deleter)(managed)


class DLPackOwner:
    """Holds a consumed DLPack capsule; calls its deleter exactly once.

    The deleter runs when :meth:`release` is first called, when the owner is
    garbage collected, or at interpreter exit, whichever comes first.  Until
    then the producer keeps the memory alive.

    Attributes
    ----------
    capsule : object
        The capsule, renamed to ``"used_dltensor[_versioned]"``.
    """

    __slots__ = ("capsule", "_finalizer", "__weakref__")

    def __init__(self, capsule: object, managed: int, deleter: int | None):
        self.capsule = capsule
        # The finalizer's arguments are plain ints, so it holds no reference
        # to the owner that would keep the owner alive.
        self._finalizer = (
            weakref.finalize(self, _call_deleter, deleter, managed) if deleter else None
        )

    @property
    def released(self) -> bool:
        """Whether the deleter has run (or there is none)."""
        return self._finalizer is None or not self._finalizer.alive

    def release(self) -> None:
        """Call the producer's deleter now, if it has not run yet."""
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<DLPackOwner {state} {self.capsule!r}>"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _device(obj: Any) -> tuple[int, int]:
    try:
        device = obj.__dlpack_device__()
    except NotImplementedError as exc:
        # Not "no DLPack": the producer speaks it and failed.
        raise BufferError(f"DLPack: __dlpack_device__() failed: {exc}") from exc
    if (
        not isinstance(device, tuple)
        or len(device) != 2
        or not all(_is_int(v) for v in device)
    ):
        raise BufferError(
            "DLPack: __dlpack_device__() must return a tuple "
            f"(device_type: int, device_id: int), got {device!r}"
        )
    return int(device[0]), int(device[1])


def _consumer_stream(device_type: int, default: int, stream: Any) -> int:
    if stream is None:
        return default
    if not _is_int(stream):
        raise TypeError(f"stream must be None or an int stream handle, got {stream!r}")
    if stream < -1 or (stream == 0 and device_type in _CUDA_DEVICE_TYPES):
        raise ValueError(
            f"stream={stream} is not a valid DLPack consumer stream for "
            f"device_type {device_type}: use None, -1 (no synchronization), "
            "1 (legacy default stream), 2 (per-thread default stream) or a "
            "stream handle"
        )
    return stream


def _export(obj: Any, kwargs: dict[str, int]) -> object:
    try:
        try:
            return obj.__dlpack__(max_version=MAX_VERSION, **kwargs)
        except TypeError:
            # A producer older than DLPack 1.0 takes no max_version.
            return obj.__dlpack__(**kwargs)
    except NotImplementedError as exc:
        raise BufferError(f"DLPack: __dlpack__() failed: {exc}") from exc


def _dtype(dtype: _DLDataType) -> tuple[int, int]:
    code, bits, lanes = dtype.code, dtype.bits, dtype.lanes
    entry = _DTYPE_CODES.get(code)
    if entry is None:
        raise BufferError(f"DLPack: dtype.code={code} is not a DLDataTypeCode")
    name, allowed = entry
    if allowed is None:
        valid = bits > 0 and (bits < 8 or bits % 8 == 0)
    else:
        valid = bits in allowed
    if not valid:
        raise BufferError(f"DLPack: dtype.bits={bits} is not valid for {name}")
    if lanes != 1:
        raise BufferError(
            f"DLPack: dtype.lanes={lanes}; vector types (lanes != 1) are not supported"
        )
    return code, bits


def _dims(tensor: _DLTensor, ndim: int, field: str) -> tuple[int, ...] | None:
    pointer = getattr(tensor, field)
    if not pointer:
        return None
    return tuple(pointer[i] for i in range(ndim))


def read(obj: Any, writable: bool, stream: int | None = None) -> dict[str, Any]:
    """Describe the memory ``obj`` exports through DLPack.

    Parameters
    ----------
    obj : object
        An object with ``__dlpack__`` and ``__dlpack_device__``.
    writable : bool
        ``True`` when the memory is a receive target and must be writable.
    stream : int or None
        The consumer stream passed to ``__dlpack__`` for CUDA and ROCm
        memory: ``None`` for the default (1, CUDA's legacy default stream;
        0 on ROCm), ``-1`` for no synchronization, else a stream handle.
        Host memory is exported without a stream.

    Returns
    -------
    dict
        Keyword arguments for :class:`gpucx.mem.buffer.Buffer`.  The owner is
        a :class:`DLPackOwner`; ``stream`` is the consumer stream the producer
        ordered its work before (``None`` for host memory or ``stream=-1``),
        which the caller must synchronize before the memory is used.

    Raises
    ------
    NotImplementedError
        ``obj`` lacks ``__dlpack__`` or ``__dlpack_device__``.
    BufferError
        The producer fails or returns something malformed (the message names
        the field): a device type gpucx cannot move, a device tuple or
        capsule of the wrong kind, a DLPack major version other than 1,
        ``ndim < 0``, a NULL ``shape`` or a negative extent, an unknown
        ``dtype.code``, invalid ``dtype.bits``, ``dtype.lanes != 1``,
        non-contiguous ``strides``, NULL ``data`` for a non-empty tensor; or
        ``writable`` is true and the tensor is read-only or a copy.
    TypeError
        ``stream`` is not ``None`` or an int.
    ValueError
        ``stream`` is 0 for CUDA memory (ambiguous) or below -1.
    """
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        raise NotImplementedError("no __dlpack__/__dlpack_device__")
    device_type, device_id = _device(obj)
    entry = DEVICE_TYPES.get(device_type)
    if entry is None:
        raise BufferError(
            f"DLPack: device_type={device_type} (device_id={device_id}) is not "
            "memory gpucx can move; supported: "
            "kDLCPU=1, kDLCUDA=2, kDLCUDAHost=3, kDLROCM=10, kDLROCMHost=11, "
            "kDLCUDAManaged=13"
        )
    memory_type, default_stream, has_device = entry
    kwargs: dict[str, int] = {}
    consumer: int | None = None
    if default_stream is not None:
        consumer = _consumer_stream(device_type, default_stream, stream)
        kwargs["stream"] = consumer
        if consumer == -1:
            consumer = None
    capsule = _export(obj, kwargs)

    # Until the capsule is renamed, dropping it (on any error below) makes the
    # producer's capsule destructor call the deleter.
    flags = 0
    if _capsule_is_valid(capsule, _NAME_VERSIONED):
        managed = _capsule_get_pointer(capsule, _NAME_VERSIONED)
        versioned = _DLManagedTensorVersioned.from_address(managed)
        major, minor = versioned.version.major, versioned.version.minor
        if major != MAX_VERSION[0]:
            raise BufferError(
                f"DLPack: version={major}.{minor} is not supported "
                f"(gpucx reads DLPack {MAX_VERSION[0]}.x)"
            )
        flags = versioned.flags
        tensor = versioned.dl_tensor
        deleter = versioned.deleter
        used = _USED_VERSIONED
    elif _capsule_is_valid(capsule, _NAME):
        managed = _capsule_get_pointer(capsule, _NAME)
        legacy = _DLManagedTensor.from_address(managed)
        tensor = legacy.dl_tensor
        deleter = legacy.deleter
        used = _USED
    else:
        raise BufferError(
            f"DLPack: __dlpack__() must return an unused 'dltensor' or "
            f"'dltensor_versioned' capsule, got {capsule!r}"
        )

    got = (tensor.device.device_type, tensor.device.device_id)
    if got != (device_type, device_id):
        raise BufferError(
            f"DLPack: DLTensor.device={got} differs from __dlpack_device__() "
            f"= {(device_type, device_id)}"
        )
    ndim = tensor.ndim
    if ndim < 0:
        raise BufferError(f"DLPack: ndim={ndim} is negative")
    code, bits = _dtype(tensor.dtype)
    shape = _dims(tensor, ndim, "shape")
    if shape is None:
        if ndim:
            raise BufferError(f"DLPack: shape is NULL with ndim={ndim}")
        shape = ()
    if any(n < 0 for n in shape):
        raise BufferError(f"DLPack: shape={shape} has a negative extent")
    strides = _dims(tensor, ndim, "strides")
    if strides is not None and contiguous_order(shape, strides, 1) is None:
        raise BufferError(describe("DLPack", shape, f"{strides} (in elements)"))
    count = math.prod(shape)
    itemsize = (bits + 7) // 8
    if bits % 8 and not flags & _FLAG_IS_SUBBYTE_TYPE_PADDED:
        nbytes = (count * bits + 7) // 8  # packed sub-byte elements
    else:
        nbytes = count * itemsize
    data = tensor.data or 0
    if not data and count:
        raise BufferError(f"DLPack: data is NULL for a tensor of shape {shape}")
    readonly = bool(flags & _FLAG_READ_ONLY)
    if writable and readonly:
        raise BufferError(
            "DLPack: the receive target is read-only (the DLPack READ_ONLY flag "
            "is set); pass a writable array"
        )
    if writable and flags & _FLAG_IS_COPIED:
        raise BufferError(
            "DLPack: the producer exported a copy (IS_COPIED flag), which cannot "
            "be a receive target; pass an array whose memory can be exported"
        )

    _capsule_set_name(capsule, used)
    owner = DLPackOwner(capsule, managed, deleter)
    kind = _NUMPY_KINDS.get(code)
    fmt = None
    if kind is not None and bits % 8 == 0:
        fmt = f"{'|' if itemsize == 1 else _BYTEORDER}{kind}{itemsize}"
    return {
        "ptr": data + tensor.byte_offset,
        "nbytes": nbytes,
        "memory_type": memory_type,
        "readonly": readonly,
        "owner": owner,
        "device": device_id if has_device else -1,
        "stream": consumer,
        "protocol": "dlpack",
        "itemsize": itemsize,
        "format": fmt,
        "shape": shape,
    }
