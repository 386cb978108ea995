"""Reader for the Python buffer protocol (host memory).

:func:`read` turns an object that exports a buffer (``bytes``, ``bytearray``,
``memoryview``, ``array.array``, NumPy arrays, ...) into the fields of a
:class:`gpucx.mem.buffer.Buffer`.  The memory must be one C- or
Fortran-contiguous block; anything else is a :class:`BufferError`.

This module also holds :func:`contiguous_order`, the contiguity rule the CAI
and DLPack readers share with it.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from .memtype import MemoryType

__all__ = ["read", "contiguous_order", "describe"]

_HOST = MemoryType.HOST

# PyBUF_ANY_CONTIGUOUS (0x0080 | PyBUF_STRIDES 0x0018): a read-only request
# that any exporter of a contiguous block honours.  Only ``buf`` is used.
_PYBUF_ANY_CONTIGUOUS = 0x0098


class _PyBuffer(ctypes.Structure):
    # ``Py_buffer`` from Include/pybuffer.h, unchanged since Python 3.3 and
    # part of the stable ABI since 3.11.
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


# Private prototypes, so that no argtypes are set on the shared
# ``ctypes.pythonapi`` function objects that other code may also use.
_get_buffer = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int
)(("PyObject_GetBuffer", ctypes.pythonapi))
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))(
    ("PyBuffer_Release", ctypes.pythonapi)
)

# Names between colons in a PEP 3118 struct format (``T{d:x:O:obj:}``).
_FIELD_NAMES = re.compile(r":[^:]*:")


def _address(view: memoryview) -> int:
    """Address of the first byte of a contiguous ``view``.

    ``ffi.from_buffer`` and ``ctypes.c_char.from_buffer`` both insist on
    C-contiguity (and the latter on writability), so the address is read
    from a ``Py_buffer`` asked for with ``PyBUF_ANY_CONTIGUOUS``.  ``view``
    keeps its own export of the memory, so the address stays valid after
    this short-lived request is released.
    """
    pybuf = _PyBuffer()
    _get_buffer(view, ctypes.byref(pybuf), _PYBUF_ANY_CONTIGUOUS)
    try:
        return pybuf.buf or 0
    finally:
        _release_buffer(ctypes.byref(pybuf))


def contiguous_order(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> str | None:
    """Tell whether ``strides`` describe one contiguous block.

    Parameters
    ----------
    shape : tuple of int
        Extent of every dimension (non-negative).
    strides : tuple of int
        Step of every dimension, in the same unit as ``itemsize`` (bytes for
        the buffer protocol and CAI, elements for DLPack with ``itemsize=1``).
    itemsize : int
        Size of one element in that unit.

    Returns
    -------
    str or None
        ``"C"`` for row-major (also for 0-d, 1-d and empty arrays), ``"F"``
        for column-major, ``None`` when the elements do not form one gap-free
        block.  Like NumPy, the stride of a dimension of extent 1 is ignored.
    """
    if 0 in shape:
        return "C"
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent != 1 and stride != expected:
            break
        expected *= extent
    else:
        return "C"
    expected = itemsize
    for extent, stride in zip(shape, strides, strict=True):
        if extent != 1 and stride != expected:
            return None
        expected *= extent
    return "F"


def describe(protocol: str, shape: Any, strides: Any) -> str:
    """Message for a buffer that is not one contiguous block."""
    return (
        f"{protocol}: non-contiguous memory (shape={shape}, strides={strides}); "
        "gpucx moves one C- or Fortran-contiguous block, make a contiguous copy"
    )


def _holds_objects(fmt: str) -> bool:
    # Format code "O" is a PyObject pointer; field names may contain an "O".
    return "O" in fmt and "O" in _FIELD_NAMES.sub("", fmt)


def read(obj: Any, writable: bool) -> dict[str, Any]:
    """Describe the host memory ``obj`` exports through the buffer protocol.

    Parameters
    ----------
    obj : object
        Any object that supports the buffer protocol.
    writable : bool
        ``True`` when the memory is a receive target and must be writable.

    Returns
    -------
    dict
        Keyword arguments for :class:`gpucx.mem.buffer.Buffer`; the owner is
        a ``memoryview`` that holds the export (a ``bytearray`` cannot be
        resized while it lives).

    Raises
    ------
    NotImplementedError
        ``obj`` does not support the buffer protocol.
    BufferError
        The exporter refuses the request, the memory is not contiguous, it
        holds Python object pointers, or ``writable`` is true and the memory
        is read-only.
    """
    try:
        view = memoryview(obj)
    except TypeError:
        raise NotImplementedError("no buffer protocol") from None
    except (ValueError, BufferError) as exc:
        # NumPy refuses dtypes the protocol cannot describe (datetime64...).
        raise BufferError(
            f"buffer protocol: {type(obj).__name__} refused to export a buffer: {exc}"
        ) from exc
    if writable and view.readonly:
        raise BufferError(
            f"buffer protocol: the receive target is read-only "
            f"({type(obj).__name__} exports a read-only buffer); pass a writable "
            "object such as a bytearray or a writeable NumPy array"
        )
    if not view.contiguous:
        raise BufferError(describe("buffer protocol", view.shape, view.strides))
    fmt = view.format
    if _holds_objects(fmt):
        raise BufferError(
            f"buffer protocol: format={fmt!r} holds Python object pointers, "
            "which cannot be moved between processes"
        )
    return {
        "ptr": _address(view),
        "nbytes": view.nbytes,
        "memory_type": _HOST,
        "readonly": view.readonly,
        "owner": view,
        "device": -1,
        "stream": None,
        "protocol": "buffer",
        "itemsize": view.itemsize,
        "format": fmt,
        "shape": view.shape,
    }
