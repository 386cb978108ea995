"""The progress engine of one worker: its UCX handle and C state, the event
fds, the shared completion slot, the operations in flight (pending and
parked), the liveness of peers on this host, and every wait.

A :class:`~gpucx.Worker` holds one :class:`Engine` (``worker._engine``; an
:class:`~gpucx.Endpoint` holds its worker's).  The layers above --
``gpucx.request``, ``gpucx.ops``, ``gpucx.mem``, ``gpucx.aio`` and, through
:func:`gpucx._internal.engine`, ``gpucx.bench`` -- touch
progress and waiting only through the engine's attributes and methods
documented here, never through the Worker's private fields
(docs/layout.md, "The engine").

The waits are one protocol (docs/layout.md, "One wait loop"):

* :meth:`Engine.spin` busy-polls one completion slot in C for a bounded
  time, stopping for the handlers of active messages and notifications as
  they arrive (``gpucx_wait_due``); a blocking wait, an await
  (``gpucx.aio``) and the slow half of a fused C post-and-wait helper all
  spin through it, or through the same C call inlined;
* :meth:`Engine.block` waits for one operation: the spin, then sleeps on
  the event fd in slices, running :meth:`poll_events` between slices; on
  timeout or interrupt it gives the operation up (:meth:`abandon`);
* :meth:`Engine.wait_for` waits for anything else (a connection, an array,
  a notification) in the same slices;
* :meth:`Engine.wait_closing` and :meth:`Engine.drain` are the bounded
  waits of the close paths.

The engine imports nothing above it: what must run between wait slices
(active-message handlers, notifications, drop warnings, gpucx's own copies)
is handed to it as hooks by the Worker, which knows the operations.
Liveness of peers on this host is plugged in the same way: an endpoint
whose peer is watched registers what to do when the peer dies
(:meth:`Engine.watch`).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import _heartbeat as _hb
from . import _liveness as _live
from ._handle import raise_closed
from ._lib import ffi, lib
from .errors import TimeoutError, note_deadline

__all__ = ["Engine", "new_slot", "slice_ms", "INPROGRESS", "SLICE_MS"]

INPROGRESS = lib.UCS_INPROGRESS

#: Longest single sleep, so deadlines and signals are checked in time.
SLICE_MS = 100
#: Progress calls between two looks at the deadline in a polling wait.
POLL_STRIDE = 1000
#: How many tracked requests trigger a sweep of completed, unobserved ones.
SWEEP_MIN = 1024
#: How long a timed-out or interrupted wait drains its canceled operation:
#: a receive reports back within a progress call or two; UCX cannot cancel a
#: send, which is parked at once so that the deadline is kept.
CANCEL_DRAIN_S = 0.02
#: How long ``on_timeout="release"`` waits, after force-closing the
#: endpoint, for UCX to complete the operation (a force close completes
#: what it purges within a progress call or two; the bound is for a UCX
#: that does not).
RELEASE_DRAIN_S = 1.0

#: What the C sleeps report when a watched local peer's pidfd woke them.
_PEER_EXITED = lib.GPUCX_PEER_EXITED
#: What gpucx_wait_due reports when Python has work due (handlers to run).
WAIT_DUE = lib.GPUCX_WAIT_DUE
#: Bits of lib.gpucx_progress's (and lib.gpucx_due's) result: work for
#: Python after progress.  They are the top three bits, so a result of at
#: least DUE_DROPS has one set; _COUNT masks UCX's event count.
DUE_AM = lib.GPUCX_DUE_AM
DUE_NOTIFY = lib.GPUCX_DUE_NOTIFY
DUE_DROPS = lib.GPUCX_DUE_DROPS
_COUNT = ~lib.GPUCX_DUE & 0xFFFFFFFF

# Looked up once: a cffi ``lib.name`` costs about 50 ns, and these run for
# every operation that waits.
_wait = lib.gpucx_wait
_wait_due = lib.gpucx_wait_due
_due = lib.gpucx_due
_progress = lib.gpucx_progress
_slot_release = lib.gpucx_slot_release

_SLOT_P = ffi.typeof("gpucx_slot_t *")


def new_slot():
    """A fresh completion slot (C memory owned by the returned cdata)."""
    return ffi.new(_SLOT_P)


def slice_ms(deadline: float | None, timeout: float | None, what: str) -> int:
    """How long the next sleep may be: one slice, never past the deadline.

    Raises
    ------
    gpucx.TimeoutError
        Once ``deadline`` (a ``time.monotonic()`` value) has passed; the
        message reads ``f"{what} within {timeout} s"``.
    """
    if deadline is None:
        return SLICE_MS
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what} within {timeout} s", lib.UCS_ERR_TIMED_OUT)
    return min(SLICE_MS, max(1, int(left * 1000)))


def _nothing(engine: Any) -> None:
    """The hook of a worker that has not installed its own (or has closed)."""


class Engine:
    """The progress engine of one worker (see the module doc).

    The layers above read these attributes and call the methods; they write
    only the per-worker state of their own operations (``am``,
    ``notify_q``...) and ``driver``.

    Attributes
    ----------
    h : ucp_worker_h or None
        The UCX worker; None once the worker closed (or was abandoned in a
        forked child).  The hot paths test it for "closed".
    state : gpucx_worker_state_t *
        The C state the fused post-and-wait helpers take.
    efd : int
        The worker's event fd (``ucp_worker_get_efd``).
    pfd : int
        The epoll fd of watched local peers' pidfds, or -1.
    multi : bool
        ``thread_mode="multi"``: every blocking operation takes a fresh slot.
    sslot : gpucx_slot_t * or None
        The shared slot of blocking operations on a single-thread worker
        (None on a ``"multi"`` one); see :meth:`slot`.
    spin_ns : int
        How long a blocking wait spins in C first (``GPUCX_SPIN_US``).
    context : Context
        The worker's context (features, caps, options).
    pending : set
        Requests UCX may still complete (:meth:`track`).
    parked : list
        ``(slot, keep, holds)`` of operations given up while UCX held them
        (:meth:`park`).
    parked_keys : list
        ``(ucp_rkey_h, slots)`` of remote keys closed while parked
        operations used them (:meth:`park_key`).
    parked_eps : list
        :class:`ParkedEndpoint` of same-host endpoints closed while UCX
        still held operations on them (:meth:`park_endpoint`).
    stranded : list
        ``(slot, nbytes)`` of operations given up on same-host endpoints
        (:meth:`strand`, :meth:`stranded_bytes`).
    suspects : WeakKeyDictionary
        Requests pending when gpucx force-closed a dead peer's endpoint:
        request -> (reason, until); see ``Endpoint._peer_died``.
    watched, pidfds, pset, pfd, peer_interval, peer_check_at, peer_tick
        Liveness of peers on this host (:meth:`watch`, ``gpucx._liveness``).
    beats, beat_tokens, beat_token, beat_at, ping
        The heartbeat of peers that operations wait on (:meth:`hear`,
        ``gpucx._heartbeat``); ``ping(ep, token)`` sends one (the endpoint
        module's hook; None: no ``"am"`` feature, no heartbeat).
    am, amq, notify_q, notify_handler, amo_ok, copies, copy_streams
        What the operations keep per worker (``gpucx.ops.am``, ``.rma``,
        ``.atomic``, ``.ipc``), written by those modules.
    driver
        The ``gpucx.aio`` driver when an event loop drives the worker.
    on_close : list
        Callables run first when the worker closes.
    on_am, on_notify, on_drops, on_copies, find_endpoint
        The worker's hooks (:meth:`progress`, :meth:`poll_events`,
        :meth:`reply_endpoint`).
    siblings : list
        The engines of the context's live workers (:meth:`others`).
    owner : weakref
        The Worker (weak: it owns the engine).
    """

    __slots__ = (
        "h",
        "state",
        "efd",
        "multi",
        "sslot",
        "spin_ns",
        "context",
        "pending",
        "sweep_at",
        "parked",
        "parked_keys",
        "parked_eps",
        "stranded",
        "suspects",
        "watched",
        "pidfds",
        "pset",
        "pfd",
        "peer_interval",
        "peer_check_at",
        "peer_tick",
        "beats",
        "beat_tokens",
        "beat_token",
        "beat_at",
        "ping",
        "am",
        "amq",
        "notify_q",
        "notify_handler",
        "amo_ok",
        "copies",
        "copy_streams",
        "driver",
        "on_close",
        "on_am",
        "on_notify",
        "on_drops",
        "on_copies",
        "find_endpoint",
        "siblings",
        "owner",
        "__weakref__",
    )

    def __init__(
        self,
        worker,
        state,
        context,
        multi: bool,
        spin_ns: int,
        peer_interval,
        siblings: list,
    ):
        self.h = state.worker
        self.state = state
        self.efd = state.efd
        self.multi = multi
        self.sslot = None if multi else new_slot()
        self.spin_ns = spin_ns
        self.context = context
        self.pending: set = set()
        self.sweep_at = SWEEP_MIN
        self.parked: list = []
        # Remote keys closed while parked operations held them:
        # (ucp_rkey_h, their slots), freed once UCX let go of those.
        self.parked_keys: list = []
        # Same-host endpoints closed with operations pending (ParkedEndpoint,
        # closed by sweep_endpoints once idle), and (slot, nbytes) of the
        # operations given up on same-host endpoints (stranded_bytes).
        self.parked_eps: list = []
        self.stranded: list = []
        self.suspects: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Liveness of peers on this host (gpucx._liveness): endpoint ->
        # (pid, start time, its C state, what to do when it dies), checked
        # at most every peer_interval seconds.
        self.watched: dict = {}
        self.pidfds: dict = {}  # endpoint -> pidfd of its peer (-1: none)
        # The epoll set of those pidfds that blocking waits sleep on beside
        # the UCX event fd and the asyncio driver puts on its loop (its fd,
        # or -1 while there is none).
        self.pset = None
        self.pfd = -1
        self.peer_interval = peer_interval
        self.peer_check_at = 0.0
        self.peer_tick = _live.PROGRESS_STRIDE
        # The heartbeat (gpucx._heartbeat): endpoint -> Beat, token ->
        # endpoint, the last token given, when to look next; on only once
        # the endpoint module installed ping() and GPUCX_PEER_TIMEOUT is not
        # 0.
        # (weak: an endpoint nobody holds is collected and closed as ever)
        self.beats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.beat_tokens: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.beat_token = 0
        self.beat_at = 0.0
        self.ping: Callable[[Any, bytes], Any] | None = None
        self.am = None
        self.amq = None
        self.notify_q = None
        self.notify_handler = None
        self.amo_ok = False
        self.copies: list = []
        self.copy_streams = None
        self.driver = None
        self.on_close: list = []
        # The hooks the Worker installs (functions of the engine).
        self.on_am: Callable[[Any], None] = _nothing
        self.on_notify: Callable[[Any], None] = _nothing
        self.on_drops: Callable[[Any], None] = _nothing
        self.on_copies: Callable[[Any], None] = _nothing
        self.find_endpoint: Callable[[Any, bool], Any] = _no_endpoint
        # The engines of the context's live workers, this one included: one
        # list the context's engines share, held strongly (engines hold no
        # worker), so that a close that needs its peer can progress the
        # other workers also when garbage collection has already cleared
        # the weak references to them (a cycle of unclosed objects).
        self.siblings = siblings
        siblings.append(self)
        # The Worker, for messages naming it (weak: the worker owns the
        # engine, and a worker nobody holds must be collected at once).
        self.owner = weakref.ref(worker)

    def __repr__(self) -> str:
        return f"<gpucx engine of {self.owner()!r}>"

    def raise_closed(self) -> None:
        """Raise the :class:`~gpucx.ClosedError` of the closed worker."""
        w = self.owner()
        if w is not None:
            raise_closed(w)
        from .errors import ClosedError

        raise ClosedError("Worker is closed")

    # -- slots and the operations in flight ---------------------------------

    def slot(self):
        """The slot a blocking operation posts with: the worker's shared
        slot (single-thread workers: no allocation per operation), or a
        fresh one (``"multi"``).  A wait that gives the shared slot to a
        pending operation replaces it (:meth:`block`, :meth:`release_shared`)."""
        return self.sslot or new_slot()

    def release_shared(self, slot) -> None:
        """``slot`` stays with an operation still pending: if it is the
        shared slot, the next blocking operation takes a fresh one."""
        if slot is self.sslot:
            self.sslot = new_slot()

    def track(self, req) -> None:
        """Track a pending request (settled by a sweep when nobody looks):
        ``Request.__init__`` inlines this."""
        pending = self.pending
        pending.add(req)
        if len(pending) >= self.sweep_at:
            self.sweep()

    def untrack(self, req) -> None:
        """Stop tracking ``req`` (it finished, or was parked)."""
        self.pending.discard(req)

    def pending_on(self, ep) -> list:
        """The pending requests of operations on endpoint ``ep``
        (:attr:`gpucx.Request.endpoint`): what its close drains or gives
        up."""
        return [r for r in self.pending if r.endpoint is ep]

    def sweep(self) -> None:
        """Complete the finished requests nobody looked at
        (``Request.__init__`` calls it once the pending set doubled since the
        last sweep)."""
        pending = self.pending
        for r in [r for r in pending if r._slot.status != INPROGRESS]:
            r._complete()
        self.sweep_at = max(SWEEP_MIN, 2 * len(pending))

    def park(self, slot, keep: Any = None, holds: Any = None) -> None:
        """Leave a slot UCX still holds with the engine, with ``keep`` (what
        UCX reads or writes) alive until UCX lets go of it; ``holds`` names
        the remote keys the operation uses (:meth:`holding`)."""
        self.parked.append((slot, keep, holds))

    def park_key(self, rkey_h, slots) -> None:
        """Free ``rkey_h`` (a closed remote key's ``ucp_rkey_h``) once UCX let
        go of every one of ``slots`` (parked operations that use it), or when
        the worker closes."""
        self.parked_keys.append((rkey_h, slots))

    def holding(self, obj) -> tuple[list, list]:
        """The operations still in UCX's hands that hold ``obj`` (a remote
        key): ``(pending requests, parked slots)``.  Each operation names
        what it holds when it is made (``Request(..., holds=)``,
        :meth:`park`)."""
        reqs = [
            r
            for r in self.pending
            if r._slot.status == INPROGRESS and _holds(r._holds, obj)
        ]
        slots = [
            s
            for s, _keep, holds in self.parked
            if s.status == INPROGRESS and _holds(holds, obj)
        ]
        return reqs, slots

    def sweep_parked(self) -> None:
        """Free parked slots UCX has let go of (their buffers go with them),
        and the remote keys closed while such operations held them, once UCX
        let go of every one (before their slots are released); and close
        the parked same-host endpoints that became idle."""
        if self.parked_eps:
            self.sweep_endpoints()
        if self.parked_keys:
            self.free_parked_keys()
        parked = self.parked
        if parked and any(p[0].status != INPROGRESS for p in parked):
            keep = []
            for p in parked:
                if p[0].status == INPROGRESS:
                    keep.append(p)
                else:
                    _slot_release(p[0])
            parked[:] = keep

    def free_parked_keys(self, closing: bool = False) -> None:
        """Free the remote keys of :meth:`park_key` whose operations UCX has
        let go of.  With ``closing`` (the worker's close, before
        ``ucp_worker_destroy``) every entry goes: one UCX still uses is left
        to the worker's destruction, never freed under UCX."""
        left = []
        for rkey_h, slots in self.parked_keys:
            if all(s.status != INPROGRESS for s in slots):
                lib.gpucx_rkey_destroy(rkey_h)
            elif not closing:
                left.append((rkey_h, slots))
        self.parked_keys[:] = left

    # -- same-host endpoints: strands, park and sweep -------------------------

    def strand(self, slot, nbytes: int) -> None:
        """Count ``nbytes`` held by an operation given up on a same-host
        endpoint (closed with it pending, or its peer died) while UCX still
        holds it (``slot`` pending): :meth:`stranded_bytes`."""
        if slot.status == INPROGRESS:
            self.stranded.append((slot, nbytes))

    def stranded_bytes(self) -> int:
        """Bytes held by operations given up on same-host endpoints that UCX
        has not let go of (0 once the worker closed)."""
        if self.h is None:
            return 0
        left = [s for s in self.stranded if s[0].status == INPROGRESS]
        self.stranded[:] = left
        return sum(n for _, n in left)

    def park_endpoint(self, ep_h, slots, peer, on_death, rkeys=()) -> None:
        """Take over a same-host endpoint closed while UCX held operations on
        it: ``ep_h`` (its UCX endpoint), ``slots`` (those operations').
        UCX forbids a force close of an endpoint without peer error
        handling, so it is flush-closed once none of ``slots`` is pending
        (:meth:`sweep_endpoints`, run with :meth:`sweep_parked`).  Its peer
        (``peer``: pid, start time, the endpoint's C state; this process's
        own for a worker of this process) stays watched meanwhile: its
        death calls ``on_death(reason)`` (fails the operations) and leaves
        the UCX endpoint to the worker's destruction.  ``rkeys``: the
        remote keys closed under the endpoint's operations, freed with
        them."""
        rec = ParkedEndpoint(ep_h, slots, on_death)
        self.parked_eps.append(rec)
        for rkey_h in rkeys:
            self.park_key(rkey_h, slots)
        # Watched also for the sweeps: the liveness check runs them.
        _live.watch(self, rec, peer[0], peer[1], peer[2], rec.peer_died)

    def sweep_endpoints(self) -> None:
        """Flush-close the parked same-host endpoints whose operations UCX
        let go of; forget those whose peer died (the worker's destruction
        frees them: UCX closes no such endpoint while it holds a send)."""
        if self.h is None:
            return
        if self.parked_keys:  # the keys go before their endpoint does
            self.free_parked_keys()
        left = []
        for rec in self.parked_eps:
            if rec.dead:
                continue
            if any(s.status == INPROGRESS for s in rec.slots):
                left.append(rec)
                continue
            rec.closed = True
            _live.unwatch(self, rec)
            slot = new_slot()
            if lib.gpucx_ep_close(rec.h, 0, slot) == INPROGRESS:
                self.park(slot)
            else:
                _slot_release(slot)
            rec.h = None
        self.parked_eps[:] = left

    # -- progress -------------------------------------------------------------

    def progress(self) -> int:
        """:meth:`gpucx.Worker.progress`: progress UCX once (``gpucx_progress``:
        until it reports no more events, at most 16 rounds), then run what
        Python has due; return UCX's event count.

        Raises
        ------
        gpucx.ClosedError
            If the worker is closed.
        """
        if self.h is None:
            self.raise_closed()
        # One C call: UCX's progress, and bits for the queued messages,
        # notifications or drops that need Python now.  The hooks are
        # called here, not through run_due: a call more cost an AM
        # ping-pong 0.25 us per round trip (two workers in one process,
        # best of 15 x 2000).
        n = _progress(self.state)
        if n >= DUE_DROPS:
            if n & DUE_AM:
                self.on_am(self)
            if n & DUE_NOTIFY:  # set only while a notify handler is set
                self.on_notify(self)
            if n & DUE_DROPS:  # a queue cap dropped some
                self.on_drops(self)
            n &= _COUNT
        if self.copies:
            self.on_copies(self)
        if self.watched or self.parked or (self.pending and self.beats):
            # Peers on this host, operations UCX still held when their
            # endpoint failed, or requests waiting on heard peers: look at
            # them now and then (a loop of progress() alone must also free
            # what UCX lets go of, and ping the peers it waits for).
            self.peer_tick -= 1
            if self.peer_tick <= 0:
                self.peer_tick = _live.PROGRESS_STRIDE
                if self.watched or self.parked:
                    _live.check(self)
                if self.beats:
                    _hb.check(self)
        return n

    def run_due(self, due: int) -> None:
        """Do what the due bits say: run the handlers of queued active
        messages and notifications, warn about drops since the last look."""
        if due & DUE_AM:
            self.on_am(self)
        if due & DUE_NOTIFY:  # set only while a notify handler is set
            self.on_notify(self)
        if due & DUE_DROPS:  # a queue cap dropped some
            self.on_drops(self)

    def poll_events(self) -> None:
        """The hook run between wait slices: dispatches queued active
        messages and put-with-notify notifications (when a handler is set),
        checks peers on this host (at most once per interval) and frees
        parked operations UCX has let go of."""
        due = _due(self.state)
        if due:
            self.run_due(due)
        if self.watched:
            _live.check(self)
        elif self.parked:
            self.sweep_parked()

    # -- liveness of peers on this host (gpucx._liveness) ----------------------

    def watch(self, ep, pid: int, start_time: int, ep_state, on_death) -> None:
        """Check ``ep``'s peer process (``pid``, ``start_time``) from now on;
        ``on_death(reason)`` fails the endpoint when it dies (``ep_state``:
        its C state, whose error says it failed already)."""
        _live.watch(self, ep, pid, start_time, ep_state, on_death)

    def unwatch(self, ep) -> None:
        """Stop checking ``ep``'s peer (closed, or found dead)."""
        _live.unwatch(self, ep)

    def check_peers(self, force: bool = False) -> None:
        """Check the watched peers if the interval has passed, or now
        (``force``: a sleep was woken by a peer's pidfd)."""
        _live.check(self, force=force)

    def check_peer(self, ep) -> bool:
        """Look at ``ep``'s peer now: True (and ``ep`` failed) if it died."""
        return _live.check_peer(self, ep)

    def hear(self, ep, on_silence) -> None:
        """Check that ``ep``'s peer progresses while operations on ``ep``
        wait (a heartbeat, ``gpucx._heartbeat``); ``on_silence(reason)``
        fails the endpoint when the peer, which answered once, fell silent
        for ``GPUCX_PEER_TIMEOUT``.  Nothing without the ``"am"`` feature
        (no ``ping``) or with the timeout 0."""
        if self.ping is not None and self.context.peer_timeout > 0:
            _hb.hear(self, ep, on_silence)

    def unhear(self, ep) -> None:
        """Stop the heartbeat of ``ep``'s peer (closed, or failed)."""
        _hb.unhear(self, ep)

    def let_go(self, req) -> None:
        """Park a heartbeat message nobody waits for (``gpucx._heartbeat``)."""
        _hb.let_go(self, req)

    def beat_interval(self) -> float | None:
        """How often an event loop should call :meth:`beat` (seconds), or
        None when no endpoint is heard (nothing to look at)."""
        if not self.beats or self.context.peer_timeout <= 0:
            return None
        return _hb.interval(self.context.peer_timeout)

    def beat(self) -> None:
        """The heartbeat's look from an event loop (``gpucx.aio``, whose
        awaits are no blocking waits): ping the peers that requests wait on,
        fail those fallen silent."""
        if self.beats:
            _hb.check(self)

    def heard(self, token: bytes) -> None:
        """A pong carrying ``token`` arrived (its handler)."""
        _hb.answered(self, token)

    def peer_alive(self, ep) -> bool:
        """False when ``ep``'s peer is a process of this host that died."""
        return _live.peer_alive(self, ep)

    def reply_endpoint(self, ep_h):
        """The Endpoint of UCX endpoint ``ep_h`` (an active message's reply
        endpoint): the user's own if this worker made it, else a borrowed
        wrapper (the worker's hook)."""
        return self.find_endpoint(ep_h, True)

    def own_endpoint(self, ep_h):
        """This worker's Endpoint for UCX endpoint ``ep_h`` (a notification's
        sender), or None when this side holds none."""
        return self.find_endpoint(ep_h, False)

    # -- waits ------------------------------------------------------------------

    def spin(self, slot, spin_ns: int, deadline: float | None = None) -> bool:
        """Busy-poll ``slot`` in C for up to ``spin_ns`` (in all), stopping for
        Python's work as it arrives (``gpucx_wait_due``): the handlers of
        active messages and notifications run then (:meth:`poll_events`),
        not once the operation is done or the spin is over.  True when the
        slot completed.  A stop for such work also ends the spin once
        ``deadline`` (``time.monotonic()``) has passed: messages streaming
        in do not stretch a wait past its timeout.

        Inside a handler that work stays due (dispatch does not nest), and
        the rest of the spin ignores it.  A handler's exception ends the
        spin and propagates; the operation stays pending.
        """
        st = _wait_due(self.state, slot, spin_ns)
        if st == WAIT_DUE:
            st = self._spin_due(slot, spin_ns, deadline)
        return st != INPROGRESS

    def _spin_due(self, slot, spin_ns: int, deadline: float | None) -> int:
        """The rest of a spin that stopped for Python's work (``WAIT_DUE``):
        run it, spin on for what is left of ``spin_ns``; the slot's status
        (``INPROGRESS`` when the spin ended first)."""
        end = time.monotonic_ns() + spin_ns
        while True:
            self.poll_events()
            st = slot.status
            if st != INPROGRESS:
                return st
            spin_ns = end - time.monotonic_ns()
            if spin_ns <= 0 or (deadline is not None and time.monotonic() >= deadline):
                return INPROGRESS
            if _due(self.state):
                return _wait(self.h, slot, spin_ns)
            st = _wait_due(self.state, slot, spin_ns)
            if st != WAIT_DUE:
                return st

    def block(
        self,
        slot,
        timeout: float | None,
        keep: Any = None,
        ep=None,
        cancel: bool = True,
        holds: Any = None,
        on_timeout: str | None = None,
    ) -> int:
        """Progress until ``slot`` completes; return its status.

        Spins for the worker's ``spin_ns`` (:meth:`spin`), then sleeps on
        the event fd in slices of at most ``SLICE_MS`` (the GIL released),
        checking the deadline, the between-slices hook and ``ep`` between
        slices, and spins again after each wake.  ``keep``: what the
        operation reads or writes (parked with it if UCX keeps it past the
        wait); ``holds``: the remote keys it uses (:meth:`holding`).
        ``cancel=False`` for operations UCX cannot cancel (atomics: UCX
        aborts the process when asked to cancel a software atomic): on
        timeout they are parked without a cancel request.  ``on_timeout``
        (``"park"``, ``"release"``, None: ``ep``'s): what :meth:`abandon`
        does with an operation UCX does not withdraw.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first; the operation is given up
            (:meth:`abandon`), and the error's ``released`` says whether its
            buffers are the caller's again.
        gpucx.PeerError
            When gpucx finds ``ep``'s peer dead while waiting (the operation
            is parked until UCX lets go of it).
        """
        if slot is self.sslot:
            # Waiting runs Python (AM handlers, aio callbacks) that may start
            # blocking calls of its own: they get a fresh shared slot, this
            # one stays with the operation it belongs to.
            self.sslot = new_slot()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # spin()'s first C call, inlined: most waits end in it, and a
            # method call costs about 60 ns of an 8-byte round trip.
            st = _wait_due(self.state, slot, self.spin_ns)
            if st == WAIT_DUE:
                st = self._spin_due(slot, self.spin_ns, deadline)
            while st == INPROGRESS:
                self.poll_events()
                if self.beats:  # the peer must show it progresses
                    _hb.check(self, ep, slot)
                if (
                    ep is not None
                    and ep.closed
                    and slot.status == INPROGRESS
                    and ep.error is not None
                ):
                    # The peer died or fell silent: PeerError.  (A same-host
                    # endpoint closed with this operation pending has no
                    # error: UCX still does it, Engine.park_endpoint.)
                    raise_closed(ep)
                ms = slice_ms(deadline, timeout, "operation did not complete")
                st = lib.gpucx_wait_sleep(self.h, self.efd, self.pfd, slot, ms)
                if st == _PEER_EXITED:
                    # Woken by the pidfd of a watched local peer: look at
                    # the peers now, not at the next interval.
                    _live.check(self, force=True)
                    st = INPROGRESS
                if st == INPROGRESS:
                    st = _wait_due(self.state, slot, self.spin_ns)
                    if st == WAIT_DUE:
                        st = self._spin_due(slot, self.spin_ns, deadline)
            return st
        except BaseException:
            exc = sys.exc_info()[1]
            released, detail = self.abandon(slot, keep, cancel, holds, ep, on_timeout)
            if exc is not None:
                note_deadline(exc, released, detail)
            raise

    def wait_for(
        self,
        ready: Callable[[], Any],
        timeout: float | None,
        what: str | None = None,
        check: Callable[[], object] | None = None,
        poll: bool = False,
    ) -> Any:
        """Wait until ``ready()`` returns something true; return it.

        The blocking wait for anything other than one operation's slot (a
        connection request, an array, a notification, a control message).
        Between looks at ``ready()`` it sleeps one slice on the event fd
        (progressing first; cffi releases the GIL), then runs
        :meth:`poll_events`, looks at ``ready()`` and, when it is still
        false, runs ``check()``, which raises to end the wait (e.g.
        ``PeerError`` for a dead peer): what arrived wins over a failure
        found in the same slice.  ``poll=True`` busy-polls
        instead of sleeping (benchmark receivers, as ``ucx_perftest``'s: a
        sleeping receiver makes a shared-memory sender signal it and wait
        for it to wake): :meth:`progress` after each look, the deadline and
        ``check()`` every ``POLL_STRIDE`` looks.

        ``timeout`` None waits forever.  When it passes: ``TimeoutError``
        reading ``f"{what} within {timeout} s"`` if ``what`` is given,
        otherwise the last ``ready()`` value (false) is returned.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        r = ready()
        while not r:
            try:
                ms = slice_ms(deadline, timeout, what or "wait")
            except TimeoutError:
                if what is None:
                    return r
                raise
            if poll:
                progress = self.progress
                for _ in range(POLL_STRIDE):
                    progress()
                    r = ready()
                    if r:
                        return r
            else:
                if self.h is None:
                    self.raise_closed()
                woke = lib.gpucx_worker_sleep(self.h, self.efd, self.pfd, ms)
                if woke == -_PEER_EXITED:
                    _live.check(self, force=True)
                self.poll_events()
                if self.beats:
                    _hb.check(self)
            # What arrived comes first: a reply and the peer's going away
            # can land in one progress call (a server that answers and
            # closes), and the reply is the answer.
            r = ready()
            if not r and check is not None:
                check()
                r = ready()
        return r

    def wait_closing(self, done: Callable[[], bool], end: float, others=()) -> bool:
        """The bounded wait of a close that needs its peer to progress: until
        ``done()`` or ``time.monotonic()`` passes ``end``.

        The peer may be another worker of this process (tests, pipelines):
        each round progresses the ``others`` (their engines) too, then
        sleeps at most 1 ms on this worker (without its event fd while
        others are progressed: their events would not wake it).  No Python
        handlers run.  True when done.
        """
        efd = -1 if others else self.efd
        while not done():
            if time.monotonic() >= end:
                return False
            for other in others:
                if other.h is not None:
                    lib.ucp_worker_progress(other.h)
            lib.gpucx_worker_sleep(self.h, efd, -1, 1)
        return True

    def drain(self, reqs, end: float) -> bool:
        """Progress (no sleep, no Python handlers) until none of ``reqs`` is
        pending or ``time.monotonic()`` passes ``end``: the bounded drain of
        the close paths (worker, endpoint, remote key).  True when none is
        pending any more."""
        return self.drain_slots([r._slot for r in reqs], end)

    def drain_slots(self, slots, end: float) -> bool:
        """:meth:`drain` for completion slots (parked operations have no
        request): True when none of ``slots`` is pending any more."""
        pending = [s for s in slots if s.status == INPROGRESS]
        while pending and time.monotonic() < end:
            lib.ucp_worker_progress(self.h)
            pending = [s for s in pending if s.status == INPROGRESS]
        return not pending

    def abandon(
        self,
        slot,
        keep: Any = None,
        cancel: bool = True,
        holds: Any = None,
        ep=None,
        on_timeout: str | None = None,
    ) -> tuple[bool, str]:
        """Give up waiting for an operation: cancel it (unless ``cancel`` is
        False) and wait (bounded) until UCX lets go of it.

        If UCX does not report back within ``CANCEL_DRAIN_S`` (a send, which
        UCX cannot cancel; a receive UCX already matched), what happens
        depends on ``on_timeout`` (None: ``ep.on_timeout``, or ``"park"``
        without an endpoint):

        * ``"park"``: the slot and ``keep`` are parked (:meth:`park`): never
          freed while UCX may still use them, freed once UCX lets go;
        * ``"release"``: ``ep`` is force-closed (``Endpoint.abort``), which
          makes UCX complete everything it holds on it, and the operation
          is drained (at most ``RELEASE_DRAIN_S``); an endpoint still
          carrying a send over TCP has its TCP sockets shut down first
          (``Endpoint._shut_tcp_lanes``: after a plain force close UCX 1.22
          would crash later).  Without an endpoint (a worker-wide receive),
          on a closed one, on one whose peer reaches this process's memory
          by itself (``Endpoint.direct_access``), or on one carrying a send
          over TCP whose sockets gpucx cannot find
          (``Endpoint._release_shut``), it is parked instead.

        Returns ``(released, detail)``: whether UCX let go of the
        operation's buffers, and what happened, in words (for the error
        raised: :func:`gpucx.errors.note_deadline`).
        """
        h = self.h
        if slot.status != INPROGRESS or h is None:
            _slot_release(slot)
            return True, "the operation is over"
        if cancel:
            lib.gpucx_slot_cancel(h, slot)
        end = time.monotonic() + CANCEL_DRAIN_S
        while slot.status == INPROGRESS and time.monotonic() < end:
            _wait(h, slot, 1_000_000)
        if slot is self.sslot:
            # The shared blocking slot may still be referenced by UCX.
            self.sslot = new_slot()
        if slot.status != INPROGRESS:
            _slot_release(slot)
            return True, "UCX withdrew the operation"
        why = self._release((slot, keep, holds), ep, on_timeout)
        if why is None:
            return True, f"gpucx force-closed endpoint {ep.peer} (on_timeout='release')"
        return False, (
            f"{why}; UCX keeps the buffer in use until it lets go of the "
            "operation (do not modify or free it), or the endpoint or worker "
            "closes"
        )

    def _release(self, entry: tuple, ep, on_timeout: str | None) -> str | None:
        """``on_timeout="release"`` for an operation UCX did not withdraw,
        ``entry`` ``(slot, keep, holds)``: force-close ``ep`` and drain the
        slot.  None when UCX let go of it (its slot released), else why it
        still holds it (and the operation is parked)."""
        slot = entry[0]
        why = self._why_not_release(ep, on_timeout)
        # Parked while the endpoint closes: the remote keys closed with it
        # see the operation that uses them (holding) and wait for it.
        self.parked.append(entry)
        if why is None:
            # A send blocked on a TCP socket: its sockets first (UCX 1.22
            # would crash after a plain force close); parked where gpucx
            # cannot find them.
            why = ep._release_shut(slot)
        if why is not None:
            return why
        ep.abort("released after a deadline (on_timeout='release')")
        self.drain_slots([slot], time.monotonic() + RELEASE_DRAIN_S)
        if slot.status == INPROGRESS:
            return f"UCX still held the operation after endpoint {ep.peer} closed"
        self.parked[:] = [p for p in self.parked if p is not entry]
        if self.parked_keys:
            self.free_parked_keys()
        _slot_release(slot)
        return None

    def _why_not_release(self, ep, on_timeout: str | None) -> str | None:
        """Why ``on_timeout`` does not release an operation over ``ep``
        (None: it may; a TCP send whose sockets gpucx cannot find is
        refused by :meth:`_release` itself, ``Endpoint._release_shut``)."""
        if on_timeout is None:
            on_timeout = self.context.on_timeout if ep is None else ep.on_timeout
        if on_timeout != "release":
            return "UCX could not withdraw the operation (on_timeout='park')"
        if ep is None:
            return (
                "UCX could not withdraw the operation and gpucx cannot tell "
                "its endpoint (a worker-wide receive already matched: give "
                "the receive its endpoint, ep=, to release it)"
            )
        if ep.closed:
            return f"endpoint {ep.peer} was already closed or failed"
        direct = ep.direct_access()
        if direct:
            return (
                f"endpoint {ep.peer} uses {', '.join(direct)}, through which "
                "the peer reaches this process's memory by itself: closing "
                "the endpoint would not stop it, so it was left open"
            )
        return None

    # -- closing ------------------------------------------------------------------

    def cancel_pending(self, end: float) -> None:
        """A closing worker: cancel what is still outstanding and give UCX
        until ``end`` to report back, so that no callback writes into freed
        slots; complete what finished."""
        h = self.h
        for req in list(self.pending):
            if req._slot.status == INPROGRESS and req._cancelable:
                lib.gpucx_slot_cancel(h, req._slot)
        self.drain(self.pending, end)
        for req in list(self.pending):
            if req._slot.status != INPROGRESS:
                req._complete()
        self.free_parked_keys(closing=True)
        for p in self.parked:
            _slot_release(p[0])

    def others(self) -> list:
        """The engines of the other live workers of this worker's context: a
        peer may be one of them (tests, pipelines), and a close that needs
        the peer progresses them too (:meth:`wait_closing`)."""
        return [e for e in self.siblings if e is not self and e.h is not None]

    def destroyed(self, fail) -> None:
        """The UCX worker is gone (``ucp_worker_destroy``): whatever UCX still
        held went with it.  Each request still pending completes as canceled
        and then fails with ``fail()`` (a fresh exception)."""
        self.h = None
        if self in self.siblings:
            self.siblings.remove(self)
        for req in list(self.pending):
            req._slot.req = ffi.NULL
            req._slot.status = lib.UCS_ERR_CANCELED
            req._complete()
            req._value = fail()
        self.parked.clear()
        self.on_am = self.on_notify = self.on_drops = self.on_copies = _nothing
        self.find_endpoint = _no_endpoint

    def forget(self) -> None:
        """The worker was abandoned (a forked child): never call UCX again."""
        self.h = None
        if self in self.siblings:
            self.siblings.remove(self)


class ParkedEndpoint:
    """A same-host endpoint the engine closes once idle
    (:meth:`Engine.park_endpoint`).  Watched for its peer's liveness in
    place of the closed :class:`~gpucx.Endpoint` (``closed`` is what the
    liveness check reads)."""

    __slots__ = ("h", "slots", "on_death", "closed", "dead", "__weakref__")

    def __init__(self, h, slots, on_death):
        self.h = h
        self.slots = slots
        self.on_death = on_death
        self.closed = False
        self.dead = False

    def peer_died(self, reason: str) -> None:
        """The liveness check found the peer dead: fail the operations."""
        self.dead = True
        self.closed = True
        self.on_death(reason)


def _no_endpoint(ep_h, borrow: bool):
    return None


def _holds(holds: Any, obj: Any) -> bool:
    """Whether an operation's ``holds`` (one object, a tuple of them, or
    None) names ``obj``."""
    if holds is obj:
        return True
    return type(holds) is tuple and any(h is obj for h in holds)
