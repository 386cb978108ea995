"""Active messages (``ucp_am_send_nbx`` / ``ucp_worker_set_am_recv_handler``).

An active message (AM) is an id (0..65535), a small header and a payload.
The receiving worker runs the Python handler set for the id with an
:class:`AmMessage`.

How it runs: the UCX receive callback is C (``gpucx/_csrc/am.c``).  It copies
the header, records data pointer, length, flags and reply endpoint into the
worker's C queue and keeps eager data alive (``UCS_INPROGRESS``).  After
``ucp_worker_progress`` returns, :func:`dispatch` pops the queue and runs the
handlers in arrival order.  Every path that progresses a worker dispatches:
:meth:`Worker.progress`, the waiting loop of blocking calls and
``Request.wait`` (through the engine's ``poll_events``), and ``recv_array``.

Rules:

* An exception raised by a handler propagates to the caller of
  ``progress()`` / ``wait()``; messages after it stay queued and are
  dispatched by the next progress.
* A message whose id has no handler when it is dispatched (the handler was
  cleared with ``set_am_handler(id, None)`` after the message arrived) is
  **dropped with a** :class:`RuntimeWarning` (the first of each id only).
  Messages for ids that never had a handler or a posted receive on the
  worker are dropped by UCX itself.
* Posted receives (:func:`am_recv_nb`) are matched in the UCX callback.  An
  id used with them and without a handler keeps, in C, the messages that
  find no posted receive, for the next receive posted (up to
  ``GPUCX_AM_KEPT_MAX_COUNT`` / ``_BYTES``; past them messages are dropped
  and counted in ``Worker.stats()``, see :mod:`gpucx._bounds`).
* Handlers do not nest: while a handler runs, progress made inside it (a
  blocking reply, say) queues new messages instead of dispatching them.
* Ids ``0xFF00``..``0xFFFF`` are reserved for gpucx itself
  (:data:`RESERVED_AM_IDS`; ``send_array`` uses :data:`ARRAY_AM_ID`).
"""

from __future__ import annotations

import functools
import sys
import warnings

from .. import _bounds
from .. import protocols as _protocols
from .._engine import new_slot
from .._handle import raise_closed
from .._lib import ffi, lib
from ..errors import (
    AlreadyReceivedError,
    MessageTruncatedError,
    UCXError,
    UnsupportedError,
    check,
)
from ..mem import cuda as _cuda
from ..mem.buffer import _BUFFER_TYPES, _CHAR_ARRAY, _from_buffer, acquire
from ..mem.cuda import Deferred as _Deferred
from ..mem.memtype import CUDA_INTS as _CUDA_TYPES
from ..mem.memtype import HOST_INT as _HOST
from ..request import (
    Request,
    _DoneAtPost,
    _new_done,
    done_with,
    finish,
    posted,
    raise_status,
)

__all__ = [
    "AmMessage",
    "set_am_handler",
    "am_send",
    "am_send_nb",
    "am_recv",
    "am_recv_nb",
    "am_recv_many",
    "am_recv_many_nb",
    "dispatch",
    "RESERVED_AM_IDS",
    "MAX_USER_AM_ID",
]

#: AM ids gpucx keeps for itself (put-with-notify, send_array, ...).
RESERVED_AM_IDS = range(0xFF00, 0x10000)
#: The largest id users may pass to ``set_am_handler`` / ``am_send``.
MAX_USER_AM_ID = 0xFEFF
#: The reserved id ``send_array`` / ``recv_array`` travel on.
ARRAY_AM_ID = 0xFF10

_PROTO = {None: 0, "eager": lib.GPUCX_AM_SEND_EAGER, "rndv": lib.GPUCX_AM_SEND_RNDV}
_REPLY = lib.GPUCX_AM_SEND_REPLY
_RNDV = lib.GPUCX_AM_FLAG_RNDV
_FAILED = lib.GPUCX_AM_FLAG_FAILED  # the highest flag bit: flags >= _FAILED
_SEND = "am send"
_RECV = "am receive"


# -- worker integration (called by Worker) -----------------------------------


class _AmWorker:
    """Per-worker AM bookkeeping (the engine's ``am``)."""

    __slots__ = (
        "state",
        "regs",
        "handlers",
        "live",
        "busy",
        "max_header",
        "arrays",
        "free",
        "held",
        "enabled",
        "recv_ids",
        "array_stats",
        "warn_at",
        "unhandled",
        "pools",
        "old_pools",
        "array_waiters",
        "staging",
    )

    def __init__(self, e):
        ctx = e.context
        self.state = ffi.new("gpucx_am_state_t *")
        kept, queue = _bounds.caps(ctx, "am_kept"), _bounds.caps(ctx, "am_queue")
        lib.gpucx_am_init(self.state, e.h, ffi.new("size_t[4]", kept + queue))
        self.array_stats = _bounds.ArrayQueueStats(*_bounds.caps(ctx, "arrays"))
        self.warn_at = 0.0  # no drop warning before this time.monotonic()
        self.unhandled: set = set()  # ids warned about having no handler
        self.regs: dict = {}  # am_id -> gpucx_am_reg_t * (UCX holds a pointer)
        self.handlers: dict = {}  # am_id -> callable
        self.live = [e.h]  # set to None when the worker is destroyed
        self.busy = False
        self.max_header: int | None = None
        self.arrays: dict = {}  # reply-ep address -> deque of array messages
        # Message records, reused: (gpucx_am_msg_t *, gpucx_slot_t *) pairs.
        # ``free`` holds idle ones (at most _POOL_MAX); ``held`` maps id(pair)
        # to the pairs of popped messages whose data is not yet released.
        self.free: list = []
        self.held: dict = {}
        self.enabled = "am" in ctx.features
        # Ids used with posted receives: without a handler, their messages
        # that find no posted receive are kept for the next one (C side).
        self.recv_ids: set = set()
        # Receive pools (set_am_handler(..., into=)): am_id -> (pool, keeps)
        # for the pools in use, and replaced ones that still held messages
        # when they were replaced (freed once idle, or with the worker).
        self.pools: dict = {}
        self.old_pools: list = []
        # recv_array_nb requests no array matched yet: queue key -> deque,
        # in posting order (gpucx.ops.arrays).
        self.array_waiters: dict = {}
        # The pinned bounce buffers of receiver-side staging, made on first
        # use (gpucx.ops._staging.Pool).
        self.staging = None


#: Idle message records a worker keeps for reuse.
_POOL_MAX = 64
_MSG_P = ffi.typeof("gpucx_am_msg_t *")
_SLOT_P = ffi.typeof("gpucx_slot_t *")
_NO_MEMORY = lib.UCS_ERR_NO_MEMORY
_INPROGRESS = lib.UCS_INPROGRESS
_OK = lib.UCS_OK
_NULL = ffi.NULL
# Looked up once (a cffi ``lib.name`` costs about 50 ns): once a message.
_am_send = lib.gpucx_am_send
_recv_msg = lib.gpucx_am_recv_msg
_new_slot = functools.partial(ffi.new, _SLOT_P)


def attach(e) -> None:
    """Give a new worker's engine ``e`` its AM queue (``e.am``, ``e.amq``;
    :func:`gpucx.ops.arrays.attach` then registers the internal array id on
    it).

    A context without the ``"am"`` feature cannot register handlers; the
    queue then just stays empty.
    """
    am = _AmWorker(e)
    e.am = am
    e.amq = am.state
    lib.gpucx_progress_watch(e.state, am.state, ffi.NULL)


def give_back_unreceived(e) -> None:
    """Release the messages nobody received yet (a closing worker, before
    its endpoints close): the kept and queued ones in C, with the receives
    still posted (canceled), and the array queues.  A rendezvous sender
    completes once its message is released.  What arrives later is released
    by :func:`detach`."""
    am = e.am
    for reg in am.regs.values():
        lib.gpucx_am_unpost_all(reg)
    lib.gpucx_am_release_queued(am.state)
    for q in am.arrays.values():
        for msg in q:
            msg._drop()
    am.arrays.clear()
    s = am.array_stats
    s.count = s.bytes = 0


def detach(e) -> None:
    """Release every queued message (before ``ucp_worker_destroy``)."""
    am = e.am
    give_back_unreceived(e)  # again: what arrived since the close began
    # Receives into pool buffers that ucp_worker_destroy cancels give their
    # buffer back instead of queueing (the pools live as long as ``am``).
    for pool, _keeps in [*am.pools.values(), *am.old_pools]:
        lib.gpucx_am_pool_close(pool)
    lib.gpucx_am_drain(am.state)
    # Messages Python still holds give their UCX buffers back now (UCX frees
    # its pools with the worker); views of their data must not be used after.
    for rec, _slot in list(am.held.values()):
        lib.gpucx_am_release(e.h, rec)
    am.held.clear()
    am.free.clear()
    am.live[0] = None
    am.handlers.clear()


def _register(am: _AmWorker, am_id: int) -> int:
    if am_id in am.regs:
        return lib.UCS_OK
    reg = ffi.new("gpucx_am_reg_t *")
    reg.state = am.state
    reg.id = am_id
    st = lib.gpucx_am_set_handler(reg, 1)
    if st == lib.UCS_OK:
        am.regs[am_id] = reg
    return st


def _release(am: _AmWorker, pair) -> None:
    """Give a message's UCX data back (idempotent)."""
    if am.held.pop(id(pair), None) is not None:
        h = am.live[0]
        lib.gpucx_am_release(h if h is not None else ffi.NULL, pair[0])


def _recycle(am: _AmWorker, pair, _ptr=None) -> None:
    # Once per message, when nothing can use its record any more: the
    # message is garbage and so is every view of its data (ffi.gc), or the
    # rendezvous receive that took the record is done (_received).
    if lib is None:  # interpreter shutdown
        return
    _release(am, pair)
    if len(am.free) < _POOL_MAX and am.live[0] is not None:
        am.free.append(pair)


def _retire(msg) -> None:
    """The message is garbage, or about to be: give its record back unless
    views of its data (``ffi.gc``) or a receive (the request) own it."""
    pair = msg._pair
    if pair is not None and msg._desc is None:
        _recycle(msg._am, pair)


_refs = sys.getrefcount


def dispatch(e) -> None:
    """Run the handlers of queued messages, in arrival order (the engine's
    ``on_am`` hook).

    Raises
    ------
    Exception
        Whatever a handler raised (the rest stays queued).
    """
    am = e.am
    if am.busy:
        return
    am.busy = True
    try:
        st = am.state
        handlers = am.handlers
        free = am.free
        held = am.held
        pop = lib.gpucx_am_pop
        while True:
            pair = free.pop() if free else (ffi.new(_MSG_P), ffi.new(_SLOT_P))
            if not pop(st, pair[0]):
                free.append(pair)
                break
            held[id(pair)] = pair
            msg = AmMessage(e, pair, am)
            handler = handlers.get(msg.am_id)
            if handler is not None:
                # The count before the call, not a constant: how many
                # references the interpreter's own stack holds varies
                # between Python versions.
                unkept = _refs(msg)
                try:
                    handler(msg)
                except BaseException:
                    msg.__class__ = _KeptMessage
                    raise
                # A message nothing kept gives its record back now, without
                # a finalizer (about 0.4 us a message); one kept (queued,
                # stored, in a traceback) gives it back when collected.
                if msg._pair is not None:
                    if _refs(msg) > unkept:
                        msg.__class__ = _KeptMessage
                    else:
                        _retire(msg)
            else:
                # Once per id: a peer sending many must not make as many
                # warnings.
                if msg.am_id not in am.unhandled:
                    am.unhandled.add(msg.am_id)
                    warnings.warn(
                        f"gpucx: active message id {msg.am_id} ({msg.nbytes} "
                        "bytes) dropped: no handler is set for it (later "
                        "messages of this id are dropped without a warning)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                msg._drop()
                _retire(msg)
    finally:
        am.busy = False


# -- the message --------------------------------------------------------------


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
                _cuda.ready(e, ptr, mt, stream, _RECV, keep)
            ffi.memmove(ptr, rec.data, nbytes)
        elif mt in _CUDA_TYPES:
            # UCX delivered the eager payload to host memory: copy it in.
            _cuda.copy_in(e, ptr, mt, rec.data, nbytes, stream, _RECV, keep)
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


def _nbytes(req) -> int:
    return req._slot.length


def _received(req) -> int:
    """Result of a rendezvous ``receive_into``: the byte count; the record
    goes back to the pool (the request is done with its slot)."""
    _keep, pair, am = req._keep
    # _recycle without its _release: receive_into already took the record
    # out of ``am.held``, and UCX holds no data of it (one call a message).
    if len(am.free) < _POOL_MAX and am.live[0] is not None:
        am.free.append(pair)
    return req._slot.length


# -- handlers and sends ----------------------------------------------------------


def check_id(am_id) -> None:
    """Refuse an AM id users may not pass (also for gpucx.ops.am_batch).

    Raises
    ------
    TypeError
        For an id that is not an int.
    ValueError
        For an id outside 0..0xFEFF.
    """
    if not isinstance(am_id, int) or isinstance(am_id, bool):
        raise TypeError(f"am_id must be an int, not {type(am_id).__name__}")
    if not 0 <= am_id <= MAX_USER_AM_ID:
        raise ValueError(
            f"am_id must be in 0..{MAX_USER_AM_ID:#x} (ids {RESERVED_AM_IDS.start:#x}"
            f"..{RESERVED_AM_IDS.stop - 1:#x} are reserved for gpucx), not {am_id}"
        )


def set_am_handler(worker, am_id: int, handler, *, into=None) -> None:
    """Run ``handler(msg: AmMessage)`` for each active message sent to
    ``am_id`` (``None`` clears it; later messages for the id are dropped
    with a warning, or kept for posted receives once the id was used with
    them).  Replacing a handler takes effect for the next message; messages
    kept for posted receives go to a handler set afterwards, in order.

    Parameters
    ----------
    into : sequence of buffers, optional
        A receive pool: writable, contiguous host buffers (NumPy arrays,
        ``bytearray``, :meth:`Context.allocate` memory...).  A rendezvous
        payload that fits a free buffer is received into it in the UCX
        callback, before the handler runs, with no Python in between (the
        ucxx allocator model, without calling Python inside progress): the
        handler gets a message whose :attr:`AmMessage.data` is a read-only
        view of the buffer, and the buffer is free again once the message
        and its views are garbage.  The first free buffer the payload fits
        is taken, in the order given; while every buffer it fits is busy,
        the message waits, in arrival order.  A payload larger than every
        buffer, and every eager payload, comes as without a pool.  A pooled
        message reaches the handler once its payload is in, so it may come
        after messages sent later.  gpucx holds the buffers until the worker
        closes or the pool is replaced (``into=None`` or another pool); a
        replaced pool whose buffers still hold messages is let go by a
        later ``set_am_handler`` call once they are free.  Do not write to a
        buffer meanwhile.

    Raises
    ------
    ValueError
        For an id outside 0..0xFEFF (0xFF00..0xFFFF are reserved), an empty
        ``into``, buffers of ``into`` that share memory, or ``into`` without
        a handler.
    TypeError
        If ``handler`` is neither callable nor None, or ``into`` is not a
        sequence.
    BufferError
        If a buffer of ``into`` is read-only or not contiguous.
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature, or for a
        buffer of ``into`` in memory other than host memory.
    gpucx.ClosedError
        If the worker is closed.
    """
    e = worker._engine
    if e.h is None:
        raise_closed(worker)
    check_id(am_id)
    if handler is not None and not callable(handler):
        raise TypeError(f"handler must be callable or None, not {handler!r}")
    am = e.am
    if not am.enabled:
        _no_am()
    pool = None
    if into is not None:
        if handler is None:
            raise ValueError("set_am_handler: into= needs a handler")
        pool = _new_pool(am, into)
    _install(am, am_id, handler)
    if pool is not None or am_id in am.pools:
        _set_pool(am, am_id, pool)
    if am_id in am.recv_ids:
        # With a handler, kept messages move to the dispatch queue for it;
        # without one, the id's messages are kept for receives again.
        lib.gpucx_am_set_keep(am.regs[am_id], 1 if handler is None else 0)


def _host_buffer(buf, stream, where: str, i: int, refusal: str):
    """``(ptr, nbytes, keepalive)`` of a writable host buffer; an error
    (``refusal`` for other memory) names the buffer as ``where.format(i)``
    (made only then: a receive round posts its buffers in one call)."""
    try:
        ptr, n, mt, keep = acquire(buf, True, stream)
        if mt != _HOST:
            raise UnsupportedError(refusal)
    except (TypeError, ValueError, BufferError, UCXError) as exc:
        exc.args = (f"{where.format(i)}: {exc}", *exc.args[1:])
        raise
    return ptr, n, keep


def _new_pool(am: _AmWorker, into):
    """A C receive pool of the buffers of ``into``: ``(pool, keepalives)``."""
    try:
        bufs = list(into)
    except TypeError:
        raise TypeError(
            f"set_am_handler: into must be a sequence of buffers, not "
            f"{type(into).__name__}"
        ) from None
    if not bufs:
        raise ValueError("set_am_handler: into holds no buffer")
    ptrs, lens, keeps = [], [], []
    for i, buf in enumerate(bufs):
        ptr, n, keep = _host_buffer(
            buf,
            None,
            "set_am_handler: into[{}]",
            i,
            "a receive pool takes host memory; receive device memory with "
            "AmMessage.receive_into",
        )
        ptrs.append(ptr)
        lens.append(n)
        keeps.append((buf, keep))
    # Two buffers sharing memory would take two payloads at once.
    spans = sorted(
        (int(ffi.cast("uintptr_t", p)), n, i)
        for i, (p, n) in enumerate(zip(ptrs, lens, strict=True))
        if n
    )
    for (a, n, i), (b, _, j) in zip(spans, spans[1:], strict=False):
        if a + n > b:
            i, j = sorted((i, j))
            raise ValueError(
                f"set_am_handler: into[{i}] and into[{j}] share memory (each "
                "buffer of a receive pool takes one payload at a time)"
            )
    pool = lib.gpucx_am_pool_new(
        am.state, ffi.new(_PTRS, ptrs), ffi.new(_SIZES, lens), len(bufs)
    )
    if pool == ffi.NULL:
        raise MemoryError("set_am_handler: no memory for the receive pool")
    return ffi.gc(pool, lib.gpucx_am_pool_free), keeps


def _set_pool(am: _AmWorker, am_id: int, pool) -> None:
    """Receive ``am_id``'s rendezvous payloads into ``pool`` ((pool,
    keepalives) or None) from the next message on.  A replaced pool is
    freed, with its buffers, once none of them holds a message."""
    reg = am.regs[am_id]
    lib.gpucx_am_set_pool(reg, pool[0] if pool is not None else ffi.NULL)
    old = am.pools.pop(am_id, None)
    if pool is not None:
        am.pools[am_id] = pool
    if old is not None:
        am.old_pools.append(old)
    # The C callback checks reg->pool under the lock before it touches a
    # pool, so an idle replaced one can go now.
    am.old_pools = [p for p in am.old_pools if lib.gpucx_am_pool_busy(p[0])]


def _install(am, am_id: int, handler) -> None:
    """Set the Python handler of ``am_id``, registering the C callback with
    UCX on first use, or remove it (``None``).  The C callback then stays
    installed: messages already on their way are dropped with a warning at
    dispatch rather than silently by UCX."""
    if handler is None:
        am.handlers.pop(am_id, None)
        return
    check(_register(am, am_id), "ucp_worker_set_am_recv_handler")
    am.handlers[am_id] = handler


def _no_am():
    raise UnsupportedError(
        'active messages need a Context created with the "am" feature '
        "(features=None enables every feature)"
    )


def set_internal_handler(e, am_id: int, handler) -> None:
    """Install a gpucx-internal handler on a reserved id (0xFF00..0xFFFF) of
    the worker whose engine is ``e``.

    For other gpucx modules (put-with-notify...): same queue, same dispatch
    and the same exception rules as user handlers.  ``send_array`` owns
    :data:`ARRAY_AM_ID`.

    Raises
    ------
    ValueError
        For an id outside the reserved range, or :data:`ARRAY_AM_ID`.
    gpucx.UnsupportedError
        If the context was created without the ``"am"`` feature.
    """
    if am_id not in RESERVED_AM_IDS or am_id == ARRAY_AM_ID:
        raise ValueError(f"{am_id!r} is not a free reserved gpucx AM id")
    am = e.am
    if not am.enabled:
        _no_am()
    _install(am, am_id, handler)


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


# -- posted receives -----------------------------------------------------------


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
        _cuda.ready(e, ptr, mt, stream, _RECV, keep)
    return ptr, n, mt, keep


def _memtype_name(mt: int) -> str:
    from ..mem.memtype import MemoryType

    try:
        return MemoryType(mt).name
    except ValueError:
        return f"memory type {mt}"


def _copy_kept(e, msg, ptr, mt) -> int:
    """Copy the kept eager message C handed over (``GPUCX_AM_COPY_IN``)
    into device memory at ``ptr`` and give its data back; its length."""
    try:
        _cuda.copy_in(e, ptr, mt, msg.data, msg.length, None, _RECV)
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
_PTRS = ffi.typeof("void *[]")
_SIZES = ffi.typeof("size_t[]")
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
    e = worker._engine
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
        _cuda.ready(e, ffi.NULL, _HOST, stream, _RECV)
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
