"""Posted receives: ``am_recv``/``am_recv_nb`` and
``am_recv_many``/``am_recv_many_nb``, matched to arriving messages in the
UCX callback (C), with no Python per message."""

from __future__ import annotations

from ..._handle import raise_closed
from ..._internal import engine
from ..._lib import ffi, lib
from ...errors import (
    UCXError,
    UnsupportedError,
    check,
)
from ...mem import cuda as _cuda
from ...mem.buffer import acquire
from ...mem.memtype import CUDA_INTS as _CUDA_TYPES
from ...mem.memtype import HOST_INT as _HOST
from ...request import (
    Request,
    raise_status,
)
from ._state import (
    _INPROGRESS,
    _NO_MEMORY,
    _OK,
    _PTRS,
    _RECV,
    _SIZES,
    _AmWorker,
    _new_slot,
    _no_am,
    _register,
    check_id,
)


def _nbytes(req) -> int:
    return req._slot.length


def recv_registration(e, am_id: int):
    """The registration posted receives for ``am_id`` go through on the
    worker of engine ``e`` (made on first use; what
    ``gpucx._internal.am_recv_registration`` hands the benchmark's C
    loops)."""
    return _recv_reg(e.am, am_id)


def _recv_reg(am: _AmWorker, am_id: int):
    """The registration of an id used with posted receives (made on first
    use: the C callback is installed, and without a handler messages that
    find no posted receive are kept for the next one)."""
    reg = am.regs.get(am_id)
    if reg is None or am_id not in am.recv_ids:
        check(_register(am, am_id), "ucp_worker_set_am_recv_handler")
        reg = am.regs[am_id]
        am.recv_ids.add(am_id)
        if am_id not in am.handlers:
            lib.gpucx_am_set_keep(reg, 1)
    return reg


def _recv_target(e, buf, stream, what: str):
    """``(ptr, nbytes, memory_type, keepalive)`` of a posted receive's
    buffer: writable host or CUDA memory.  Device memory passes the CUDA
    door now (the context can move it, its owner is made current when
    none is, its producer stream and ``stream`` are waited for): UCX
    writes it later, inside progress."""
    ptr, n, mt, keep = acquire(buf, True, stream, True)
    if mt != _HOST and mt not in _CUDA_TYPES:
        raise UnsupportedError(
            f"{what}: posted receives take host or CUDA memory, not "
            f"{_memtype_name(mt)} memory"
        )
    if mt != _HOST or stream is not None:
        _cuda.door(e, ptr, mt, stream, _RECV, keep).ready()
    return ptr, n, mt, keep


def _memtype_name(mt: int) -> str:
    from ...mem.memtype import MemoryType

    try:
        return MemoryType(mt).name
    except ValueError:
        return f"memory type {mt}"


def _copy_kept(e, msg, ptr, mt) -> int:
    """Copy the kept eager message C handed over (``GPUCX_AM_COPY_IN``)
    into device memory at ``ptr`` and give its data back; its length."""
    try:
        _cuda.door(e, ptr, mt, None, _RECV).copy_in(msg.data, msg.length)
    finally:
        lib.gpucx_am_release(e.h, msg)
    return msg.length


def _posted_target(worker, e, am_id, buf, stream, what: str):
    """Check a posted receive: ``(reg, ptr, nbytes, memory_type, keepalive)``."""
    if e.h is None:
        raise_closed(worker)
    am = e.am
    if type(am_id) is not int or am_id not in am.recv_ids:
        check_id(am_id)
        if not am.enabled:
            _no_am()
    ptr, n, mt, keep = _recv_target(e, buf, stream, what)
    return _recv_reg(am, am_id), ptr, n, mt, keep


def am_recv_nb(worker, am_id: int, buf, *, stream=None) -> Request:
    """Post ``buf`` for the next active message sent to ``am_id``.

    Posted receives of an id are matched to its messages in posting order,
    in the UCX callback itself: a rendezvous payload moves straight into
    ``buf`` (zero copy) and an eager one is copied, with no Python run per
    message.  A matched message never reaches the id's handler; messages
    that find no posted receive go to the handler as usual, or, when the id
    has no handler, wait (in C, in arrival order) for the next receive
    posted, which takes the oldest at once; past the context's
    ``GPUCX_AM_KEPT_MAX_COUNT`` / ``GPUCX_AM_KEPT_MAX_BYTES`` caps they are
    dropped instead (counted in ``worker.stats()["am_kept"]``).  The first
    receive posted for an id registers it: before that, UCX drops messages
    of an id with neither handler nor receive.  The header and reply
    endpoint of a matched message are not kept (use a handler when you need
    them).

    ``buf`` may be host or CUDA memory.  A CUDA buffer passes the CUDA door
    when posted (the context can move CUDA memory; the owning device's
    context is made current if the thread has none; a CAI v3 producer
    stream and ``stream`` are waited for), and UCX writes it with the
    memory type given: a rendezvous payload zero copy (``cuda_ipc``,
    GPUDirect), an eager one unpacked by UCX's own CUDA copy, in the UCX
    callback, with no Python per message either way.  The one exception
    is an eager message already kept when a CUDA buffer is posted: gpucx
    copies it in with the CUDA driver when posting (UCX cannot unpack
    every kept eager message safely outside its callback).  UCX touches
    device memory inside ``progress()``: progress the worker from a thread
    where the device's context is current (gpucx leaves the owner current
    when posting from a thread that had none).

    Returns
    -------
    Request
        ``wait()`` returns the payload size in bytes.  It fails with
        :class:`~gpucx.MessageTruncatedError` for a message larger than
        ``buf`` (the message is dropped, its sender completes); ``cancel()``
        or a ``wait`` timeout withdraws a receive no message matched yet,
        and a message arriving later is not lost.

    Raises
    ------
    ValueError
        For an id outside 0..0xFEFF.
    BufferError
        If ``buf`` is read-only or not contiguous.
    gpucx.UnsupportedError
        For memory other than host and CUDA memory, CUDA memory on a
        context that cannot move it (the message says what is missing), a
        ``stream`` without a CUDA driver, or a context without the ``"am"``
        feature.
    gpucx.ClosedError
        If the worker is closed.
    """
    e = worker._engine
    reg, ptr, n, mt, keep = _posted_target(worker, e, am_id, buf, stream, "am_recv_nb")
    slot = _new_slot()
    if mt == _HOST:
        st = lib.gpucx_am_post(reg, ptr, n, slot)
    else:
        out = ffi.new(_MSG)
        st = lib.gpucx_am_post_mt(reg, ptr, n, mt, slot, out)
        if st == _COPY_IN:
            slot.length = _copy_kept(e, out, ptr, mt)
            slot.status = _OK
    if st == _NO_MEMORY:
        check(st, "am_recv_nb")
    # Pending, or finished at once with a kept message (OK or truncated).
    return Request(e, slot, keep, _RECV, _nbytes, None, n)


def am_recv(worker, am_id: int, buf, timeout: float | None = None, *, stream=None):
    """Receive the next active message sent to ``am_id`` into ``buf`` (see
    :func:`am_recv_nb`); return the payload size in bytes.

    Posts and waits in one call into C.  A message that arrived before the
    call (kept, see :func:`am_recv_nb`) is received at once, so a loop of
    ``am_recv`` loses nothing between its calls.

    Raises
    ------
    gpucx.TimeoutError
        When no message arrived within ``timeout`` (the receive is withdrawn).
    gpucx.MessageTruncatedError
        For a message larger than ``buf`` (dropped).
    ValueError, BufferError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`am_recv_nb`.
    """
    e = worker._engine
    reg, ptr, n, mt, keep = _posted_target(worker, e, am_id, buf, stream, "am_recv")
    slot = e.sslot or _new_slot()  # Engine.slot(), inlined (a call less)
    out = ffi.NULL if mt == _HOST else ffi.new(_MSG)
    st = lib.gpucx_am_recv_wait(e.state, reg, ptr, n, mt, slot, out, e.spin_ns)
    if st == _COPY_IN:
        return _copy_kept(e, out, ptr, mt)
    if st == _INPROGRESS:
        st = e.block(slot, timeout, keep)
    if st != _OK:
        if st == _NO_MEMORY:
            check(st, "am_recv")
        raise_status(st, _RECV, None, slot, n)
    return slot.length


_SLOTS = ffi.typeof("gpucx_slot_t[]")


_MSG = ffi.typeof("gpucx_am_msg_t *")


_MTS = ffi.typeof("int[]")


_COPY_IN = lib.GPUCX_AM_COPY_IN


_GROUP = ffi.typeof("gpucx_am_group_t *")


_RECV_MANY = "am receive (posted together)"


def _sizes(req) -> list:
    members = req._keep[1]
    n = len(members)
    out = ffi.new(_SIZES, n)
    lib.gpucx_am_group_lengths(members, n, out)
    return ffi.unpack(out, n)


def am_recv_many_nb(worker, am_id: int, bufs, *, stream=None) -> Request:
    """Post every buffer of ``bufs``, in order, for the next ``len(bufs)``
    active messages sent to ``am_id``; one request for all of them.

    As :func:`am_recv_nb` for each buffer (matched in posting order, in the
    UCX callback, no Python per message), with one C call to post them all
    and one completion: the way to keep a stream of messages flowing into a
    set of buffers at the cost of one Python call per batch.  Receives
    posted singly and in groups share one order per id.

    Parameters
    ----------
    bufs : sequence of buffers
        Writable, contiguous host or CUDA memory each (the same buffer may
        appear more than once; CUDA buffers as for :func:`am_recv_nb`).
    stream : stream object or int, optional
        As for :func:`am_recv_nb`.

    Returns
    -------
    Request
        ``wait()`` returns the payload sizes, a list in the order of
        ``bufs``, once every buffer received its message.  If one failed
        (a message larger than its buffer: ``MessageTruncatedError``, the
        message is dropped) the request fails with that error once every
        buffer is done.  ``cancel()`` or a ``wait`` timeout withdraws the
        buffers no message has matched yet (the request then fails with
        :class:`~gpucx.CanceledError`); messages already matched still land
        in their buffers.

    Raises
    ------
    TypeError
        If ``bufs`` is not a sequence.
    ValueError, BufferError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`am_recv_nb` (naming the buffer), before anything is
        posted.
    """
    e = engine(worker)
    if e.h is None:
        raise_closed(worker)
    check_id(am_id)
    am = e.am
    if not am.enabled:
        _no_am()
    try:
        bufs = list(bufs)
    except TypeError:
        raise TypeError(
            f"am_recv_many_nb: bufs must be a sequence of buffers, not "
            f"{type(bufs).__name__}"
        ) from None
    n = len(bufs)
    keeps = []
    # Each distinct buffer is checked once.  One buffer posted n times (a
    # stream of messages into one buffer) goes to C as one entry: no
    # per-message Python, the cost that bounds a receiver's message rate.
    ids = set(map(id, bufs))
    seen: dict = {}
    for i, buf in enumerate(bufs):
        if id(buf) in seen:
            continue
        try:
            ptr, nbytes, mt, keep = _recv_target(e, buf, stream, "am_recv_many_nb")
        except (TypeError, ValueError, BufferError, UCXError) as exc:
            exc.args = (f"am_recv_many_nb: buffer {i}: {exc}", *exc.args[1:])
            raise
        seen[id(buf)] = (ptr, nbytes, mt)
        keeps.append((buf, keep))
        if len(seen) == len(ids):
            break
    if len(seen) == 1:
        got = list(seen.values())
        nbufs = 1
    else:
        got = [seen[id(buf)] for buf in bufs]
        nbufs = n
    ptrs = ffi.new(_PTRS, [g[0] for g in got] or 1)
    lens = ffi.new(_SIZES, [g[1] for g in got] or 1)
    device = any(g[2] != _HOST for g in got)
    mts = ffi.new(_MTS, [g[2] for g in got]) if device else ffi.NULL
    if stream is not None and not device:
        _cuda.door(e, ffi.NULL, _HOST, stream, _RECV).ready()
    reg = _recv_reg(am, am_id)
    members = ffi.new(_SLOTS, max(n, 1))
    group = ffi.new(_GROUP)
    at = ffi.new("size_t *")
    out = ffi.new(_MSG) if device else ffi.NULL
    args = (reg, group, ptrs, lens, mts, nbufs, members, n, at, out)
    st = lib.gpucx_am_post_group(*args)
    while st == _COPY_IN:
        # A kept eager message for device memory (see _copy_kept); the
        # members before it are posted, the ones after it not yet.
        i = at[0]
        g = got[0] if nbufs == 1 else got[i]
        try:
            length, done = _copy_kept(e, out, g[0], g[2]), _OK
        except Exception:
            # The members around it are posted and belong to the request
            # now: this one fails, the request reports it when waited.
            length, done = out.length, lib.UCS_ERR_IO_ERROR
        lib.gpucx_am_member_finish(group, members + i, done, length)
        at[0] = i + 1
        st = lib.gpucx_am_post_group(*args)
    if st not in (lib.UCS_INPROGRESS, lib.UCS_OK) and at[0] == 0:
        # Nothing posted.  Past the first member, the members left failed
        # in C and the request reports it.
        check(st, "am_recv_many_nb")
    if n == 0:
        members = ffi.new(_SLOTS, 0)
    slot = ffi.addressof(group, "slot")
    return Request(e, slot, (keeps, members, group), _RECV_MANY, _sizes)


def am_recv_many(
    worker, am_id: int, bufs, timeout: float | None = None, *, stream=None
) -> list:
    """Receive the next ``len(bufs)`` active messages sent to ``am_id`` into
    ``bufs``, in order (see :func:`am_recv_many_nb`); return their sizes.

    Raises
    ------
    gpucx.TimeoutError
        When not every buffer received a message within ``timeout`` (the
        rest are withdrawn).
    gpucx.MessageTruncatedError
        For a message larger than its buffer (dropped).
    TypeError, ValueError, BufferError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`am_recv_many_nb`.
    """
    return am_recv_many_nb(worker, am_id, bufs, stream=stream).wait(timeout)
