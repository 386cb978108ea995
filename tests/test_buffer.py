"""Tests of ``gpucx.mem.as_buffer`` / ``acquire``, the door for user memory.

Every field test runs over every array kind (host types, NumPy layouts and
dtypes, and the fake-GPU doubles of ``fakegpu.py``); then one test per
malformed input of each protocol.
"""

from __future__ import annotations

import array
import ctypes
import gc
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from gpucx._lib import ffi
from gpucx.errors import UnsupportedError
from gpucx.mem.buffer import Buffer, acquire, as_buffer, set_stream_sync_hook
from gpucx.mem.memtype import MemoryType

from fakegpu import (
    FAKE_STREAM,
    MISSING,
    DLPackHostArray,
    FakeCudaArrayV2,
    FakeCudaArrayV3,
    FakeDLPackCuda,
    FakeDLPackCudaLegacy,
    live_fake_tensors,
)

pytestmark = pytest.mark.timeout(60)

HOST = MemoryType.HOST
CUDA = MemoryType.CUDA


@pytest.fixture(autouse=True)
def synced():
    """Install a stream-sync hook that records its calls (the fake GPU's).

    It records ``(stream, id(buffer))``: holding the buffer itself would keep
    its owner, and a DLPack deleter, from running.
    """
    calls: list[tuple[int, int]] = []
    previous = set_stream_sync_hook(lambda stream, buf: calls.append((stream, id(buf))))
    yield calls
    set_stream_sync_hook(previous)


def address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def raw(arr: np.ndarray) -> bytes:
    """The bytes of ``arr`` in memory order (C or Fortran)."""
    return arr.tobytes(order="A")


# --- array kinds ------------------------------------------------------------

DTYPES = ["bool", "int8", "float16", "float64", "complex128"]
LAYOUTS = {
    "0d": ((), "C"),
    "empty": ((0,), "C"),
    "1d": ((7,), "C"),
    "2d-C": ((3, 4), "C"),
    "2d-F": ((3, 4), "F"),
    "3d-F-empty": ((2, 0, 3), "F"),
    "3d-F": ((2, 3, 2), "F"),
}


def make_array(dtype: str, layout: str) -> np.ndarray:
    shape, order = LAYOUTS[layout]
    values = np.arange(1, math.prod(shape) + 1).reshape(shape)
    return np.array(values, dtype=dtype, order=order)


@dataclass
class Case:
    """An object to hand to as_buffer, and what it must report."""

    obj: Any
    memory: np.ndarray  # a NumPy view of the same bytes
    memory_type: MemoryType = HOST
    protocol: str = "buffer"
    readonly: bool = False
    device: int = -1
    stream: int | None = None
    typed: bool = True  # shape/itemsize follow the array, not bytes

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes


def readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class NumpySubclass(np.ndarray):
    """Not an exact ndarray: read through DLPack, NumPy's own producer."""


def _bytes_case(obj: Any, **kw: Any) -> Case:
    return Case(obj, np.frombuffer(obj, np.uint8), typed=False, **kw)


KINDS = {
    "bytes": lambda a: _bytes_case(a.tobytes(), readonly=True),
    "bytearray": lambda a: _bytes_case(bytearray(a.tobytes())),
    "array.array": lambda a: _bytes_case(array.array("B", a.tobytes())),
    "memoryview": lambda a: Case(memoryview(a), a),
    "memoryview-readonly": lambda a: Case(memoryview(a).toreadonly(), a, readonly=True),
    "numpy": lambda a: Case(a, a),
    "numpy-readonly": lambda a: Case(readonly(a), a, readonly=True),
    "numpy-subclass": lambda a: Case(a.view(NumpySubclass), a, protocol="dlpack"),
    "dlpack-host": lambda a: Case(DLPackHostArray(a), a, protocol="dlpack"),
    "dlpack-host-readonly": lambda a: Case(
        DLPackHostArray(readonly(a)), a, protocol="dlpack", readonly=True
    ),
    "fake-cai-v2": lambda a: Case(
        FakeCudaArrayV2(a), a, memory_type=CUDA, protocol="cai"
    ),
    "fake-cai-v3": lambda a: Case(
        FakeCudaArrayV3(a), a, memory_type=CUDA, protocol="cai", stream=FAKE_STREAM
    ),
    "fake-cai-v3-readonly": lambda a: Case(
        FakeCudaArrayV3(readonly(a)),
        a,
        memory_type=CUDA,
        protocol="cai",
        stream=FAKE_STREAM,
        readonly=True,
    ),
    "fake-dlpack-cuda": lambda a: Case(
        FakeDLPackCuda(a, device=(2, 1)),
        a,
        memory_type=CUDA,
        protocol="dlpack",
        device=1,
        stream=1,
    ),
    "fake-dlpack-cuda-readonly": lambda a: Case(
        FakeDLPackCuda(readonly(a)),
        a,
        memory_type=CUDA,
        protocol="dlpack",
        device=0,
        stream=1,
        readonly=True,
    ),
    "fake-dlpack-cuda-legacy": lambda a: Case(
        FakeDLPackCudaLegacy(a),
        a,
        memory_type=CUDA,
        protocol="dlpack",
        device=0,
        stream=1,
    ),
    "fake-dlpack-managed": lambda a: Case(
        FakeDLPackCuda(a, device=(13, 2)),
        a,
        memory_type=MemoryType.CUDA_MANAGED,
        protocol="dlpack",
        device=2,
        stream=1,
    ),
    "fake-dlpack-pinned": lambda a: Case(
        FakeDLPackCuda(a, device=(3, 0)), a, protocol="dlpack"
    ),
    "fake-dlpack-rocm": lambda a: Case(
        FakeDLPackCuda(a, device=(10, 3)),
        a,
        memory_type=MemoryType.ROCM,
        protocol="dlpack",
        device=3,
        stream=0,
    ),
}


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture(params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture(params=KINDS)
def case(request, dtype, layout):
    """One array kind; afterwards, every fake DLPack tensor must be deleted."""
    before = live_fake_tensors()
    yield KINDS[request.param](make_array(dtype, layout))
    if live_fake_tensors() != before:
        gc.collect()  # only when reference counting alone did not free them
    assert live_fake_tensors() == before


def check_fields(buf: Buffer, case: Case, synced: list) -> None:
    assert isinstance(buf, Buffer)
    assert buf.nbytes == case.nbytes
    if case.nbytes:
        assert buf.ptr == address(case.memory)
        # The pointer really addresses the bytes (host memory in every fake).
        assert ctypes.string_at(buf.ptr, buf.nbytes) == raw(case.memory)
    assert buf.memory_type is case.memory_type
    assert buf.readonly is case.readonly
    assert buf.device == case.device
    assert buf.stream == case.stream
    assert buf.protocol == case.protocol
    assert buf.owner is not None
    if case.typed:
        assert buf.shape == case.memory.shape
        assert buf.itemsize == case.memory.itemsize
    else:
        assert buf.shape == (case.nbytes,)
        assert buf.itemsize == 1
    if case.stream is None:
        assert synced == []
    else:
        assert synced == [(case.stream, id(buf))]


def test_as_buffer_fields(case, synced):
    buf = as_buffer(case.obj)
    check_fields(buf, case, synced)


def test_as_buffer_writable(case, synced):
    if case.readonly:
        with pytest.raises(BufferError, match="receive target is read-only"):
            as_buffer(case.obj, writable=True)
        return
    buf = as_buffer(case.obj, writable=True)
    check_fields(buf, case, synced)
    ctypes.memset(buf.ptr, 0x5A, buf.nbytes)
    assert raw(case.memory) == b"\x5a" * case.nbytes


def test_acquire(case, synced):
    if case.readonly:
        with pytest.raises(BufferError, match="receive target is read-only"):
            acquire(case.obj, True)
    cptr, nbytes, memory_type, keepalive = acquire(case.obj, False)
    assert nbytes == case.nbytes
    assert memory_type == case.memory_type
    assert keepalive is not None
    if nbytes:
        assert int(ffi.cast("uintptr_t", cptr)) == address(case.memory)
    # cptr converts to a void * argument without a cast.
    assert ffi.cast("void *", cptr) is not None
    ffi.new("void *[1]", [cptr])


def test_as_buffer_type_order():
    arr = np.arange(4.0)
    # An exact ndarray also speaks DLPack; the buffer protocol wins.
    assert as_buffer(arr).protocol == "buffer"

    class Both(FakeDLPackCuda):
        __cuda_array_interface__ = FakeCudaArrayV2(arr).__cuda_array_interface__

    both = Both(arr)
    assert as_buffer(both).protocol == "cai"
    assert both.streams == []


def test_buffer_repr():
    buf = as_buffer(FakeCudaArrayV3(np.zeros(2)))
    text = repr(buf)
    assert text.startswith("Buffer(ptr=0x")
    assert "memory_type=CUDA" in text
    assert f"stream={FAKE_STREAM:#x}" in text


# --- buffer protocol: malformed input ---------------------------------------


def test_buffer_noncontiguous():
    arr = np.zeros((4, 4))[:, ::2]
    with pytest.raises(BufferError) as info:
        as_buffer(arr)
    message = str(info.value)
    assert "buffer protocol" in message
    assert "non-contiguous" in message
    assert "shape=(4, 2)" in message
    assert "strides=(32, 16)" in message


def test_buffer_noncontiguous_memoryview():
    with pytest.raises(BufferError, match=r"non-contiguous.*strides=\(2,\)"):
        as_buffer(memoryview(bytearray(8))[::2])


@pytest.mark.parametrize(
    "target",
    [
        b"abc",
        memoryview(bytearray(3)).toreadonly(),
        memoryview(b"abc"),
        readonly(np.zeros(3)),
        readonly(np.zeros((2, 3), order="F")),
    ],
    ids=["bytes", "memoryview-ro", "memoryview-bytes", "numpy-ro", "numpy-F-ro"],
)
def test_buffer_readonly_receive_target(target):
    with pytest.raises(BufferError, match="buffer protocol: the receive target is"):
        as_buffer(target, writable=True)


def test_buffer_object_pointers():
    with pytest.raises(BufferError, match="Python object pointers"):
        as_buffer(np.array([1, None], dtype=object))


def test_buffer_exporter_refuses():
    with pytest.raises(BufferError, match="refused to export"):
        as_buffer(np.zeros(2, dtype="M8[s]"))


@pytest.mark.parametrize("obj", [42, "text", None, object(), [1, 2]])
def test_not_a_buffer(obj):
    with pytest.raises(TypeError, match="is not a buffer"):
        as_buffer(obj)


def test_as_buffer_bytearray_keeps_export():
    data = bytearray(8)
    buf = as_buffer(data)
    with pytest.raises(BufferError):
        data.extend(b"x")  # resizing would move the memory
    del buf
    gc.collect()
    data.extend(b"x")


# --- CAI: malformed input ---------------------------------------------------


def cai_error(obj: Any, *parts: str, writable: bool = False) -> str:
    with pytest.raises(BufferError) as info:
        as_buffer(obj, writable=writable)
    message = str(info.value)
    assert message.startswith("__cuda_array_interface__")
    for part in parts:
        assert part in message, message
    return message


def test_cai_noncontiguous_strides():
    arr = np.zeros((4, 4))[:, ::2]
    cai_error(FakeCudaArrayV2(arr), "non-contiguous", "shape=(4, 2)", "(32, 16)")


def test_cai_fortran_strides_accepted():
    arr = np.zeros((3, 4), order="F")
    assert FakeCudaArrayV2(arr).__cuda_array_interface__["strides"] == (8, 24)
    assert as_buffer(FakeCudaArrayV2(arr)).nbytes == 96


def test_cai_c_strides_given_accepted():
    arr = np.zeros((3, 4))
    assert as_buffer(FakeCudaArrayV2(arr, strides=(32, 8))).nbytes == 96


@pytest.mark.parametrize("strides", [(8,), (8, 8, 8), [32, 8], (32.0, 8), "x"])
def test_cai_bad_strides(strides):
    cai_error(FakeCudaArrayV2(np.zeros((3, 4)), strides=strides), "'strides'")


def test_cai_mask():
    mask = FakeCudaArrayV2(np.ones(3, dtype=bool))
    cai_error(FakeCudaArrayV2(np.zeros(3), mask=mask), "'mask' must be None")


@pytest.mark.parametrize("version", [4, -1, "3", None, True, 2.0])
def test_cai_bad_version(version):
    cai_error(FakeCudaArrayV2(np.zeros(3), version=version), "'version'", "0..3")


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_cai_versions(version):
    assert as_buffer(FakeCudaArrayV2(np.zeros(3), version=version)).nbytes == 24


@pytest.mark.parametrize("key", ["version", "shape", "typestr", "data"])
def test_cai_missing_key(key):
    cai_error(FakeCudaArrayV2(np.zeros(3), **{key: MISSING}), "missing", key)


def test_cai_not_a_dict():
    class Listy:
        __cuda_array_interface__ = [("shape", (3,))]

    cai_error(Listy(), "must be a dict", "list")


@pytest.mark.parametrize("stream", [0, -5, True, "1", 1.5])
def test_cai_bad_stream(stream, synced):
    message = cai_error(FakeCudaArrayV3(np.zeros(3), stream=stream), "'stream'")
    assert repr(stream) in message
    assert synced == []


@pytest.mark.parametrize("stream", [1, 2, 0x7F00DEADBEEF])
def test_cai_stream_recorded(stream, synced):
    buf = as_buffer(FakeCudaArrayV3(np.zeros(3), stream=stream))
    assert buf.stream == stream
    assert synced == [(stream, id(buf))]


def test_cai_stream_none_needs_no_sync(synced):
    buf = as_buffer(FakeCudaArrayV3(np.zeros(3), stream=None))
    assert buf.stream is None
    assert synced == []


@pytest.mark.parametrize("typestr", ["<f7", "abc", 5, "|O", "|V0", None])
def test_cai_bad_typestr(typestr):
    message = cai_error(FakeCudaArrayV2(np.zeros(3), typestr=typestr), "'typestr'")
    assert repr(typestr) in message


@pytest.mark.parametrize(
    "data",
    [
        [4096, False],
        (4096,),
        (4096, False, 0),
        ("4096", False),
        (4096, 0),
        (-1, False),
        (1.5, False),
        (True, False),
        None,
    ],
)
def test_cai_bad_data(data):
    message = cai_error(FakeCudaArrayV2(np.zeros(3), data=data), "'data'")
    assert repr(data) in message


def test_cai_null_pointer_with_data():
    cai_error(FakeCudaArrayV2(np.zeros(3), data=(0, False)), "'data'", "non-null")


def test_cai_null_pointer_empty():
    buf = as_buffer(FakeCudaArrayV2(np.zeros((2, 0)), data=(0, False)))
    assert (buf.ptr, buf.nbytes, buf.shape) == (0, 0, (2, 0))


@pytest.mark.parametrize("shape", [[3], (-1,), (3.0,), (True,), "3", None])
def test_cai_bad_shape(shape):
    message = cai_error(FakeCudaArrayV2(np.zeros(3), shape=shape), "'shape'")
    assert repr(shape) in message


def test_cai_readonly_receive_target():
    arr = readonly(np.zeros(3))
    cai_error(FakeCudaArrayV3(arr), "receive target is read-only", writable=True)


def test_cai_without_attribute_falls_through():
    class HostTensor(bytearray):
        """Like a PyTorch CPU tensor: the property raises AttributeError."""

        @property
        def __cuda_array_interface__(self):
            raise AttributeError("not on a CUDA device")

    assert as_buffer(HostTensor(4)).protocol == "buffer"


# --- stream-sync hook -------------------------------------------------------


def test_sync_hook_runs_before_as_buffer_returns():
    events: list[Any] = []
    set_stream_sync_hook(lambda stream, buf: events.append(("sync", stream, buf)))
    buf = as_buffer(FakeCudaArrayV3(np.zeros(3), stream=77))
    events.append(("returned", buf))
    assert events == [("sync", 77, buf), ("returned", buf)]


def test_sync_hook_error_propagates():
    def failing(stream, buf):
        raise RuntimeError(f"stream {stream} failed")

    set_stream_sync_hook(failing)
    with pytest.raises(RuntimeError, match="stream 77 failed"):
        as_buffer(FakeCudaArrayV3(np.zeros(3), stream=77))


def test_sync_hook_error_releases_dlpack():
    fake = FakeDLPackCuda(np.zeros(3))

    def failing(stream, buf):
        raise RuntimeError("sync failed")

    set_stream_sync_hook(failing)
    with pytest.raises(RuntimeError, match="sync failed"):
        as_buffer(fake)
    gc.collect()
    assert fake.deleted == 1


def test_default_sync_hook_raises_for_device_memory():
    set_stream_sync_hook(None)
    with pytest.raises(UnsupportedError, match="no CUDA runtime layer"):
        as_buffer(FakeCudaArrayV3(np.zeros(3)))
    # Without a stream nothing needs the CUDA layer.
    assert as_buffer(FakeCudaArrayV2(np.zeros(3))).memory_type is CUDA
    assert as_buffer(FakeCudaArrayV3(np.zeros(3), stream=None)).stream is None


def test_set_stream_sync_hook_returns_previous():
    def first(stream, buf):
        pass

    set_stream_sync_hook(first)
    assert set_stream_sync_hook(None) is first
    default = set_stream_sync_hook(first)
    assert default is not first
    assert set_stream_sync_hook(default) is first


def test_set_stream_sync_hook_not_callable():
    with pytest.raises(TypeError, match="callable"):
        set_stream_sync_hook(42)


# --- DLPack: streams, ownership ---------------------------------------------


@pytest.mark.parametrize(
    ("stream", "passed", "recorded"),
    [(None, 1, 1), (2, 2, 2), (0x7F00BEEF, 0x7F00BEEF, 0x7F00BEEF), (-1, -1, None)],
)
def test_dlpack_consumer_stream(stream, passed, recorded, synced):
    fake = FakeDLPackCuda(np.zeros(3))
    buf = as_buffer(fake, stream=stream)
    assert fake.streams == [passed]
    assert fake.max_versions == [(1, 0)]
    assert buf.stream == recorded
    assert synced == ([] if recorded is None else [(recorded, id(buf))])


def test_dlpack_consumer_stream_through_acquire(synced):
    fake = FakeDLPackCuda(np.zeros(3))
    acquire(fake, False, stream=5)
    assert fake.streams == [5]
    assert [stream for stream, _ in synced] == [5]


def test_dlpack_rocm_default_stream():
    fake = FakeDLPackCuda(np.zeros(3), device=(10, 0))
    as_buffer(fake)
    assert fake.streams == [0]


def test_dlpack_host_gets_no_stream(synced):
    host = DLPackHostArray(np.zeros(3))
    as_buffer(host, stream=5)
    assert host.calls == [{"max_version": (1, 0)}]
    pinned = FakeDLPackCuda(np.zeros(3), device=(3, 0))
    as_buffer(pinned)
    assert pinned.streams == [None]
    assert synced == []


def test_dlpack_stream_zero_is_ambiguous_for_cuda():
    fake = FakeDLPackCuda(np.zeros(3))
    with pytest.raises(ValueError, match="stream=0"):
        as_buffer(fake, stream=0)
    assert fake.streams == []


@pytest.mark.parametrize("stream", [-2])
def test_dlpack_stream_out_of_range(stream):
    with pytest.raises(ValueError, match=f"stream={stream}"):
        as_buffer(FakeDLPackCuda(np.zeros(3)), stream=stream)


@pytest.mark.parametrize("stream", ["1", 1.0, True])
def test_dlpack_stream_not_an_int(stream):
    with pytest.raises(TypeError, match="stream must be None or an int"):
        as_buffer(FakeDLPackCuda(np.zeros(3)), stream=stream)


def test_dlpack_legacy_fallback():
    fake = FakeDLPackCudaLegacy(np.arange(3.0))
    buf = as_buffer(fake)
    # The call with max_version fails on the signature, before any export.
    assert fake.streams == [1]
    assert "used_dltensor" in repr(buf.owner.capsule)
    assert "versioned" not in repr(buf.owner.capsule)


def test_dlpack_capsule_renamed():
    buf = as_buffer(FakeDLPackCuda(np.zeros(3)))
    assert "used_dltensor_versioned" in repr(buf.owner.capsule)


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_dlpack_deleter_runs_once_when_owner_dropped(legacy):
    before = live_fake_tensors()
    cls = FakeDLPackCudaLegacy if legacy else FakeDLPackCuda
    fake = cls(np.zeros(3))
    buf = as_buffer(fake)
    owner = buf.owner
    assert fake.deleted == 0
    assert not owner.released
    del buf
    gc.collect()
    assert fake.deleted == 0  # the owner still holds the tensor
    del owner
    gc.collect()
    assert fake.deleted == 1
    assert live_fake_tensors() == before


def test_dlpack_release_then_drop_runs_deleter_once():
    fake = FakeDLPackCuda(np.zeros(3))
    owner = as_buffer(fake).owner
    owner.release()
    assert owner.released
    assert fake.deleted == 1
    owner.release()
    del owner
    gc.collect()
    assert fake.deleted == 1


def test_dlpack_acquire_keepalive_owns_tensor():
    fake = FakeDLPackCuda(np.zeros(3))
    keepalive = acquire(fake, True)[3]
    gc.collect()
    assert fake.deleted == 0
    del keepalive
    gc.collect()
    assert fake.deleted == 1


def test_dlpack_numpy_host_owner():
    arr = np.arange(4.0)
    buf = as_buffer(DLPackHostArray(arr), writable=True)
    assert "used_dltensor_versioned" in repr(buf.owner.capsule)
    assert buf.ptr == address(arr)
    del buf
    gc.collect()


def test_dlpack_byte_offset():
    arr = np.arange(4.0)
    buf = as_buffer(FakeDLPackCuda(arr, byte_offset=64))
    assert buf.ptr == address(arr)


def test_dlpack_subbyte_packed():
    arr = np.zeros(3, dtype=np.uint8)
    buf = as_buffer(FakeDLPackCuda(arr, dtype=(17, 4, 1), shape=(5,), strides=None))
    assert (buf.nbytes, buf.itemsize, buf.format) == (3, 1, None)


def test_dlpack_bfloat16_has_no_numpy_format():
    arr = np.zeros(3, dtype=np.uint16)
    buf = as_buffer(FakeDLPackCuda(arr, dtype=(4, 16, 1)))
    assert (buf.nbytes, buf.itemsize, buf.format) == (6, 2, None)


def test_dlpack_null_strides_are_c_contiguous():
    buf = as_buffer(FakeDLPackCuda(np.zeros((3, 4)), strides=None))
    assert buf.nbytes == 96


def test_dlpack_null_data_empty():
    buf = as_buffer(FakeDLPackCuda(np.zeros((0, 4)), data=0))
    assert (buf.ptr, buf.nbytes) == (0, 0)


# --- DLPack: malformed input ------------------------------------------------


def dlpack_error(obj: Any, *parts: str, writable: bool = False) -> str:
    """as_buffer must fail naming ``parts``, and still run the deleter once."""
    before = live_fake_tensors()
    with pytest.raises(BufferError) as info:
        as_buffer(obj, writable=writable)
    message = str(info.value)
    assert message.startswith("DLPack")
    for part in parts:
        assert part in message, message
    del info
    gc.collect()
    if isinstance(obj, FakeDLPackCuda):
        assert obj.deleted == len(obj.streams)  # one export, one deleter call
    assert live_fake_tensors() == before
    return message


def test_dlpack_noncontiguous_strides():
    arr = np.zeros((4, 4))[:, ::2]
    dlpack_error(FakeDLPackCuda(arr), "non-contiguous", "shape=(4, 2)", "(4, 2)")


def test_dlpack_noncontiguous_host():
    arr = np.zeros((4, 4))[:, ::2]
    dlpack_error(DLPackHostArray(arr), "non-contiguous", "(4, 2)")


def test_dlpack_fortran_strides_accepted():
    arr = np.zeros((3, 4), order="F")
    buf = as_buffer(FakeDLPackCuda(arr))
    assert buf.nbytes == 96


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_dlpack_readonly_receive_target(legacy):
    if legacy:
        # A legacy capsule has no READ_ONLY flag: the memory passes as writable.
        assert not as_buffer(FakeDLPackCudaLegacy(readonly(np.zeros(3)))).readonly
        return
    fake = FakeDLPackCuda(np.zeros(3), readonly=True)
    dlpack_error(fake, "receive target is read-only", "READ_ONLY", writable=True)


def test_dlpack_host_readonly_receive_target():
    host = DLPackHostArray(readonly(np.zeros(3)))
    dlpack_error(host, "receive target is read-only", writable=True)


def test_dlpack_copy_is_no_receive_target():
    fake = FakeDLPackCuda(np.zeros(3), copied=True)
    dlpack_error(fake, "IS_COPIED", writable=True)
    assert as_buffer(FakeDLPackCuda(np.zeros(3), copied=True)).nbytes == 24


@pytest.mark.parametrize("device_type", [0, 4, 7, 12, 14, 99])
def test_dlpack_unknown_device(device_type):
    fake = FakeDLPackCuda(np.zeros(3), device=(device_type, 0))
    dlpack_error(fake, f"device_type={device_type}")
    assert fake.streams == []


@pytest.mark.parametrize("device", [[2, 0], (2,), ("2", 0), None, (2, 0, 0)])
def test_dlpack_bad_device_tuple(device):
    dlpack_error(FakeDLPackCuda(np.zeros(3), device=device), "__dlpack_device__()")


def test_dlpack_device_mismatch():
    fake = FakeDLPackCuda(np.zeros(3), tensor_device=(2, 5))
    dlpack_error(fake, "DLTensor.device=(2, 5)", "(2, 0)")


@pytest.mark.parametrize("lanes", [0, 2, 4])
def test_dlpack_lanes(lanes):
    fake = FakeDLPackCuda(np.zeros(3), dtype=(2, 64, lanes))
    dlpack_error(fake, f"dtype.lanes={lanes}")


@pytest.mark.parametrize("code", [18, 99, 255])
def test_dlpack_bad_dtype_code(code):
    dlpack_error(FakeDLPackCuda(np.zeros(3), dtype=(code, 8, 1)), f"dtype.code={code}")


@pytest.mark.parametrize(
    ("code", "bits"), [(0, 0), (2, 12), (2, 0), (6, 7), (4, 32), (10, 16), (17, 8)]
)
def test_dlpack_bad_dtype_bits(code, bits):
    fake = FakeDLPackCuda(np.zeros(3), dtype=(code, bits, 1))
    dlpack_error(fake, f"dtype.bits={bits}")


def test_dlpack_negative_ndim():
    dlpack_error(FakeDLPackCuda(np.zeros(3), ndim=-1), "ndim=-1")


def test_dlpack_negative_shape():
    fake = FakeDLPackCuda(np.zeros(3), shape=(-3,), strides=None)
    dlpack_error(fake, "shape=(-3,)", "negative")


def test_dlpack_null_shape():
    dlpack_error(FakeDLPackCuda(np.zeros(3), shape=None), "shape is NULL", "ndim=1")


def test_dlpack_null_data():
    dlpack_error(FakeDLPackCuda(np.zeros(3), data=0), "data is NULL")


@pytest.mark.parametrize("version", [(0, 8), (2, 0)])
def test_dlpack_unsupported_version(version):
    dlpack_error(FakeDLPackCuda(np.zeros(3), version=version), "version=")


class CapsuleProducer:
    """Speaks DLPack but returns whatever it is given."""

    def __init__(self, capsule: Any):
        self.capsule = capsule

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        return self.capsule


def test_dlpack_not_a_capsule():
    dlpack_error(CapsuleProducer(42), "capsule", "42")


def test_dlpack_used_capsule():
    owner = as_buffer(FakeDLPackCuda(np.zeros(3))).owner
    dlpack_error(CapsuleProducer(owner.capsule), "used_dltensor_versioned")


def test_dlpack_producer_not_implemented():
    class Failing(CapsuleProducer):
        def __dlpack__(self, **kwargs):
            raise NotImplementedError("no export today")

    dlpack_error(Failing(None), "__dlpack__() failed", "no export today")


def test_dlpack_producer_buffer_error_propagates():
    class Failing(CapsuleProducer):
        def __dlpack__(self, **kwargs):
            raise BufferError("DLPack producer: cannot export")

    dlpack_error(Failing(None), "cannot export")


# --- acquire ----------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [b"12345678", bytearray(8), memoryview(bytearray(8)), np.zeros(1)],
    ids=["bytes", "bytearray", "memoryview", "numpy"],
)
def test_acquire_fast_path(obj):
    cptr, nbytes, memory_type, keepalive = acquire(obj, False)
    assert ffi.typeof(cptr) is ffi.typeof("char[]")
    assert nbytes == len(cptr) == 8
    assert memory_type == MemoryType.HOST
    assert keepalive is cptr


def test_acquire_fortran_falls_back():
    arr = np.zeros((3, 4), order="F")
    cptr, nbytes, memory_type, keepalive = acquire(arr, True)
    assert ffi.typeof(cptr) is ffi.typeof("void *")
    assert int(ffi.cast("uintptr_t", cptr)) == address(arr)
    assert (nbytes, memory_type) == (96, MemoryType.HOST)
    assert isinstance(keepalive, memoryview)


@pytest.mark.parametrize(
    "target",
    [b"x", readonly(np.zeros(2)), memoryview(bytearray(2)).toreadonly()],
    ids=["bytes", "numpy-ro", "memoryview-ro"],
)
def test_acquire_readonly_receive_target(target):
    with pytest.raises(BufferError, match="receive target is read-only"):
        acquire(target, True)


def test_acquire_noncontiguous():
    with pytest.raises(BufferError, match="non-contiguous"):
        acquire(np.zeros((4, 4))[:, ::2], False)


def test_acquire_keepalive_holds_export():
    data = bytearray(8)
    keepalive = acquire(data, True)[3]
    with pytest.raises(BufferError):
        data.extend(b"x")
    del keepalive
    gc.collect()
    data.extend(b"x")


def test_acquire_device_memory_type():
    cptr, nbytes, memory_type, keepalive = acquire(FakeCudaArrayV2(np.zeros(2)), True)
    assert memory_type == int(MemoryType.CUDA)
    assert nbytes == 16
    assert isinstance(keepalive, FakeCudaArrayV2)
