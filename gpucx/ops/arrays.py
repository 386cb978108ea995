"""Typed array messaging: ``ep.send_array(arr)`` / ``ep.recv_array()``.

One array is one active message on the reserved id
:data:`~gpucx.ops.am.ARRAY_AM_ID`, sent with a reply endpoint.  The AM header
describes the array; the payload is its bytes (UCX picks eager or rendezvous
by size).  The receiver queues array messages per sender endpoint (the AM
reply endpoint), so two peers sending to one receiver never mix;
``recv_array`` allocates a fresh array of the same dtype and shape and
receives into it (rendezvous: straight from the sender, no extra copy).

Header layout (little endian), format version 1::

    magic  4s   b"GXAR"
    version B   1
    memtype B   ucs_memory_type_t of the sender's data
    order   B   b"<", b">" or b"|" (byte order of the dtype)
    ndim    B   0..64
    dtlen   B   length of the dtype string
    dtype   dtlen bytes, NumPy ``dtype.str`` (e.g. "<f8", "|b1", "<c16")
    shape   ndim x uint64
"""

from __future__ import annotations

import functools
import re
import struct
import time
from collections import deque

from .. import _bounds
from .._engine import INPROGRESS as _INPROGRESS
from .._engine import new_slot as _new_slot
from .._handle import raise_closed
from .._lib import ffi, lib
from ..errors import ClosedError, UCXError, UnsupportedError, error_for
from ..errors import TimeoutError as _TimeoutError
from ..mem import cuda as _cuda
from ..mem.buffer import _read, acquire
from ..mem.memtype import CUDA_INTS as _CUDA_INTS
from ..mem.memtype import HOST_INT as _HOST
from ..mem.memtype import MemoryType
from ..request import Request
from ..request import observe as _observe
from . import _staging
from . import am as _am

_MANAGED = int(MemoryType.CUDA_MANAGED)
_CUDA = int(MemoryType.CUDA)

__all__ = [
    "send_array",
    "send_array_nb",
    "recv_array",
    "recv_array_nb",
    "ArrayRequest",
    "FORMAT_VERSION",
]

#: Version of the array header written by this gpucx.
FORMAT_VERSION = 1
_MAGIC = b"GXAR"
_FIXED = struct.Struct("<4sBBBBB")
_MAX_NDIM = 64


def _describe(arr):
    """(contiguous object to send, dtype str, shape, device array?)."""
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(s) for s in cai["shape"])
        typestr = cai["typestr"]
        strides = cai.get("strides")
        if strides is not None:
            import numpy as np

            itemsize = np.dtype(typestr).itemsize
            expect, acc = [], itemsize
            for s in reversed(shape):
                expect.append(acc)
                acc *= s
            if tuple(strides) != tuple(reversed(expect)) and 0 not in shape:
                raise ValueError(
                    "send_array: the device array is not C-contiguous "
                    f"(shape {shape}, strides {tuple(strides)}); send a "
                    "contiguous copy (e.g. cupy.ascontiguousarray)"
                )
        return arr, typestr, shape, True
    import numpy as np

    a = arr if isinstance(arr, np.ndarray) else np.asarray(arr)
    if a.dtype.hasobject:
        raise TypeError("send_array: arrays of Python objects cannot be sent")
    if a.dtype.fields is not None or a.dtype.subdtype is not None:
        raise TypeError(
            f"send_array: structured dtype {a.dtype} is not supported; send a "
            "plain numeric/bool array"
        )
    if not a.flags.c_contiguous:
        # Send a C-ordered copy: the receiver rebuilds C order, never strides.
        a = np.ascontiguousarray(a)
    return a, a.dtype.str, a.shape, False


def _pack(typestr: str, shape, memtype: int) -> bytes:
    dt = typestr.encode()
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"send_array: {len(shape)} dimensions (at most {_MAX_NDIM})")
    order = dt[:1] if dt[:1] in (b"<", b">", b"|") else b"|"
    return (
        _FIXED.pack(_MAGIC, FORMAT_VERSION, memtype, order[0], len(shape), len(dt))
        + dt
        + struct.pack(f"<{len(shape)}Q", *shape)
    )


# A dtype string as NumPy's ``dtype.str`` writes it for the kinds gpucx sends:
# byte order, kind, item size, and a unit for datetime/timedelta.  Anything
# else (object "O", structured "i4,f8", subarray "(2,)f8", names) is refused
# before NumPy parses it.
_TYPESTR = re.compile(
    rb"[<>|=]?[biufcSUV][0-9]{1,9}|[<>|=]?[mM]8(\[[0-9]{0,9}[a-zA-Z]{1,2}\])?"
)
_MEMTYPES = frozenset(int(m) for m in MemoryType)
_INTP_MAX = (1 << 63) - 1


@functools.lru_cache(maxsize=64)
def _dtype(typestr: bytes):
    """The NumPy dtype of a header's dtype string, or ValueError."""
    import numpy as np

    if _TYPESTR.fullmatch(typestr) is None:
        raise ValueError(f"array header dtype {typestr!r} is not a plain dtype")
    try:
        dt = np.dtype(typestr.decode("ascii"))
    except (TypeError, ValueError, OverflowError, MemoryError) as exc:
        raise ValueError(f"array header dtype {typestr!r}: {exc}") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(f"array header dtype {typestr!r} is not a plain dtype")
    if dt.itemsize == 0:
        raise ValueError(f"array header dtype {typestr!r} has no size")
    return dt


def parse_header(header: bytes, nbytes: int):
    """Check an array header against the payload size; return
    ``(dtype, shape, memory_type)``.

    A pure function over bytes from the peer: it allocates nothing of the
    sizes it reads, so a hostile header costs no memory.

    Raises
    ------
    ValueError
        Naming what is wrong: short or long header, magic, version, unknown
        memory type, too many dimensions, a dtype string that is not a plain
        NumPy dtype (object, structured and subarray dtypes are refused), or
        a shape whose byte count is not ``nbytes``.
    """
    n = len(header)
    if n < _FIXED.size:
        raise ValueError(f"array header of {n} bytes is too short")
    magic, version, memtype, _order, ndim, dtlen = _FIXED.unpack_from(header)
    if magic != _MAGIC:
        raise ValueError(f"array header magic {magic!r} is not {_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"array header format version {version} (this gpucx reads {FORMAT_VERSION})"
        )
    if memtype not in _MEMTYPES:
        raise ValueError(f"array header memory type {memtype} is unknown")
    if ndim > _MAX_NDIM:
        raise ValueError(f"array header has {ndim} dimensions (at most {_MAX_NDIM})")
    end = _FIXED.size + dtlen
    if n != end + 8 * ndim:
        raise ValueError(
            f"array header length {n} does not match its ndim {ndim} and "
            f"dtype length {dtlen}"
        )
    dt = _dtype(bytes(header[_FIXED.size : end]))
    shape = struct.unpack_from(f"<{ndim}Q", header, end)
    # Python ints: a product of 64 huge dimensions cannot overflow.  NumPy
    # (and CuPy) refuse a shape whose non-zero dimensions multiply past the
    # largest intp, even when another dimension is 0.
    count = span = 1
    for d in shape:
        count *= d
        span *= d or 1
    if span * dt.itemsize > _INTP_MAX:
        raise ValueError(f"array header shape {shape} of {dt.str} is too big")
    if count * dt.itemsize != nbytes:
        raise ValueError(
            f"array header says shape {shape} of {dt.str} ({count * dt.itemsize} "
            f"bytes) but the message carries {nbytes} bytes"
        )
    return dt, shape, memtype


#: parse_header of the headers seen last: a stream of arrays repeats a few
#: headers (a pure function of the bytes; errors are not cached).
_parsed = functools.lru_cache(maxsize=256)(parse_header)


def _prepare(ep, arr):
    if ep.closed:
        raise_closed(ep)
    obj, typestr, shape, device = _describe(arr)
    if device:
        # CAI memory is CUDA memory to the header (as for as_buffer, which
        # cannot tell managed memory without the driver); the send's door
        # checks it, and waits for the producer stream, once.
        return obj, _pack(typestr, shape, _CUDA)
    # The memory type only: the producer stream is waited for once, in the
    # send's CUDA door (as_buffer would wait here too, with driver calls of
    # its own).
    buf = _read(obj, False, None)
    return obj, _pack(typestr, shape, int(buf.memory_type))


def send_array(ep, arr, *, proto=None, stream=None, timeout=None) -> None:
    """Send an array (dtype, shape and data) to the peer's ``recv_array``.

    Parameters
    ----------
    arr : array
        NumPy array (or anything ``numpy.asarray`` takes) or a CUDA array
        (``__cuda_array_interface__``).  A non-contiguous host array is sent
        as a C-contiguous copy; a non-contiguous device array is rejected.
    proto : None, "eager" or "rndv"
        Force a protocol (None: UCX chooses by size).
    stream : stream object or int, optional
        A CUDA stream (CuPy/Numba/PyTorch object or raw handle): the send is
        posted only once the work queued on it before the call finished.
    timeout : float, optional
        Seconds to wait at most (None: no limit).

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass before the array is reusable.  UCX cannot
        withdraw a send already handed to the transport: parked (the
        default) it may still reach the peer, and gpucx keeps the array alive
        (do not modify it) until UCX lets go of it, or the endpoint is
        closed; released (:attr:`Endpoint.on_timeout` ``"release"``) the
        endpoint is force-closed first.  The error's ``released`` says which.
    ValueError
        For a non-contiguous device array or more than 64 dimensions.
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it, or a ``stream``
        without a CUDA driver.
    TypeError
        For object or structured dtypes.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.ClosedError
        If the endpoint is closed.
    """
    obj, header = _prepare(ep, arr)
    flags = _am.send_flags(True, proto)
    _am._send_nb(ep, _am.ARRAY_AM_ID, obj, header, flags, stream).wait(timeout)


def send_array_nb(ep, arr, *, proto=None, stream=None):
    """Start :meth:`send_array`; returns a :class:`~gpucx.Request`.

    Raises
    ------
    ValueError, TypeError, gpucx.ClosedError
        As for :func:`send_array`.
    """
    obj, header = _prepare(ep, arr)
    flags = _am.send_flags(True, proto)
    return _am._send_nb(ep, _am.ARRAY_AM_ID, obj, header, flags, stream)


def _charge(msg) -> int:
    """Bytes an array message holds here: header and eager payload."""
    return len(msg.header) + (0 if msg.is_rndv else msg.nbytes)


def attach(e) -> None:
    """Register the internal array AM id on a new worker's engine ``e``
    (after :func:`gpucx.ops.am.attach` gave it its AM queue)."""
    am = e.am
    if am.enabled and _am._register(am, _am.ARRAY_AM_ID) == lib.UCS_OK:
        am.handlers[_am.ARRAY_AM_ID] = _on_array
    e.on_close.append(functools.partial(_close, am))


def _close(am) -> None:
    """The worker closes: posted ``recv_array_nb`` requests no array matched
    fail (ClosedError), and the staging pool lets its idle buffers go (one
    still lent to a receive goes when the receive is over)."""
    waiters = am.array_waiters
    am.array_waiters = {}
    for ws in waiters.values():
        for w in ws:
            w._settle_failed(ClosedError(f"{_NB}: the worker closed first"))
    pool = am.staging
    if pool is not None:
        pool.close()


def _on_array(msg) -> None:
    """Internal AM handler: queue the message by its sender's endpoint,
    within the caps of all array queues together
    (``GPUCX_ARRAY_QUEUE_MAX_*``)."""
    import warnings

    reply_h = msg._reply_h
    if reply_h == ffi.NULL:
        warnings.warn(
            "gpucx: array message without a reply endpoint dropped",
            RuntimeWarning,
            stacklevel=2,
        )
        msg._drop()
        return
    key = int(ffi.cast("uintptr_t", reply_h))
    e = msg._engine
    am = e.am
    q = am.arrays.get(key)
    if q is None:
        q = am.arrays[key] = deque()
    s = am.array_stats
    charge = _charge(msg)
    if (s.max_count and s.count >= s.max_count) or (
        s.max_bytes and s.bytes + charge > s.max_bytes
    ):
        # Past a cap: eager data goes back to UCX, a rendezvous payload is
        # never fetched (its sender completes).
        msg._drop()
        s.dropped += 1
        s.dropped_bytes += charge
        if not q:
            del am.arrays[key]
        _bounds.dropped(e)
        return
    q.append(msg)
    s.count += 1
    s.bytes += charge
    if am.array_waiters:
        _serve(am, key)


def _pop(q, key, pending, am) -> None:
    """Take the first queued array message of a sender off its queue."""
    charge = _charge(pending.popleft())
    s = am.array_stats
    s.count -= 1
    s.bytes -= charge
    if not pending:
        del q[key]


def _default_allocator(
    nbytes: int, memory_type: int, device: int | None = None, dtype=None, shape=None
):
    """NumPy memory for host data, CuPy memory for CUDA data.  Given
    ``dtype`` and ``shape``, the array itself in that dtype and shape (one
    allocation, nothing to view afterwards); else ``nbytes`` flat bytes."""
    if memory_type == _HOST:
        import numpy as np

        if dtype is not None:
            return np.empty(shape, dtype)
        return np.empty(nbytes, np.uint8)
    if memory_type in _CUDA_INTS:
        try:
            import cupy
        except ImportError:
            raise UnsupportedError(
                "recv_array: the sender sent CUDA memory and CuPy is not "
                "installed (install cupy or pass allocator=)"
            ) from None
        try:
            if device is None:
                # The current device: no Device switch (a few us per array).
                return _cupy_empty(cupy, nbytes, memory_type, dtype, shape)
            with cupy.cuda.Device(device):
                return _cupy_empty(cupy, nbytes, memory_type, dtype, shape)
        except Exception as exc:
            raise UnsupportedError(
                f"recv_array: cannot allocate CUDA memory here ({exc}); pass allocator="
            ) from None
    raise UnsupportedError(
        f"recv_array: no allocator for memory type {MemoryType(memory_type).name}; "
        "pass allocator="
    )


def _cupy_empty(cupy, nbytes: int, memory_type: int, dtype, shape):
    if memory_type == _MANAGED:
        mem = cupy.cuda.malloc_managed(max(nbytes, 1))
        return cupy.ndarray((nbytes,), cupy.uint8, mem)
    if dtype is not None:
        return cupy.empty(shape, dtype)
    return cupy.empty(nbytes, cupy.uint8)


_NOT_YET: object = object()
_cupy_module: object = _NOT_YET


def _cupy():
    """CuPy, or None where it does not import (asked once: a failing
    import searches the whole path every time)."""
    global _cupy_module
    if _cupy_module is _NOT_YET:
        try:
            import cupy
        except ImportError:
            cupy = None
        _cupy_module = cupy
    return _cupy_module


def _as_array(raw, typestr, shape, memory_type, nbytes):
    cai = getattr(raw, "__cuda_array_interface__", None)
    if cai is not None:
        cupy = _cupy()
        if cupy is None:
            # Device memory from the allocator and no CuPy to view it: the
            # allocator's object itself holds the array's bytes.
            return raw
        flat = cupy.asarray(raw).ravel().view(cupy.uint8)[:nbytes]
        return flat.view(typestr).reshape(shape)
    import numpy as np

    flat = np.frombuffer(raw, np.uint8, count=nbytes)
    if not flat.flags.writeable:
        flat = np.frombuffer(memoryview(raw).cast("B"), np.uint8, count=nbytes)
    return flat.view(np.dtype(typestr)).reshape(shape)


def _allocate(allocator, nbytes: int, memory_type: int, device: int | None):
    if allocator is None:
        return _default_allocator(nbytes, memory_type, device)
    if device is not None and memory_type in _CUDA_INTS:
        with _cuda.device_context(device=device):
            return allocator(nbytes, memory_type)
    return allocator(nbytes, memory_type)


#: Memory types a header may name: host and CUDA (anything else is refused
#: and dropped, never left queued).
_RECEIVABLE = _CUDA_INTS | {_HOST}


def _limit(e, max_bytes) -> int:
    """The byte limit of one recv_array call (0: none)."""
    if max_bytes is None:
        return e.context.max_array_bytes
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
        raise TypeError(
            f"recv_array: max_bytes must be an int or None, not "
            f"{type(max_bytes).__name__}"
        )
    if max_bytes < 0:
        raise ValueError(f"recv_array: max_bytes must be >= 0, not {max_bytes}")
    return max_bytes


def _discard(q, key, pending, am) -> None:
    """Drop the first queued array message of a sender.

    A rendezvous message gives its descriptor back to UCX
    (``ucp_am_data_release``), which completes the sender's request.
    """
    msg = pending[0]
    _pop(q, key, pending, am)
    msg._drop()


def recv_array(
    ep,
    timeout: float | None = None,
    allocator=None,
    *,
    device: int | None = None,
    stream=None,
    max_bytes: int | None = None,
):
    """Receive the next array the peer of ``ep`` sent with ``send_array``.

    Parameters
    ----------
    timeout : float or None
        Seconds to wait for the array (None: forever).
    allocator : callable or None
        ``allocator(nbytes, memory_type) -> buffer`` of at least ``nbytes``
        writable bytes; the default gives NumPy for host data and CuPy for
        CUDA data.  It may return host memory for CUDA data (and the
        reverse): the array then lives where the allocator put it.
    device : int or None
        CUDA device for CUDA data: the default allocator allocates there and
        a custom one is called with that device current.  None: the current
        device (CuPy's current device, or the calling thread's context).
    stream : stream object or int, optional
        A CUDA stream: the receive is posted only once the work queued on it
        before the call finished; when the call returns the data is in
        memory, visible to kernels launched afterwards on any stream.
    max_bytes : int or None
        The largest array payload, in bytes, to accept (0: no limit).  None:
        the context's ``GPUCX_MAX_ARRAY_BYTES`` option (default 4 GiB).
        A larger array is refused before anything is allocated:
        its message is dropped (the sender's request completes) and
        ``ValueError`` is raised; the next call gets the next array.

    Returns
    -------
    array
        A new array with the sender's dtype and shape (NumPy or CuPy).

    Raises
    ------
    gpucx.TimeoutError
        When no array arrived within ``timeout`` (nothing is lost).
    gpucx.UnsupportedError
        CUDA data without CuPy/GPU here, or an allocator that returned CUDA
        memory on a context that cannot move it (the array stays queued:
        retry with another ``allocator=``).
    ValueError
        A malformed array header (including a memory type other than host
        or CUDA), or an array of more than ``max_bytes`` bytes (the message
        is dropped, the next call gets the next array); or ``max_bytes`` < 0.
    MemoryError
        The allocator could not allocate the array (the message is
        dropped, the next call gets the next array).
    TypeError
        If ``max_bytes`` is not an int or None.
    gpucx.ClosedError
        If the endpoint is closed.
    gpucx.PeerError
        If the peer died (or the connection failed) while waiting.
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature.
    Exception
        Whatever an AM handler dispatched while waiting raised.
    """
    e, am, key = _receiver(ep)
    limit = _limit(e, max_bytes)
    q = am.arrays

    def alive() -> None:
        _alive(ep)

    deadline = None if timeout is None else time.monotonic() + timeout
    pending = q.get(key)
    if not pending:
        e.progress()  # runs the AM dispatch: what already arrived is queued
        pending = e.wait_for(
            lambda: q.get(key), timeout, "recv_array: no array arrived", alive
        )
    req, out, staged = _begin(e, am, q, key, pending, limit, allocator, device, stream)
    # The array is here: give its transfer at least a second.
    rest = None if deadline is None else max(1.0, deadline - time.monotonic())
    if staged is None:
        req.wait(rest)
        return out
    try:
        req.wait(rest)
    except BaseException:
        _staging.forfeit(am.staging, staged[0])
        raise
    _copy_staged(e, am, staged, _RECV)
    return out


_RECV = "recv_array"
_NB = "recv_array_nb"


def _receiver(ep):
    """``(engine, AM state, queue key)`` of a receiving endpoint.

    Raises
    ------
    gpucx.ClosedError
        If the endpoint is closed.
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature.
    """
    h = ep._h
    if h is None:
        raise_closed(ep)
    e = ep._engine
    am = e.am
    if not am.enabled:
        _am._no_am()
    return e, am, int(ffi.cast("uintptr_t", h))


def _alive(ep) -> None:
    """Raise what a receive from ``ep``'s peer fails with, once it cannot
    come: the peer died (PeerError) or the endpoint was closed."""
    if ep.closed:
        raise_closed(ep)  # gpucx found the peer dead: PeerError
    error = ep.error
    if error is not None:
        raise error  # UCX reported the peer failed (PeerError)


def _begin(e, am, q, key, pending, limit, allocator, device, stream):
    """Start receiving the first queued array message of a sender:
    ``(request, array, staged)``, ``staged`` None or what
    :func:`_copy_staged` needs once the request is done.

    Raises
    ------
    ValueError, MemoryError
        As for :func:`recv_array` (the message is dropped).
    gpucx.UnsupportedError, BufferError
        The receive could not start (the message stays queued).
    """
    msg = pending[0]
    nbytes = msg.nbytes
    if limit and nbytes > limit:
        _discard(q, key, pending, am)
        raise ValueError(
            f"recv_array: the peer sent an array of {nbytes} bytes, more than "
            f"max_bytes={limit} (GPUCX_MAX_ARRAY_BYTES); the array was dropped"
        )
    try:
        dtype, shape, memtype = _parsed(msg.header, nbytes)
        if memtype not in _RECEIVABLE:
            raise ValueError(
                f"array header memory type {MemoryType(memtype).name} is not "
                "host or CUDA memory"
            )
    except ValueError as exc:
        _discard(q, key, pending, am)
        raise ValueError(f"recv_array: malformed array message: {exc}") from None
    # The default allocator makes the array itself where it can (host and
    # CUDA device memory in a native byte order): no views to build after.
    shaped = allocator is None and dtype.isnative and memtype != _MANAGED
    try:
        if shaped and memtype == _HOST:
            import numpy as np

            raw = np.empty(shape, dtype)  # _default_allocator's host case, inlined
        elif shaped:
            raw = _default_allocator(nbytes, memtype, device, dtype, shape)
        else:
            raw = _allocate(allocator, nbytes, memtype, device)
    except MemoryError as exc:
        # Never retried into a wedge: the message goes, the next array comes.
        _discard(q, key, pending, am)
        raise MemoryError(
            f"recv_array: cannot allocate {nbytes} bytes for the peer's array "
            f"({exc or type(exc).__name__}); the array was dropped"
        ) from None
    staged = None
    if memtype == _HOST and not shaped and nbytes:
        # Host data into memory the allocator chose: device memory takes
        # the staging path (gpucx.ops._staging) when the pool has room.
        staged = _stage(e, am, raw, nbytes, stream)
    # Posting first: a receive that cannot start leaves the message queued.
    if staged is None:
        req = msg.receive_into(raw, stream=stream)
    else:
        try:
            req = msg.receive_into(staged[0].view)
        except BaseException:
            am.staging.give(staged[0])
            raise
    _pop(q, key, pending, am)
    out = raw if shaped else _as_array(raw, dtype, shape, memtype, nbytes)
    return req, out, staged


def _stage(e, am, raw, nbytes: int, stream):
    """``(bounce, device address, nbytes, streams to wait for, keepalive)``
    when host data for ``raw`` takes the staging path: ``raw`` is CUDA
    device memory of at least ``nbytes`` bytes and the worker's pool lends
    a buffer; else None (UCX receives into ``raw`` itself)."""
    if getattr(raw, "__cuda_array_interface__", None) is None:
        return None  # host memory (or DLPack, left to UCX): no staging
    pool = am.staging
    if pool is None:
        pool = am.staging = _staging.Pool(int(e.context.options["STAGING_BYTES"]))
    if not pool.cap or _cuda.driver() is None:
        return None
    ptr, n, mt, keep = acquire(raw, True, None, True)
    if mt != _CUDA or n < nbytes:
        return None  # managed memory, or a short buffer (UCX says so)
    after = []
    if type(keep) is _cuda.Deferred:
        after.append(keep.stream)  # the target's producer (CAI v3 stream)
    handle = _cuda.as_stream(stream)  # a bad stream raises before a take
    if handle is not None and handle not in after:
        after.append(handle)
    dst = int(ffi.cast("uintptr_t", ptr))
    try:
        b = pool.take(nbytes, dst)
    except _cuda.DriverError:
        b = None  # no page-locked memory to be had: the direct path
    if b is None:
        return None
    return b, dst, nbytes, tuple(after), keep


def _copy_staged(e, am, staged, what: str) -> None:
    """Copy a staged payload from its bounce buffer into device memory; the
    buffer goes back to the pool.

    Raises
    ------
    gpucx.UCXError
        ``UCS_ERR_IO_ERROR`` naming the driver's error (the array is lost).
    """
    b, dst, nbytes, after, _keep = staged
    try:
        _staging.copy_in(am.staging, b, dst, nbytes, after, e.progress)
    except _cuda.DriverError as exc:
        raise error_for(
            lib.UCS_ERR_IO_ERROR,
            f"{what}: copying the staged array ({nbytes} bytes) into device "
            f"memory failed ({exc})",
        ) from None


def _serve(am, key: int) -> None:
    """Start the ``recv_array_nb`` requests posted for sender ``key`` on its
    queued arrays, in posting order (from the array handler and when a
    request is posted)."""
    waiters = am.array_waiters.get(key)
    q = am.arrays
    while waiters:
        pending = q.get(key)
        if not pending:
            break
        if not waiters.popleft()._match(am, q, key, pending):
            break  # the array stays queued: the next request waits
    if waiters is not None and not waiters:
        del am.array_waiters[key]


def recv_array_nb(
    ep,
    allocator=None,
    *,
    device: int | None = None,
    stream=None,
    max_bytes: int | None = None,
) -> ArrayRequest:
    """Post a receive for the next array the peer of ``ep`` sends with
    ``send_array``; returns an :class:`ArrayRequest` whose result is the
    array.

    Requests posted on one endpoint take its arrays in posting order (a
    blocking :func:`recv_array` takes what no posted request took).  An
    array is received as soon as it arrives, whoever progresses the worker:
    with several requests posted, the transfers of the next arrays run
    while the program works on the current one (read-ahead).  The
    arguments are those of :func:`recv_array`; the allocator is called when
    the array arrives, inside the progress that received it.

    Returns
    -------
    ArrayRequest
        ``wait(timeout)`` returns the array.  It fails with the errors
        :func:`recv_array` raises for its array (``ValueError``,
        ``MemoryError``, ``gpucx.UnsupportedError``...), with
        :class:`~gpucx.PeerError` when the peer died before its array came,
        and with :class:`~gpucx.ClosedError` when the worker closed first.
        ``cancel()`` or a ``wait`` timeout before the array arrived
        withdraws the request (it fails with :class:`~gpucx.CanceledError`;
        the array goes to the next request); once the array is arriving,
        they cancel its transfer as for any receive (UCX may still finish a
        rendezvous fetch under way; a canceled array is lost).

    Raises
    ------
    TypeError, ValueError
        For a bad ``max_bytes`` or ``stream``.
    gpucx.ClosedError
        If the endpoint is closed.
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature.
    """
    e, am, key = _receiver(ep)
    if stream is not None:
        _cuda.as_stream(stream)  # a bad stream fails here, not on arrival
    req = ArrayRequest(e, ep, key, (_limit(e, max_bytes), allocator, device, stream))
    waiters = am.array_waiters.get(key)
    if waiters is None:
        waiters = am.array_waiters[key] = deque()
    waiters.append(req)
    if am.arrays.get(key):
        _serve(am, key)
    return req


def _const_slot(status: int):
    slot = _new_slot()
    slot.status = status
    return slot


# The slots of an ArrayRequest before its array's receive has one of its
# own: waiting for an array, an eager array copied when posted, failed.
# Shared and never written: nothing cancels or releases them (UCX holds
# none; ArrayRequest.cancel and _complete do not).
_WAITING = _const_slot(_INPROGRESS)
_MATCHED = _const_slot(lib.UCS_OK)
_SETTLED = _const_slot(lib.UCS_ERR_CANCELED)


class ArrayRequest(Request):
    """The :class:`~gpucx.Request` of :func:`recv_array_nb`: waits for the
    sender's next array, then for its transfer (and, on the staging path,
    the copy into device memory); its result is the array."""

    __slots__ = ("_key", "_args", "_inner", "_out", "_staged", "_am")

    def __init__(self, e, ep, key: int, args):
        # The fields of Request, for a slot gpucx completes until an array
        # matches; then the slot is the receive's (UCX completes it).
        self._slot = _WAITING
        self._engine = e
        self._ep = ep
        self._keep = self._value = None
        self._state = 0
        self._key = key
        self._args = args
        self._inner = None
        self._out = None
        self._staged = None
        self._am = e.am

    # Request's fields that never change here, as class constants (as
    # request._Done's): fewer stores per request.
    _holds = None
    _what = _NB
    _finish = None
    _nbytes = None

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<gpucx.ArrayRequest {state}>"

    @property
    def protocol(self):
        """The protocol UCX selected for the array's transfer while it runs
        (see :attr:`gpucx.Request.protocol`); None before the array came."""
        if self._inner is None:
            return None
        return super().protocol

    def _match(self, am, q, key, pending) -> bool:
        """Start receiving the first queued array; False when it stays
        queued (this request failed on it, the next would too)."""
        e = self._engine
        try:
            req, out, staged = _begin(e, am, q, key, pending, *self._args)
        except (ValueError, MemoryError) as exc:
            self._settle_failed(exc)  # the array was dropped
            return True
        except Exception as exc:
            self._settle_failed(exc)
            return False
        self._out = out
        self._staged = staged
        self._inner = req
        self._keep = req
        if _observe(req):  # an eager array, copied when posted
            self._slot = _MATCHED
        else:
            # From now on this request reads the receive's slot (what the
            # engine and the asyncio driver look at); the receive's own
            # request stays tracked and completes it, once (_complete).
            self._slot = req._slot
        return True

    def _settle_failed(self, exc) -> None:
        """Fail with ``exc`` before an array matched."""
        self._state = 2
        self._value = exc
        self._slot = _SETTLED

    def _withdraw(self) -> None:
        waiters = self._am.array_waiters.get(self._key)
        if waiters is not None:
            try:
                waiters.remove(self)
            except ValueError:
                pass  # matched or failed meanwhile
            if not waiters:
                del self._am.array_waiters[self._key]

    def _complete(self) -> None:
        if self._state:
            return
        inner, self._inner = self._inner, None
        staged, self._staged = self._staged, None
        out, self._out = self._out, None
        self._keep = None
        if inner is None:  # failed before an array matched
            return
        _observe(inner)  # completes the receive (its slot released once)
        exc = inner.exception()
        if exc is not None:
            if staged is not None:
                _staging.forfeit(self._am.staging, staged[0])
            self._state = 2
            self._value = exc
            return
        if staged is not None:
            try:
                _copy_staged(self._engine, self._am, staged, _NB)
            except UCXError as exc:
                self._state = 2
                self._value = exc
                return
        self._state = 1
        self._value = out

    def __del__(self) -> None:
        # Dropped unwaited with an array staged: its bounce buffer goes back
        # to the pool once the receive into it is over (else it is given
        # up: UCX may still write it).
        staged = self._staged
        if staged is not None and _staging is not None:
            pool = self._am.staging
            if _observe(self._inner):
                pool.give(staged[0])
            else:
                _staging.forfeit(pool, staged[0])

    def _unmatched_failure(self):
        """The error of a request whose peer died or endpoint closed, or
        None while it may still match."""
        try:
            _alive(self._ep)
        except UCXError as exc:
            return exc
        return None

    def done(self) -> bool:
        """Progress once if needed; True once the request finished."""
        if self._state:
            return True
        if self._inner is None:
            e = self._engine
            if e.h is None:
                return False
            e.progress()  # runs the array handler: may match
            if self._state:
                return True
            if self._inner is None:
                exc = self._unmatched_failure()
                if exc is None:
                    return False
                self._withdraw()
                self._settle_failed(exc)
                return True
        return super().done()

    def wait(
        self, timeout: float | None = None, on_timeout: str | None = None, ep=None
    ):
        """Block until the array is here; return it.

        ``on_timeout``, ``ep``: as for :meth:`gpucx.Request.wait`, once the
        array matched (its transfer is what UCX may still hold); a request
        no array matched yet is withdrawn at its deadline, nothing held.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first (the request is withdrawn,
            or the transfer canceled, see :func:`recv_array_nb`).
        Exception
            The request's own error (see :func:`recv_array_nb`).
        """
        if not self._state and self._inner is None:
            e = self._engine
            if e.h is None:
                e.raise_closed()
            deadline = None if timeout is None else time.monotonic() + timeout

            def check() -> None:
                exc = self._unmatched_failure()
                if exc is not None:
                    self._withdraw()
                    self._settle_failed(exc)

            try:
                e.wait_for(
                    lambda: self._state or self._inner is not None,
                    timeout,
                    f"{_NB}: no array arrived",
                    check,
                )
            except _TimeoutError:
                if self._inner is None and not self._state:
                    self._withdraw()
                    self._settle_failed(error_for(lib.UCS_ERR_CANCELED, _NB))
                raise
            if self._state:
                raise self._value
            # The array is here: give its transfer at least a second.
            if deadline is not None:
                timeout = max(1.0, deadline - time.monotonic())
        return super().wait(timeout, on_timeout, ep)

    def cancel(self) -> bool:
        """Withdraw the request, or cancel its array's transfer; True if
        it was still pending."""
        if self._state:
            return False
        if self._inner is None:
            self._withdraw()
            self._settle_failed(error_for(lib.UCS_ERR_CANCELED, _NB))
            return True
        return super().cancel()
