"""The UCX worker: progress engine, tag receive side, endpoint factory."""

from __future__ import annotations

import time
import weakref
from typing import Any

from . import _address, _bounds
from . import _liveness as _live
from ._handle import CLOSE_GRACE_S, Handle, raise_closed, time_left
from ._lib import ffi, lib
from .config import THREAD_MODES
from .errors import ClosedError, check
from .ops import am as _am
from .ops import arrays as _arrays
from .ops import atomic as _atomic
from .ops import ipc as _own
from .ops import rma as _rma
from .ops import tag as _tag
from .request import INPROGRESS, _due, finish, new_slot, settle

__all__ = ["Worker"]

#: How many tracked requests trigger a sweep of completed, unobserved ones.
_SWEEP_MIN = 1024
#: Bits of lib.gpucx_progress's (and lib.gpucx_due's) result: work for
#: Python after progress.  They are the top three bits, so a result of at
#: least _DUE_DROPS has one set; _COUNT masks UCX's event count.
_DUE_AM = lib.GPUCX_DUE_AM
_DUE_NOTIFY = lib.GPUCX_DUE_NOTIFY
_DUE_DROPS = lib.GPUCX_DUE_DROPS
_COUNT = ~lib.GPUCX_DUE & 0xFFFFFFFF
#: At most this many ``ucp_worker_progress`` calls a closing worker makes to
#: serve what its peers already sent (bounded: a flooding peer cannot hold
#: the close).
_CLOSE_SERVE_ROUNDS = 64


class Worker(Handle):
    """A UCX worker (``ucp_worker_create``), made by
    :meth:`Context.create_worker`.

    The worker progresses communication: blocking calls progress it
    themselves, non-blocking users call :meth:`progress` (or use
    :mod:`gpucx.aio`).  Tag receives are worker-wide, like in UCX.
    """

    _is_worker = True
    _amq: Any  # the C active-message queue (gpucx.ops.am.attach)
    _am: Any  # its Python bookkeeping (gpucx.ops.am._AmWorker)

    def __init__(self, context, thread_mode: str = "single"):
        h = context._h
        if h is None:
            raise_closed(context)
        try:
            mode = THREAD_MODES[thread_mode]
        except (KeyError, TypeError):
            raise ValueError(
                f"thread_mode must be one of {sorted(THREAD_MODES)}, "
                f"not {thread_mode!r}"
            ) from None
        self._init_handle()
        state = ffi.new("gpucx_worker_state_t *")
        check(lib.gpucx_worker_create(h, mode, 1, state), "ucp_worker_create")
        self._state = state
        self._h = state.worker
        self._efd = state.efd
        self._context = context
        self.thread_mode = thread_mode
        self._multi = thread_mode == "multi"
        self._sslot = new_slot()
        self._pending: set = set()
        self._sweep_at = _SWEEP_MIN
        self._parked: list = []
        # Remote keys closed while parked operations held them:
        # (ucp_rkey_h, their slots), freed once UCX let go of those.
        self._parked_keys: list = []
        # gpucx's own copy-engine copies in flight (gpucx.ops.ipc) and the
        # streams they run on (made at the first).
        self._copies: list = []
        self._ipc_engine = None
        self._address: bytes | None = None
        self._ucx_address: bytes | None = None
        # Liveness of peers on this host (gpucx._liveness): endpoint ->
        # (pid, start time), checked at most every _peer_interval seconds.
        self._watched: dict = {}
        self._pidfds: dict = {}  # endpoint -> pidfd of its peer (-1: none)
        # The epoll set of those pidfds that blocking waits sleep on beside
        # the UCX event fd and the asyncio driver puts on its loop (its fd,
        # or -1 while there is none).
        self._pset = None
        self._pfd = -1
        self._peer_interval = context._peer_interval
        self._spin_ns = context._spin_ns
        self._peer_check_at = 0.0
        self._peer_tick = _live.PROGRESS_STRIDE
        # Requests pending when gpucx force-closed a dead peer's endpoint:
        # request -> (reason, until); see gpucx._liveness.peer_died.
        self._suspects: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._aio = None  # gpucx.aio driver, when an event loop drives us
        self._notify_handler = None  # put-with-notify handler (ops.rma)
        self._on_close: list = []  # callables run first when closing
        self._reply_eps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        _am.attach(self)  # sets self._am and self._amq (the C AM queue)
        _arrays.attach(self)  # the internal array AM id, on top of AM
        context._adopt(self)
        _rma.worker_init(self)
        _atomic.worker_init(self)

    def __repr__(self) -> str:
        state = "closed" if self._h is None else self.thread_mode
        return f"<gpucx.Worker {state}>"

    # -- progress -----------------------------------------------------------

    def progress(self) -> int:
        """Progress outstanding communication; return the event count.

        One call progresses UCX until it reports no more events (at most 16
        rounds), then runs the handlers of the messages that arrived
        meanwhile, in arrival order.

        Raises
        ------
        gpucx.ClosedError
            If the worker is closed.
        """
        h = self._h
        if h is None:
            raise_closed(self)
        # One C call: UCX's progress, and bits for the queued messages,
        # notifications or drops that need Python now.  _run_queues,
        # inlined: a method call here cost an AM ping-pong 0.25 us per
        # round trip (two workers in one process, best of 15 x 2000).
        n = lib.gpucx_progress(self._state)
        if n >= _DUE_DROPS:
            if n & _DUE_AM:
                _am.dispatch(self)
            if n & _DUE_NOTIFY:  # set only while a notify handler is set
                _rma.dispatch_notifications(self)
            if n & _DUE_DROPS:  # a queue cap dropped some
                _bounds.dropped(self)
            n &= _COUNT
        if self._copies:
            _own.poll(self)
        if self._watched or self._parked:
            # Peers on this host, or operations UCX still held when their
            # endpoint failed: look at them now and then (a loop of
            # progress() alone must also free what UCX lets go of).
            self._peer_tick -= 1
            if self._peer_tick <= 0:
                self._peer_tick = _live.PROGRESS_STRIDE
                _live.check(self)
        return n

    def _poll_events(self) -> None:
        """Hook run between wait slices: dispatches queued active messages
        and put-with-notify notifications (when a handler is set), checks
        peers on this host (at most once per interval) and frees parked
        operations UCX has let go of."""
        due = _due(self._state)
        if due:
            self._run_queues(due)
        if self._watched:
            _live.check(self)
        elif self._parked:
            _live.sweep_parked(self)

    def _run_queues(self, due: int) -> None:
        """Do what the due bits say: run the handlers of queued active
        messages and notifications, warn about drops since the last look."""
        if due & _DUE_AM:
            _am.dispatch(self)
        if due & _DUE_NOTIFY:  # set only while a notify handler is set
            _rma.dispatch_notifications(self)
        if due & _DUE_DROPS:  # a queue cap dropped some
            _bounds.dropped(self)

    def fileno(self) -> int:
        """The worker's event fd (``ucp_worker_get_efd``), for event loops."""
        if self._h is None:
            raise_closed(self)
        return self._efd

    def arm(self) -> bool:
        """``ucp_worker_arm``: True if armed (safe to sleep on the fd), False
        if events are pending (progress again first)."""
        h = self._h
        if h is None:
            raise_closed(self)
        st = lib.ucp_worker_arm(h)
        if st == lib.UCS_ERR_BUSY:
            return False
        check(st, "ucp_worker_arm")
        return True

    def signal(self) -> None:
        """Wake a thread sleeping on this worker's event fd."""
        h = self._h
        if h is None:
            raise_closed(self)
        check(lib.ucp_worker_signal(h), "ucp_worker_signal")

    @property
    def address(self) -> bytes:
        """This worker's address for :meth:`connect` on a peer.

        The UCX worker address (``ucp_worker_query``) followed by a gpucx
        trailer: a format version, the length of the UCX part, a checksum,
        and this process's identity (pid, start time, boot id, pid
        namespace) so that a peer on the same host notices when this process
        dies.  A plain UCX program can use it as it is (UCX ignores the
        trailer)."""
        if self._h is None:
            raise_closed(self)
        if self._address is None:
            self._address = _address.frame(self.ucx_address)
        return self._address

    @property
    def ucx_address(self) -> bytes:
        """The bare UCX worker address (``ucp_worker_query``), without the
        gpucx trailer of :attr:`address`."""
        h = self._h
        if h is None:
            raise_closed(self)
        if self._ucx_address is None:
            out = ffi.new("void **")
            n = ffi.new("size_t *")
            check(lib.gpucx_worker_address(h, out, n), "ucp_worker_query(address)")
            try:
                self._ucx_address = bytes(ffi.buffer(out[0], n[0]))
            finally:
                lib.gpucx_free(out[0])
        return self._ucx_address

    def flush(self, timeout: float | None = None) -> None:
        """Complete every outstanding operation of every endpoint remotely.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` passes first.
        """
        h = self._h
        if h is None:
            raise_closed(self)
        if self._copies:  # gpucx's own copies (gpucx.ops.ipc) first
            _own.drain(self, None, timeout)
        slot = new_slot()
        finish(self, slot, lib.gpucx_worker_flush(h, slot), timeout, "worker flush")

    def fence(self) -> None:
        """Order operations: those issued after the fence start after those
        before it complete (``ucp_worker_fence``)."""
        h = self._h
        if h is None:
            raise_closed(self)
        check(lib.ucp_worker_fence(h), "ucp_worker_fence")

    # -- endpoints ----------------------------------------------------------

    def connect(self, address, *, error_handling: bool = True, raw: bool = False):
        """Create an :class:`~gpucx.Endpoint` to a peer.

        The call returns at once, as in UCX; an unreachable peer is reported
        by the first operation (or :meth:`Endpoint.flush`) as ``PeerError``.

        Parameters
        ----------
        address : bytes or (str, int)
            A peer worker's :attr:`address`, or the ``(host, port)`` of a
            peer's :class:`~gpucx.Listener`.
        error_handling : bool
            Peer error-handling mode (default): a dead peer fails pending
            operations with :class:`~gpucx.PeerError` instead of hanging.
        raw : bool
            ``address`` is a bare UCX worker address (from a program that
            does not use gpucx, or :attr:`ucx_address`): it has no gpucx
            trailer to verify, and its peer gets no liveness checks.

        Raises
        ------
        gpucx.InvalidAddressError
            For a malformed worker address (a gpucx address whose trailer is
            missing, truncated, extended or fails its checksum), or an
            unresolvable host.
        TypeError
            If ``address`` is neither bytes nor a ``(host, port)`` pair.
        """
        from .endpoint import Endpoint

        return Endpoint._connect(self, address, error_handling, raw)

    def listen(self, port: int = 0, host: str = "0.0.0.0"):
        """Accept connections on ``host:port`` (0 = any free port).

        Raises
        ------
        gpucx.UCXError
            If UCX cannot listen there (port in use: ``UCS_ERR_BUSY``).
        ValueError
            For a port outside 0..65535.
        """
        from .listener import Listener

        return Listener(self, host, port)

    # -- tag matching (facades over gpucx.ops.tag) ---------------------------

    recv = _tag.recv
    recv_nb = _tag.recv_nb
    probe = _tag.probe

    # -- active messages (facades over gpucx.ops.am) ---------------------------

    set_am_handler = _am.set_am_handler
    am_recv = _am.am_recv
    am_recv_nb = _am.am_recv_nb
    am_recv_many = _am.am_recv_many
    am_recv_many_nb = _am.am_recv_many_nb

    def _endpoint_for(self, h):
        """The Endpoint for UCX endpoint ``h`` (an AM reply endpoint): the
        user's own if this worker made it, else a borrowed wrapper."""
        key = int(ffi.cast("uintptr_t", h))
        ep = self._reply_eps.get(key)
        if ep is not None and ep._h is not None:
            return ep
        from .endpoint import Endpoint

        for child in list(self._children):
            if isinstance(child, Endpoint) and child._h is not None and child._h == h:
                ep = child
                break
        else:
            ep = Endpoint._borrow(self, h)
        self._reply_eps[key] = ep
        return ep

    def stats(self) -> dict[str, _bounds.QueueStats]:
        """Counters of the queues peers can fill, by name: ``"am_kept"``,
        ``"am_queue"``, ``"notify"`` and ``"arrays"`` (each a
        :class:`~gpucx.QueueStats`: held now, caps, dropped so far).  See
        docs/reliability.md, "Bounded queues".

        Raises
        ------
        gpucx.ClosedError
            If the worker is closed.
        """
        if self._h is None:
            raise_closed(self)
        return _bounds.stats(self)

    # -- put-with-notify, owner side (facade over gpucx.ops.rma) --------------

    notifications = _rma.notifications
    set_notify_handler = _rma.set_notify_handler

    # -- request bookkeeping --------------------------------------------------

    def _sweep(self) -> None:
        """Settle the finished requests nobody looked at (Request.__init__
        calls it once the pending set doubled since the last sweep)."""
        pending = self._pending
        for r in [r for r in pending if r._slot.status != INPROGRESS]:
            r._complete()
        self._sweep_at = max(_SWEEP_MIN, 2 * len(pending))

    def _untrack(self, req) -> None:
        self._pending.discard(req)

    def _park(self, slot, keep) -> None:
        self._parked.append((slot, keep))

    def _am_recv_registration(self, am_id: int):
        """The registration posted receives for ``am_id`` go through (made
        on first use; gpucx._internal.am_recv_registration)."""
        return _am._recv_reg(self._am, am_id)

    def _serve(self) -> None:
        """Progress UCX until it reports nothing more (bounded; no Python
        handlers run): a closing worker serves what its peers already sent
        before its endpoints go, since an emulated put or atomic waits for
        this worker's answer and the peer's flush (a sibling worker's close
        too) would wait out its deadline."""
        h = self._h
        for _ in range(_CLOSE_SERVE_ROUNDS):
            if not lib.ucp_worker_progress(h):
                break

    def _give_back_unreceived(self) -> None:
        """Give back what peers sent that nobody received (queued active
        messages and arrays; posted AM receives are canceled): a closing
        worker will not receive them, and a rendezvous sender completes only
        once the receiver takes or releases its message, so the peer's
        flush (a sibling worker's close too) would wait out its deadline."""
        _am.give_back_unreceived(self)

    def _close_children(self) -> None:
        self._serve()
        self._give_back_unreceived()
        super()._close_children()

    def _release(self) -> None:
        h = self._h
        for hook in self._on_close:
            hook()
        if self._aio is not None:
            self._aio.detach()
            self._aio = None
        _live.unwatch_all(self)
        # Cancel what is still outstanding and give UCX a bounded time to
        # report back, so no callback writes into freed slots.
        for req in list(self._pending):
            if req._slot.status == INPROGRESS and req._cancelable:
                lib.gpucx_slot_cancel(h, req._slot)
        settle(
            h,
            self._pending,
            time.monotonic() + time_left(self._deadline, CLOSE_GRACE_S),
        )
        for req in list(self._pending):
            if req._slot.status != INPROGRESS:
                req._complete()
        _live.free_parked_keys(self, closing=True)
        for slot, _keep in self._parked:
            lib.gpucx_slot_release(slot)
        _am.detach(self)
        lib.ucp_worker_destroy(h)
        _rma.worker_release(self)
        lib.gpucx_amo_worker_free(self._state)
        # Whatever UCX still held is gone with the worker: settle it.
        for req in list(self._pending):
            req._slot.req = ffi.NULL
            req._slot.status = lib.UCS_ERR_CANCELED
            req._complete()
            req._value = ClosedError("worker closed with the operation pending")
        self._parked.clear()
