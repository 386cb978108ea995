"""The received message: :class:`AmMessage` (what a handler gets: header,
``data``, ``receive_into``, ``reply_ep``) and the kept variant that gives
its record back when collected."""

from __future__ import annotations

import functools

from ..._lib import ffi, lib
from ...errors import (
    AlreadyReceivedError,
    MessageTruncatedError,
    UnsupportedError,
)
from ...mem import cuda as _cuda
from ...mem.buffer import _BUFFER_TYPES, _CHAR_ARRAY, _from_buffer, acquire
from ...mem.cuda import Deferred as _Deferred
from ...mem.memtype import CUDA_INTS as _CUDA_TYPES
from ...mem.memtype import HOST_INT as _HOST
from ...request import (
    Request,
    done_with,
    raise_status,
)
from ._state import (
    _FAILED,
    _POOL_MAX,
    _RECV,
    _RNDV,
    _recv_msg,
    _recycle,
    _release,
    _retire,
)


class AmMessage:
    """One received active message, given to the handler.

    Attributes
    ----------
    am_id : int
        The id it was sent to.
    header : bytes
        The sender's header (a copy).
    nbytes : int
        Payload size in bytes.
    is_rndv : bool
        True when the payload waits at the sender (rendezvous): only
        :meth:`receive_into` gets it.
    reply_ep : Endpoint or None
        An endpoint back to the sender when it sent with ``reply=True``.

    Eager payloads stay in UCX's receive buffer (no copy) until the message
    and every view of :attr:`data` are garbage; a rendezvous payload not
    received before then is discarded (the sender's request completes).
    With a receive pool (``set_am_handler(..., into=bufs)``) a rendezvous
    payload that fits a free buffer is received before the handler runs:
    the message then reads as eager (``is_rndv`` False, :attr:`data` a view
    of the pool buffer), and the buffer is free again once the message and
    every view of :attr:`data` are garbage.
    Views of :attr:`data` must not outlive the worker.

    A message the handler does not keep gives its record back as soon as
    the handler returns; one it keeps (stores, queues) when it is
    collected.
    """

    __slots__ = (
        "am_id",
        "header",
        "nbytes",
        "is_rndv",
        "_reply_ep",
        "_engine",
        "_pair",
        "_am",
        "_desc",
        "_taken",
        "_rh",
        "__weakref__",
    )

    def __init__(self, e, pair, am):
        rec = pair[0]
        self.am_id = rec.id
        n = rec.header_length  # C copied a header of n > 0 bytes
        self.header = ffi.buffer(rec.header, n)[:] if n else b""
        self.nbytes = rec.length
        flags = rec.flags
        self.is_rndv = (flags & _RNDV) != 0
        self._reply_ep = None
        self._engine = e
        self._pair = pair
        self._am = am
        # The record goes back to the pool when the handler returns without
        # keeping the message (dispatch) or when the message is collected
        # (_KeptMessage), or, once .data made a view, when the last view is
        # (ffi.gc), or, once receive_into took a rendezvous payload, when
        # the receive succeeds (_received).
        self._desc = None
        # True once received; the status of a failed receive into the
        # handler's pool (set_am_handler(..., into=)).
        self._taken = rec.status if flags >= _FAILED else False

    def __repr__(self) -> str:
        proto = "rndv" if self.is_rndv else "eager"
        return (
            f"<gpucx.AmMessage id={self.am_id} {proto} nbytes={self.nbytes} "
            f"header={len(self.header)}B>"
        )

    @property
    def _reply_h(self):
        """The raw reply ``ucp_ep_h`` (NULL when the sender sent none)."""
        pair = self._pair
        return pair[0].reply_ep if pair is not None else self._rh

    @property
    def reply_ep(self):
        """The :class:`~gpucx.Endpoint` to answer the sender on (messages
        sent with ``reply=True``), or None."""
        if self._reply_ep is None:
            h = self._reply_h
            if h != ffi.NULL:
                self._reply_ep = self._engine.reply_endpoint(h)
        return self._reply_ep

    @property
    def data(self) -> memoryview:
        """The payload, read-only, without a copy: an eager payload in
        UCX's receive buffer, or one received into a buffer of the
        handler's pool (``set_am_handler(..., into=bufs)``).

        Raises
        ------
        ValueError
            For a rendezvous message (use :meth:`receive_into`).
        gpucx.AlreadyReceivedError
            If the payload was already received.
        gpucx.UCXError
            If the receive into the handler's pool failed
            (:class:`~gpucx.PeerError` when the sender died during it).
        """
        if self.is_rndv:
            raise ValueError(
                "a rendezvous active message has no data yet: use receive_into(buf)"
            )
        if self._taken:
            self._no_payload()
        desc = self._desc
        if desc is None:
            # From now on the last view (not the message) recycles the record.
            desc = self._desc = ffi.gc(
                ffi.cast("char *", self._pair[0].data),
                functools.partial(_recycle, self._am, self._pair),
            )
        return memoryview(ffi.buffer(desc, self.nbytes)).toreadonly()

    def receive_into(self, buf, *, stream=None) -> Request:
        """Receive the payload into ``buf``.

        A rendezvous payload moves straight from the sender into ``buf``
        (``ucp_am_recv_data_nbx``, zero copy); an eager payload is copied.
        ``stream`` (a CUDA stream object or raw handle): the receive starts
        only once the work queued on it before the call finished.

        Returns
        -------
        Request
            ``wait()`` returns the number of bytes received.

        Raises
        ------
        gpucx.MessageTruncatedError
            If ``buf`` is smaller than the payload.
        gpucx.AlreadyReceivedError
            If the payload was already received.
        gpucx.UCXError
            If the receive into the handler's pool failed (see :attr:`data`).
        BufferError
            If ``buf`` is read-only or not contiguous.
        gpucx.UnsupportedError
            For an eager payload into memory other than host or CUDA, or CUDA
            memory on a context that cannot move it.
        gpucx.ClosedError
            If the worker is closed.
        """
        e = self._engine
        if e.h is None:
            e.raise_closed()
        if self._taken:
            self._no_payload()
        if stream is None and type(buf) in _BUFFER_TYPES:
            # acquire's host fast path, inlined (a handler calls this once
            # a message): the cdata holds the buffer export.
            try:
                ptr = keep = _from_buffer(_CHAR_ARRAY, buf, True)
                n, mt = len(ptr), _HOST
            except (ValueError, BufferError, TypeError):
                ptr, n, mt, keep = acquire(buf, True, stream)  # explains
        else:
            ptr, n, mt, keep = acquire(buf, True, stream, True)
        nbytes = self.nbytes
        if n < nbytes:
            exc = MessageTruncatedError(
                f"{_RECV}: message truncated: the receive buffer holds {n} bytes, "
                f"the message has {nbytes} bytes",
                lib.UCS_ERR_MESSAGE_TRUNCATED,
            )
            exc.buffer_size = n
            exc.message_size = nbytes
            raise exc
        if self.is_rndv:
            # The descriptor moves to the receive, and the record (its slot
            # is the request's) to the request, which gives it back to the
            # pool once the receive succeeded (_received).
            pair = self._pair
            rec, slot = pair
            if mt == _HOST and stream is None:
                self._taken = True
                _recv_msg(e.h, rec, ptr, mt, slot)
            else:
                with _cuda.door(e, ptr, mt, stream, _RECV, keep):
                    self._taken = True
                    _recv_msg(e.h, rec, ptr, mt, slot)
            am = self._am
            # The record holds nothing to give back now: recycling it needs
            # no C call.
            am.held.pop(id(pair), None)
            self._rh = rec.reply_ep
            self._pair = None
            # Tied to the sender's endpoint when it is known (a reply endpoint
            # already looked up): a dead sender then reads as PeerError.
            return Request(
                e, slot, (keep, pair, am), _RECV, _received, self._reply_ep, n
            )
        rec = self._pair[0]
        if mt == _HOST or not nbytes:
            if stream is not None or type(keep) is _Deferred:
                _cuda.door(e, ptr, mt, stream, _RECV, keep).ready()
            ffi.memmove(ptr, rec.data, nbytes)
        elif mt in _CUDA_TYPES:
            # UCX delivered the eager payload to host memory: copy it in.
            _cuda.door(e, ptr, mt, stream, _RECV, keep).copy_in(rec.data, nbytes)
        else:
            raise UnsupportedError(
                "receive_into: an eager active message can only be copied into "
                "host or CUDA memory (send with proto='rndv' for device buffers)"
            )
        if self._desc is None:
            # _drop and dispatch's _retire in one: the record goes back to
            # the pool now (the reply endpoint kept for reply_ep).
            self._taken = True
            self._rh = rec.reply_ep
            pair = self._pair
            self._pair = None
            _recycle(self._am, pair)
        else:
            self._drop()
        return done_with(nbytes)

    def _no_payload(self):
        taken = self._taken
        if taken is True:
            raise AlreadyReceivedError(
                "the payload of this message was already received"
            )
        raise_status(taken, f"{_RECV} into the handler's pool ({self.nbytes} bytes)")

    def _drop(self) -> None:
        """Give the data back now (views made by .data keep it until they go)."""
        self._taken = True
        if self._desc is None:
            if self._pair is not None:
                _release(self._am, self._pair)
        else:
            self._desc = False  # the views' ffi.gc recycles the record


class _KeptMessage(AmMessage):
    """An :class:`AmMessage` its handler kept: gives its record back when
    collected (dispatch switches a kept message to this class)."""

    __slots__ = ()

    def __del__(self) -> None:
        _retire(self)


def _received(req) -> int:
    """Result of a rendezvous ``receive_into``: the byte count; the record
    goes back to the pool (the request is done with its slot)."""
    _keep, pair, am = req._keep
    # _recycle without its _release: receive_into already took the record
    # out of ``am.held``, and UCX holds no data of it (one call a message).
    if len(am.free) < _POOL_MAX and am.live[0] is not None:
        am.free.append(pair)
    return req._slot.length
