"""Tag-matched messaging (``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx``).

Plain UCP on the wire: the user's tag and bytes, nothing added, so gpucx
interoperates with any UCX program that uses the same tags.

The blocking calls post and progress in one C call on the worker's shared
slot (no per-message allocation); the ``_nb`` calls return a
:class:`~gpucx.Request` that holds the buffers until completion.  A list of
buffers is one message (UCX IOV datatype).
"""

from __future__ import annotations

from .. import protocols as _protocols
from .._engine import INPROGRESS, new_slot
from .._handle import raise_closed
from .._internal import engine
from .._lib import ffi, lib
from ..errors import AlreadyReceivedError
from ..mem import cuda as _cuda
from ..mem.buffer import _BUFFER_TYPES as _FAST_TYPES
from ..mem.buffer import acquire
from ..mem.memtype import HOST_INT as _HOST
from ..request import RecvInfo, Request, finish, posted, raise_status

__all__ = ["send", "send_nb", "recv", "recv_nb", "probe", "TAG_MASK_FULL"]

#: Match every bit of the tag.
TAG_MASK_FULL = (1 << 64) - 1

_SEND = "tag send"
_RECV = "tag recv"


def _bad_tag(exc: Exception, tag, tag_mask=0) -> Exception:
    """What to raise for ``exc``, an ``OverflowError`` or ``TypeError`` of a
    post call: the error naming a bad ``tag`` or ``tag_mask``, or ``exc``
    itself when both are good (then the cause is elsewhere, and every
    entry point says so alike)."""
    for name, value in (("tag", tag), ("tag_mask", tag_mask)):
        if not isinstance(value, int):
            return TypeError(f"{name} must be an int, not {type(value).__name__}")
        if not 0 <= value <= TAG_MASK_FULL:
            return ValueError(f"{name} must be in [0, 2**64), not {value}")
    return exc


def _iov(bufs, writable: bool, stream=None):
    """Acquire each buffer of a list; build the UCX IOV array."""
    n = len(bufs)
    if n == 0:
        raise ValueError("a list of buffers must not be empty")
    iov = ffi.new("ucp_dt_iov_t[]", n)
    keep = [iov]
    memtype = None
    for i, b in enumerate(bufs):
        ptr, nbytes, mt, k = acquire(b, writable, stream)
        if memtype is None:
            memtype = mt
        elif mt != memtype:
            raise ValueError(
                "all buffers of one message must be in the same memory type"
            )
        iov[i].buffer = ffi.cast("void *", ptr)
        iov[i].length = nbytes
        keep.append(k)
    total = sum(iov[i].length for i in range(n))
    return iov, n, memtype, keep, total


_tuple_new = tuple.__new__
_from_buffer = ffi.from_buffer
_CHAR_ARRAY = ffi.typeof("char[]")


def send(ep, buf, tag: int = 0, *, stream=None, timeout=None) -> None:
    """Send ``buf`` to the peer with ``tag``; return once ``buf`` is reusable.

    ``buf`` is any object :func:`gpucx.mem.as_buffer` accepts, or a list of
    them sent as one message.  ``stream`` (a CuPy/Numba/PyTorch stream or a
    raw handle): the send is posted only once the work queued on it before
    the call has finished (the worker progresses meanwhile).  ``timeout``:
    seconds to wait at most (None: no limit).

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass before ``buf`` is reusable.  UCX cannot
        withdraw a send already handed to the transport: by default
        (:attr:`Endpoint.on_timeout` ``"park"``) it may still reach the
        peer, and gpucx keeps ``buf`` alive (do not modify it) until UCX
        lets go of it, or the endpoint is closed; with ``"release"`` the
        endpoint is force-closed first and ``buf`` is yours again.  The
        error's ``released`` says which (docs/reliability.md, "Deadlines
        and the buffer"; per call: ``send_nb(...).wait(timeout,
        on_timeout=...)``).
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send (non-contiguous...).
    ValueError
        For a tag outside [0, 2**64).
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it (see
        :attr:`Context.cuda_problem`), or a ``stream`` without a CUDA driver.
    """
    h = ep._h
    if h is None:
        raise_closed(ep)
    e = ep._engine
    # acquire()'s exact-type fast path, inlined: a function call is a third
    # of the Python cost of a small blocking send.  Anything unusual (and
    # every error) goes through acquire(), the one door.
    if type(buf) in _FAST_TYPES:
        try:
            ptr = keep = _from_buffer(buf)
            n, mt = len(ptr), _HOST
        except (ValueError, BufferError, TypeError):
            ptr, n, mt, keep = acquire(buf, False)
    elif type(buf) is list or type(buf) is tuple:
        send_nb(ep, buf, tag, stream=stream).wait(timeout)
        return
    else:
        ptr, n, mt, keep = acquire(buf, False, stream, True)
    if mt == _HOST and stream is None:  # inlined: the small-message path
        slot = e.sslot or new_slot()  # Engine.slot(), inlined (a call less)
        try:
            st = lib.gpucx_tag_send_wait(e.state, h, ptr, n, tag, mt, slot, e.spin_ns)
        except (OverflowError, TypeError) as exc:
            raise _bad_tag(exc, tag) from None
    else:
        with _cuda.door(e, ptr, mt, stream, _SEND, keep):
            slot, st = _send(e, h, ptr, n, tag, mt)
        if not (ep._proto_seen >> (32 + mt)) & 1:
            _check_protocol(ep, mt, n, slot if st == INPROGRESS else None)
    if st:
        finish(e, slot, st, timeout, _SEND, ep, keep)


def _check_protocol(ep, mt: int, n: int, slot) -> None:
    """Once per endpoint and device memory type: warn if UCX put this send
    on a slow path (gpucx.protocols).  Host sends have none by its rules
    (only RMA emulation and device memory staged through host copies are),
    so the host path does not look."""
    _protocols.first_use(ep, "tag", 32 + mt, n, (mt, ""), slot)


def _send(e, h, ptr, n: int, tag, mt: int):
    """Post a blocking tag send (the device path of :func:`send`)."""
    slot = e.slot()
    try:
        return slot, lib.gpucx_tag_send_wait(
            e.state, h, ptr, n, tag, mt, slot, e.spin_ns
        )
    except (OverflowError, TypeError) as exc:
        raise _bad_tag(exc, tag) from None


def send_nb(ep, buf, tag: int = 0, sync: bool = False, *, stream=None) -> Request:
    """Start sending ``buf`` (or a list of buffers as one message).

    With ``sync=True`` the request completes only once the receiver matched
    the message (``ucp_tag_send_sync_nbx``).  ``stream``: as for
    :func:`send` (waited for before the send is posted).

    Returns
    -------
    Request
        ``wait()`` returns None.

    Raises
    ------
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send.
    ValueError
        For a tag outside [0, 2**64) or an empty list.
    gpucx.UnsupportedError
        As for :func:`send`.
    """
    h = ep._h
    if h is None:
        raise_closed(ep)
    e = ep._engine
    slot = e.slot()
    try:
        if type(buf) is list or type(buf) is tuple:
            iov, count, mt, keep, n = _iov(buf, False, stream)
            if mt == _HOST and stream is None:
                st = lib.gpucx_tag_send_iov(
                    h, iov, count, tag, mt, 1 if sync else 0, slot
                )
            else:
                with _cuda.door(e, iov[0].buffer, mt, stream, _SEND):
                    st = lib.gpucx_tag_send_iov(
                        h, iov, count, tag, mt, 1 if sync else 0, slot
                    )
        else:
            ptr, n, mt, keep = acquire(buf, False, stream, True)
            if mt == _HOST and stream is None:
                st = lib.gpucx_tag_send(h, ptr, n, tag, mt, 1 if sync else 0, slot)
            else:
                with _cuda.door(e, ptr, mt, stream, _SEND, keep):
                    st = lib.gpucx_tag_send(h, ptr, n, tag, mt, 1 if sync else 0, slot)
    except (OverflowError, TypeError) as exc:
        raise _bad_tag(exc, tag) from None
    req = posted(e, slot, st, keep, _SEND, ep)
    if mt != _HOST and not (ep._proto_seen >> (32 + mt)) & 1:
        _check_protocol(ep, mt, n, slot if st == INPROGRESS else None)
    return req


def _recv_info(req) -> RecvInfo:
    slot = req._slot
    return _tuple_new(RecvInfo, (slot.tag, slot.length))


def recv(
    worker,
    buf,
    tag: int = 0,
    tag_mask: int = TAG_MASK_FULL,
    timeout: float | None = None,
    *,
    stream=None,
) -> RecvInfo:
    """Receive one message whose tag matches ``tag`` under ``tag_mask``.

    ``stream`` (a CuPy/Numba/PyTorch stream or a raw handle): the receive is
    posted only once the work queued on it before the call has finished, so
    kernels still reading ``buf`` are not overwritten.  When the call
    returns the data is in device memory (UCX completes a CUDA transfer only
    after its copies finished), visible to kernels launched afterwards.

    Returns
    -------
    RecvInfo
        ``(tag, nbytes)``: the sender's tag and the bytes received.

    Raises
    ------
    gpucx.MessageTruncatedError
        If the message is larger than ``buf`` (names both sizes).
    gpucx.TimeoutError
        When ``timeout`` seconds pass first (the receive is canceled; one
        UCX already matched to a send stays parked, its ``released`` False:
        to release it, ``recv_nb(...).wait(timeout, on_timeout="release",
        ep=endpoint_to_the_sender)``, docs/reliability.md).
    BufferError
        If ``buf`` is read-only or not contiguous.
    gpucx.ClosedError
        If the worker is closed.
    gpucx.UnsupportedError
        As for :func:`send`.
    """
    e = worker._engine
    h = e.h
    if h is None:
        raise_closed(worker)
    if type(buf) in _FAST_TYPES:  # acquire()'s fast path, inlined (see send)
        try:
            ptr = keep = _from_buffer(_CHAR_ARRAY, buf, True)
            n, mt = len(ptr), _HOST
        except (ValueError, BufferError, TypeError):
            ptr, n, mt, keep = acquire(buf, True)
    elif type(buf) is list or type(buf) is tuple:
        return recv_nb(worker, buf, tag, tag_mask, stream=stream).wait(timeout)
    else:
        ptr, n, mt, keep = acquire(buf, True, stream, True)
    if mt == _HOST and stream is None:
        # Inlined (a call costs a measurable share of a small blocking
        # receive); the device path shares it through _recv.
        slot = e.sslot or new_slot()  # Engine.slot(), inlined (a call less)
        try:
            if timeout is None:
                st = lib.gpucx_tag_recv_wait(
                    e.state, ptr, n, tag, tag_mask, mt, slot, e.spin_ns
                )
            else:
                st = lib.gpucx_tag_recv(h, ptr, n, tag, tag_mask, mt, slot)
        except (OverflowError, TypeError) as exc:
            raise _bad_tag(exc, tag, tag_mask) from None
    else:
        with _cuda.door(e, ptr, mt, stream, _RECV, keep):
            slot, st = _recv(e, h, ptr, n, tag, tag_mask, mt, timeout)
    if st:
        if st == INPROGRESS:
            st = e.block(slot, timeout, keep)
        if st:
            raise_status(st, _RECV, None, slot, n)
    return _tuple_new(RecvInfo, (slot.tag, slot.length))


def _recv(e, h, ptr, n: int, tag, tag_mask, mt: int, timeout):
    """Post a tag receive, waiting in C without a timeout: (slot, status)
    (the device path of :func:`recv`)."""
    slot = e.slot()
    try:
        if timeout is None:
            st = lib.gpucx_tag_recv_wait(
                e.state, ptr, n, tag, tag_mask, mt, slot, e.spin_ns
            )
        else:
            st = lib.gpucx_tag_recv(h, ptr, n, tag, tag_mask, mt, slot)
    except (OverflowError, TypeError) as exc:
        raise _bad_tag(exc, tag, tag_mask) from None
    return slot, st


def recv_nb(
    worker, buf, tag: int = 0, tag_mask: int = TAG_MASK_FULL, *, stream=None
) -> Request:
    """Start a tag receive into ``buf`` (or a list of buffers).

    ``stream``: as for :func:`recv` (waited for before the receive is posted).

    Returns
    -------
    Request
        ``wait()`` returns :class:`RecvInfo`.

    Raises
    ------
    BufferError
        If ``buf`` is read-only or not contiguous.
    gpucx.ClosedError
        If the worker is closed.
    gpucx.UnsupportedError
        As for :func:`send`.
    """
    e = worker._engine
    h = e.h
    if h is None:
        raise_closed(worker)
    slot = new_slot()
    try:
        if type(buf) is list or type(buf) is tuple:
            iov, count, mt, keep, n = _iov(buf, True, stream)
            if mt == _HOST and stream is None:
                lib.gpucx_tag_recv_iov(h, iov, count, tag, tag_mask, mt, slot)
            else:
                with _cuda.door(e, iov[0].buffer, mt, stream, _RECV):
                    lib.gpucx_tag_recv_iov(h, iov, count, tag, tag_mask, mt, slot)
        else:
            ptr, n, mt, keep = acquire(buf, True, stream, True)
            if mt == _HOST and stream is None:
                lib.gpucx_tag_recv(h, ptr, n, tag, tag_mask, mt, slot)
            else:
                with _cuda.door(e, ptr, mt, stream, _RECV, keep):
                    lib.gpucx_tag_recv(h, ptr, n, tag, tag_mask, mt, slot)
    except (OverflowError, TypeError) as exc:
        raise _bad_tag(exc, tag, tag_mask) from None
    return Request(e, slot, keep, _RECV, _recv_info, None, n)


class ProbedMessage:
    """A message :func:`probe` found: its ``tag`` and ``nbytes``, and how to
    receive it.

    ``removed`` is True for ``probe(remove=True)``: the message was taken off
    UCX's unexpected queue and must be received with :meth:`recv` or
    :meth:`recv_nb` (UCX holds it until then).  With ``remove=False`` it
    stays queued: :meth:`recv` posts a receive for its exact tag (which
    takes it, the oldest message with that tag), or receive it any other
    way.  ``tag, nbytes = probed`` unpacks like a :class:`RecvInfo`.
    """

    __slots__ = ("tag", "nbytes", "removed", "_msg", "_worker", "_taken")

    def __init__(self, worker, tag: int, nbytes: int, msg, removed: bool = True):
        self.tag = tag
        self.nbytes = nbytes
        self.removed = removed
        self._msg = msg
        self._worker = worker
        self._taken = False

    def __repr__(self) -> str:
        how = "removed" if self.removed else "queued"
        return f"<gpucx.ProbedMessage tag={self.tag:#x} nbytes={self.nbytes} {how}>"

    def __iter__(self):
        return iter((self.tag, self.nbytes))

    def recv_nb(self, buf, *, stream=None) -> Request:
        """Start receiving the message into ``buf``.

        ``stream`` (a CuPy/Numba/PyTorch stream or a raw handle): the
        receive is posted only once the work queued on it before the call
        finished, as for :func:`recv`.

        Raises
        ------
        gpucx.AlreadyReceivedError
            If the message was already received.
        BufferError
            If ``buf`` is read-only or not contiguous.
        gpucx.UnsupportedError
            For CUDA memory on a context that cannot move it, or a
            ``stream`` without a CUDA driver (the message stays yours to
            receive).
        TypeError, ValueError
            For a bad ``stream`` (the message stays yours to receive).
        gpucx.ClosedError
            If the worker is closed.
        """
        w = self._worker
        e = engine(w)
        if e.h is None:
            raise_closed(w)
        if self._taken:
            raise AlreadyReceivedError("this probed message was already received")
        if not self.removed:
            req = recv_nb(w, buf, self.tag, TAG_MASK_FULL, stream=stream)
            self._taken = True
            return req
        ptr, n, mt, keep = acquire(buf, True, stream, True)
        slot = new_slot()
        if mt == _HOST and stream is None:
            self._taken = True
            lib.gpucx_tag_msg_recv(e.h, ptr, n, self._msg, mt, slot)
        else:
            with _cuda.door(e, ptr, mt, stream, _RECV, keep):
                self._taken = True
                lib.gpucx_tag_msg_recv(e.h, ptr, n, self._msg, mt, slot)
        return Request(e, slot, keep, _RECV, _recv_info, None, n)

    def recv(self, buf, timeout: float | None = None, *, stream=None) -> RecvInfo:
        """Receive the message into ``buf`` (blocking); ``stream`` as for
        :meth:`recv_nb`.

        Raises
        ------
        RuntimeError, BufferError, gpucx.UnsupportedError, TypeError, ValueError
            As for :meth:`recv_nb`.
        gpucx.TimeoutError
            When ``timeout`` passes first.
        gpucx.ClosedError
            If the worker is closed.
        """
        return self.recv_nb(buf, stream=stream).wait(timeout)


def probe(worker, tag: int = 0, tag_mask: int = TAG_MASK_FULL, remove: bool = False):
    """Check for a matching message that arrived and was not received yet.

    Progresses the worker once.  Returns None when there is none, otherwise
    a :class:`ProbedMessage` (``tag``, ``nbytes``, ``recv()``): with
    ``remove=False`` the message stays queued, with ``remove=True`` UCX
    hands it over and it must be received through the ProbedMessage.

    Raises
    ------
    gpucx.ClosedError
        If the worker is closed.
    """
    h = engine(worker).h
    if h is None:
        raise_closed(worker)
    info = ffi.new("ucp_tag_recv_info_t *")
    msg = ffi.new("ucp_tag_message_h *")
    lib.ucp_worker_progress(h)
    try:
        found = lib.gpucx_tag_probe(h, tag, tag_mask, 1 if remove else 0, info, msg)
    except (OverflowError, TypeError) as exc:
        raise _bad_tag(exc, tag, tag_mask) from None
    if not found:
        return None
    return ProbedMessage(
        worker, info.sender_tag, info.length, msg[0] if remove else None, remove
    )
