"""The UCX worker: its progress engine (:mod:`gpucx._engine`), tag receive
side, endpoint factory."""

from __future__ import annotations

import time
import weakref

from . import _address, _bounds
from . import _liveness as _live
from ._engine import Engine, new_slot
from ._handle import CLOSE_GRACE_S, Handle, raise_closed, time_left
from ._internal import engine, handle
from ._lib import ffi, lib
from .config import THREAD_MODES
from .errors import ClosedError, check
from .ops import am as _am
from .ops import arrays as _arrays
from .ops import atomic as _atomic
from .ops import ipc as _own
from .ops import rma as _rma
from .ops import tag as _tag
from .request import finish

__all__ = ["Worker"]
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

    def __init__(self, context, thread_mode: str = "single"):
        h = handle(context)
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
        self._h = state.worker
        self._context = context
        self.thread_mode = thread_mode
        # Progress, waits, slots, operations in flight, liveness of local
        # peers: the engine's (gpucx._engine), which every layer above uses.
        options = context.options
        e = self._engine = Engine(
            self,
            state,
            context,
            thread_mode == "multi",
            int(options["SPIN_US"] * 1000),
            options["PEER_CHECK_INTERVAL"],
            _siblings(context),
        )
        e.on_am = _am.dispatch
        e.on_notify = _rma.dispatch_notifications
        e.on_drops = _bounds.dropped
        e.on_copies = _own.poll
        e.find_endpoint = _endpoint_finder(self)
        self._address: bytes | None = None
        self._ucx_address: bytes | None = None
        self._reply_eps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        _am.attach(e)  # the AM queue (e.am, e.amq)
        _arrays.attach(e)  # the internal array AM id, on top of AM
        context._adopt(self)
        _rma.worker_init(e)
        _atomic.worker_init(e)

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
        return self._engine.progress()

    def fileno(self) -> int:
        """The worker's event fd (``ucp_worker_get_efd``), for event loops."""
        if self._h is None:
            raise_closed(self)
        return self._engine.efd

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
    def context(self):
        """The :class:`~gpucx.Context` this worker was created from."""
        return self._context

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
        e = self._engine
        if e.copies:  # gpucx's own copies (gpucx.ops.ipc) first
            _own.drain(e, None, timeout)
        slot = new_slot()
        finish(e, slot, lib.gpucx_worker_flush(h, slot), timeout, "worker flush")

    def fence(self) -> None:
        """Order operations: those issued after the fence start after those
        before it complete (``ucp_worker_fence``)."""
        h = self._h
        if h is None:
            raise_closed(self)
        check(lib.ucp_worker_fence(h), "ucp_worker_fence")

    # -- endpoints ----------------------------------------------------------

    def connect(
        self,
        address,
        *,
        error_handling: bool | None = None,
        raw: bool = False,
        mode: str | None = None,
    ):
        """Create an :class:`~gpucx.Endpoint` to a peer.

        The call returns at once, as in UCX; an unreachable peer is reported
        by the first operation (or :meth:`Endpoint.flush`) as ``PeerError``.

        Parameters
        ----------
        address : bytes or (str, int)
            A peer worker's :attr:`address`, or the ``(host, port)`` of a
            peer's :class:`~gpucx.Listener`.
        error_handling : bool
            Peer error-handling mode (default True): a dead peer fails
            pending operations with :class:`~gpucx.PeerError` instead of
            hanging.
        raw : bool
            ``address`` is a bare UCX worker address (from a program that
            does not use gpucx, or :attr:`ucx_address`): it has no gpucx
            trailer to verify, and its peer gets no liveness checks.
        mode : None or "same-host"
            ``"same-host"``: an endpoint to a process on this host without
            UCX peer error handling, so that UCX may move large messages
            with single-copy ``cma`` (it leaves ``cma`` out of endpoints
            with error handling), looked after by gpucx instead: the peer
            process is watched (its death fails pending operations with
            ``PeerError``), a close with operations pending does not wait
            (the worker closes the UCX endpoint once they are done), and
            what such operations hold when given up counts in
            :attr:`stranded_bytes`, capped by the context's
            ``GPUCX_MAX_STRANDED_BYTES``.  ``address`` must be a gpucx
            worker address; docs/guide.md, "Endpoint modes".

        Raises
        ------
        gpucx.InvalidAddressError
            For a malformed worker address (a gpucx address whose trailer is
            missing, truncated, extended or fails its checksum), or an
            unresolvable host.
        TypeError
            If ``address`` is neither bytes nor a ``(host, port)`` pair.
        ValueError
            For an unknown ``mode``, or ``mode="same-host"`` with
            ``error_handling=True``, ``raw=True`` or a ``(host, port)``.
        gpucx.UnsupportedError
            ``mode="same-host"`` refused: the peer runs on another host (or
            pid namespace), the liveness checks are off
            (``GPUCX_PEER_CHECK_INTERVAL=0``), or :attr:`stranded_bytes`
            reached ``GPUCX_MAX_STRANDED_BYTES``.
        gpucx.PeerError
            ``mode="same-host"``: the peer process is gone.
        """
        from .endpoint import Endpoint

        return Endpoint._connect(self, address, error_handling, raw, mode)

    @property
    def stranded_bytes(self) -> int:
        """Bytes held by operations given up on this worker's
        ``mode="same-host"`` endpoints (still in UCX's hands when their
        endpoint was closed or their peer died) that UCX has not let go
        of: UCX cancels no send and closes no such endpoint while it holds
        one, so a send whose peer died stays until the worker closes.  Past
        the context's ``GPUCX_MAX_STRANDED_BYTES``, ``connect(...,
        mode="same-host")`` refuses.  0 once the worker closed."""
        return self._engine.stranded_bytes()

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

    def _endpoint_of(self, h, borrow: bool):
        """This worker's Endpoint for UCX endpoint ``h``; when it made none:
        with ``borrow``, a borrowed wrapper (an active message's reply
        endpoint, which UCX made), else None (a notification's sender this
        side holds no endpoint to)."""
        key = int(ffi.cast("uintptr_t", h))
        ep = self._reply_eps.get(key)
        if ep is not None and not ep.closed:
            return ep
        from .endpoint import Endpoint

        for child in list(self._children):
            if isinstance(child, Endpoint) and handle(child) == h:
                ep = child
                break
        else:
            if not borrow:
                return None
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
        return _bounds.stats(self._engine)

    # -- put-with-notify, owner side (facade over gpucx.ops.rma) --------------

    notifications = _rma.notifications
    set_notify_handler = _rma.set_notify_handler

    def _am_recv_registration(self, am_id: int):
        """The registration posted receives for ``am_id`` go through (made
        on first use; gpucx._internal.am_recv_registration)."""
        return _am.recv_registration(self._engine, am_id)

    def _serve(self) -> None:
        """Progress UCX until it reports nothing more (bounded; no Python
        handlers run): a closing worker serves what its peers already sent
        before its endpoints go, since an emulated put or atomic waits for
        this worker's answer and the peer's flush (a sibling worker's close
        too) would wait out its deadline."""
        h = self._engine.h
        for _ in range(_CLOSE_SERVE_ROUNDS):
            if not lib.ucp_worker_progress(h):
                break

    def _give_back_unreceived(self) -> None:
        """Give back what peers sent that nobody received (queued active
        messages and arrays; posted AM receives are canceled): a closing
        worker will not receive them, and a rendezvous sender completes only
        once the receiver takes or releases its message, so the peer's
        flush (a sibling worker's close too) would wait out its deadline."""
        _am.give_back_unreceived(self._engine)

    def _let_go_of_peers(self) -> None:
        """What a closing worker does first, while its endpoints and its
        context's other workers live (``Context._close_children`` does it
        for every worker before any endpoint goes): serve what peers sent,
        and give back what nobody received."""
        self._serve()
        self._give_back_unreceived()

    def _endpoints(self) -> list:
        """This worker's endpoints (the children it adopted that are
        endpoints; closing one already closed does nothing)."""
        from .endpoint import Endpoint

        return [c for c in self._children if isinstance(c, Endpoint)]

    def _close_children(self) -> None:
        self._let_go_of_peers()
        super()._close_children()

    def _release(self) -> None:
        h = self._h
        e = self._engine
        for hook in e.on_close:
            hook()
        if e.driver is not None:
            e.driver.detach()
            e.driver = None
        _live.unwatch_all(e)
        # Cancel what is still outstanding and give UCX a bounded time to
        # report back, so no callback writes into freed slots.
        e.cancel_pending(time.monotonic() + time_left(self._deadline, CLOSE_GRACE_S))
        _am.detach(e)
        lib.ucp_worker_destroy(h)
        _rma.worker_release(e)
        lib.gpucx_amo_worker_free(e.state)
        # Whatever UCX still held is gone with the worker: settle it.
        e.destroyed(lambda: ClosedError("worker closed with the operation pending"))

    def _abandon(self, reason: str) -> None:
        super()._abandon(reason)
        self._engine.forget()


def _siblings(context) -> list:
    """The list of engines the workers of ``context`` share (see
    ``Engine.siblings``): an existing worker's, or a new one."""
    for child in list(context._children):
        if isinstance(child, Worker) and not child.closed:
            return engine(child).siblings
    return []


def _endpoint_finder(worker):
    """The engine's ``find_endpoint`` hook for ``worker``: ``(ep_h, borrow)``
    -> this worker's Endpoint for UCX endpoint ``ep_h``; with ``borrow``, a
    borrowed wrapper when it made none (an active message's reply endpoint),
    else None.  Holds the worker weakly (it owns the engine)."""
    ref = weakref.ref(worker)

    def find(ep_h, borrow: bool):
        w = ref()
        if w is None or ep_h == ffi.NULL:
            return None
        return w._endpoint_of(ep_h, borrow)

    return find
