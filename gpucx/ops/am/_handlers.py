"""Handlers: setting them (``set_am_handler``, receive pools, gpucx's own
handlers on reserved ids) and running them (:func:`dispatch`, the
engine's ``on_am`` hook, in arrival order)."""

from __future__ import annotations

import sys
import warnings

from ..._handle import raise_closed
from ..._internal import engine
from ..._lib import ffi, lib
from ...errors import (
    UCXError,
    UnsupportedError,
    check,
)
from ...mem.buffer import acquire
from ...mem.memtype import HOST_INT as _HOST
from ._message import AmMessage, _KeptMessage
from ._state import (
    _MSG_P,
    _PTRS,
    _SIZES,
    _SLOT_P,
    ARRAY_AM_ID,
    RESERVED_AM_IDS,
    _AmWorker,
    _no_am,
    _register,
    _retire,
    check_id,
)

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
    e = engine(worker)
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
