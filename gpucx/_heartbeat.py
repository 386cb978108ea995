"""gpucx's own check that a peer *progresses*: a heartbeat that only a
progressing gpucx worker answers.

A frozen peer (SIGSTOP, a debugger) that this side only waits for (a
rendezvous send it must fetch, a get's data, a message from it) is invisible
to TCP and to UCX's keepalive: its kernel still answers both; over shared
memory nothing notices a stopped process either.  So while an operation on
an endpoint waits, the engine sends the peer a small internal active message
(a "ping", :data:`PING_AM_ID`, whose header is a token naming the endpoint),
and the peer's gpucx answers "pong" (:data:`PONG_AM_ID`, the same token)
from C, inside the UCX receive callback of the ping
(``gpucx__am_ping_cb`` in ``gpucx/_csrc/am.c``): whatever progresses the
peer's worker answers, its Python dispatching messages, a
:class:`gpucx.aio.ProgressThread`, or a blocking wait spinning in C, and
nothing answers while nothing progresses it.  When nothing was heard from a
peer for ``GPUCX_PEER_TIMEOUT`` seconds while operations on its endpoint
waited, the endpoint fails (``on_silence``: its pending operations end with
:class:`~gpucx.PeerError`, and the peer gets the abort notice).

Only a pong counts as hearing a peer; a ping from it does not.  The peer's
C answers this side's pings whenever it progresses, so a pinging peer is
heard through its pongs anyway, and pings never reach Python (they neither
wake a blocking wait nor take a place in the active-message queue).  A ping
that comes on an endpoint UCX closed is dropped by UCX; on one that failed
the pong's send fails and the ping is dropped; so is a ping without a reply
endpoint or whose token is not ``lib.GPUCX_PING_TOKEN`` (8) bytes.  The
pong's request is freed in C at once: it is no operation of the endpoint
(nothing waits for it, and a close does not count it).  Pongs are handled
by Python on the pinging side (:func:`answered`), whose checks run right
after it dispatches.

Costs and rules:

* Nothing on idle endpoints and nothing on the hot path: the engine looks
  here only between wait slices (after a blocking wait's spin), every few
  hundred ``progress()`` calls while requests are pending, and then at most
  once per :func:`interval`.  Pings go only while something waits on the
  endpoint, at most one outstanding per endpoint.
* Only endpoints whose peer may run gpucx are pinged (:meth:`Engine.hear`:
  gpucx worker addresses and ``(host, port)`` connections, never ``raw``
  ones), and only one that *answered a ping once* on this endpoint is ever
  failed for silence: a peer that is not gpucx (ucxx), or whose context has
  no ``"am"`` feature, never answers and is never failed by this check.
  The first ping goes once an operation has waited 0.2 T (a short wait,
  such as a new endpoint's wireup, pings nobody), so a progressing peer
  proves itself within 0.2 T of a longer wait.
* The silence is counted only while this side looked: when this process
  itself did not check for half the timeout (it was frozen or busy
  itself), every clock starts again, so a process that comes back from a
  stop does not blame its peers for its own absence.

Every function here takes the worker's engine (:mod:`gpucx._engine`).
"""

from __future__ import annotations

import time
import weakref

from ._lib import lib
from .errors import check as _check

#: The reserved active-message ids of the heartbeat (beside the abort
#: notice's 0xFF30 in ``gpucx.endpoint``): 0xFF31 and 0xFF32, defined in C.
PING_AM_ID = lib.GPUCX_PING_AM_ID
PONG_AM_ID = lib.GPUCX_PONG_AM_ID
#: A ping goes once nothing was heard for this fraction of the timeout.
PING_AFTER = 0.2

_INPROGRESS = lib.UCS_INPROGRESS


class Beat:
    """What the engine knows of one endpoint's peer (:meth:`Engine.hear`)."""

    __slots__ = ("token", "on_silence", "heard", "ping", "answered", "busy")

    def __init__(self, token: int, on_silence):
        self.token = token
        #: on_silence(reason, slot): what fails the endpoint (a weak method:
        #: the engine must not keep an endpoint nobody holds alive); ``slot``:
        #: the operation of a blocking wait on it, or None.
        self.on_silence = weakref.WeakMethod(on_silence)
        #: When the peer was last heard (or the wait began).
        self.heard = 0.0
        #: When the outstanding ping went (None: none outstanding).
        self.ping = None
        #: The peer answered a ping once: it runs gpucx and can answer.
        self.answered = False
        #: Something waits on the endpoint (as of the last check).
        self.busy = False


def interval(timeout: float) -> float:
    """How often the engine looks (at most): a tenth of the timeout."""
    return max(0.02, timeout / 10)


def hear(engine, ep, on_silence) -> None:
    """Check that ``ep``'s peer progresses while operations on it wait;
    ``on_silence(reason, slot)`` fails the endpoint (``slot``: the
    operation a blocking wait on it waits for, which no tracked request
    shows, or None)."""
    engine.beat_token += 1
    tok = engine.beat_token
    engine.beats[ep] = Beat(tok, on_silence)
    engine.beat_tokens[tok] = ep


def unhear(engine, ep) -> None:
    """Stop checking ``ep``'s peer (closed or failed)."""
    b = engine.beats.pop(ep, None)
    if b is not None:
        engine.beat_tokens.pop(b.token, None)


def answer_pings(engine) -> None:
    """Answer peers' pings to the engine's worker in C from now on (the
    endpoint module calls it with the worker's first endpoint)."""
    # UCX refuses only an id past 65535, or when it has no memory to grow
    # its table of handlers; even a context without the "am" feature takes
    # it (gpucx does not ask there).
    _check(lib.gpucx_am_answer_pings(engine.h), "ucp_worker_set_am_recv_handler")


def answered(engine, token: bytes) -> None:
    """A pong arrived (the handler of :data:`PONG_AM_ID`): the peer of the
    endpoint whose ``token`` it carries was heard now."""
    ep = engine.beat_tokens.get(int.from_bytes(token[:8], "little"))
    b = engine.beats.get(ep) if ep is not None else None
    if b is not None:
        b.heard = time.monotonic()
        b.answered = True
        b.ping = None


def let_go(engine, req) -> None:
    """Nobody waits for the heartbeat's own pings: one UCX still holds is
    parked with the engine (its header kept alive), which frees it once UCX
    lets go, so that it is never a pending operation of the endpoint (a
    wait, or something its close waits for)."""
    if req._slot.status != _INPROGRESS:
        req.done()  # finished: complete it now (no progress call)
    else:
        engine.untrack(req)
        engine.park(req._slot, req._keep)


def check(engine, ep=None, slot=None) -> None:
    """Ping the peers that operations wait on, and fail those that answered
    once but not for ``context.peer_timeout`` seconds.  ``ep``: the endpoint
    a blocking wait waits on, ``slot`` its operation (no tracked request:
    what fails the endpoint is told of it, a TCP send in flight)."""
    now = time.monotonic()
    if now < engine.beat_at:
        return
    timeout = engine.context.peer_timeout
    step = interval(timeout)
    absent = now - engine.beat_at > timeout / 2  # this side did not look
    engine.beat_at = now + step
    beats = engine.beats
    busy = set()
    if ep is not None and ep in beats:
        busy.add(ep)
    for r in engine.pending:
        e = r.endpoint
        if e is not None and r._slot.status == _INPROGRESS and e in beats:
            busy.add(e)
    for e, b in list(beats.items()):
        if e not in busy:
            b.busy = False
            continue
        if e.closed:
            unhear(engine, e)
            continue
        if not b.busy or absent:
            # A wait began (or this side was away): the clock starts now.
            b.busy = True
            b.heard = now
            b.ping = None
        silent = now - b.heard
        if b.answered and silent >= timeout:
            unhear(engine, e)
            fail = b.on_silence()
            if fail is None:  # pragma: no cover - the endpoint is being collected
                continue
            fail(
                f"the peer did not answer for {timeout:g} s: frozen, or not "
                "progressing (GPUCX_PEER_TIMEOUT; docs/reliability.md)",
                slot if e is ep else None,
            )
        elif b.ping is None and silent >= PING_AFTER * timeout:
            req = engine.ping(e, b.token.to_bytes(8, "little"))
            if req is not None:
                b.ping = now
                let_go(engine, req)
