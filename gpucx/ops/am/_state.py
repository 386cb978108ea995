"""A worker's active-message state: the ids (user and reserved) and their
checks, the per-worker bookkeeping (:class:`_AmWorker`, the engine's
``am``), attaching it to and detaching it from a worker, the registration
of an id with UCX, and the reused message records (release, recycle).
"""

from __future__ import annotations

import functools

from ... import _bounds
from ..._lib import ffi, lib
from ...errors import (
    UnsupportedError,
)

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


def _no_am():
    raise UnsupportedError(
        'active messages need a Context created with the "am" feature '
        "(features=None enables every feature)"
    )


_PTRS = ffi.typeof("void *[]")


_SIZES = ffi.typeof("size_t[]")
