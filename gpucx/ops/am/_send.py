"""Sending active messages: ``am_send`` (one C call, post and wait),
``am_send_nb``, and gpucx's own sends on reserved ids; the header and
flag helpers ``gpucx.ops.am_batch`` and ``gpucx.ops.arrays`` share."""

from __future__ import annotations

from ... import protocols as _protocols
from ..._engine import new_slot
from ..._handle import raise_closed
from ..._lib import ffi, lib
from ...mem import cuda as _cuda
from ...mem.buffer import _BUFFER_TYPES, _from_buffer, acquire
from ...mem.memtype import HOST_INT as _HOST
from ...request import (
    Request,
    _DoneAtPost,
    _new_done,
    finish,
    posted,
)
from ._state import (
    _INPROGRESS,
    _NULL,
    _OK,
    _PROTO,
    _REPLY,
    _SEND,
    MAX_USER_AM_ID,
    RESERVED_AM_IDS,
    _am_send,
    _no_am,
    check_id,
)


def send_internal_nb(ep, am_id: int, buf, header=b"", *, reply=False) -> Request:
    """:func:`am_send_nb` for a reserved id (gpucx modules only).

    Raises
    ------
    ValueError
        For an id outside the reserved range.
    """
    if ep.closed:
        raise_closed(ep)
    if am_id not in RESERVED_AM_IDS:
        raise ValueError(f"{am_id!r} is not a reserved gpucx AM id")
    return _send_nb(ep, am_id, buf, header, _REPLY if reply else 0)


def pack_header(e, header):
    """``(pointer, length)`` of an AM user header for the worker of engine
    ``e`` (NULL, 0 for none; also for gpucx.ops.am_batch).

    Raises
    ------
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature.
    ValueError
        For a header longer than the worker's maximum.
    """
    am = e.am
    if not am.enabled:
        _no_am()
    if not header:
        return ffi.NULL, 0
    h = ffi.from_buffer(header)
    n = len(h)
    if am.max_header is None:
        am.max_header = lib.gpucx_am_max_header(e.h)
    if n > am.max_header:
        raise ValueError(
            f"am_send: header of {n} bytes exceeds this worker's maximum of "
            f"{am.max_header} bytes (put large data in the payload)"
        )
    return h, n


def send_flags(reply, proto) -> int:
    """The ``gpucx_am_send`` flags of ``reply`` and ``proto`` (also for
    gpucx.ops.am_batch and gpucx.ops.arrays).

    Raises
    ------
    ValueError
        For a ``proto`` other than None, "eager" and "rndv".
    """
    try:
        flags = _PROTO[proto]
    except (KeyError, TypeError):
        raise ValueError(
            f"proto must be None, 'eager' or 'rndv', not {proto!r}"
        ) from None
    return flags | _REPLY if reply else flags


def am_send(
    ep,
    am_id: int,
    buf,
    header=b"",
    *,
    reply: bool = False,
    proto=None,
    stream=None,
    timeout=None,
):
    """Send ``buf`` as an active message to handler ``am_id`` of the peer;
    return once ``buf`` is reusable.

    Parameters
    ----------
    am_id : int
        0..0xFEFF.
    buf : buffer
        Any object :func:`gpucx.mem.as_buffer` accepts (may be empty).
    header : bytes-like
        Small user header (at most the worker's ``max_am_header``, copied).
    reply : bool
        Give the receiver a :attr:`AmMessage.reply_ep` back to this worker.
    proto : None, "eager" or "rndv"
        Force a protocol; None lets UCX choose by size.
    stream : stream object or int, optional
        A CUDA stream (CuPy/Numba/PyTorch object or raw handle): the send is
        posted only once the work queued on it before the call finished.
    timeout : float, optional
        Seconds to wait at most (None: no limit).

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass before ``buf`` is reusable.  UCX cannot
        withdraw a send already handed to the transport: parked (the
        default) it may still reach the peer, and gpucx keeps ``buf`` alive
        (do not modify it) until UCX lets go of it, or the endpoint is
        closed; released (:attr:`Endpoint.on_timeout` ``"release"``) the
        endpoint is force-closed first.  The error's ``released`` says which.
    ValueError
        For a bad id, an unknown ``proto`` or an oversized header.
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it, or a ``stream``
        without a CUDA driver.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send.
    """
    h = ep._h
    if h is None:
        raise_closed(ep)
    check_id(am_id)
    flags = send_flags(reply, proto)
    e = ep._engine
    hdr, hn = pack_header(e, header)
    ptr, n, mt, keep = acquire(buf, False, stream, True)
    if mt == _HOST and stream is None:
        slot = e.sslot or new_slot()  # Engine.slot(), inlined (a call less)
        st = lib.gpucx_am_send_wait(
            e.state, h, am_id, hdr, hn, ptr, n, mt, flags, slot, e.spin_ns
        )
    else:
        with _cuda.door(e, ptr, mt, stream, _SEND, keep):
            slot = e.slot()
            st = lib.gpucx_am_send_wait(
                e.state, h, am_id, hdr, hn, ptr, n, mt, flags, slot, e.spin_ns
            )
        if mt != _HOST and not (ep._proto_seen >> (_AM_PROTO_BIT + mt)) & 1:
            _check_protocol(ep, mt, n, slot if st == _INPROGRESS else None)
    if st:
        finish(e, slot, st, timeout, _SEND, ep, keep)


#: gpucx.protocols' first-use bits of AM sends: one per device memory type
#: (tag sends use 32 + memory type, RMA the bits below 32).
_AM_PROTO_BIT = 48


def _check_protocol(ep, mt: int, n: int, slot) -> None:
    """Once per endpoint and device memory type: warn if UCX put this active
    message on a slow path (gpucx.protocols).  Host memory has none by its
    rules, so the host path does not look."""
    _protocols.first_use(ep, "am", _AM_PROTO_BIT + mt, n, (mt, ""), slot)


def am_send_nb(
    ep, am_id: int, buf, header=b"", *, reply: bool = False, proto=None, stream=None
) -> Request:
    """Start sending an active message (see :func:`am_send`, also for
    ``stream``).

    Returns
    -------
    Request
        ``wait()`` returns None once ``buf`` is reusable.

    Raises
    ------
    ValueError
        For a bad id, an unknown ``proto`` or an oversized header.
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send.
    """
    h = ep._h
    if h is None:
        raise_closed(ep)
    if type(am_id) is not int or not 0 <= am_id <= MAX_USER_AM_ID:
        check_id(am_id)
    flags = (_REPLY if reply else 0) if proto is None else send_flags(reply, proto)
    return _send_nb(ep, am_id, buf, header, flags, stream)


def _send_nb(ep, am_id, buf, header, flags, stream=None) -> Request:
    e = ep._engine
    if not header and stream is None and type(buf) in _BUFFER_TYPES and e.am.enabled:
        # No header, a host buffer: _header, acquire's fast path and posted
        # inlined, three calls fewer a message.  Anything else (and every
        # error) takes the general path below.
        try:
            ptr = keep = _from_buffer(buf)
        except (ValueError, BufferError, TypeError):
            pass
        else:
            slot = e.sslot or new_slot()  # Engine.slot(), inlined (a call less)
            st = _am_send(ep._h, am_id, _NULL, 0, ptr, len(ptr), _HOST, flags, slot)
            if st == _OK:
                return _new_done(_DoneAtPost)
            e.release_shared(slot)
            return Request(e, slot, keep, _SEND, None, ep)
    hdr, hn = pack_header(e, header)
    ptr, n, mt, keep = acquire(buf, False, stream, True)
    if mt == _HOST and stream is None:
        slot = e.slot()
        st = lib.gpucx_am_send(ep._h, am_id, hdr, hn, ptr, n, mt, flags, slot)
    else:
        with _cuda.door(e, ptr, mt, stream, _SEND, keep):
            slot = e.slot()
            st = lib.gpucx_am_send(ep._h, am_id, hdr, hn, ptr, n, mt, flags, slot)
        if mt != _HOST and not (ep._proto_seen >> (_AM_PROTO_BIT + mt)) & 1:
            _check_protocol(ep, mt, n, slot if st == _INPROGRESS else None)
    return posted(e, slot, st, keep, _SEND, ep)
