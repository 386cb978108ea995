"""Requests: the Python face of one outstanding UCX operation.

A :class:`Request` owns a completion slot (a C ``gpucx_slot_t`` that the UCX
callback writes), the worker it progresses, and whatever the operation reads
or writes (buffers, IOV arrays) until the operation completes.  The UCX
request handle is released exactly once, by C, when completion is observed.

:func:`block` is the one waiting loop for an operation: it spins in C, then
sleeps on the worker's event fd (cffi releases the GIL), checks the deadline
between slices, and on timeout or interrupt cancels the operation and drains
it so that UCX never writes into memory Python has freed.  The other waits
live here too, one function each: :func:`wait_for` (anything else the
blocking API waits for: a connection, an array, a notification),
:func:`wait_closing` (a close that needs the peer), :func:`settle` (the
close paths' bounded drain of requests) and :func:`abandon`.  No other
module writes a progress-and-sleep loop (docs/layout.md).
"""

from __future__ import annotations

import time
from collections import namedtuple
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

from ._lib import ffi, lib
from .errors import (
    CanceledError,
    MessageTruncatedError,
    TimeoutError,
    UCXError,
    error_for,
    peer_error_for,
    peer_gone,
)

__all__ = [
    "Request",
    "RecvInfo",
    "block",
    "wait_for",
    "wait_closing",
    "settle",
    "INPROGRESS",
    "posted",
]

INPROGRESS = lib.UCS_INPROGRESS
OK = lib.UCS_OK
TRUNCATED = lib.UCS_ERR_MESSAGE_TRUNCATED
CANCELED = lib.UCS_ERR_CANCELED
_SHMEM_SEGMENT = lib.UCS_ERR_SHMEM_SEGMENT

#: Longest single sleep, so deadlines and signals are checked in time.
_SLICE_MS = 100
#: What the C sleeps report when a watched local peer's pidfd woke them.
_PEER_EXITED = lib.GPUCX_PEER_EXITED
_WAIT_DUE = lib.GPUCX_WAIT_DUE
# Looked up once: a cffi ``lib.name`` costs about 50 ns, and these run for
# every request that completes or waits.
_slot_release = lib.gpucx_slot_release
_wait_due = lib.gpucx_wait_due
_due = lib.gpucx_due
#: How long a canceled operation may take to report back when its worker
#: closes.
_DRAIN_S = 5.0
#: How long a timed-out or interrupted wait drains its canceled operation:
#: a receive reports back within a progress call or two; UCX cannot cancel a
#: send, which is parked at once so that the deadline is kept.
_CANCEL_DRAIN_S = 0.02

RecvInfo = namedtuple("RecvInfo", ["tag", "nbytes"])
RecvInfo.__doc__ = "What a tag receive got: the sender's ``tag`` and ``nbytes``."


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
        return _SLICE_MS
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what} within {timeout} s", lib.UCS_ERR_TIMED_OUT)
    return min(_SLICE_MS, max(1, int(left * 1000)))


def _peer_exited(worker) -> None:
    """A sleep was woken by the pidfd of a local peer the worker watches:
    look at its peers now, not at the next interval (gpucx._liveness; the
    dead peer's endpoint fails, its pidfd leaves the sleeping set)."""
    from . import _liveness

    _liveness.check(worker, force=True)


def block(
    worker, slot, timeout: float | None, keep: Any = None, ep=None, cancel=True
) -> int:
    """Progress ``worker`` until ``slot`` completes; return its status.

    ``cancel=False`` for operations UCX cannot cancel (atomics: UCX aborts
    the process when asked to cancel a software atomic): on timeout they are
    parked without a cancel request.

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass first; the operation is canceled.
    gpucx.PeerError
        When gpucx finds ``ep``'s peer dead while waiting (the operation is
        parked until UCX lets go of it).
    """
    h = worker._h
    efd = worker._efd
    deadline = None if timeout is None else time.monotonic() + timeout
    if slot is worker._sslot:
        # Waiting runs Python (AM handlers, aio callbacks) that may start
        # blocking calls of its own: they get a fresh shared slot, this one
        # stays with the operation it belongs to.
        worker._sslot = new_slot()
    state = worker._state
    # The spin stops for Python's work as it arrives (gpucx_wait_due): the
    # handlers of active messages run then, not once the operation is done
    # or the spin is over.  Not while that work stays due after the hook
    # ran (this wait is inside a handler: dispatch does not nest).
    due = True
    try:
        while True:
            if due:
                st = _wait_due(state, slot, worker._spin_ns)
                if st == _WAIT_DUE:
                    worker._poll_events()
                    if _due(state):
                        due = False
                    if deadline is None or time.monotonic() < deadline:
                        continue
                    st = INPROGRESS  # the slice below raises the timeout
            else:
                st = lib.gpucx_wait(h, slot, worker._spin_ns)
            if st != INPROGRESS:
                return st
            worker._poll_events()
            if ep is not None and ep._h is None and slot.status == INPROGRESS:
                from ._handle import raise_closed

                raise_closed(ep)  # the peer died: PeerError
            ms = slice_ms(deadline, timeout, "operation did not complete")
            st = lib.gpucx_wait_sleep(h, efd, worker._pfd, slot, ms)
            if st != INPROGRESS:
                if st != _PEER_EXITED:
                    return st
                _peer_exited(worker)
    except BaseException:
        abandon(worker, slot, keep, cancel)
        raise


#: Progress calls between two looks at the deadline in a polling wait.
POLL_STRIDE = 1000


def wait_for(
    worker,
    ready: Callable[[], Any],
    timeout: float | None,
    what: str | None = None,
    check: Callable[[], object] | None = None,
    poll: bool = False,
) -> Any:
    """Wait on ``worker`` until ``ready()`` returns something true; return it.

    The blocking wait for anything other than one operation's slot (a
    connection request, an array, a notification, a control message).
    Between looks at ``ready()`` it sleeps one slice on the worker's event
    fd (progressing first; cffi releases the GIL), then runs the worker's
    between-slices hook (AM handlers, notifications, liveness of peers on
    this host, parked operations) and ``check()``, which raises to end the
    wait (e.g. ``PeerError`` for a dead peer).  ``poll=True`` busy-polls
    instead of sleeping (benchmark receivers, as ``ucx_perftest``'s: a
    sleeping receiver makes a shared-memory sender signal it and wait for
    it to wake): ``worker.progress()`` after each look, the deadline and
    ``check()`` every ``POLL_STRIDE`` looks.

    ``timeout`` None waits forever.  When it passes: ``TimeoutError``
    reading ``f"{what} within {timeout} s"`` if ``what`` is given, otherwise
    the last ``ready()`` value (false) is returned.
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
            for _ in range(POLL_STRIDE):
                worker.progress()
                r = ready()
                if r:
                    return r
        else:
            woke = lib.gpucx_worker_sleep(worker._h, worker._efd, worker._pfd, ms)
            if woke == -_PEER_EXITED:
                _peer_exited(worker)
            worker._poll_events()
        if check is not None:
            check()
        r = ready()
    return r


def wait_closing(worker, done: Callable[[], bool], end: float, others=()) -> bool:
    """The bounded wait of a close that needs its peer to progress: until
    ``done()`` or ``time.monotonic()`` passes ``end``.

    The peer may be another worker of this process (tests, pipelines):
    each round progresses the ``others`` too, then sleeps at most 1 ms on
    ``worker`` (without its event fd while others are progressed: their
    events would not wake it).  No Python handlers run.  True when done.
    """
    efd = -1 if others else worker._efd
    while not done():
        if time.monotonic() >= end:
            return False
        for other in others:
            if other._h is not None:
                lib.ucp_worker_progress(other._h)
        lib.gpucx_worker_sleep(worker._h, efd, -1, 1)
    return True


def settle(worker_h, reqs, end: float) -> bool:
    """Progress a worker (its UCX handle ``worker_h``) until none of
    ``reqs`` is pending or ``time.monotonic()`` passes ``end``.

    The bounded wait of the close paths (worker, endpoint, remote key):
    progress only, no sleep.  True when none is pending any more.
    """
    return settle_slots(worker_h, [r._slot for r in reqs], end)


def settle_slots(worker_h, slots, end: float) -> bool:
    """:func:`settle` for completion slots (parked operations have no
    request): True when none of ``slots`` is pending any more."""
    pending = [s for s in slots if s.status == INPROGRESS]
    while pending and time.monotonic() < end:
        lib.ucp_worker_progress(worker_h)
        pending = [s for s in pending if s.status == INPROGRESS]
    return not pending


def abandon(worker, slot, keep: Any = None, cancel: bool = True) -> None:
    """Cancel a pending operation and wait (bounded) until UCX lets go of it.

    If UCX does not report back within ``_CANCEL_DRAIN_S`` (a send, which UCX
    cannot cancel), the slot and the buffers are parked on the worker: never
    freed while UCX may still use them, freed once UCX lets go.
    """
    if slot.status != INPROGRESS or worker._h is None:
        lib.gpucx_slot_release(slot)
        return
    if cancel:
        lib.gpucx_slot_cancel(worker._h, slot)
    end = time.monotonic() + _CANCEL_DRAIN_S
    while slot.status == INPROGRESS and time.monotonic() < end:
        lib.gpucx_wait(worker._h, slot, 1_000_000)
    if slot.status == INPROGRESS:
        worker._park(slot, keep)
    else:
        lib.gpucx_slot_release(slot)
    if slot is worker._sslot:
        # The shared blocking slot may still be referenced by UCX.
        worker._sslot = new_slot()


def finish(
    worker, slot, st: int, timeout: float | None, what: str, ep=None, keep=None
) -> None:
    """Complete a just-posted operation synchronously: wait while it is
    pending (``keep`` holds its buffers), raise its error if it failed."""
    if st == INPROGRESS:
        st = block(worker, slot, timeout, keep, ep)
    if st != OK:
        raise_status(st, what, ep)


def raise_status(st: int, what: str, ep=None, slot=None, nbytes=None) -> None:
    """Raise the error for a failed operation (one place for every op)."""
    if st == _SHMEM_SEGMENT and ep is not None and ep._h is not None:
        # UCX could not attach the peer's shared-memory segment: a local peer
        # that died before gpucx's liveness check looked is the usual cause.
        from . import _liveness

        _liveness.check_peer(ep._w, ep)
    if ep is not None and ep._state is not None and ep._state.error != OK:
        # The endpoint failed: report the endpoint's cause (peer death), not
        # the secondary status of the request.
        exc = peer_error_for(ep._state.error, what)
        if ep._error_reason is not None:  # gpucx found the peer dead
            exc.args = (f"{what}: {ep._error_reason}",)
        else:
            exc.args = (exc.args[0] + ep._failure_hint(),)
        raise exc
    exc = error_for(st, what)
    if st == TRUNCATED and isinstance(exc, MessageTruncatedError):
        exc.buffer_size = nbytes
        got = slot.length if slot is not None else 0
        if nbytes is None:  # receives posted together: one of the buffers
            exc.message_size = got or None
            exc.args = (
                f"{what}: message truncated: a message"
                + (f" of {got} bytes" if got else "")
                + " is larger than its receive buffer",
            )
            raise exc
        exc.message_size = got if got and got > nbytes else None
        exc.args = (
            f"{what}: message truncated: the receive buffer holds {nbytes} bytes"
            + (
                f", the message has {exc.message_size} bytes"
                if exc.message_size
                else ", the message is larger"
            ),
        )
    raise exc


def _raise_if_peer_died(req) -> None:
    """Raise PeerError if ``req`` was canceled by gpucx force-closing a dead
    peer's endpoint (see gpucx._liveness.peer_died)."""
    found = req._worker._suspects.pop(req, None)
    if found is not None and time.monotonic() < found[1]:
        raise peer_gone(req._what, found[0])


class Request:
    """One outstanding operation.

    ``done()`` progresses the worker once and says whether the operation
    finished; ``wait(timeout)`` blocks until it did and returns its result (or
    raises its error); ``result()`` returns the result of a finished request;
    ``cancel()`` asks UCX to cancel it (it then fails with
    :class:`~gpucx.CanceledError`; ``cancelled()`` says whether it did).
    Inside asyncio a request is awaitable.
    """

    #: False for operations UCX cannot cancel (atomics).
    _cancelable = True

    __slots__ = (
        "_slot",
        "_worker",
        "_keep",
        "_what",
        "_finish",
        "_ep",
        "_nbytes",
        "_state",
        "_value",
        "__weakref__",
    )

    def __init__(self, worker, slot, keep, what, finish, ep=None, nbytes=None):
        self._slot = slot
        self._worker = worker
        self._keep = keep
        self._what = what
        self._finish = finish
        self._ep = ep
        self._nbytes = nbytes
        self._state = 0  # 0 pending, 1 ok, 2 failed
        self._value = None
        if slot.status == INPROGRESS:
            # Worker._track, inlined: one call less for every pending
            # operation.
            pending = worker._pending
            pending.add(self)
            if len(pending) >= worker._sweep_at:
                worker._sweep()
        else:
            self._complete()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<gpucx.Request {self._what} {state}>"

    @property
    def protocol(self):
        """The protocol UCX selected for this operation
        (:class:`gpucx.protocols.Protocol`, from ``ucp_request_query``)
        while UCX still holds its request; None once it completed, or for
        an operation that finished when posted or that UCX does not
        describe (receives)."""
        if self._state != 0:
            return None
        return _protocol_reader(self._slot, self._ep)

    def _complete(self) -> None:
        """First observation of completion: free the UCX request, settle."""
        slot = self._slot
        st = _slot_release(slot)
        if st == OK:
            self._state = 1
            self._value = self._finish(self) if self._finish is not None else None
        else:
            self._state = 2
            try:
                if st == CANCELED and self._worker._suspects:
                    _raise_if_peer_died(self)
                raise_status(st, self._what, self._ep, slot, self._nbytes)
            except UCXError as exc:
                self._value = exc
        self._keep = None
        self._worker._pending.discard(self)

    def _fail(self, exc: UCXError) -> None:
        """Settle as failed while UCX still holds the operation (the caller
        parked the slot and the buffers on the worker)."""
        self._state = 2
        self._value = exc
        self._keep = None
        self._worker._untrack(self)

    def done(self) -> bool:
        """Progress once if needed; return True when the operation finished."""
        if self._state:
            return True
        if self._slot.status == INPROGRESS:
            w = self._worker
            if w._h is None:
                return False
            w.progress()
            if self._slot.status == INPROGRESS:
                return False
        self._complete()
        return True

    def wait(self, timeout: float | None = None):
        """Block until the operation finished; return its result.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first (the operation is canceled).
        gpucx.UCXError
            The operation's own error (``PeerError``, ``CanceledError``...).
        """
        if not self._state:
            if self._slot.status == INPROGRESS:
                w = self._worker
                if w._h is None:
                    from ._handle import raise_closed

                    raise_closed(w)
                try:
                    block(w, self._slot, timeout, None, self._ep, self._cancelable)
                except BaseException:
                    if self._state:  # failed while waiting (a dead peer)
                        raise self._value from None
                    w._suspects.pop(self, None)  # canceled by the timeout
                    # block() canceled and drained (or parked) the operation.
                    if self._slot.status != INPROGRESS:
                        self._complete()
                    raise
            self._complete()
        if self._state == 1:
            return self._value
        raise self._value

    def result(self):
        """The result of a finished request (raises its error if it failed).

        Raises
        ------
        concurrent.futures.InvalidStateError
            When the request has not finished (use :meth:`wait`).
        """
        if self._state == 1:
            return self._value
        if self._state == 2:
            raise self._value
        if self.done():
            return self.result()
        raise InvalidStateError(f"{self!r} has not finished; call wait()")

    def exception(self):
        """The error of a finished failed request, or None."""
        if not self.done():
            raise InvalidStateError(f"{self!r} has not finished")
        return self._value if self._state == 2 else None

    def cancel(self) -> bool:
        """Ask UCX to cancel the operation; True if it was still pending.

        Atomics cannot be canceled (UCX has no way to withdraw one): for them
        this returns False and the operation goes on."""
        if self._state or self._slot.status != INPROGRESS or not self._cancelable:
            return False
        w = self._worker
        if w._h is None:
            return False
        w._suspects.pop(self, None)  # canceled by the user, not a death
        if lib.gpucx_slot_cancel(w._h, self._slot) != INPROGRESS:
            # Canceled on the spot (a receive no message matched yet):
            # settle now rather than stay tracked until someone looks.
            self._complete()
        return True

    def cancelled(self) -> bool:
        """True when the request finished because it was canceled (spelled as
        :meth:`concurrent.futures.Future.cancelled`)."""
        return self._state == 2 and isinstance(self._value, CanceledError)

    @property
    def canceled(self) -> bool:
        """Alias of :meth:`cancelled` as a property (kept for old code)."""
        return self.cancelled()

    def __await__(self):
        # The event-loop side lives in gpucx.aio, which registers itself
        # (set_awaiter): this layer knows no event loop.
        return _awaiter(self).__await__()


def _no_awaiter(req: Request):
    raise TypeError("gpucx: no awaiter registered (import gpucx.aio)")


#: ``await req`` returns ``_awaiter(req).__await__()``; see set_awaiter.
_awaiter: Any = _no_awaiter


def set_awaiter(fn) -> None:
    """Make ``fn(req)`` (a coroutine) what ``await req`` waits on.

    ``gpucx`` registers a loader that imports :mod:`gpucx.aio` on the first
    ``await``; ``gpucx.aio`` then registers its ``wait_request``.
    """
    global _awaiter
    _awaiter = fn


def _no_protocol_reader(slot, ep):
    raise TypeError("gpucx: no protocol reader registered (import gpucx)")


#: ``Request.protocol`` returns ``_protocol_reader(slot, ep)``; see
#: set_protocol_reader.
_protocol_reader: Any = _no_protocol_reader


def set_protocol_reader(fn) -> None:
    """Make ``fn(slot, ep)`` what :attr:`Request.protocol` reads a request in
    flight with (``gpucx`` registers :func:`gpucx.protocols.request_protocol`:
    UCX's protocol reports belong to the operations' layer, above this one).
    """
    global _protocol_reader
    _protocol_reader = fn


class _Done(Request):
    """A request finished when it was made, its result in ``_value`` (an
    eager active message ``receive_into`` copied): settled from birth,
    nothing to free or track (see :func:`done_with`).

    Its other attributes are class constants, so making one costs an
    object with one slot set.
    """

    __slots__ = ()
    _state = 1
    _keep = None
    _worker = None
    _ep = None
    _finish = None
    _nbytes = None
    _what = "operation"
    _slot = ffi.new(_SLOT_P, {"status": OK})


class _Settled(_Done):
    """A request UCX finished while it was posted, with no result to carry
    (a send, put or get): its result is a class constant too, so making one
    costs an empty object."""

    __slots__ = ()
    _value = None


_new_settled = object.__new__


def done_with(value) -> Request:
    """A request already finished with ``value`` as its result."""
    req = _new_settled(_Done)
    req._value = value
    return req


def posted(worker, slot, st: int, keep, what: str, ep) -> Request:
    """The :class:`Request` of a just-posted send, put or get (``wait()``
    returns None) whose post returned ``st``.

    ``slot`` may be the worker's shared slot (single-thread workers): an
    operation that finished at once leaves it free for the next one and gets
    a settled request without a slot; one still pending keeps it, and the
    worker takes a fresh shared slot.
    """
    if st == OK:
        return _new_settled(_Settled)
    if slot is worker._sslot:
        worker._sslot = new_slot()
    return Request(worker, slot, keep, what, None, ep)
