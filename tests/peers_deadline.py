"""Peer programs for the deadline tests (tests/test_deadlines.py).

Run as ``python peers_deadline.py ROLE OP``, on this host or on an emulated
one (tests/hosts.py), spoken to one JSON value a line over stdin/stdout
(bytes as ``{"b": hex}``), as tests/peers_hosts.py is.  UCX's transports
come from the environment (``UCX_TLS``).

Two roles meet over gpucx, the test passing their addresses:

* ``victim``: sets up its half of ``OP``, says "ready" and stops itself
  (SIGSTOP) in the middle of it; once the test resumes it (SIGCONT) it
  reports what became of its half: the outcome of its own operation (for
  "put" and "get", a stream receive on the endpoint that nothing answers),
  its error message, how long that took, what a later send on the
  endpoint does, and how many canary bytes reached its memory;
* ``releaser``: runs ``OP`` against the stopped victim with a short
  deadline and ``on_timeout`` as told, reports the error (type,
  ``released``, message), overwrites its buffer with the canary, and after
  the victim resumed, reports whether the canary survived.

OP is one of "send" (a rendezvous tag send from the releaser to a posted
receive), "recv" (a receive the releaser posts, matched to the victim's
send), "put", "get" (RMA on the victim's region), "am" (``receive_into`` of
a rendezvous active message the victim sent).  "OP!" runs OP as if UCX
were a version whose TCP sockets gpucx cannot find (a release of a TCP send
is refused then).

OP "hb" is the heartbeat's failing of a frozen peer (GPUCX_PEER_TIMEOUT from
the environment) with a send in flight: the ``victim`` answers the
heartbeat once, then stops itself; the ``releaser`` (no ``on_timeout``
given) blocks in an 8 MiB send to it until the heartbeat fails the
endpoint, reports how, and keeps progressing while the resumed victim
closes its endpoint: :func:`hb_victim`, :func:`hb_sender`.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import time

from hosts import child_channel

# Before UCX loads: its log lines go to fd 1.
put, get = child_channel()
faulthandler.enable()
faulthandler.dump_traceback_later(
    int(os.environ.get("GPUCX_PEER_DEADLINE", "40")), exit=True
)

import numpy as np  # noqa: E402

import gpucx  # noqa: E402

#: The payload: past every rendezvous threshold of TCP and shared memory.
N = 8 << 20
TAG = 7
AM_ID = 9
#: The tag of the "hb" victim's message that the sender waits for first.
HELLO = 11
CANARY = 0xEE
DATA = 1
#: How long the victim waits for its own operation once resumed.
VICTIM_WAIT_S = 1.5


def get_progressing(w):
    """:func:`get`, progressing ``w`` meanwhile: the peer's messages (its
    rendezvous request, a connection's handshake) come in while we wait."""
    while not select.select([sys.stdin], [], [], 0.001)[0]:
        w.progress()
    return get()


def canaries(buf: np.ndarray) -> int:
    return int(np.count_nonzero(buf == CANARY))


def victim(op: str) -> None:
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        put(w.address)
        ep = w.connect(get())
        ep.flush(timeout=10)  # wired up both ways before anything stops
        mem = None
        req = None
        if op in ("send", "aio"):  # the releaser sends: a receive posted here
            mem = np.zeros(N, np.uint8)
            req = w.recv_nb(mem, tag=TAG)
        elif op in ("recv", "recv_noep"):  # the releaser receives: a send here
            req = ep.send_nb(np.full(N, DATA, np.uint8), tag=TAG)
        elif op == "am":
            req = ep.am_send_nb(
                AM_ID, np.full(N, DATA, np.uint8), reply=True, proto="rndv"
            )
        else:  # put, get: a region the releaser reaches
            mem = np.full(N, DATA if op == "get" else 0, np.uint8)
            region = ctx.register(mem)
            put(region.remote().to_bytes())
            # An operation of this side's own on the endpoint, pending when
            # the releaser gives up: a stream receive it never sends to.
            req = ep.stream_recv_nb(np.zeros(8, np.uint8))
        end = time.monotonic() + 0.1  # the rendezvous request goes out
        while time.monotonic() < end:
            w.progress()
        put("ready")
        os.kill(os.getpid(), signal.SIGSTOP)
        # Resumed: what becomes of this side's own operation.
        t0 = time.monotonic()
        outcome = "none"
        why = ""
        if req is not None:
            try:
                # A tag receive names the endpoint its data comes from: the
                # endpoint's failure (the releaser's notice) fails it.
                req.wait(VICTIM_WAIT_S, ep=ep if op in ("send", "aio") else None)
                outcome = "done"
            except gpucx.TimeoutError:
                outcome = "timeout"
            except gpucx.UCXError as exc:
                outcome = type(exc).__name__
                why = str(exc)
        else:
            end = t0 + 0.5
            while time.monotonic() < end:
                w.progress()
                time.sleep(0.001)
        took = time.monotonic() - t0
        try:  # what a later operation on the endpoint says
            ep.send(b"x", tag=TAG + 1, timeout=0.5)
            after = "done"
        except gpucx.UCXError as exc:
            after = type(exc).__name__
        put(
            {
                "outcome": outcome,
                "why": why,
                "s": took,
                "after": after,
                "canaries": canaries(mem) if mem is not None else 0,
            }
        )
        get()  # the test is done with us
        ep.close(force=True)


def aio_releaser(on_timeout: str, timeout: float) -> None:
    """``releaser`` for "aio": an awaited send canceled by
    ``asyncio.wait_for``, the endpoint's ``on_timeout`` as told."""
    import asyncio

    import gpucx.aio

    async def main() -> None:
        with gpucx.Context() as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                put(w.address)
                ep = w.connect(get())
                ep.flush(timeout=10)
                ep.on_timeout = on_timeout
                mem = np.full(N, DATA, np.uint8)
                get_progressing(w)
                t0 = time.monotonic()
                err = None
                try:
                    await asyncio.wait_for(ep.asend(mem, tag=TAG), timeout)
                except asyncio.TimeoutError as exc:
                    err = exc
                put(
                    {
                        "error": type(err).__name__ if err is not None else None,
                        "released": ep.closed,
                        "message": f"canceled after {time.monotonic() - t0:.3f} s",
                        "closed": ep.closed,
                    }
                )
                mem[:] = CANARY
                get()
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    await asyncio.sleep(0.01)
                put({"intact": bool((mem == CANARY).all())})
                get()

    asyncio.run(main())


def releaser(op: str, on_timeout: str, timeout: float) -> None:
    if op == "aio":
        aio_releaser(on_timeout, timeout)
        return
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        put(w.address)
        ep = w.connect(get())
        ep.flush(timeout=10)
        rkey = None
        if op in ("put", "get"):
            rkey = ep.unpack(get())
        msgs: list = []
        if op == "am":
            w.set_am_handler(AM_ID, msgs.append)
        mem = (
            np.full(N, DATA, np.uint8)
            if op in ("send", "put")
            else np.zeros(N, np.uint8)
        )
        get_progressing(w)  # "go": the victim is stopped
        err = None
        try:
            # Blocking calls follow the endpoint's choice; a request's
            # wait takes one per call.
            ep.on_timeout = on_timeout
            if op == "send":
                ep.send(mem, tag=TAG, timeout=timeout)
            elif op == "recv":
                req = w.recv_nb(mem, tag=TAG)
                req.wait(timeout, on_timeout=on_timeout, ep=ep)
            elif op == "recv_noep":  # no endpoint named
                w.recv_nb(mem, tag=TAG).wait(timeout, on_timeout=on_timeout)
            elif op == "put":
                ep.put(mem, rkey, timeout=timeout)
            elif op == "get":
                ep.get(mem, rkey, timeout=timeout)
            else:
                end = time.monotonic() + 10
                while not msgs and time.monotonic() < end:
                    w.progress()
                msg = msgs[0]
                # Looked up first, the reply endpoint (the sender's) is the
                # receive's endpoint: the one a release closes.
                assert msg.reply_ep is not None
                msg.receive_into(mem).wait(timeout, on_timeout=on_timeout)
        except gpucx.UCXError as exc:
            err = exc
        put(
            {
                "error": type(err).__name__ if err is not None else None,
                "released": getattr(err, "released", None),
                "message": str(err),
                "closed": ep.closed,
            }
        )
        mem[:] = CANARY
        get()  # the victim runs again
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # any late write lands meanwhile
            w.progress()
            time.sleep(0.001)
        put({"intact": bool((mem == CANARY).all())})
        get()


def hb_victim() -> None:
    """The victim of "hb": answers the heartbeat during the sender's first
    wait (a receive it serves after 1 s), stops itself, and once
    resumed closes its endpoint when told to (what UCX 1.22 crashed the
    sender on after a plain force close with a send in flight)."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        put(w.address)
        ep = w.connect(get())
        ep.flush(timeout=10)
        end = time.monotonic() + 1.0  # the sender pings (after 0.4 s) meanwhile
        while time.monotonic() < end:
            w.progress()
        ep.send(np.ones(8, np.uint8), tag=HELLO)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            w.progress()
        put("ready")
        os.kill(os.getpid(), signal.SIGSTOP)
        put("resumed")
        get_progressing(w)  # "bye"
        ep.close()
        put("closed")
        get()


def hb_sender() -> None:
    """The sender of "hb": waits once on the victim (which answers a ping),
    then, the victim stopped, blocks in an 8 MiB send until the heartbeat
    fails the endpoint; reports the error, whether the endpoint's TCP
    lanes were shut down first, and progresses on while the victim closes
    its side."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        put(w.address)
        ep = w.connect(get())
        ep.flush(timeout=10)
        # A wait on the endpoint (ep=): the heartbeat pings its peer.
        w.recv_nb(np.zeros(8, np.uint8), tag=HELLO).wait(10, ep=ep)
        answered = w._engine.beats[ep].answered
        get_progressing(w)  # "go": the victim is stopped
        t0 = time.monotonic()
        err = None
        try:
            ep.send(np.ones(N, np.uint8), tag=TAG, timeout=30)
        except gpucx.UCXError as exc:
            err = exc
        put(
            {
                "answered": answered,
                "error": type(err).__name__ if err is not None else None,
                "message": str(err),
                "s": time.monotonic() - t0,
                "closed": ep.closed,
                "lanes_shut": ep._lanes_shut,
            }
        )
        get_progressing(w)  # the victim closes its endpoint meanwhile
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            w.progress()
            time.sleep(0.001)
        put("alive")
        get()


if __name__ == "__main__":
    role, op = sys.argv[1], sys.argv[2]
    if op.endswith("!"):
        # As if this UCX were not one whose TCP transport gpucx knows: it
        # cannot find an endpoint's sockets to shut them down, and refuses
        # to release a TCP send (test_release_refused_for_tcp_sends).
        import gpucx.endpoint

        gpucx.endpoint._TCP_SHUTDOWN_UCX = frozenset()
        op = op[:-1]
    if op == "hb":
        hb_victim() if role == "victim" else hb_sender()
    elif role == "victim":
        victim(op)
    else:
        releaser(op, sys.argv[3], float(sys.argv[4]))
