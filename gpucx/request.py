"""Requests: the Python face of one outstanding UCX operation.

A :class:`Request` owns a completion slot (a C ``gpucx_slot_t`` that the UCX
callback writes), the engine of the worker it progresses
(:mod:`gpucx._engine`), and whatever the operation reads or writes
(buffers, IOV arrays) until the operation completes.  The UCX request
handle is released exactly once, by C, when completion is observed.

Waiting is the engine's (:meth:`gpucx._engine.Engine.block` and the other
waits): this module adds what turns a finished slot into a result or an
error (:func:`finish`, :func:`raise_status`, :func:`posted`).
"""

from __future__ import annotations

import time
from collections import namedtuple
from concurrent.futures import InvalidStateError
from typing import Any

from ._engine import INPROGRESS, new_slot
from ._lib import ffi, lib
from .config import on_timeout_mode
from .errors import (
    CanceledError,
    MessageTruncatedError,
    UCXError,
    error_for,
    peer_gone,
)

__all__ = [
    "Request",
    "RecvInfo",
    "INPROGRESS",
    "posted",
    "finish",
    "raise_status",
    "observe",
    "in_flight",
    "spin",
    "engine_of",
]

OK = lib.UCS_OK
TRUNCATED = lib.UCS_ERR_MESSAGE_TRUNCATED
CANCELED = lib.UCS_ERR_CANCELED

# Looked up once: a cffi ``lib.name`` costs about 50 ns, and this runs for
# every request that completes.
_slot_release = lib.gpucx_slot_release

RecvInfo = namedtuple("RecvInfo", ["tag", "nbytes"])
RecvInfo.__doc__ = "What a tag receive got: the sender's ``tag`` and ``nbytes``."


_SLOT_P = ffi.typeof("gpucx_slot_t *")


def finish(
    engine,
    slot,
    st: int,
    timeout: float | None,
    what: str,
    ep=None,
    keep=None,
    holds=None,
    on_timeout: str | None = None,
) -> None:
    """Complete a just-posted operation synchronously: wait while it is
    pending (``keep`` holds its buffers, ``holds`` names the remote keys it
    uses: see :meth:`gpucx._engine.Engine.holding`; ``on_timeout``: what a
    passed deadline does, :meth:`gpucx._engine.Engine.abandon`), raise its
    error if it failed."""
    if st == INPROGRESS:
        st = engine.block(slot, timeout, keep, ep, True, holds, on_timeout)
    if st != OK:
        raise_status(st, what, ep, slot)


def raise_status(st: int, what: str, ep=None, slot=None, nbytes=None) -> None:
    """Raise the error for a failed operation (one place for every op)."""
    if ep is not None:
        # A failed endpoint reports its cause (peer death), not the
        # secondary status of the request (gpucx.Endpoint._failure).
        exc = ep._failure(st, what)
        if exc is not None:
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
        "_engine",
        "_keep",
        "_what",
        "_finish",
        "_ep",
        "_nbytes",
        "_state",
        "_value",
        "_holds",
        "__weakref__",
    )

    def __init__(
        self, engine, slot, keep, what, finish, ep=None, nbytes=None, holds=None
    ):
        self._slot = slot
        self._engine = engine
        self._keep = keep
        self._what = what
        self._finish = finish
        self._ep = ep
        self._nbytes = nbytes
        self._state = 0  # 0 pending, 1 ok, 2 failed
        self._value = None
        # The remote keys (one, or a tuple) the operation uses: what a key's
        # close asks about (Engine.holding).
        self._holds = holds
        if slot.status == INPROGRESS:
            # Engine.track, inlined: one call less for every pending
            # operation.
            pending = engine.pending
            pending.add(self)
            if len(pending) >= engine.sweep_at:
                engine.sweep()
        else:
            self._complete()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<gpucx.Request {self._what} {state}>"

    @property
    def endpoint(self):
        """The :class:`~gpucx.Endpoint` the operation runs on, or None for
        an operation of no endpoint (a worker-wide tag or active-message
        receive, or a request finished when it was made)."""
        return self._ep

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
                if st == CANCELED and self._engine.suspects:
                    self._raise_if_peer_died()
                raise_status(st, self._what, self._ep, slot, self._nbytes)
            except UCXError as exc:
                self._value = exc
        self._keep = None
        self._holds = None
        self._engine.pending.discard(self)

    def _raise_if_peer_died(self) -> None:
        """Raise PeerError if this request was canceled by gpucx
        force-closing a dead peer's endpoint (see gpucx.Endpoint._peer_died)."""
        found = self._engine.suspects.pop(self, None)
        if found is not None and time.monotonic() < found[1]:
            raise peer_gone(self._what, found[0])

    def _fail(self, exc: UCXError) -> None:
        """Settle as failed while UCX still holds the operation (the caller
        parked the slot and the buffers with the engine)."""
        self._state = 2
        self._value = exc
        self._keep = None
        self._engine.untrack(self)

    def done(self) -> bool:
        """Progress once if needed; return True when the operation finished."""
        if self._state:
            return True
        if self._slot.status == INPROGRESS:
            e = self._engine
            if e.h is None:
                return False
            e.progress()
            if self._slot.status == INPROGRESS:
                return False
        self._complete()
        return True

    # on_timeout and ep are not keyword-only: a keyword-only default costs
    # about 20 ns a call (a dict lookup each), a positional one about 1 ns,
    # and wait() is on the 8-byte send_nb(...).wait() path.
    def wait(
        self, timeout: float | None = None, on_timeout: str | None = None, ep=None
    ):
        """Block until the operation finished; return its result.

        ``on_timeout`` (``"park"`` or ``"release"``; None: :attr:`on_timeout`):
        what happens when ``timeout`` passes (or the wait is interrupted)
        while UCX still holds the operation (docs/reliability.md, "Deadlines
        and the buffer").  ``ep``: for an operation of no endpoint (a tag
        receive), the endpoint its data comes from: releasing a receive UCX
        already matched force-closes it, and its failure fails the wait.

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first: the operation is canceled,
            and if UCX cannot withdraw it, parked or released as
            ``on_timeout`` says; the error's ``released`` tells which.
        gpucx.UCXError
            The operation's own error (``PeerError``, ``CanceledError``...).
        ValueError
            For an ``on_timeout`` other than ``"park"``, ``"release"``, None.
        """
        if on_timeout is not None:
            on_timeout_mode(on_timeout)
        if not self._state:
            if self._slot.status == INPROGRESS:
                e = self._engine
                if e.h is None:
                    e.raise_closed()
                try:
                    e.block(
                        self._slot,
                        timeout,
                        None,
                        self._ep if ep is None else ep,
                        self._cancelable,
                        None,
                        on_timeout,
                    )
                except BaseException:
                    if self._state:  # failed while waiting (a dead peer)
                        raise self._value from None
                    e.suspects.pop(self, None)  # canceled by the timeout
                    # block() canceled and drained (or parked) the operation.
                    if self._slot.status != INPROGRESS:
                        self._complete()
                    raise
            self._complete()
        if self._state == 1:
            return self._value
        if (
            ep is not None
            and self._ep is None
            and type(self._value) is CanceledError
            and ep.error is not None
        ):
            # UCX canceled a receive because the endpoint its data comes
            # from failed (the peer died, or aborted it): say that, as for
            # an operation of the endpoint.  Also when the receive matched
            # only after the failure and was canceled at once.
            raise_status(CANCELED, self._what, ep)
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

    @property
    def on_timeout(self) -> str:
        """What a passed deadline (or a canceled await) does with this
        operation if UCX cannot withdraw it: its endpoint's
        :attr:`~gpucx.Endpoint.on_timeout`, or the context's
        ``GPUCX_ON_TIMEOUT`` for an operation of no endpoint."""
        ep = self._ep
        return ep.on_timeout if ep is not None else self._engine.context.on_timeout

    def give_up(self, on_timeout: str | None = None) -> bool:
        """Give the operation up now, as a passed deadline does: cancel it,
        and if UCX does not withdraw it, park it or release it
        (``on_timeout``, None: :attr:`on_timeout`; docs/reliability.md,
        "Deadlines and the buffer").  The request then fails
        (:class:`~gpucx.CanceledError`) once UCX let go of it.

        Returns
        -------
        bool
            True when UCX no longer holds the operation's buffers (it
            finished, was withdrawn, or its endpoint was force-closed);
            False when it is parked.

        Raises
        ------
        ValueError
            For an ``on_timeout`` other than ``"park"``, ``"release"``, None.
        """
        if on_timeout is not None:
            on_timeout_mode(on_timeout)
        if self._state or self._slot.status != INPROGRESS:
            self.done()
            return True
        e = self._engine
        if e.h is None:
            return False
        e.suspects.pop(self, None)  # given up by the caller, not a death
        released, _detail = e.abandon(
            self._slot, None, self._cancelable, None, self._ep, on_timeout
        )
        if self._slot.status != INPROGRESS:
            self._complete()
        return released

    def cancel(self) -> bool:
        """Ask UCX to cancel the operation; True if it was still pending.

        Atomics cannot be canceled (UCX has no way to withdraw one): for them
        this returns False and the operation goes on."""
        if self._state or self._slot.status != INPROGRESS or not self._cancelable:
            return False
        e = self._engine
        if e.h is None:
            return False
        e.suspects.pop(self, None)  # canceled by the user, not a death
        if lib.gpucx_slot_cancel(e.h, self._slot) != INPROGRESS:
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

    # -- read by the layers above (engine_of, observe, in_flight, spin) ----

    def _engine_of(self):
        """The engine this request progresses (None for a request finished
        when it was made)."""
        return self._engine

    def _observe(self) -> bool:
        """True once the request finished, without progressing: the first
        look at a finished slot completes it (frees the UCX request, sets
        its result).  What an event-loop driver asks of the requests it
        waits for."""
        if self._state:
            return True
        if self._slot.status == INPROGRESS:
            return False
        self._complete()
        return True

    def _in_flight(self) -> bool:
        """True while UCX still holds the operation (its slot is pending),
        also after the request failed: one failed by its peer's death while
        UCX held it stays in flight until UCX lets go of it."""
        return self._slot.status == INPROGRESS

    def _spin(self, spin_ns: int) -> bool:
        """Busy-poll the completion for up to ``spin_ns`` ns
        (:meth:`gpucx._engine.Engine.spin`); True when it completed."""
        return self._engine.spin(self._slot, spin_ns)

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
    _engine = None
    _holds = None
    _ep = None
    _finish = None
    _nbytes = None
    _what = "operation"
    _slot = ffi.new(_SLOT_P, {"status": OK})


class _DoneAtPost(_Done):
    """A request UCX finished while it was posted, with no result to carry
    (a send, put or get): its result is a class constant too, so making one
    costs an empty object."""

    __slots__ = ()
    _value = None


_new_done = object.__new__


def done_with(value) -> Request:
    """A request already finished with ``value`` as its result."""
    req = _new_done(_Done)
    req._value = value
    return req


def posted(engine, slot, st: int, keep, what: str, ep, holds=None) -> Request:
    """The :class:`Request` of a just-posted send, put or get (``wait()``
    returns None) whose post returned ``st``.

    ``slot`` may be the engine's shared slot (single-thread workers): an
    operation that finished at once leaves it free for the next one and gets
    a settled request without a slot; one still pending keeps it, and the
    engine takes a fresh shared slot.  ``holds``: the remote keys it uses.
    """
    if st == OK:
        return _new_done(_DoneAtPost)
    if slot is engine.sslot:
        engine.sslot = new_slot()
    return Request(engine, slot, keep, what, None, ep, None, holds)


# -- what the layers above a request read of it ---------------------------------
# Methods of Request (its own state), named here for the layers above: an
# event-loop driver waits through these, never through a request's fields.

#: ``engine_of(req)``: see :meth:`Request._engine_of`.
engine_of = Request._engine_of
#: ``observe(req)``: see :meth:`Request._observe`.
observe = Request._observe
#: ``in_flight(req)``: see :meth:`Request._in_flight`.
in_flight = Request._in_flight
#: ``spin(req, spin_ns)``: see :meth:`Request._spin`.
spin = Request._spin
