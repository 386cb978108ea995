"""Reader for ``__cuda_array_interface__`` (CAI), versions 0 to 3.

:func:`read` validates every key of the interface dictionary and turns it
into the fields of a :class:`gpucx.mem.buffer.Buffer`.  It does not
synchronize the CAI v3 ``stream``; it records it, and
:func:`gpucx.mem.buffer.as_buffer` runs the stream-sync hook before it
returns.

Reference: https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from ._bufproto import contiguous_order, describe
from .memtype import MemoryType

__all__ = ["read"]

_CUDA = MemoryType.CUDA
_VERSIONS = range(4)


def _is_int(value: Any) -> bool:
    # bool is an int subclass but never a valid pointer, extent or handle.
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(key: str, value: Any, expected: str) -> BufferError:
    return BufferError(
        f"__cuda_array_interface__: {key!r} must be {expected}, got {value!r}"
    )


def _dtype(typestr: Any) -> numpy.dtype:
    if not isinstance(typestr, str):
        raise _bad("typestr", typestr, "a NumPy type string such as '<f4'")
    try:
        dtype = numpy.dtype(typestr)
    except (TypeError, ValueError):
        raise _bad("typestr", typestr, "a NumPy type string such as '<f4'") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise _bad("typestr", typestr, "a fixed-size, non-object type")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _bad("shape", shape, "a tuple of non-negative ints")
    return shape


def _data(data: Any) -> tuple[int, bool]:
    if (
        not isinstance(data, tuple)
        or len(data) != 2
        or not _is_int(data[0])
        or data[0] < 0
        or not isinstance(data[1], bool)
    ):
        raise _bad("data", data, "a tuple (pointer: int >= 0, readonly: bool)")
    return data


def _stream(stream: Any) -> int | None:
    # CAI v3: None means "no synchronization needed"; 0 is disallowed because
    # it is ambiguous between the legacy and the per-thread default stream.
    if stream is None:
        return None
    if not _is_int(stream) or stream <= 0:
        raise _bad(
            "stream",
            stream,
            "None or a positive int stream handle (1: legacy default stream, "
            "2: per-thread default stream; 0 is disallowed)",
        )
    return stream


def read(obj: Any, writable: bool) -> dict[str, Any]:
    """Describe the CUDA memory ``obj`` exposes through CAI.

    Parameters
    ----------
    obj : object
        An object with a ``__cuda_array_interface__`` attribute.
    writable : bool
        ``True`` when the memory is a receive target and must be writable.

    Returns
    -------
    dict
        Keyword arguments for :class:`gpucx.mem.buffer.Buffer`.  The memory
        type is ``CUDA`` (managed memory cannot be told apart without the
        CUDA runtime), the device is ``-1`` (unknown; the CUDA layer resolves
        it), the owner is ``obj`` and ``stream`` is the CAI v3 stream handle
        or ``None``.

    Raises
    ------
    NotImplementedError
        ``obj`` has no ``__cuda_array_interface__`` (or the attribute raises
        ``AttributeError``, as PyTorch does for host tensors).
    BufferError
        A key is missing or malformed (the message names the key and its
        value): ``version`` outside 0..3, ``shape`` not a tuple of
        non-negative ints, ``typestr`` not a fixed-size NumPy type, ``data``
        not ``(int, bool)`` or a null pointer for a non-empty array,
        ``strides`` that are not one C- or Fortran-contiguous block, a
        ``mask``, a ``stream`` that is not ``None`` or a positive int; or
        ``writable`` is true and ``data[1]`` says read-only.
    """
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        raise NotImplementedError("no __cuda_array_interface__") from None
    if not isinstance(cai, dict):
        raise BufferError(
            f"__cuda_array_interface__ must be a dict, got {type(cai).__name__}"
        )
    missing = [k for k in ("version", "shape", "typestr", "data") if k not in cai]
    if missing:
        raise BufferError(
            f"__cuda_array_interface__: missing key(s) {missing} in {cai!r}"
        )
    version = cai["version"]
    if not _is_int(version) or version not in _VERSIONS:
        raise _bad("version", version, "an int in 0..3")
    shape = _shape(cai["shape"])
    dtype = _dtype(cai["typestr"])
    ptr, readonly = _data(cai["data"])
    mask = cai.get("mask")
    if mask is not None:
        raise BufferError(
            f"__cuda_array_interface__: 'mask' must be None, got {mask!r}; "
            "masked arrays are not supported"
        )
    strides = cai.get("strides")
    if strides is not None:
        if (
            not isinstance(strides, tuple)
            or len(strides) != len(shape)
            or not all(_is_int(s) for s in strides)
        ):
            raise _bad("strides", strides, f"None or a tuple of {len(shape)} ints")
        if contiguous_order(shape, strides, dtype.itemsize) is None:
            raise BufferError(describe("__cuda_array_interface__", shape, strides))
    stream = _stream(cai.get("stream"))
    nbytes = math.prod(shape) * dtype.itemsize
    if ptr == 0 and nbytes:
        raise _bad("data", cai["data"], f"a non-null pointer for {nbytes} bytes")
    if writable and readonly:
        raise BufferError(
            "__cuda_array_interface__: the receive target is read-only "
            f"('data' is {cai['data']!r}); pass a writable device array"
        )
    return {
        "ptr": ptr,
        "nbytes": nbytes,
        "memory_type": _CUDA,
        "readonly": readonly,
        "owner": obj,
        "device": -1,
        "stream": stream,
        "protocol": "cai",
        "itemsize": dtype.itemsize,
        "format": cai["typestr"],
        "shape": shape,
    }
