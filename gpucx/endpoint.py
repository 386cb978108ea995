"""Endpoints: a connection from a worker to one peer."""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import struct
import time
import warnings
import weakref

from . import _address
from . import _heartbeat as _hb
from . import protocols as _protocols
from ._engine import INPROGRESS, new_slot
from ._handle import CLOSE_GRACE_S, Handle, raise_closed, time_left
from ._lib import ffi, lib
from ._liveness import SUSPECT_S, proc_alive
from .config import on_timeout_mode
from .errors import (
    CanceledError,
    InvalidAddressError,
    UCXError,
    UnsupportedError,
    check,
    ep_create_error,
    peer_error_for,
    peer_gone,
    stacklevel_outside,
)
from .ops import am as _am
from .ops import am_batch as _am_batch
from .ops import arrays as _arrays
from .ops import atomic as _atomic
from .ops import ipc as _own
from .ops import rma as _rma
from .ops import stream as _stream
from .ops import tag as _tag
from .request import finish, in_flight

__all__ = ["Endpoint"]


class Endpoint(Handle):
    """A connection to one peer worker (``ucp_ep_create``).

    Made by :meth:`Worker.connect` or :meth:`Listener.accept`.  Sends go
    through the endpoint; tag receives are worker-wide.
    """

    _is_endpoint = True

    _borrowed = False
    #: True while close() runs (keys unpacked on it defer to it).
    _closing = False
    #: Why gpucx failed this endpoint itself (a dead local peer), or None.
    _error_reason: str | None = None
    #: Created with peer error handling (UCX may be asked to force-close it).
    _peer_mode = True
    #: Connected by ``(host, port)`` (UCX client/server wireup).
    _sockaddr = False
    #: ``mode="same-host"``: no UCX peer error handling, gpucx's liveness
    #: check, strands counted, closed by the engine once idle.
    _same_host = False
    #: (pid, start time) of a watched peer process on this host, or None.
    _peer_id: tuple[int, int] | None = None
    #: Bits of the (operation, memory type) combinations whose protocol
    #: gpucx checked for a slow path (protocols.first_use).
    _proto_seen = 0
    #: This endpoint's own ``on_timeout`` (None: the context's).
    _on_timeout: str | None = None
    #: Why gpucx force-closed this endpoint to release an operation's
    #: buffers (``on_timeout="release"``), or None.
    _released_reason: str | None = None
    #: The peer worker's UCX address when this endpoint was made from a
    #: gpucx worker address (the peer runs gpucx): where :meth:`abort`
    #: sends its notice out of band when the in-band one cannot leave.
    _peer_ucx: bytes | None = None
    #: gpucx shut this endpoint's TCP lanes down before a force close, a
    #: send of this side being in flight over TCP (:meth:`_shut_tcp_lanes`):
    #: :meth:`abort`'s notice goes out of band.
    _lanes_shut: bool = False
    #: Why a close of the user's (``close(force=True)``, :meth:`abort`, a
    #: flush close past its timeout) shut those lanes down, or None: the
    #: operations UCX then failed end with CanceledError saying so, as a
    #: force close's do, not PeerError.
    _shut_by_close: str | None = None
    #: :meth:`abort` (or the heartbeat, :meth:`_fell_silent`) looked for a
    #: TCP send in flight before its notice: the force close that follows
    #: does not look again (the notice, a few bytes of gpucx's own queued
    #: behind what is in flight, would count as one).
    _shut_decided: bool = False

    def __init__(self, worker, state, peer: str, hear: bool = False):
        self._init_handle()
        self._w = worker
        # The worker's progress engine (gpucx._engine): what the operations
        # on this endpoint post with and wait on.
        self._engine = worker._engine
        self._state = state
        self._h = state.ep
        self.peer = peer
        worker._adopt(self)
        e = self._engine
        am = e.am
        if am is not None and am.enabled and ABORT_AM_ID not in am.handlers:
            # The notice a peer's abort() sends (a worker with endpoints
            # of its own is the one that can be told), and the heartbeat
            # (gpucx._heartbeat): a ping is answered in C by whatever
            # progresses this worker, a pong says the peer was heard.
            _am.set_internal_handler(e, ABORT_AM_ID, _on_abort)
            _am.set_internal_handler(e, NOTICE_AM_ID, _notice_handler(e))
            _hb.answer_pings(e)
            _am.set_internal_handler(e, PONG_AM_ID, _pong_handler(e))
            e.ping = _send_ping
        if hear:  # the peer may run gpucx, and answer pings
            e.hear(self, self._fell_silent)

    @classmethod
    def _connect(
        cls,
        worker,
        address,
        error_handling: bool | None,
        raw: bool = False,
        ep_mode: str | None = None,
    ):
        if worker._h is None:
            raise_closed(worker)
        same_host = _same_host_mode(ep_mode, address, error_handling, raw)
        if error_handling is None:
            error_handling = not same_host
        wstate = worker._engine.state
        state = ffi.new("gpucx_ep_state_t *")
        mode = 1 if error_handling else 0
        ident = None
        blob = None
        if isinstance(address, (bytes, bytearray, memoryview)):
            blob = bytes(address)
            if not raw:
                blob, ident = _address.parse(blob)
            if same_host:
                _refuse_same_host(worker._engine, ident)
            _check_worker_address(blob, worker.ucx_address)
            # UCX parses addresses without a length: a truncated blob makes it
            # read past the end.  Hand it a zero-padded copy so such reads stay
            # in memory we own and the outcome is deterministic.
            padded = ffi.new("char[]", len(blob) + _ADDRESS_PAD)
            ffi.memmove(padded, blob, len(blob))
            st = lib.gpucx_ep_create_address(wstate, padded, mode, state)
            peer = f"worker address ({len(blob)} bytes)"
            if ident is not None and _watched(ident):
                peer = f"process {ident.pid} ({len(blob)}-byte worker address)"
        elif isinstance(address, tuple) and len(address) == 2:
            host, port = address
            if not isinstance(host, str) or not isinstance(port, int):
                raise TypeError("address must be (host: str, port: int)")
            if not 0 < port < 65536:
                raise ValueError(f"port must be in 1..65535, not {port}")
            st = lib.gpucx_ep_create_sockaddr(wstate, host.encode(), port, mode, state)
            peer = f"{host}:{port}"
        else:
            raise TypeError(
                "address must be a peer's worker address (bytes) or a "
                f"(host, port) tuple, not {type(address).__name__}"
            )
        exc = ep_create_error(st, peer, by_address=not isinstance(address, tuple))
        if exc is not None:
            raise exc
        # A (host, port) or a gpucx worker address: the peer may run gpucx,
        # and answer the heartbeat (never a raw address).
        ep = cls(worker, state, peer, isinstance(address, tuple) or ident is not None)
        ep._connected(
            error_handling, isinstance(address, tuple), same_host, ident, blob
        )
        return ep

    def _connected(
        self,
        error_handling: bool,
        sockaddr: bool,
        same_host: bool,
        ident,
        blob: bytes | None = None,
    ):
        """Record how :meth:`_connect` made this endpoint; watch its peer
        when ``ident`` (a framed address's) names a process of this host.
        A framed address's peer runs gpucx: its UCX address ``blob`` is
        where :meth:`abort`'s notice goes out of band, and a notice from
        that worker finds this endpoint by it (:func:`_notice_handler`)."""
        self._peer_mode = error_handling
        self._sockaddr = sockaddr
        self._same_host = same_host
        if ident is not None and blob is not None:
            self._peer_ucx = blob
            _notices(self._engine).index(self, blob)
        if ident is not None and _watched(ident):
            self._watch(ident.pid, ident.start_time)

    @classmethod
    def _accept(cls, worker, conn_request, peer: str, error_handling: bool = True):
        state = ffi.new("gpucx_ep_state_t *")
        mode = 1 if error_handling else 0
        check(
            lib.gpucx_ep_create_conn(worker._engine.state, conn_request, mode, state),
            "ucp_ep_create(conn_request)",
        )
        ep = cls(worker, state, peer, hear=True)
        ep._peer_mode = error_handling
        return ep

    @classmethod
    def _borrow(cls, worker, h):
        """Wrap an endpoint UCX created itself (an active message's reply
        endpoint).  gpucx does not own it: close() only forgets it."""
        state = ffi.new("gpucx_ep_state_t *")
        state.ep = h
        state.error = lib.UCS_OK
        ep = cls(worker, state, "reply endpoint")
        ep._borrowed = True
        return ep

    def __repr__(self) -> str:
        state = "closed" if self._h is None else self.peer
        return f"<gpucx.Endpoint {state}>"

    @property
    def mode(self) -> str | None:
        """The endpoint mode it was connected with: ``"same-host"``
        (guide, "Endpoint modes"), or None (UCX's own error handling, or
        none with ``error_handling=False``)."""
        return "same-host" if self._same_host else None

    @property
    def worker(self):
        """The :class:`~gpucx.Worker` this endpoint belongs to."""
        return self._w

    @property
    def error(self) -> UCXError | None:
        """The failure UCX reported for this endpoint (peer death...), or None."""
        st = self._state.error
        if st == lib.UCS_OK:
            return None
        if self._shut_by_close is not None and self._error_reason is None:
            return None  # closed here (close(force=True)), not failed
        exc = peer_error_for(st, f"endpoint {self.peer}")
        if self._error_reason is not None:
            exc.args = (f"endpoint {self.peer}: {self._error_reason}",)
        else:
            exc.args = (exc.args[0] + self._failure_hint(),)
        return exc

    def _failure(self, st: int, what: str):
        """The error an operation ``what`` that failed with ``st`` raises
        when the cause is this endpoint's failure (peer death), else None
        (gpucx.request.raise_status: one place for every operation)."""
        if st == _SHMEM_SEGMENT and self._h is not None:
            # UCX could not attach the peer's shared-memory segment: a local
            # peer that died before gpucx's liveness check looked is the
            # usual cause.
            self._engine.check_peer(self)
        if self._state is None or self._state.error == lib.UCS_OK:
            return None
        reason = self._error_reason
        if reason is None and self._shut_by_close is not None:
            # A close of the user's shut the TCP lanes down before its force
            # close (_shut_tcp_lanes): canceled, as by the force close itself.
            return CanceledError(f"{what}: {self._shut_by_close}", _CANCELED)
        exc = peer_error_for(self._state.error, what)
        if reason is not None:  # gpucx found the peer dead (or released it)
            exc.args = (f"{what}: {reason}",)
        else:
            exc.args = (exc.args[0] + self._failure_hint(),)
        return exc

    def _watch(self, pid: int, start_time: int) -> None:
        """Have the engine check the peer, process ``pid`` of this host
        started at ``start_time``, from now on (gpucx._liveness): its death
        fails this endpoint (:meth:`_peer_died`)."""
        self._peer_id = (pid, start_time)
        self._engine.watch(self, pid, start_time, self._state, self._peer_died)

    def _fell_silent(self, reason: str, slot=None) -> None:
        """The peer, which answered the heartbeat once (gpucx._heartbeat),
        fell silent for ``GPUCX_PEER_TIMEOUT`` while operations on this
        endpoint waited for it: fail this endpoint
        with ``reason`` (PeerError for every pending operation) after
        sending the peer the abort notice, so that its own operations with
        this side fail at once when it runs again.  ``slot``: the operation
        of a blocking wait on this endpoint (no tracked request), or None."""
        if self._h is None:
            return
        # Force-closed as for a dead peer: the close is what fails the
        # thawed peer's operations over TCP.  A send of this side still on
        # a TCP socket (a peer that stopped taking data, where
        # TCP_USER_TIMEOUT has not reset the connection first: UCX before
        # 1.22, or the option chosen longer) has the sockets shut down
        # first (docs/reliability.md, "Known UCX limitation"), decided
        # before the notice as abort() decides it (the notice then goes out
        # of band only).
        if self._peer_mode and not self._engine.multi:
            self._shut_tcp_lanes(slot, reason)
        self._shut_decided = True
        self._notify_abort()
        self._peer_died(reason, slot)

    def _peer_died(self, reason: str, slot=None) -> None:
        """gpucx found the peer, a process of this host, dead (the engine's
        liveness check, :mod:`gpucx._liveness`): fail this endpoint with
        ``reason`` and close it in UCX.

        With peer error handling the UCX endpoint is force-closed, which
        fails every operation still outstanding on it.  Without it a force
        close is undefined behaviour in UCX; in ``"multi"`` thread mode
        another thread may be posting on the endpoint right now.  In those
        cases the UCX endpoint is left to the worker's destruction.  Either
        way, a tracked request UCX still holds is parked (its buffers stay
        alive until UCX lets go) and fails with PeerError, and blocking
        waits on the endpoint raise PeerError (``Engine.block``).

        A send of this side in flight over TCP (a tracked request's, or
        ``slot``'s: a blocking wait's operation) leaves the UCX endpoint open
        the same way: no force close, which UCX 1.21/1.22 may crash on.
        """
        e = self._engine
        e.unhear(self)
        force = self._peer_mode and not e.multi
        if (
            force
            and not self._shut_decided
            and self._state.error == lib.UCS_OK
            and self._tcp_send_in_flight(slot) is not None
        ):
            # A send of this side in flight over TCP: no force close (UCX
            # 1.21/1.22 may crash on it once the peer closes, and shutting
            # the sockets down first crashed UCX when the peer had closed
            # already, the usual order when a notice fails the endpoint).
            # The endpoint is left open to UCX, as in "multi" mode: UCX
            # fails it when the peer's side closes or the connection times
            # out, and completes the send then (docs/reliability.md, "Known
            # UCX limitation").
            force = False
        self._state.error = lib.UCS_ERR_CONNECTION_RESET
        self._error_reason = reason
        self._closed_reason = reason
        h = self._h
        self._h = None  # later operations raise PeerError (_handle.raise_closed)
        parent = self._parent  # the bookkeeping close() does for a closed child
        if parent is not None:
            parent._live -= 1
        if force:
            pending = [r for r in e.pending if r._slot.status == INPROGRESS]
            slot = new_slot()
            if lib.gpucx_ep_close(h, 1, slot) == INPROGRESS:
                e.park(slot)
            else:
                lib.gpucx_slot_release(slot)
            lib.ucp_worker_progress(e.h)
            # Operations gpucx cannot tie to an endpoint (a tag receive
            # already matched to the dead peer's rendezvous send) come back
            # canceled by the force close, within a few progress calls: that
            # is the peer's death (see Request._complete).
            until = time.monotonic() + SUSPECT_S
            for req in pending:
                if req._ep is None:
                    e.suspects[req] = (reason, until)
        # Atomics gpucx emulates over active messages wait for a reply UCX
        # knows nothing of: they fail with the peer's death now.
        lib.gpucx_amo_ep_closed(e.state, h, self._state.error)
        self._give_up_requests(reason)
        # The endpoint's children (unpacked remote keys) must go before the
        # UCX endpoint and worker do; a later close() of the endpoint finds
        # no UCX handle and would not reach them.
        if force:
            self._close_children()
        else:  # the UCX endpoint lives on: close them with the worker
            e.on_close.append(self._close_keys)

    def _close_keys(self) -> None:
        """Close a dead peer's remote keys within the closing worker's
        deadline."""
        self._deadline = self._w._deadline
        self._close_children()

    def _give_up_requests(
        self, reason: str | None, strand: bool = True, reqs: list | None = None
    ) -> list:
        """This endpoint's requests (or ``reqs``) that UCX still holds are
        given up: on a same-host endpoint their bytes count as stranded
        (:meth:`gpucx._engine.Engine.strand`) unless ``strand`` is False
        (counted already).  With ``reason`` (the peer died) each is parked
        with its buffers and fails with PeerError, and those already
        finished complete.  Returns ``(request, slot)`` of those UCX
        holds."""
        e = self._engine
        same_host = self._same_host and strand
        held = []
        if reqs is None:
            reqs = e.pending_on(self)
        else:  # those not settled meanwhile
            reqs = [r for r in reqs if r in e.pending]
        for req in reqs:
            slot, keep = req._slot, req._keep
            if slot.status != INPROGRESS:
                if reason is not None:
                    req._complete()
                continue
            held.append((req, slot))
            if same_host:
                e.strand(slot, _held_bytes(keep))
            if reason is not None:
                e.park(slot, keep, req._holds)
                req._fail(peer_gone(req._what, reason, self._state.error))
        return held

    def _parked_peer_died(self, reqs: list, reason: str) -> None:
        """The peer of this same-host endpoint, closed and parked with the
        engine (:meth:`_park_busy`) with requests ``reqs`` pending, died:
        those fail with PeerError (their bytes were counted as stranded at
        the close)."""
        self._state.error = lib.UCS_ERR_CONNECTION_RESET
        self._error_reason = reason
        self._give_up_requests(reason, False, reqs)

    def check_peer(self) -> None:
        """Look at the peer process now, when it runs on this host (an
        endpoint made from a gpucx worker address: a ``select`` of its
        pidfd, else a read of ``/proc``); if it died, fail this endpoint as
        the periodic liveness check would, and raise.

        Cheap enough to call before posting a large message on a
        ``mode="same-host"`` endpoint: UCX never reports such a peer's
        death, and a rendezvous send to it stays with UCX for good.

        Raises
        ------
        gpucx.PeerError
            If the peer died (now or before).
        gpucx.ClosedError
            If the endpoint was closed here.
        """
        if self._h is not None:
            self._engine.check_peer(self)
        if self._h is None:
            raise_closed(self)
        exc = self.error
        if exc is not None:
            raise exc

    def _park_busy(self) -> bool:
        """Close step of a same-host endpoint whose peer lives: True when UCX
        still holds operations on it, which are then stranded and the
        endpoint parked with the engine (closed once they are done,
        :meth:`gpucx._engine.Engine.park_endpoint`); False when it is idle
        (the caller's flush close then finishes at once)."""
        # Its requests, not an endpoint flush: UCX completes a flush while a
        # rendezvous send still waits for the peer to fetch it.
        held = self._give_up_requests(None)
        if not held:
            return False
        reqs = [r for r, _ in held]
        # A worker of this process (no peer id): the engine watches this
        # process instead, which never dies but keeps the sweeps coming.
        me = _address.own_identity()
        pid, start = self._peer_id or (me.pid, me.start_time)
        self._engine.park_endpoint(
            self._h,
            [slot for _, slot in held],
            (pid, start, self._state),
            functools.partial(self._parked_peer_died, reqs),
            self._late_rkeys,
        )
        return True

    def _failure_hint(self) -> str:
        """What to check when UCX failed a ``(host, port)`` connection."""
        if not self._sockaddr:
            return ""
        from ._lib import UCX_VERSION

        # gpucx does not know whether the connection ever worked (a lost
        # host fails an established one the same way): the hint says when
        # it applies.
        return (
            f" (if this connection never worked and a listener runs there, "
            f"check that it runs UCX "
            f"{UCX_VERSION[0]}.{UCX_VERSION[1]} like this process: UCX's "
            "client/server wireup does not cross UCX minor versions; "
            "`gpucx info` shows the version)"
        )

    @property
    def on_timeout(self) -> str:
        """What a blocking operation on this endpoint does when its deadline
        passes (or its wait is interrupted) while UCX still holds it:
        ``"park"`` (keep the buffer alive, in UCX's use, until UCX lets go)
        or ``"release"`` (force-close this endpoint so that UCX lets go
        before the error is raised).  Defaults to the context's
        ``GPUCX_ON_TIMEOUT``; a call's own ``on_timeout=`` wins.
        docs/reliability.md, "Deadlines and the buffer".

        Raises
        ------
        ValueError
            When set to anything but ``"park"``, ``"release"`` or None (the
            context's again).
        """
        mode = self._on_timeout
        return mode if mode is not None else self._engine.context.on_timeout

    @on_timeout.setter
    def on_timeout(self, mode: str | None) -> None:
        self._on_timeout = None if mode is None else on_timeout_mode(mode)

    def direct_access(self) -> list[str]:
        """The transports of this endpoint through which the peer reaches
        this process's memory by itself (``cma``, ``knem``, ``xpmem``,
        ``cuda_ipc``, ``rocm_ipc``, ``dc``...: a peer holding a rendezvous
        address reads or writes it without this endpoint), as UCX reports
        them (:attr:`transports` and :meth:`protocols`).  Closing this
        endpoint cannot stop those: ``on_timeout="release"`` does not
        release over them.  Empty for TCP, copy-in/copy-out shared memory
        (``posix``, ``sysv``), ``self`` and RC verbs.

        Raises
        ------
        gpucx.ClosedError
            If the endpoint is closed.
        """
        names = {tl for tl, _dev in self.transports}
        for row in self.protocols():
            names.update(part.split("/")[0] for part in row.config.split(","))
        return sorted(n for n in names if n.strip().startswith(_DIRECT_ACCESS))

    def _tcp_send_in_flight(self, slot=None) -> str | None:
        """What a force close of this endpoint must not meet, or None: a send
        (tag, AM, stream, put) that UCX still carries over a ``tcp`` lane,
        ``slot`` (an operation being given up) or another operation pending
        on the endpoint, as UCX names it (``ucp_request_query``).

        UCX 1.22 crashes this process (use after free in
        ``uct_tcp_iface_handle_events``) when an endpoint made from a worker
        address is force-closed with such a send blocked on its socket and
        the peer closes its side later: docs/reliability.md, "Known UCX
        limitation".  A release shuts such an endpoint's TCP sockets down
        first (:meth:`_shut_tcp_lanes`).
        """
        rows = [] if slot is None else [_protocols.request_protocol(slot)]
        rows += [r.protocol for r in self._engine.pending_on(self)]
        for row in rows:
            if row is not None and row.op in _SENDS and "tcp/" in row.config:
                return (
                    f"endpoint {self.peer} carries a {row.operation} of "
                    f"{row.start} bytes over {row.config} ({row.description}) "
                    "that UCX could not finish: force-closing it would let "
                    "UCX 1.22 crash this process once the peer closes its "
                    "side (use after free in uct_tcp_iface_handle_events, "
                    'docs/reliability.md "Known UCX limitation"), so it was '
                    "left open"
                )
        return None

    def _release_shut(self, slot) -> str | None:
        """What ``on_timeout="release"`` does before its force close: shut
        the TCP lanes down when a send is in flight over one
        (:meth:`_shut_tcp_lanes`).  None when that was done or not needed;
        else why the endpoint must be left open for ``slot``'s operation: a
        send UCX carries over a TCP lane whose sockets gpucx cannot find
        (:meth:`_tcp_lane_sockets`)."""
        why = self._shut_tcp_lanes(slot)
        if why is None:
            return None
        from ._lib import UCX_VERSION

        return (
            f"{why} (gpucx shuts such an endpoint's TCP connections down "
            "before the close, but could not find their sockets: it knows "
            "where UCX 1.21 and 1.22 keep them; this is UCX "
            f"{UCX_VERSION[0]}.{UCX_VERSION[1]})"
        )

    def _tcp_lane_sockets(self) -> list[int] | None:
        """The sockets (file descriptors, UCX's own) of this endpoint's TCP
        lanes, or None when gpucx cannot find one for each lane: a UCX other
        than 1.21 or 1.22 (``_TCP_SHUTDOWN_UCX``), a lane UCX keeps beyond
        the first ones, ``/proc`` not readable.

        UCX has no API for them.  Its TCP transport registers each
        connection's socket in an epoll set with the connection's UCT
        endpoint as the event's data (``/proc/self/fdinfo``), and the
        endpoint object holds the UCT endpoints of its first lanes, or a
        wireup proxy for one (a lane not yet switched to its transport),
        which holds this endpoint's address and, in the next word, the UCT
        endpoint.  A socket is this endpoint's when its event's data is one
        of the object's first ``_EP_WORDS`` words, or the word after this
        endpoint's address among the first ``_PROXY_WORDS`` of what those
        point to, and it is a connected TCP socket.  Memory is read through
        ``/proc/self/mem`` (a word that is no pointer reads nothing), and
        only epoll sets whose every event's data is a pointer are looked at
        (not those of asyncio or ``select.epoll``, which hold file
        numbers)."""
        from ._lib import UCX_VERSION

        h = self._h
        if h is None or tuple(UCX_VERSION[:2]) not in _TCP_SHUTDOWN_UCX:
            return None
        lanes = sum(1 for tl, dev in self.transports if tl == "tcp" and dev)
        if not lanes:
            return None
        try:
            mem = os.open("/proc/self/mem", os.O_RDONLY)
        except OSError:
            return None
        me = int(ffi.cast("uintptr_t", h))
        try:
            # The lanes' UCT endpoints, or proxies (each names this endpoint
            # and, in the next word, the UCT endpoint it wraps).
            near = set(_words(mem, me, _EP_WORDS))
            for w in list(near):
                got = _words(mem, w, _PROXY_WORDS)
                near.update(got[i + 1] for i in range(len(got) - 1) if got[i] == me)
        finally:
            os.close(mem)
        fds = [fd for p, fd in _epoll_pointers() if p in near and _tcp_connection(fd)]
        return fds if len(fds) == lanes else None

    def _shut_tcp_lanes(
        self, slot=None, reason: str | None = None, cancels: bool = False
    ) -> str | None:
        """Before a force close: when UCX still carries a send of this side
        over a TCP lane (:meth:`_tcp_send_in_flight`, for ``slot``'s
        operation or another one pending on the endpoint), shut the lanes'
        sockets down (``shutdown(2)``, :meth:`_tcp_lane_sockets`) and
        progress (at most ``TCP_SHUTDOWN_S``) until UCX fails the endpoint,
        as when a peer's connection breaks: UCX completes the send with an
        error and closes the socket itself, and the force close that follows
        meets a failed connection, not the one UCX 1.22 keeps for receiving
        and later crashes on (docs/reliability.md, "Known UCX limitation").

        The operations UCX fails then say ``reason`` (None: a release's
        words, what ``Engine._release`` calls it for); ``cancels``: they end
        with CanceledError (a close of the user's) rather than PeerError.
        What releases a send (``Engine._release``), closes with ``force``
        (:meth:`_release`) and fails an endpoint (:meth:`_peer_died`) calls.
        Only an endpoint UCX has not failed yet (its error callback is what
        ends the wait).  Returns None when nothing was in flight over TCP or
        the lanes were shut down, else what was in flight (a TCP send whose
        sockets gpucx could not find: the caller's force close risks the
        crash)."""
        why = self._tcp_send_in_flight(slot)
        if why is None:
            return None
        fds = self._tcp_lane_sockets()  # the /proc search: only now
        if not fds:
            return why
        if cancels:
            self._shut_by_close = reason
        else:
            self._error_reason = _RELEASED_SHUT if reason is None else reason
        self._lanes_shut = True  # abort's notice then goes out of band only
        for fd in fds:
            _shutdown(fd)
        e = self._engine
        end = time.monotonic() + TCP_SHUTDOWN_S
        while self._state.error == lib.UCS_OK and time.monotonic() < end:
            lib.ucp_worker_progress(e.h)
        return None

    def abort(self, reason: str = "aborted", *, notify: bool = True) -> None:
        """Force-close this endpoint now (``UCP_EP_CLOSE_MODE_FORCE``) so that
        UCX lets go of everything it holds on it; ``reason`` says why.

        What ``on_timeout="release"`` does when a deadline passes: every
        operation still outstanding on the endpoint completes as canceled
        (:class:`~gpucx.CanceledError`), its buffers no longer in UCX's use
        (except over :meth:`direct_access` transports), and later
        operations raise :class:`~gpucx.ClosedError`.

        With ``notify`` (and the ``"am"`` feature) a small notice goes to
        the peer first, in order behind what this endpoint already sent:
        the peer's gpucx fails its endpoint back to this worker
        (:meth:`fail`), so that its own pending operations with this side
        end at once with :class:`~gpucx.PeerError` rather than at their
        deadlines.  When that notice cannot leave within
        ``ABORT_NOTICE_S`` (a send, put or get queued towards a peer that
        stopped taking data: the close drops it with them) and this
        endpoint was made from a gpucx worker address, the notice goes out
        of band as well, on an endpoint of its own to the peer's worker
        (made at the first such release and kept, one per peer worker,
        until this worker closes): it arrives once the peer progresses
        again and fails the peer's endpoints made from this worker's
        address.  An endpoint made by ``(host, port)`` or a listener, or
        from a ``raw`` address, has only the in-band notice; the peer then
        learns from its own deadlines (docs/reliability.md, "What the peer
        sees").  Safe on a closed endpoint (does nothing).
        """
        if self._h is None:
            return
        self._released_reason = reason
        self._closed_reason = reason
        if self._peer_mode and not self._borrowed and self._state.error == lib.UCS_OK:
            # A TCP send in flight: the sockets first, before the notice
            # (which then goes out of band only, _notify_abort).
            self._shut_before_force_close(_ABORTED_SHUT)
        self._shut_decided = True
        if notify and not self._borrowed:
            self._notify_abort()
        self.close(force=True)

    def _notify_abort(self) -> None:
        """Send the peer the notice of :meth:`abort` and give it
        ``ABORT_NOTICE_S`` to leave; the force close that follows cancels it
        if it could not, so it then goes out of band as well
        (:meth:`_notify_out_of_band`)."""
        e = self._engine
        if e.am is None or not e.am.enabled:
            return
        if self._state.error != lib.UCS_OK:
            if self._lanes_shut:
                # gpucx shut the TCP lanes down (_shut_tcp_lanes): the peer
                # sees the connection end, but a receive it matched to the
                # released send is not failed by that; the notice can go
                # out of band only.
                self._notify_out_of_band()
            return
        try:
            req = _am.send_internal_nb(self, ABORT_AM_ID, b"", reply=True)
        except UCXError:
            return  # the endpoint failed meanwhile: nothing to tell
        if not req.done():
            e.drain([req], time.monotonic() + ABORT_NOTICE_S)
        if not req.done():
            self._notify_out_of_band()

    def _notify_out_of_band(self) -> None:
        """Send :meth:`abort`'s notice on this worker's notice endpoint to
        the peer's worker (made now if there is none yet), which nothing
        queued on this endpoint delays.  Nobody waits for it: it leaves
        when the peer takes messages again and this worker progresses.
        Only for a peer known to run gpucx (an endpoint made from a gpucx
        worker address): another would not know the message."""
        peer = self._peer_ucx
        if peer is None:
            return
        n = _notices(self._engine)
        try:
            ep = n.endpoint(self._w, peer)
            req = _am.send_internal_nb(ep, NOTICE_AM_ID, b"", header=n.me(self._w))
        except UCXError:
            return  # the peer's worker cannot be reached: nothing to tell
        self._engine.let_go(req)

    def fail(self, reason: str) -> None:
        """Fail this endpoint now, as when its peer dies: every operation
        pending on it fails with :class:`~gpucx.PeerError` naming
        ``reason`` (a tag receive UCX already matched to the peer's send
        too), later operations raise it at once, and the UCX endpoint is
        force-closed.  What a peer's :meth:`abort` notice does on arrival.
        Safe on a closed endpoint (does nothing).
        """
        if self._h is None or self._borrowed:
            return
        self._peer_died(reason)

    @property
    def transports(self) -> list[tuple[str, str]]:
        """``(transport, device)`` of each lane this endpoint uses
        (``ucp_ep_query``).  Lanes are final once the first operation
        completed (or after :meth:`flush`)."""
        h = self._h
        if h is None:
            raise_closed(self)
        names = ffi.new("const char *[128]")
        n = lib.gpucx_ep_transports(h, names, 64)
        if n < 0:
            raise UCXError("ucp_ep_query(transports) failed")
        return [
            (ffi.string(names[2 * i]).decode(), ffi.string(names[2 * i + 1]).decode())
            for i in range(n)
        ]

    def protocols(self) -> list:
        """Every protocol UCX selected for this endpoint so far, as
        :class:`gpucx.protocols.Protocol` rows (see :mod:`gpucx.protocols`
        for UCX's reports they come from).

        Raises
        ------
        gpucx.ClosedError
            If the endpoint is closed.
        """
        return _protocols.protocols(self)

    def protocol(self, op: str, nbytes: int, memory=("host", "host"), *, rkey=None):
        """The protocol UCX selected for ``op`` ("tag", "am", "stream",
        "put", "get", ...) of ``nbytes`` bytes between ``memory`` (local,
        remote), or None when UCX has selected none yet or does not report
        it (:func:`gpucx.protocols.protocol`).  A put or get gpucx copies
        itself over CUDA IPC (for ``rkey`` when given, see docs/rma.md)
        reads ``"gpucx cuda_ipc copy"``.

        Raises
        ------
        ValueError
            For an unknown ``op`` or a negative ``nbytes``.
        gpucx.ClosedError
            If the endpoint is closed.
        """
        return _protocols.protocol(self, op, nbytes, memory, rkey=rkey)

    @property
    def local_sockaddr(self) -> tuple[str, int] | None:
        """``(host, port)`` of this side of the connection (``ucp_ep_query``),
        for endpoints made by a ``(host, port)`` connect or a listener; None
        for one made from a worker address."""
        pair = self._sockaddrs()
        return None if pair is None else pair[0]

    @property
    def remote_sockaddr(self) -> tuple[str, int] | None:
        """``(host, port)`` of the peer's side of the connection (see
        :attr:`local_sockaddr`)."""
        pair = self._sockaddrs()
        return None if pair is None else pair[1]

    def _sockaddrs(self):
        h = self._h
        if h is None:
            raise_closed(self)
        local = ffi.new("char[]", 64)
        remote = ffi.new("char[]", 64)
        lport = ffi.new("int *")
        rport = ffi.new("int *")
        if lib.gpucx_ep_sockaddrs(h, local, remote, 64, lport, rport) != 0:
            return None
        return (
            (ffi.string(local).decode(), lport[0]),
            (ffi.string(remote).decode(), rport[0]),
        )

    def flush(self, timeout: float | None = None) -> None:
        """Complete all operations issued on this endpoint at the peer.

        Raises
        ------
        gpucx.PeerError
            If the peer is dead or unreachable.
        gpucx.TimeoutError
            When ``timeout`` passes first.
        """
        h = self._h
        if h is None:
            raise_closed(self)
        e = self._engine
        if e.copies:  # gpucx's own copies (gpucx.ops.ipc) first
            _own.drain(e, self, timeout)
        slot = new_slot()
        st = lib.gpucx_ep_flush(h, slot)
        finish(e, slot, st, timeout, f"flush of endpoint {self.peer}", self)

    # -- tag matching (facades over gpucx.ops.tag) ---------------------------

    send = _tag.send
    send_nb = _tag.send_nb

    # -- stream, active messages, arrays (gpucx.ops.stream/am/arrays) -------

    stream_send = _stream.stream_send
    stream_send_nb = _stream.stream_send_nb
    stream_recv = _stream.stream_recv
    stream_recv_nb = _stream.stream_recv_nb
    am_send = _am.am_send
    am_send_nb = _am.am_send_nb
    prepare_am = _am_batch.prepare_am
    send_array = _arrays.send_array
    send_array_nb = _arrays.send_array_nb
    recv_array = _arrays.recv_array
    recv_array_nb = _arrays.recv_array_nb
    # -- RMA and atomics (facades over gpucx.ops.rma / gpucx.ops.atomic) ------

    unpack = _rma.unpack
    put = _rma.put
    put_nb = _rma.put_nb
    get = _rma.get
    get_nb = _rma.get_nb
    prepare_put = _rma.prepare_put
    prepare_get = _rma.prepare_get
    atomic_add = _atomic.atomic_add
    atomic_and = _atomic.atomic_and
    atomic_or = _atomic.atomic_or
    atomic_xor = _atomic.atomic_xor
    fetch_add = _atomic.fetch_add
    fetch_and = _atomic.fetch_and
    fetch_or = _atomic.fetch_or
    fetch_xor = _atomic.fetch_xor
    swap = _atomic.swap
    compare_swap = _atomic.compare_swap
    atomic_add_nb = _atomic.atomic_add_nb
    atomic_and_nb = _atomic.atomic_and_nb
    atomic_or_nb = _atomic.atomic_or_nb
    atomic_xor_nb = _atomic.atomic_xor_nb
    fetch_add_nb = _atomic.fetch_add_nb
    fetch_and_nb = _atomic.fetch_and_nb
    fetch_or_nb = _atomic.fetch_or_nb
    fetch_xor_nb = _atomic.fetch_xor_nb
    swap_nb = _atomic.swap_nb
    compare_swap_nb = _atomic.compare_swap_nb

    # -- lifetime -------------------------------------------------------------

    def close(self, *, force: bool = False, timeout: float | None = None) -> None:
        """Close the endpoint.  Safe to call twice.

        By default a flush close: gpucx waits until every operation issued on
        this endpoint has completed (and UCX flushed the endpoint), at most
        ``timeout`` seconds (default ``CLOSE_TIMEOUT_S``, 10 s; less when the
        worker or context is closing and its own deadline comes first).
        Whatever is still pending then is canceled by a force close: its
        request fails with :class:`~gpucx.CanceledError`.

        ``force=True`` closes at once (``UCP_EP_CLOSE_MODE_FORCE``): pending
        operations fail with :class:`~gpucx.CanceledError`, nothing is
        flushed.  An endpoint whose peer failed is always force-closed.
        Before any force close, a send of this side that UCX still carries
        over TCP has the endpoint's TCP connection shut down first (UCX 1.21
        and 1.22 crash this process otherwise once the peer closes its
        side): its operations' CanceledError says so (docs/reliability.md,
        "Every force close goes through the shutdown").

        A ``mode="same-host"`` endpoint is never force-closed (UCX forbids
        it without peer error handling) and its close does not wait: with
        operations still in UCX's hands it is closed here at once (later
        use raises ``ClosedError``), their bytes count in
        :attr:`Worker.stranded_bytes`, and the worker flush-closes the UCX
        endpoint once they are done; if the peer dies meanwhile they fail
        with :class:`~gpucx.PeerError`.  ``force`` is ignored there.

        Raises
        ------
        ValueError
            For a negative ``timeout``.

        Warns
        -----
        RuntimeWarning
            Once per process, when a force close meets a send in flight over
            TCP whose sockets gpucx cannot find (a UCX other than 1.21 and
            1.22): the close goes ahead, at the risk of that crash.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0, not {timeout}")
        if self._same_host and self._h is not None:
            # UCX forbids a force close without peer error handling (it
            # returns INVALID_PARAM, ucp_ep_close_nbx): such an endpoint is
            # flush-closed, by the engine once idle (_release).  A peer that
            # died fails it now instead (the UCX endpoint goes with the
            # worker).
            force = False
            self._engine.check_peer(self)
        self._force = force
        if self._h is not None:
            self._closing = True
            self._late_rkeys: list = []
        super().close(timeout=timeout)

    def _release(self) -> None:
        e = self._engine
        if e.h is None:  # pragma: no cover - worker closes its children first
            return
        if self._borrowed:  # UCX owns it (an AM reply endpoint)
            return
        deadline = self._deadline
        alive = e.peer_alive(self)
        e.unwatch(self)
        e.unhear(self)
        if self._same_host and alive and self._park_busy():
            return  # the engine closes it once UCX let go of its operations
        forced = getattr(self, "_force", False)
        force = (
            forced
            or self._state.error != lib.UCS_OK
            or not alive  # a flush close would wait in vain for a dead peer
        )
        if not force:
            # Flush first and wait for this endpoint's own requests: a flush
            # close in UCX completes without waiting for, e.g., a rendezvous
            # send the peer has not matched, which would then never finish.
            force = not self._drain(deadline)
        if (
            force
            and self._peer_mode
            and not self._shut_decided
            and self._state.error == lib.UCS_OK
        ):
            self._shut_before_force_close(
                _FORCE_CLOSED_SHUT if forced else _TIMED_OUT_SHUT
            )
        slot = new_slot()
        if lib.gpucx_ep_close(self._h, 1 if force else 0, slot) == INPROGRESS:
            # A flush close needs the peer to progress, which may be another
            # worker of this context (Engine.others).
            end = time.monotonic() + time_left(deadline, CLOSE_GRACE_S)
            e.wait_closing(lambda: slot.status != INPROGRESS, end, e.others())
        if slot.status == INPROGRESS:
            # UCX still owns the close request: never close twice, never free
            # the slot under it; the worker settles it when it is destroyed.
            e.park(slot)
        else:
            lib.gpucx_slot_release(slot)
        # Atomics gpucx runs over active messages on this endpoint wait for a
        # reply UCX knows nothing of: they are canceled here.
        lib.gpucx_amo_ep_closed(e.state, self._h, lib.UCS_ERR_CANCELED)
        if force:
            # A force close completes this endpoint's requests (canceled)
            # from inside progress; let them land before the caller looks.
            e.drain(e.pending_on(self), time.monotonic() + CLOSE_GRACE_S)
        if any(in_flight(r) for r in e.pending_on(self)):
            return  # UCX may still use the keys: never free them under it
        for rkey in self._late_rkeys:
            lib.gpucx_rkey_destroy(rkey)

    def _shut_before_force_close(self, reason: str) -> None:
        """A close about to force-close this endpoint (``force=True``, a
        flush close past its timeout, :meth:`abort`) while UCX has not
        failed it: a send of this side in flight over TCP has the lanes
        shut down first (:meth:`_shut_tcp_lanes`; the operations then end
        with CanceledError saying ``reason``); where gpucx cannot find
        their sockets the force close goes ahead, with a ``RuntimeWarning``
        (once per process) naming the risk."""
        why = self._shut_tcp_lanes(reason=reason, cancels=True)
        if why is None or _FORCE_CLOSE_WARNED:
            return
        _warn_force_close(why)

    def _drain(self, deadline: float | None) -> bool:
        """Flush, then wait until no request of this endpoint is pending.

        True when everything completed before ``deadline``.
        """
        e = self._engine
        slot = new_slot()
        lib.gpucx_ep_flush(self._h, slot)  # a final status lands in the slot
        # Receives on the endpoint (stream) wait for the peer to send, which
        # it may never do: the close cancels them rather than waiting.
        mine = [r for r in e.pending_on(self) if r._what != _stream.RECV]

        def drained() -> bool:
            nonlocal mine
            if slot.status == INPROGRESS:
                return False
            mine = [r for r in mine if in_flight(r)]
            return not mine

        try:
            end = time.monotonic() + time_left(deadline)
            done = e.wait_closing(drained, end, e.others())
            return done and self._state.error == lib.UCS_OK
        finally:
            if slot.status == INPROGRESS:
                # The force close that follows completes the flush request.
                e.park(slot)
            else:
                lib.gpucx_slot_release(slot)


def _check_worker_address(blob: bytes, local: bytes) -> None:
    """Reject blobs that cannot be UCX worker addresses before UCX sees them.

    UCX trusts address blobs: an unknown format version (the low 4 bits of
    the first byte) trips an assertion that aborts the process.  gpucx
    accepts the format versions UCX can parse (v1 and v2) up to the one this
    UCX writes itself; UCX checks the rest and reports ``INVALID_PARAM``.
    """
    if len(blob) < 8:
        raise InvalidAddressError(
            f"malformed worker address: {len(blob)} bytes is too short"
        )
    version = blob[0] & _ADDRESS_VERSION_MASK
    newest = max(local[0] & _ADDRESS_VERSION_MASK, 1)
    if version > newest:
        raise InvalidAddressError(
            f"malformed worker address: format version {version} is not one "
            f"this UCX reads (0..{newest})"
        )


#: The reserved active-message id of Endpoint.abort's notice to the peer.
ABORT_AM_ID = 0xFF30
#: The heartbeat's ping and pong (gpucx._heartbeat).
PING_AM_ID = _hb.PING_AM_ID
PONG_AM_ID = _hb.PONG_AM_ID
#: How long Endpoint.abort gives its notice to leave before the force close.
ABORT_NOTICE_S = 0.005
#: What a peer's abort notice fails the endpoint with.
_ABORTED_BY_PEER = (
    "the peer closed the connection after giving up an operation "
    "(on_timeout='release' or Endpoint.abort)"
)


def _on_abort(msg) -> None:
    """The handler of Endpoint.abort's notice: fail the endpoint it came on."""
    ep = msg.reply_ep
    if ep is not None:
        ep.fail(_ABORTED_BY_PEER)


#: The reserved active-message id of Endpoint.abort's notice out of band
#: (on a notice endpoint of its own, :func:`_notice_handler`).
NOTICE_AM_ID = 0xFF33
#: How long a closing worker gives its notice endpoints to deliver what
#: they carry (a peer stopped since keeps the rest from its own deadline).
NOTICE_CLOSE_S = 0.5


def _peer_key(ucx_address: bytes) -> bytes:
    """What names a worker in an out-of-band notice: 16 bytes of a hash
    of its UCX address (the bytes its peers connected to)."""
    return hashlib.blake2b(ucx_address, digest_size=16).digest()


class _Notices:
    """One worker's side of the out-of-band abort notice: its endpoints
    made from gpucx worker addresses, by the peer worker's key (those a
    notice from that worker fails), and the notice endpoints it made, one
    per peer worker, kept until the worker closes."""

    __slots__ = ("engine", "by_peer", "eps", "key")

    def __init__(self, e):
        self.engine = weakref.ref(e)
        self.by_peer: dict[bytes, weakref.WeakSet] = {}
        self.eps: dict[bytes, Endpoint] = {}
        self.key: bytes | None = None
        e.on_close.append(self.close)

    def index(self, ep: Endpoint, peer_ucx: bytes) -> None:
        """``ep`` was made from the address of the worker whose UCX address
        is ``peer_ucx``."""
        key = _peer_key(peer_ucx)
        eps = self.by_peer.get(key)
        if eps is None:
            # Peers whose endpoints are all gone leave no entry behind.
            self.by_peer = {k: v for k, v in self.by_peer.items() if v}
            eps = self.by_peer[key] = weakref.WeakSet()
        eps.add(ep)

    def me(self, worker) -> bytes:
        """This worker's key, what its notices carry."""
        if self.key is None:
            self.key = _peer_key(worker.ucx_address)
        return self.key

    def endpoint(self, worker, peer_ucx: bytes) -> Endpoint:
        """The notice endpoint to the worker at ``peer_ucx`` (a raw one:
        no heartbeat, no liveness check, not itself indexed)."""
        ep = self.eps.get(peer_ucx)
        if ep is None or ep.closed:
            ep = self.eps[peer_ucx] = _NoticeEndpoint.make(worker, peer_ucx)
        return ep

    def close(self) -> None:
        """The worker closes (its endpoints closed already): forget them."""
        for ep in self.eps.values():
            ep.close()
        self.eps.clear()
        e = self.engine()
        if e is not None:
            _NOTICES.pop(e, None)


class _NoticeEndpoint(Endpoint):
    """An endpoint that carries only out-of-band abort notices
    (:class:`_Notices`): nobody waits for them, so its close gives them
    ``NOTICE_CLOSE_S`` at most, also when its worker closes."""

    @classmethod
    def make(cls, worker, peer_ucx: bytes) -> Endpoint:
        """A notice endpoint to the worker at UCX address ``peer_ucx``: a
        raw one (no heartbeat, no liveness check, not indexed), with UCX
        peer error handling (a dead peer fails it rather than its close
        waiting)."""
        return cls._connect(worker, peer_ucx, True, raw=True)

    def close(self, *, force: bool = False, timeout: float | None = None) -> None:
        t = NOTICE_CLOSE_S if timeout is None else min(timeout, NOTICE_CLOSE_S)
        super().close(force=force, timeout=t)


#: Each worker's _Notices (by its engine: weak, the worker owns the engine).
_NOTICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _notices(e) -> _Notices:
    n = _NOTICES.get(e)
    if n is None:
        n = _NOTICES[e] = _Notices(e)
    return n


def _notice_handler(e):
    """The handler of out-of-band abort notices to engine ``e``'s worker:
    its header names the worker that gave up an operation; every endpoint
    of this worker made from that worker's address fails as the in-band
    notice fails one (:func:`_on_abort`).  A notice naming no such
    endpoint (closed meanwhile, or never made) does nothing."""

    def on_notice(msg) -> None:
        n = _NOTICES.get(e)
        eps = None if n is None else n.by_peer.get(msg.header)
        for ep in list(eps or ()):
            ep.fail(_ABORTED_BY_PEER)

    return on_notice


#: What the operations UCX fails after Endpoint._shut_tcp_lanes say: for a
#: release, a close(force=True) of the user's, a flush close past its timeout.
_RELEASED_SHUT = (
    "released after a deadline (on_timeout='release'): gpucx shut the "
    "endpoint's TCP connection down"
)
_FORCE_CLOSED_SHUT = (
    "canceled by close(force=True): gpucx shut the endpoint's TCP connection "
    "down first (a send of this side was in flight over TCP)"
)
_ABORTED_SHUT = (
    "canceled by abort(): gpucx shut the endpoint's TCP connection down "
    "first (a send of this side was in flight over TCP)"
)
_TIMED_OUT_SHUT = (
    "canceled by close(): the flush did not finish within the close's "
    "timeout, and gpucx shut the endpoint's TCP connection down before "
    "force-closing it (a send of this side was in flight over TCP)"
)
_CANCELED = lib.UCS_ERR_CANCELED
#: Endpoint._shut_before_force_close warned once already (this process).
_FORCE_CLOSE_WARNED = False


def _warn_force_close(why: str) -> None:
    """Warn, once per process, that a close force-closes an endpoint with
    a TCP send in flight whose sockets gpucx could not find (``why``: what
    :meth:`Endpoint._tcp_send_in_flight` said)."""
    global _FORCE_CLOSE_WARNED
    _FORCE_CLOSE_WARNED = True
    from ._lib import UCX_VERSION

    why = why.replace("so it was left open", "and it is force-closed anyway")
    warnings.warn(
        f"{why}: gpucx shuts such an endpoint's TCP connections down before a "
        "force close, but could not find their sockets (it knows where UCX "
        f"1.21 and 1.22 keep them; this is UCX {UCX_VERSION[0]}."
        f"{UCX_VERSION[1]}). Give the operation up with "
        "on_timeout='release' instead, or let it finish before closing; "
        "this warning is given once per process",
        RuntimeWarning,
        stacklevel=stacklevel_outside(),
    )


#: Operations (gpucx.protocols.OPERATIONS keys) that carry this side's data
#: to the peer: what a force close must not cut over TCP
#: (Endpoint._tcp_send_in_flight).
_SENDS = frozenset({"tag", "tag_sync", "am", "am_reply", "stream", "put", "rndv_send"})
#: UCX versions (major, minor) whose TCP transport Endpoint._shut_tcp_lanes
#: knows: where it finds an endpoint's sockets (Endpoint._tcp_lane_sockets)
#: and that a socket shut down takes UCX's error path, read in the source of
#: v1.21.0 and v1.22.0 (their src/uct/tcp/ differs only in keepalive) and
#: measured with 1.22.  Elsewhere a TCP send in flight stays refused.
_TCP_SHUTDOWN_UCX = frozenset({(1, 21), (1, 22)})
#: Words of UCX's endpoint object that Endpoint._tcp_lane_sockets reads:
#: its first lanes are within (UCX 1.21, 1.22: from the third word).
_EP_WORDS = 8
#: Words of what those point to that it reads for a wireup proxy's UCT
#: endpoint (the 4th word in UCX 1.22; the 53rd in 1.21, where the proxy
#: embeds a whole interface operations table).
_PROXY_WORDS = 128
#: How long Endpoint._shut_tcp_lanes waits for UCX to fail the endpoint
#: once its sockets are shut down (in practice one progress call).
TCP_SHUTDOWN_S = 0.5


def _words(mem: int, addr: int, n: int) -> tuple[int, ...]:
    """The ``n`` pointer-size words at ``addr`` of this process, read through
    ``mem`` (``/proc/self/mem``: an address not mapped reads nothing where a
    load would crash; fewer words where the mapping ends).
    Endpoint._tcp_lane_sockets."""
    if not _pointer(addr):
        return ()
    try:
        raw = os.pread(mem, 8 * n, addr)
    except (OSError, OverflowError):
        return ()
    return struct.unpack(f"{len(raw) // 8}Q", raw[: len(raw) // 8 * 8])


def _pointer(word: int) -> bool:
    """Whether ``word`` could be a pointer: past the first pages, aligned (a
    file number, a flag word or a count is not)."""
    return word >= 1 << 16 and word % 8 == 0


def _epoll_pointers() -> list[tuple[int, int]]:
    """``(data, fd)`` of every file watched by an epoll set of this process
    whose every watch carries a pointer as its data (``/proc/self/fdinfo``):
    UCX's event sets, not those that hold file numbers (asyncio,
    ``select.epoll``).  Endpoint._tcp_lane_sockets."""
    found: list[tuple[int, int]] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue  # closed meanwhile
        watches = []
        for line in lines:
            if line.startswith("tfd:"):
                fields = line.split()
                fd, data = int(fields[1]), int(fields[fields.index("data:") + 1], 16)
                watches.append((data, fd))
        # A pointer is past the first pages and aligned; a file number is not.
        if watches and all(_pointer(d) for d, _ in watches):
            found += watches
    return found


def _socket_of(fd: int) -> socket.socket | None:
    """A socket object over a duplicate of ``fd`` (closing it leaves ``fd``,
    UCX's, open), or None when ``fd`` is no socket (or closed meanwhile)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _tcp_connection(fd: int) -> bool:
    """Whether ``fd`` is a connected TCP socket (IPv4 or IPv6)."""
    sock = _socket_of(fd)
    if sock is None:
        return False
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.type != socket.SOCK_STREAM:
            return False
        try:
            sock.getpeername()
        except OSError:
            return False
        return True


def _shutdown(fd: int) -> None:
    """``shutdown(fd, SHUT_RDWR)`` without closing ``fd`` (UCX's)."""
    sock = _socket_of(fd)
    if sock is None:
        return
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # reset meanwhile: UCX sees that too


def _send_ping(ep, token: bytes):
    """The engine's ``ping`` hook (gpucx._heartbeat): ask ``ep``'s peer for a
    pong carrying ``token``; the request, or None when the endpoint cannot
    send (it failed meanwhile: nothing to ask)."""
    try:
        return _am.send_internal_nb(ep, PING_AM_ID, b"", header=token, reply=True)
    except UCXError:
        return None


def _pong_handler(e):
    """The handler of the answers to engine ``e``'s heartbeat pings: the
    peer of the endpoint named by the token it carries was heard now."""

    def on_pong(msg) -> None:
        e.heard(msg.header)

    return on_pong


#: Transports (name prefixes) through which a peer reaches this process's
#: memory by itself, without this endpoint (Endpoint.direct_access).
_DIRECT_ACCESS = ("cma", "knem", "xpmem", "cuda_ipc", "rocm_ipc", "dc")

#: UCX could not attach a peer's shared-memory segment.
_SHMEM_SEGMENT = lib.UCS_ERR_SHMEM_SEGMENT

_ADDRESS_VERSION_MASK = 0x0F
_IOV = ffi.typeof("ucp_dt_iov_t")
_ADDRESS_PAD = 4096


def _same_host_mode(mode, address, error_handling, raw) -> bool:
    """Whether ``connect(..., mode=mode)`` asks for a same-host endpoint.

    Raises
    ------
    ValueError
        For an unknown mode, or one that cannot go with the other arguments.
    """
    if mode is None:
        return False
    if mode != "same-host":
        raise ValueError(f"mode must be None or 'same-host', not {mode!r}")
    if error_handling:
        raise ValueError(
            "mode='same-host' is an endpoint without UCX peer error handling: "
            "leave error_handling out"
        )
    if raw or not isinstance(address, (bytes, bytearray, memoryview)):
        raise ValueError(
            "mode='same-host' needs a gpucx worker address (bytes, not raw=True "
            "and not (host, port)): its trailer names the peer process"
        )
    return True


def _refuse_same_host(engine, ident) -> None:
    """Refuse a same-host endpoint that gpucx could not look after.

    Raises
    ------
    gpucx.UnsupportedError
        When the peer runs on another host or in another pid namespace,
        when gpucx's liveness checks are off, or when operations given up
        on same-host endpoints hold ``GPUCX_MAX_STRANDED_BYTES`` already.
    gpucx.PeerError
        When the peer process is gone.
    """
    if not _address.is_local(ident):
        raise UnsupportedError(
            f"mode='same-host': the peer process {ident.pid} does not run on "
            "this host (another boot id or pid namespace); connect without a "
            "mode (UCX peer error handling) to reach it"
        )
    if not _address.same_node(ident):
        raise UnsupportedError(
            f"mode='same-host': the peer process {ident.pid} runs on this "
            "kernel but under another host name or in other IPC or mount "
            "namespaces (a container, an emulated host), where UCX's shared "
            "memory does not reach; connect without a mode to reach it"
        )
    if engine.peer_interval <= 0:
        raise UnsupportedError(
            "mode='same-host' relies on gpucx's liveness checks, which "
            "GPUCX_PEER_CHECK_INTERVAL=0 turned off"
        )
    if ident.pid != os.getpid() and not proc_alive(ident.pid, ident.start_time):
        raise peer_gone("mode='same-host' connect", f"peer process {ident.pid} is gone")
    cap = engine.context.max_stranded_bytes
    if cap:
        held = engine.stranded_bytes()
        if held >= cap:
            raise UnsupportedError(
                f"mode='same-host': operations given up on same-host endpoints "
                f"hold {held} bytes (GPUCX_MAX_STRANDED_BYTES={cap}); UCX keeps "
                "them until their peers take them or this worker closes; "
                "connect without a mode meanwhile"
            )


def _watched(ident) -> bool:
    """Whether a peer of identity ``ident`` gets gpucx's liveness checks:
    another process of this host and pid namespace."""
    return ident.pid != os.getpid() and _address.is_local(ident)


def _held_bytes(keep) -> int:
    """Bytes of the buffers an operation holds (its ``keep``, as the
    operations build it): a cffi ``char[]`` of a buffer-protocol object, an
    IOV list (its ``ucp_dt_iov_t`` array first), or the object that owns
    the memory (``nbytes`` of NumPy, CuPy and the like).  Best effort:
    what it cannot size counts 0."""
    if isinstance(keep, ffi.CData):
        t = ffi.typeof(keep)
        if t.kind == "array" and t.item is _IOV:
            return sum(int(keep[i].length) for i in range(len(keep)))
        return ffi.sizeof(keep) if t.kind == "array" else 0
    if isinstance(keep, list) and keep and isinstance(keep[0], ffi.CData):
        return _held_bytes(keep[0])
    if isinstance(keep, (list, tuple)):
        return sum(_held_bytes(k) for k in keep)
    n = getattr(keep, "nbytes", None)
    return n if isinstance(n, int) else 0
