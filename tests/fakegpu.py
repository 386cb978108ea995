"""Test doubles that pose host memory as GPU memory (fakes for a missing GPU).

Every class here wraps a NumPy array's host memory and exposes it only
through a GPU protocol, so that the CAI and DLPack paths of
``gpucx.mem.as_buffer`` can be tested on machines without a GPU:

- :class:`FakeCudaArrayV2` / :class:`FakeCudaArrayV3`: ``__cuda_array_interface__``
  version 2 / version 3 (with a fake stream handle).
- :class:`FakeDLPackCuda`: a DLPack producer written with ctypes that reports
  ``kDLCUDA`` and exports ``DLManagedTensorVersioned`` capsules; it records
  the consumer streams it is given and counts deleter calls.
  :class:`FakeDLPackCudaLegacy` only knows the pre-1.0 ``"dltensor"`` capsule.
- :class:`DLPackHostArray`: a real host array that speaks only DLPack
  (NumPy's own producer), recording the keyword arguments it is given.
- :class:`FakeCupyStream`, :class:`FakeTorchStream`, :class:`FakeNumbaStream`:
  objects shaped like those libraries' stream objects, carrying a fake handle.
- :class:`FakeDriver`: stands in for the CUDA driver (``libcuda.so.1``) in
  :mod:`gpucx.mem.cuda`; it owns no GPU, records every call in order and
  reports events as complete after a set number of polls.
- :func:`build_fake_libcuda`: compiles ``tests/fakecuda/libcuda_fake.c``, a
  shared library with the driver API's names and no GPU behind them.

Nothing here may touch the memory as if it were on a GPU: it is host memory,
and the tests read and write it directly to check the reported pointers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sysconfig
from typing import Any

import numpy

__all__ = [
    "FAKE_STREAM",
    "MISSING",
    "FakeCudaArrayV2",
    "FakeCudaArrayV3",
    "FakeDLPackCuda",
    "FakeDLPackCudaLegacy",
    "DLPackHostArray",
    "live_fake_tensors",
    "FakeCupyStream",
    "FakeTorchStream",
    "FakeNumbaStream",
    "FakeDriver",
]

#: The stream handle FakeCudaArrayV3 reports by default (not a real stream).
FAKE_STREAM = 0x5EED


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Pass as an override to drop a key from the fake CAI dictionary.
MISSING = _Missing()


def _address(array: numpy.ndarray) -> int:
    return array.__array_interface__["data"][0]


class FakeCudaArrayV2:
    """Fake GPU array: host memory exposed only through CAI version 2.

    Parameters
    ----------
    array : numpy.ndarray
        The host memory to expose; kept alive by the fake.
    **overrides
        Replace (or, with :data:`MISSING`, remove) keys of the interface
        dictionary, to build malformed inputs.
    """

    version = 2

    def __init__(self, array: numpy.ndarray, **overrides: Any):
        self.array = array
        iface: dict[str, Any] = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (_address(array), not array.flags.writeable),
            "strides": None if array.flags.c_contiguous else array.strides,
            "version": self.version,
        }
        iface.update(self._extra())
        iface.update(overrides)
        self._iface = {k: v for k, v in iface.items() if v is not MISSING}

    def _extra(self) -> dict[str, Any]:
        return {}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self._iface)


class FakeCudaArrayV3(FakeCudaArrayV2):
    """Fake GPU array: host memory exposed through CAI version 3 with a stream.

    Parameters
    ----------
    array : numpy.ndarray
        The host memory to expose.
    stream : int or None
        The producer stream handle to report (a fake handle by default).
    **overrides
        As for :class:`FakeCudaArrayV2`.
    """

    version = 3

    def __init__(
        self, array: numpy.ndarray, stream: Any = FAKE_STREAM, **overrides: Any
    ):
        self._stream = stream
        super().__init__(array, **overrides)

    def _extra(self) -> dict[str, Any]:
        return {"stream": self._stream}


# --- DLPack producer side, written independently of gpucx's consumer -------


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _Tensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_DTYPE_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}

_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
# These take the capsule as a raw pointer: they run inside its destructor.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p
)(("PyCapsule_GetPointer", ctypes.pythonapi))

# Address of a live DLManagedTensor[Versioned] -> what it needs to stay valid.
_LIVE: dict[int, tuple[Any, ...]] = {}


def live_fake_tensors() -> int:
    """Number of fake DLPack tensors whose deleter has not run yet."""
    return len(_LIVE)


def _on_delete(managed: int) -> None:
    fake = _LIVE.pop(managed)[0]
    fake.deleted += 1


def _on_capsule_free(capsule: int) -> None:
    # The consumer renames a capsule it takes; an unused one owns the tensor.
    for name in (_NAME_VERSIONED, _NAME):
        if _capsule_is_valid(capsule, name):
            _on_delete(_capsule_get_pointer(capsule, name))
            return


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_on_delete)
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_on_capsule_free)


class FakeDLPackCuda:
    """Fake GPU array: host memory exported as a ``kDLCUDA`` DLPack tensor.

    Parameters
    ----------
    array : numpy.ndarray
        The host memory to export; kept alive until the deleter runs.
    device : tuple of int
        What ``__dlpack_device__`` reports, ``(2, 0)`` (kDLCUDA, device 0) by
        default; the DLTensor carries the same unless ``tensor_device`` says
        otherwise.
    readonly : bool or None
        Set the READ_ONLY flag (``None``: when the array is not writeable).
    copied : bool
        Set the IS_COPIED flag.
    version : tuple of int
        DLPack version written into the versioned tensor.
    dtype : tuple of int or None
        ``(code, bits, lanes)`` instead of the one derived from the array.
    shape, strides : tuple of int, None or "auto"
        Instead of the array's (strides in elements); ``None`` writes NULL.
    ndim : int or None
        Instead of ``array.ndim``.
    data : int or None
        Instead of the array's address (``0`` writes NULL).
    byte_offset : int
        Written into the tensor; ``data`` is moved back by the same amount so
        that ``data + byte_offset`` stays the array's address.
    tensor_device : tuple of int or None
        The DLTensor's device, when it should disagree with ``device``.

    Attributes
    ----------
    streams : list
        The ``stream`` argument of every ``__dlpack__`` call.
    max_versions : list
        The ``max_version`` argument of every ``__dlpack__`` call.
    deleted : int
        How many times the deleter ran for tensors this fake exported.
    """

    def __init__(
        self,
        array: numpy.ndarray,
        *,
        device: tuple[int, int] = (2, 0),
        readonly: bool | None = None,
        copied: bool = False,
        version: tuple[int, int] = (1, 0),
        dtype: tuple[int, int, int] | None = None,
        shape: Any = "auto",
        strides: Any = "auto",
        ndim: int | None = None,
        data: int | None = None,
        byte_offset: int = 0,
        tensor_device: tuple[int, int] | None = None,
    ):
        self.array = array
        self.device = device
        self.readonly = (not array.flags.writeable) if readonly is None else readonly
        self.copied = copied
        self.version = version
        if dtype is None:
            dtype = (_DTYPE_CODES[array.dtype.kind], array.itemsize * 8, 1)
        self.dtype = dtype
        self.shape = array.shape if shape == "auto" else shape
        if strides == "auto":
            strides = tuple(s // array.itemsize for s in array.strides)
        self.strides = strides
        self.ndim = array.ndim if ndim is None else ndim
        self.data = _address(array) if data is None else data
        self.byte_offset = byte_offset
        self.tensor_device = device if tensor_device is None else tensor_device
        self.streams: list[Any] = []
        self.max_versions: list[Any] = []
        self.deleted = 0

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> object:
        self.streams.append(stream)
        self.max_versions.append(max_version)
        return self._export(versioned=max_version is not None and max_version >= (1, 0))

    def _fill(self, tensor: _Tensor, keep: list[Any]) -> None:
        tensor.data = (self.data - self.byte_offset) or None
        tensor.device = _Device(*self.tensor_device)
        tensor.ndim = self.ndim
        tensor.dtype = _DType(*self.dtype)
        for field in ("shape", "strides"):
            dims = getattr(self, field)
            if dims is not None:
                values = (ctypes.c_int64 * max(len(dims), 1))(*dims)
                keep.append(values)
                setattr(tensor, field, ctypes.addressof(values))
        tensor.byte_offset = self.byte_offset

    def _export(self, versioned: bool) -> object:
        keep: list[Any] = []
        if versioned:
            managed: Any = _ManagedVersioned()
            managed.version = _Version(*self.version)
            managed.flags = (1 if self.readonly else 0) | (2 if self.copied else 0)
            name = _NAME_VERSIONED
        else:
            managed = _Managed()
            name = _NAME
        self._fill(managed.dl_tensor, keep)
        managed.deleter = ctypes.cast(_DELETER, ctypes.c_void_p).value
        address = ctypes.addressof(managed)
        _LIVE[address] = (self, managed, keep, self.array)
        destructor = ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p)
        return _capsule_new(address, name, destructor)


class FakeDLPackCudaLegacy(FakeDLPackCuda):
    """A :class:`FakeDLPackCuda` from before DLPack 1.0: no ``max_version``.

    It exports legacy ``"dltensor"`` capsules, which carry no read-only flag.
    """

    def __dlpack__(self, *, stream: Any = None) -> object:  # type: ignore[override]
        self.streams.append(stream)
        return self._export(versioned=False)


class DLPackHostArray:
    """A host array that speaks only DLPack, through NumPy's own producer.

    Attributes
    ----------
    calls : list of dict
        The keyword arguments of every ``__dlpack__`` call.
    """

    def __init__(self, array: numpy.ndarray):
        self.array = array
        self.calls: list[dict[str, Any]] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> object:
        self.calls.append(kwargs)
        return self.array.__dlpack__(**kwargs)


# --- stream objects and the CUDA driver (no GPU behind any of them) ---------


class FakeCupyStream:
    """Shaped like ``cupy.cuda.Stream``: the handle is ``.ptr``."""

    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeTorchStream:
    """Shaped like ``torch.cuda.Stream``: the handle is ``.cuda_stream``."""

    def __init__(self, handle: int):
        self.cuda_stream = handle


class _CPointer:
    def __init__(self, value: int | None):
        self.value = value


class FakeNumbaStream:
    """Shaped like a Numba CUDA stream: ``.handle`` is a ctypes pointer whose
    ``.value`` is the handle (``None`` for the default stream)."""

    def __init__(self, handle: int | None):
        self.handle = _CPointer(handle)


class FakeDriver:
    """A stand-in for the CUDA driver, for machines without a GPU.

    Install it with ``gpucx.mem.cuda.set_driver(FakeDriver(...))``.  Every
    call is appended to :attr:`calls` as a tuple ``(name, *args)``; an
    ``observer`` callable, when set, is told the same tuples (tests use it
    to interleave their own records).

    Parameters
    ----------
    devices : int
        What ``device_count`` reports.
    pointers : dict
        ``address -> (memory_type, device, context)`` for ``pointer``;
        other addresses are host memory.
    polls : int
        ``event_query`` answers "not ready" this many times per recorded
        event before it answers "done".
    idle : bool
        What ``stream_query`` answers: False (the default) says every
        stream has work pending, so waits take the event path.
    """

    def __init__(
        self, devices: int = 2, pointers=None, polls: int = 0, idle: bool = False
    ):
        self.devices = devices
        self.pointers = dict(pointers or {})
        self.polls = polls
        self.idle = idle
        self.calls: list[tuple] = []
        self.current = 0
        self.stack: list[int] = []
        self.pending: dict[int, int] = {}
        self.observer = None
        self._next_event = 0xE0

    def _log(self, *call: Any) -> None:
        self.calls.append(call)
        if self.observer is not None:
            self.observer(call)

    def names(self) -> list[str]:
        """The names of the calls so far, in order."""
        return [c[0] for c in self.calls]

    def version(self) -> int:
        return 12040

    def device_count(self) -> int:
        self._log("device_count")
        return self.devices

    def pointer(self, ptr: int) -> tuple[int, int, int]:
        self._log("pointer", ptr)
        return self.pointers.get(ptr, (0, -1, 0))

    def current_context(self) -> int:
        self._log("current_context")
        return self.current

    def context_device(self) -> int:
        self._log("context_device")
        return (self.current - 0xC0) if self.current else -1

    def primary_context(self, device: int) -> int:
        self._log("primary_context", device)
        return 0xC0 + device

    def primary_active(self, device: int) -> bool:
        self._log("primary_active", device)
        return 0 <= device < self.devices

    def set_current(self, ctx: int) -> None:
        self._log("set_current", ctx)
        self.current = ctx

    def push(self, ctx: int) -> None:
        self._log("push", ctx)
        self.stack.append(self.current)
        self.current = ctx

    def pop(self) -> None:
        self._log("pop")
        self.current = self.stack.pop()

    def stream_query(self, stream: int) -> bool:
        self._log("stream_query", stream, self.idle)
        return self.idle

    def event_create(self) -> int:
        self._next_event += 1
        self._log("event_create", self._next_event)
        return self._next_event

    def event_record(self, event: int, stream: int) -> None:
        self._log("event_record", event, stream)
        self.pending[event] = self.polls

    def event_query(self, event: int) -> bool:
        left = self.pending.get(event, 0)
        self._log("event_query", event, left == 0)
        if left:
            self.pending[event] = left - 1
            return False
        return True

    def event_synchronize(self, event: int) -> None:
        self._log("event_synchronize", event)
        self.pending[event] = 0

    def event_destroy(self, event: int) -> None:
        self._log("event_destroy", event)

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        # The fake "device" memory is host memory: a plain copy.
        self._log("memcpy", dst, src, nbytes)
        ctypes.memmove(dst, src, nbytes)


#: The fake driver library's source (a test double for ``libcuda.so.1``).
FAKE_LIBCUDA_SOURCE = os.path.join(
    os.path.dirname(__file__), "fakecuda", "libcuda_fake.c"
)


def build_fake_libcuda(out) -> str:
    """Compile :data:`FAKE_LIBCUDA_SOURCE` into the shared library ``out``
    (with Python's C compiler, else ``cc``); return its path."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        cc = "cc"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(out), FAKE_LIBCUDA_SOURCE],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(out)
