"""Deadlines that give the buffer back (issue 35; docs/reliability.md,
"Deadlines and the buffer").

Two processes (tests/peers_deadline.py): a victim stops itself (SIGSTOP)
in the middle of a transfer with the releaser, whose operation then misses
its deadline.  With ``on_timeout="release"`` the releaser's error says
``released`` and its buffer is overwritten with a canary before the victim
resumes: the canary must survive in the releaser's receive buffer (no late
write) and must not reach the victim (no late read of a send buffer).
With ``"park"`` (today's behaviour, the default) the same run shows the
late access, which is what makes these tests able to fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import hosts as hostlib
import numpy as np
import pytest

import gpucx
from gpucx import config as gconfig
from gpucx import endpoint as gendpoint

pytestmark = pytest.mark.timeout(60)

PEERS = str(Path(__file__).with_name("peers_deadline.py"))
#: Transports where closing an endpoint stops the peer from reaching this
#: process's memory: TCP, and shared memory without CMA (copy-in/out).
TLS = {"tcp": "tcp,self", "shm": "posix,sysv,self"}
#: The releaser's deadline.
DEADLINE = 0.5
#: How soon after it resumes the stopped peer must learn of a release, at
#: most: well before its own deadline (peers_deadline.VICTIM_WAIT_S, 1.5 s).
#: Measured 0.5-15 ms on one host, 10-39 ms across hosts.
TOLD_S = 0.5


def _local(args: list[str], tls: str | None) -> hostlib.Peer:
    env = dict(os.environ)
    if tls is not None:
        env["UCX_TLS"] = tls
    env["PYTHONPATH"] = os.pathsep.join(
        [str(hostlib.TESTS), str(hostlib.ROOT), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.Popen(
        [sys.executable, "-u", PEERS, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
    )
    return hostlib.Peer(proc, " ".join(args))


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _run(op: str, mode: str, start_victim, start_releaser) -> tuple:
    """One victim/releaser run: (releaser's error report, victim's report,
    releaser's canary report)."""
    victim = start_victim(["victim", op])
    releaser = start_releaser(["releaser", op, mode, str(DEADLINE)])
    try:
        va, ra = victim.get(), releaser.get()
        victim.put(ra)
        releaser.put(va)
        if op.rstrip("!") in ("put", "get"):
            releaser.put(victim.get())  # the victim's region
        assert victim.get() == "ready"
        end = time.monotonic() + 10
        while not _stopped(victim.proc.pid):
            assert time.monotonic() < end, "the victim did not stop"
            time.sleep(0.002)
        releaser.put("go")
        error = releaser.get()
        os.kill(victim.proc.pid, signal.SIGCONT)
        releaser.put("resumed")
        seen = victim.get()
        intact = releaser.get()
        # The victim closes first: its endpoint's close reaches the releaser
        # while the releaser's worker still runs, the moment UCX 1.22
        # crashes after a force close with a TCP send in flight
        # (test_release_refused_for_tcp_sends).
        victim.put("bye")
        victim.join(15)
        releaser.put("bye")
        releaser.join(15)
        return error, seen, intact
    finally:
        for p in (victim, releaser):
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(5)


def _check_peer_told(seen, reset_ok: bool = False) -> None:
    """The thawed victim learned of the release from the notice: its own
    pending operation with the releaser failed with PeerError naming the
    cause, soon after it resumed, and its endpoint back raises it.  With
    ``reset_ok`` (a TCP send or put, released after gpucx shut the
    connection down) the connection's end may reach it before the notice:
    the same PeerError, named by UCX."""
    assert seen["outcome"] == "PeerError", seen
    causes = ("after giving up an operation",)
    if reset_ok:
        causes += ("Connection reset by remote peer",)
    assert any(c in seen["why"] for c in causes), seen
    assert seen["s"] < TOLD_S, seen
    assert seen["after"] == "PeerError", seen


def _check_released(op: str, error, seen, intact) -> None:
    assert error["error"] == "TimeoutError", error
    assert error["released"] is True, error
    assert "released: gpucx force-closed endpoint" in error["message"], error
    assert error["closed"], error
    # No late read of the releaser's send buffer reached the victim, no
    # late write reached the releaser's receive buffer.
    assert seen["canaries"] == 0, (op, seen)
    assert intact["intact"], (op, intact)


#: Operations that carry this side's data: over TCP, released only after
#: their endpoint's sockets are shut down (test_release_refused_for_tcp_sends).
TCP_SENDS = ("send", "put")


@pytest.mark.parametrize(
    "op,tls",
    [(op, tls) for tls in sorted(TLS) for op in ("send", "recv", "put", "get", "am")],
)
def test_release_keeps_the_canary(op, tls):
    """A rendezvous send, a matched receive, a put, a get and an AM
    receive_into whose peer stopped: released at the deadline, the canary
    written afterwards survives the peer's resumption.  (Over TCP, a send
    and a put are released by shutting the endpoint's sockets down first:
    test_release_across_hosts.)"""
    start = lambda args: _local(args, TLS[tls])  # noqa: E731
    error, seen, intact = _run(op, "release", start, start)
    _check_released(op, error, seen, intact)
    if op in ("recv", "am"):
        # The peer learns at once rather than at its own deadline: the
        # abort notice fails its send with PeerError, unless the send had
        # already left (UCX completes a send locally: the data went out,
        # nobody took it).
        assert seen["outcome"] in ("PeerError", "done"), seen
        assert seen["s"] < 0.5, seen
    if op == "am":
        # The notice reached the peer: its send failed, and its endpoint
        # back raises PeerError at once.
        assert seen["outcome"] == "PeerError", seen
        assert seen["after"] == "PeerError", seen
    if op in ("send", "put", "get"):
        # The in-band notice queued behind the data or requests the stopped
        # peer did not take and was dropped with the close: the notice
        # that went out of band (its own endpoint to the peer's worker)
        # fails the peer's receive matched to the send (waited on with
        # ep=), its stream receive pending on the endpoint (put, get).
        # Over TCP a send's or put's connection is shut down first, whose
        # end the peer may see before the notice.
        _check_peer_told(seen, reset_ok=op != "get" and tls == "tcp")


def _check_refused_over_tcp(error) -> None:
    assert error["error"] == "TimeoutError", error
    assert error["released"] is False, error
    assert "still parked" in error["message"], error
    assert "over tcp/" in error["message"], error
    assert "uct_tcp_iface_handle_events" in error["message"], error
    assert not error["closed"], error


@pytest.mark.parametrize("op", TCP_SENDS)
def test_release_refused_for_tcp_sends(op):
    """A send or a put still carried over TCP, where gpucx cannot find the
    endpoint's sockets to shut them down first (here: the releaser runs as
    if its UCX were not one whose TCP transport gpucx knows, "OP!"), is not
    released: a plain force close makes UCX 1.22 crash this process once
    the peer closes its side (use after free in uct_tcp_iface_handle_events,
    docs/reliability.md "Known UCX limitation").  The operation is parked,
    the error says why, the endpoint stays open, and the process outlives
    the peer's close (_run's join checks the exit status)."""
    start = lambda args: _local(args, TLS["tcp"])  # noqa: E731
    error, _seen, _intact = _run(op + "!", "release", start, start)
    _check_refused_over_tcp(error)
    assert "could not find their sockets" in error["message"], error


@pytest.mark.parametrize(
    "op,tls", [("send", "tcp"), ("get", "shm"), ("put", "shm"), ("recv", "tcp")]
)
def test_park_leaves_the_buffer_in_use(op, tls):
    """Today's behaviour, the default: the error says "still parked", and
    UCX does use the buffer after the deadline (the canary travels, or is
    overwritten): what release prevents."""
    start = lambda args: _local(args, TLS[tls])  # noqa: E731
    error, seen, intact = _run(op, "park", start, start)
    assert error["error"] == "TimeoutError", error
    assert error["released"] is False, error
    assert "still parked" in error["message"], error
    assert not error["closed"], error
    assert seen["canaries"] > 0 or not intact["intact"], (seen, intact)


@pytest.mark.parametrize("tls", sorted(TLS))
def test_aio_cancel_releases(tls):
    """An awaited send canceled by asyncio.wait_for on an endpoint in
    "release" mode: the endpoint is force-closed (over TCP, its sockets shut
    down first) before the cancellation propagates, and the canary
    survives."""
    start = lambda args: _local(args, TLS[tls])  # noqa: E731
    error, seen, intact = _run("aio", "release", start, start)
    assert error["error"] == "TimeoutError" and error["closed"], error
    assert seen["canaries"] == 0 and intact["intact"], (seen, intact)
    _check_peer_told(seen)


def test_aio_cancel_parks_by_default():
    start = lambda args: _local(args, TLS["tcp"])  # noqa: E731
    error, seen, intact = _run("aio", "park", start, start)
    assert not error["closed"], error
    assert seen["canaries"] > 0, seen


@pytest.mark.timeout(180)
def test_release_across_hosts(hosts):
    """The releaser and the stopped peer on two emulated hosts (TCP over a
    veth link, zero-copy protocols): a get, a send (8 MiB, multi-fragment
    eager zero-copy, a fragment left half-written on the socket) and a put
    are released, canary intact (the thawed peer learns of the get from the
    notice out of band), and the releaser outlives the peer closing
    its endpoint afterwards (_run's join checks the exit status): a plain
    force close with the send in flight crashed it there (docs/reliability.md,
    "Known UCX limitation"); gpucx shuts the endpoint's TCP sockets down
    first.  "send!" is the same send where gpucx could not find the sockets:
    refused, and parked over multi-fragment eager zero-copy."""
    a, b = hosts
    for op in ("get", "send", "put", "send!"):
        error, seen, intact = _run(
            op,
            "release",
            lambda args: b.python(PEERS, *args, label=" ".join(args)),
            lambda args: a.python(PEERS, *args, label=" ".join(args)),
        )
        if op == "send!":
            _check_refused_over_tcp(error)
            assert "zero-copy" in error["message"], error
        else:
            _check_released(op, error, seen, intact)
            _check_peer_told(seen, reset_ok=op != "get")


# -- in one process: the choice, its errors and its bookkeeping ---------------


def test_on_timeout_choices_and_errors():
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        assert ctx.on_timeout == "park"
        w = ctx.create_worker()
        ep = w.connect(w.address)
        assert ep.on_timeout == "park"
        ep.on_timeout = "release"
        assert ep.on_timeout == "release"
        ep.on_timeout = None  # the context's again
        assert ep.on_timeout == "park"
        with pytest.raises(ValueError, match="on_timeout must be one of"):
            ep.on_timeout = "drop"
        buf = np.zeros(4, np.uint8)
        req = w.recv_nb(buf, tag=1)
        with pytest.raises(ValueError, match="on_timeout must be one of"):
            req.wait(0.01, on_timeout="x")
        with pytest.raises(ValueError, match="on_timeout must be one of"):
            req.give_up("x")
        assert req.give_up() is True  # an unmatched receive: withdrawn
        assert req.cancelled()
        ep.close()
    with gpucx.Context(config={"GPUCX_ON_TIMEOUT": "release"}) as ctx:
        assert ctx.on_timeout == "release"
    with pytest.raises(ValueError, match="GPUCX_ON_TIMEOUT"):
        gpucx.Context(config={"GPUCX_ON_TIMEOUT": "sometimes"})


def test_on_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("GPUCX_ON_TIMEOUT", "release")
    assert gconfig.gpucx_options(None)["ON_TIMEOUT"] == 1.0
    monkeypatch.setenv("GPUCX_ON_TIMEOUT", "1")
    assert gconfig.gpucx_options(None)["ON_TIMEOUT"] == 1.0
    monkeypatch.setenv("GPUCX_ON_TIMEOUT", "2")
    with pytest.raises(ValueError, match="environment variable GPUCX_ON_TIMEOUT"):
        gconfig.gpucx_options(None)


def test_withdrawn_receive_says_released():
    """A receive nothing matched is withdrawn by UCX: released, whatever the
    mode, and the endpoint stays open."""
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        w = ctx.create_worker()
        buf = np.zeros(8, np.uint8)
        with pytest.raises(gpucx.TimeoutError) as info:
            w.recv(buf, tag=3, timeout=0.05)
        assert info.value.released is True
        assert "released: UCX withdrew the operation" in str(info.value)


def test_matched_receive_without_its_endpoint_stays_parked():
    """A worker-wide receive UCX matched, released without ``ep=``: gpucx
    cannot tell which endpoint to close, so it parks and says why."""
    start = lambda args: _local(args, TLS["tcp"])  # noqa: E731
    error, _seen, _intact = _run("recv_noep", "release", start, start)
    assert error["error"] == "TimeoutError", error
    assert error["released"] is False, error
    assert "cannot tell its endpoint" in error["message"], error
    assert not error["closed"], error


def test_direct_access_transports_are_named():
    """An endpoint reports the transports through which its peer reaches
    this process's memory by itself (none over TCP)."""
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(w.address)
        assert ep.direct_access() == []
        ep.close()
        with pytest.raises(gpucx.ClosedError):
            ep.direct_access()


def test_abort_is_idempotent_and_closes():
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(w.address)
        ep.flush(timeout=5)
        ep.abort("test")
        assert ep.closed
        ep.abort("again")  # nothing
        with pytest.raises(gpucx.ClosedError):
            ep.send(b"x", tag=1)


def test_interrupt_says_what_became_of_the_buffer():
    """A KeyboardInterrupt in a wait gets a note saying released or parked."""
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        w = ctx.create_worker()
        buf = np.zeros(8, np.uint8)
        req = w.recv_nb(buf, tag=9)

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(KeyboardInterrupt) as info:
                req.wait(5)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert any("gpucx: released" in n for n in info.value.__notes__)


def test_asyncio_wait_for_on_withdrawable_receive():
    """aio in "release" mode on an operation UCX withdraws: nothing closes."""

    async def main():
        with gpucx.Context(
            config={"TLS": "tcp,self", "GPUCX_ON_TIMEOUT": "release"}
        ) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                buf = np.zeros(8, np.uint8)
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(w.arecv(buf, tag=4), 0.05)

    import gpucx.aio  # noqa: F401

    asyncio.run(main())


def _wire(a, ab, b, ba, end: float | None = None) -> None:
    """Wire up ``ab`` (a to b) and ``ba`` by a message each way, both
    workers progressing, by ``end`` (monotonic; default: 10 s from now)."""
    reqs = [b.recv_nb(np.zeros(1, np.uint8), tag=99), ab.send_nb(b"x", tag=99)]
    reqs += [a.recv_nb(np.zeros(1, np.uint8), tag=98), ba.send_nb(b"y", tag=98)]
    end = time.monotonic() + 10 if end is None else end
    while not all(r.done() for r in reqs):
        assert time.monotonic() < end, "no wireup"
        a.progress()
        b.progress()


def _wire_up(a, b):
    """Endpoints both ways between workers ``a`` and ``b`` (one process),
    made from their addresses and wired up (:func:`_wire`)."""
    ab, ba = a.connect(b.address), b.connect(a.address)
    _wire(a, ab, b, ba)
    return ab, ba


def _wired(tls: str = "posix,sysv,self"):
    """A context, two workers of it and endpoints both ways, wired up."""
    ctx = gpucx.Context(config={"TLS": tls})
    a, b = ctx.create_worker(), ctx.create_worker()
    return (ctx, a, b, *_wire_up(a, b))


def test_release_in_one_process_cancels_the_rest():
    """Two workers of one process, b not progressing: a's rendezvous send
    misses its deadline and is released; another send pending on the same
    endpoint ends with CanceledError (the cost), later sends raise
    ClosedError, and the canary never reaches b."""
    ctx, a, b, ab, ba = _wired()
    with ctx:
        big = np.ones(8 << 20, np.uint8)
        got = np.zeros(8 << 20, np.uint8)
        rreq = b.recv_nb(got, tag=5)
        other = ab.send_nb(np.ones(1 << 20, np.uint8), tag=6)
        ab.on_timeout = "release"
        with pytest.raises(gpucx.TimeoutError) as info:
            ab.send(big, tag=5, timeout=0.2)
        assert info.value.released is True
        assert ab.closed
        assert other.done()
        with pytest.raises(gpucx.CanceledError):
            other.result()
        with pytest.raises(gpucx.ClosedError):
            ab.send(b"z", tag=7)
        big[:] = 0xEE
        with pytest.raises(gpucx.TimeoutError):
            rreq.wait(0.3)
        assert not (got == 0xEE).any()


def test_release_refused_over_direct_access():
    """An endpoint whose peer reaches this memory by itself (CMA here, as
    ``direct_access`` would report it): "release" leaves it open, parks the
    send and names the transport."""
    ctx, a, b, ab, ba = _wired()
    with ctx:
        ab.direct_access = lambda: ["cma"]  # what a CMA endpoint reports
        rreq = b.recv_nb(np.zeros(8 << 20, np.uint8), tag=5)
        sreq = ab.send_nb(np.ones(8 << 20, np.uint8), tag=5)
        with pytest.raises(gpucx.TimeoutError) as info:
            sreq.wait(0.2, on_timeout="release")  # per call
        assert info.value.released is False
        assert "uses cma" in str(info.value)
        assert not ab.closed
        del rreq


def test_give_up_releases_a_request():
    """Request.give_up("release") on a pending send: True, endpoint closed,
    the request settled as canceled."""
    ctx, a, b, ab, ba = _wired()
    with ctx:
        b.recv_nb(np.zeros(8 << 20, np.uint8), tag=5)
        req = ab.send_nb(np.ones(8 << 20, np.uint8), tag=5)
        a.progress()
        assert req.on_timeout == "park"
        assert req.give_up("release") is True
        assert ab.closed and req.done()
        with pytest.raises(gpucx.CanceledError):
            req.result()
        assert req.give_up() is True  # over already


def test_why_a_release_is_refused():
    """Each reason ``on_timeout="release"`` falls back to parking, as the
    error words it (the engine's decision, before any UCX call)."""
    with gpucx.Context(config={"TLS": "tcp,self"}) as ctx:
        w = ctx.create_worker()
        e = w._engine
        ep = w.connect(w.address)
        assert e._why_not_release(ep, "release") is None
        assert "on_timeout='park'" in e._why_not_release(ep, "park")
        assert "on_timeout='park'" in e._why_not_release(ep, None)
        assert "cannot tell its endpoint" in e._why_not_release(None, "release")
        ep.abort("test")
        assert "already closed or failed" in e._why_not_release(ep, "release")
        before = str(ep.error)
        ep.fail("nothing: closed already")  # no-op on a closed endpoint
        assert str(ep.error) == before


def test_release_tells_the_peer_out_of_band():
    """Two workers of one process, b not progressing: a's rendezvous send to
    b is released.  The in-band notice cannot pass the data queued towards
    b; the one that goes out of band, on a notice endpoint a keeps per peer
    worker, fails b's endpoint back to a once b progresses, and b's
    receive matched to the send fails with PeerError naming the cause.  A
    second release towards b reuses the notice endpoint."""
    ctx, a, b, ab, ba = _wired()
    with ctx:
        got = np.zeros(8 << 20, np.uint8)
        rreq = b.recv_nb(got, tag=5)
        ab.on_timeout = "release"
        with pytest.raises(gpucx.TimeoutError) as info:
            ab.send(np.ones(8 << 20, np.uint8), tag=5, timeout=0.2)
        assert info.value.released is True
        end = time.monotonic() + 5
        while not ba.closed:
            assert time.monotonic() < end, "b never heard of the release"
            a.progress()
            b.progress()
        assert "after giving up an operation" in str(ba.error)
        with pytest.raises(gpucx.PeerError, match="after giving up an operation"):
            rreq.wait(1, ep=ba)
        notices = gendpoint._NOTICES[a._engine]
        assert len(notices.eps) == 1
        (nep,) = notices.eps.values()
        # Again, on a new pair of endpoints: the same notice endpoint.
        ab2, ba2 = a.connect(b.address), b.connect(a.address)
        b.recv_nb(got, tag=6)
        req = ab2.send_nb(np.ones(8 << 20, np.uint8), tag=6)
        assert req.give_up("release") is True
        end = time.monotonic() + 5
        while not ba2.closed:
            assert time.monotonic() < end, "b never heard of the second release"
            a.progress()
            b.progress()
        assert list(notices.eps.values()) == [nep] and not nep.closed
    assert nep.closed  # closed with its worker
    assert a._engine not in gendpoint._NOTICES


def test_out_of_band_notice_to_a_peer_without_handlers():
    """The notice goes out of band to gpucx workers only (endpoints made
    from gpucx worker addresses); one whose context has no "am" feature
    cannot handle it: UCX drops it (and logs a warning), and the worker
    works on, its endpoint back open."""
    tls = {"TLS": "posix,sysv,self"}
    with (
        gpucx.Context(config=tls) as ca,
        gpucx.Context(features={"tag"}, config=tls) as cb,
    ):
        a, b = ca.create_worker(), cb.create_worker()
        ab, ba = _wire_up(a, b)
        one = np.zeros(1, np.uint8)
        got = np.zeros(8 << 20, np.uint8)
        b.recv_nb(got, tag=5)
        ab.on_timeout = "release"
        with pytest.raises(gpucx.TimeoutError) as info:
            ab.send(np.ones(8 << 20, np.uint8), tag=5, timeout=0.2)
        assert info.value.released is True
        assert len(gendpoint._NOTICES[a._engine].eps) == 1  # it went
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            a.progress()
            b.progress()
        assert not ba.closed and ba.error is None
        # b still receives, from a new endpoint of a's.
        ab2 = a.connect(b.address)
        rreq = b.recv_nb(one, tag=7)
        sreq = ab2.send_nb(b"y", tag=7)
        end = time.monotonic() + 5
        while not (rreq.done() and sreq.done()):
            assert time.monotonic() < end, "b stopped working"
            a.progress()
            b.progress()
        assert bytes(one) == b"y"


def test_a_closing_worker_gives_its_notice_endpoints_little_time():
    """A release towards a peer that does not progress again (another
    context, never progressed): the out-of-band notice cannot leave, and
    the closing worker waits ``NOTICE_CLOSE_S`` for it at most, not its
    close's deadline (``CLOSE_TIMEOUT_S``, 10 s)."""
    tls = {"TLS": "posix,sysv,self"}
    with gpucx.Context(config=tls) as ca, gpucx.Context(config=tls) as cb:
        a, b = ca.create_worker(), cb.create_worker()
        ab, ba = _wire_up(a, b)
        # Messages b never takes fill its shared-memory FIFO, which every
        # sender to b writes into: the notice endpoint's messages too.
        small = np.ones(8 << 10, np.uint8)
        sends = [ab.send_nb(small, tag=6) for _ in range(256)]
        for _ in range(100):
            a.progress()
        assert not sends[-1].done()
        assert sends[-1].give_up("release") is True
        (nep,) = gendpoint._NOTICES[a._engine].eps.values()
        t0 = time.monotonic()
        a.close()
        took = time.monotonic() - t0
        assert nep.closed
        assert took < gendpoint.NOTICE_CLOSE_S + 1.0, took
        ba.close(force=True)


def _wired_by_port(tls: str = "tcp"):
    """:func:`_wired` with a's endpoint made by ``(host, port)`` to b's
    listener (client/server wireup) and b's accepted from it."""
    ctx = gpucx.Context(config={"TLS": tls})
    a, b = ctx.create_worker(), ctx.create_worker()
    listener = b.listen(0, host="127.0.0.1")
    ab = a.connect(("127.0.0.1", listener.port))
    end = time.monotonic() + 10
    ba = None
    while ba is None:
        assert time.monotonic() < end, "no connection"
        a.progress()
        try:
            ba = listener.accept(timeout=0.001)
        except gpucx.TimeoutError:
            pass
    _wire(a, ab, b, ba, end)
    # A lane's connection (one over "lo", one over any other interface)
    # may still be on its way after the first messages, and completes only
    # while both sides progress: until then gpucx cannot find a socket for
    # every lane (Endpoint._tcp_lane_sockets), and the tests here would
    # meet the not-found fallback by chance.
    while ab._tcp_lane_sockets() is None or ba._tcp_lane_sockets() is None:
        assert time.monotonic() < end, (ab.transports, ba.transports)
        a.progress()
        b.progress()
    return ctx, a, b, ab, ba


def _ends(fds: list[int]) -> set:
    """(local, peer) address of each socket."""
    import socket

    ends = set()
    for fd in fds:
        with socket.socket(fileno=os.dup(fd)) as s:
            ends.add((s.getsockname(), s.getpeername()))
    return ends


def test_tcp_lane_sockets_are_the_endpoints_own():
    """Endpoint._tcp_lane_sockets finds each endpoint's own socket, in one
    process where every socket of the test is: a's endpoint to b and b's to
    a hold the two ends of one TCP connection, a's endpoint to c another
    one; none is a socket of the others.  Also by ``(host, port)``."""
    ctx, a, b, ab, ba = _wired("tcp,self")
    with ctx:
        c = ctx.create_worker()
        ac, ca = a.connect(c.address), c.connect(a.address)
        reqs = [c.recv_nb(np.zeros(1, np.uint8), tag=9), ac.send_nb(b"z", tag=9)]
        end = time.monotonic() + 10
        while not all(r.done() for r in reqs):
            assert time.monotonic() < end, "no wireup"
            for w in (a, b, c):
                w.progress()
        found = {ep: ep._tcp_lane_sockets() for ep in (ab, ba, ac, ca)}
        assert all(fds is not None and len(fds) == 1 for fds in found.values()), found
        name = {ep: _ends(fds).pop() for ep, fds in found.items()}
        assert name[ab] == name[ba][::-1], name
        assert name[ac] == name[ca][::-1], name
        assert len({found[ep][0] for ep in found}) == 4, found
    # By (host, port): a socket for each lane with a device (over "lo" and
    # any other interface), not the client/server connection's.
    ctx, a, b, ab, ba = _wired_by_port()
    with ctx:
        lanes = [dev for tl, dev in ab.transports if tl == "tcp" and dev]
        fab, fba = ab._tcp_lane_sockets(), ba._tcp_lane_sockets()
        assert fab is not None and fba is not None, ab.transports
        assert len(fab) == len(lanes) and not set(fab) & set(fba), (fab, fba)
        assert _ends(fab) == {(x, y) for y, x in _ends(fba)}


@pytest.mark.parametrize("by", ["address", "port"])
def test_release_over_tcp_in_one_process(by):
    """Two workers of one process over TCP (an endpoint made from a worker
    address, or by (host, port)), b not progressing: a's send misses its
    deadline and is released after a's sockets to b are shut down; the
    endpoint is closed, another send pending on it ends with the endpoint's
    failure (PeerError naming the release), and b, which then sees the
    connection closed, fails its endpoint back to a."""
    ctx, a, b, ab, ba = _wired("tcp,self") if by == "address" else _wired_by_port()
    with ctx:
        rreq = b.recv_nb(np.zeros(8 << 20, np.uint8), tag=5)
        other = ab.send_nb(np.ones(1 << 20, np.uint8), tag=6)
        ab.on_timeout = "release"
        with pytest.raises(gpucx.TimeoutError) as info:
            ab.send(np.ones(8 << 20, np.uint8), tag=5, timeout=0.2)
        assert info.value.released is True, info.value
        assert ab.closed
        assert other.done()
        with pytest.raises(gpucx.PeerError, match="shut the endpoint's TCP"):
            other.result()
        end = time.monotonic() + 5
        while ba.error is None:
            assert time.monotonic() < end, "b never saw the connection close"
            b.progress()
        del rreq


# -- every force close over TCP goes through the shutdown ----------------------


def _send_stuck(a, ab, b):
    """An 8 MiB send from ``a`` to ``b`` (which does not progress) and a
    1 MiB one behind it, both still in UCX's hands over TCP."""
    b.recv_nb(np.zeros(8 << 20, np.uint8), tag=5)
    big = ab.send_nb(np.ones(8 << 20, np.uint8), tag=5)
    other = ab.send_nb(np.ones(1 << 20, np.uint8), tag=6)
    for _ in range(100):
        a.progress()
    assert not big.done()
    assert ab._tcp_send_in_flight() is not None
    return big, other


def _sees_the_end(b, ba, within: float = 2.0) -> bool:
    """Whether ``b``'s endpoint back fails (the connection ended) within
    ``within`` seconds of progress: what the shutdown causes at once, and a
    plain force close with a send stuck on the socket does not."""
    end = time.monotonic() + within
    while ba.error is None and time.monotonic() < end:
        b.progress()
    return ba.error is not None


@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("by", ["address", "port"])
def test_force_close_over_tcp_shuts_the_sockets_first(by, how):
    """A user's ``close(force=True)`` (or ``abort()``) with a send in
    flight over TCP to a worker that does not progress: gpucx shuts the
    endpoint's sockets down first (b sees the connection end at once; after
    a plain force close it does not), the pending sends end with
    CanceledError saying so, later operations raise ClosedError, and b
    closing its side afterwards is harmless."""
    ctx, a, b, ab, ba = _wired("tcp,self") if by == "address" else _wired_by_port()
    with ctx:
        big, other = _send_stuck(a, ab, b)
        if how == "close":
            ab.close(force=True)
        else:
            ab.abort("the test gave up")
        assert ab.closed and ab._lanes_shut
        assert ab.error is None  # closed here, not failed
        said = r"close\(force=True\)" if how == "close" else r"abort\(\)"
        for req in (big, other):
            assert req.done()
            with pytest.raises(gpucx.CanceledError, match=said):
                req.result()
        with pytest.raises(gpucx.ClosedError) as info:
            ab.send(b"z", tag=7)
        assert not isinstance(info.value, gpucx.PeerError)
        assert _sees_the_end(b, ba), "the connection was not shut down"
        ba.close()
        for _ in range(100):
            a.progress()


def test_flush_close_past_its_timeout_shuts_the_sockets_first():
    """A flush close whose flush cannot finish (the peer does not progress)
    force-closes at its timeout: the TCP sockets are shut down first, and
    the sends end with CanceledError naming the close's timeout.  (b in a
    context of its own: a closing worker progresses its siblings.)"""
    tls = {"TLS": "tcp,self"}
    with gpucx.Context(config=tls) as ca, gpucx.Context(config=tls) as cb:
        a, b = ca.create_worker(), cb.create_worker()
        ab, ba = _wire_up(a, b)
        big, other = _send_stuck(a, ab, b)
        ab.close(timeout=0.2)
        assert ab.closed and ab._lanes_shut
        with pytest.raises(gpucx.CanceledError, match="within the close's timeout"):
            big.result()
        assert _sees_the_end(b, ba), "the connection was not shut down"


def test_failing_an_endpoint_over_tcp_leaves_it_to_ucx():
    """gpucx failing an endpoint (``Endpoint.fail``: the abort notice; the
    liveness check goes the same way, ``_peer_died``) with a send in flight
    over TCP: neither a force close (UCX 1.21/1.22 crash on it once the peer
    closes) nor a shutdown of its sockets (which crashed UCX when the peer
    had closed first, the usual order when a notice arrives): the UCX
    endpoint is left open, the pending sends fail with PeerError naming the
    reason, later ones at once, and the peer's close then ends the
    connection without a crash of this process."""
    ctx, a, b, ab, ba = _wired("tcp,self")
    with ctx:
        big, other = _send_stuck(a, ab, b)
        ab.fail("the test failed it")
        assert ab.closed and not ab._lanes_shut
        for req in (big, other):
            with pytest.raises(gpucx.PeerError, match="the test failed it"):
                req.result()
        with pytest.raises(gpucx.PeerError, match="the test failed it"):
            ab.send(b"z", tag=7)
        assert not _sees_the_end(b, ba, 0.3), "the connection was shut down"
        ba.close(force=True)  # the peer closes first
        end = time.monotonic() + 1
        while time.monotonic() < end:  # a crash here would end the run
            a.progress()
            b.progress()


def test_force_close_where_the_sockets_are_unknown_warns_once(monkeypatch):
    """Where gpucx cannot find an endpoint's sockets (as if UCX were another
    version): a ``close(force=True)`` with a TCP send in flight still
    force-closes (CanceledError as before), warning once per process that
    it risks UCX's crash; failing such an endpoint force-closes without a
    warning; a force close with no send in flight shuts nothing down."""
    monkeypatch.setattr(gendpoint, "_TCP_SHUTDOWN_UCX", frozenset())
    monkeypatch.setattr(gendpoint, "_FORCE_CLOSE_WARNED", False)
    ctx, a, b, ab, ba = _wired("tcp,self")
    with ctx:
        big, _ = _send_stuck(a, ab, b)
        with pytest.warns(RuntimeWarning, match="could not find their sockets") as rec:
            ab.close(force=True)
        assert rec[0].filename == __file__  # the caller's line
        assert ab.closed and not ab._lanes_shut
        with pytest.raises(gpucx.CanceledError, match="canceled$"):
            big.result()
        c = ctx.create_worker()
        for fail in (False, True):
            ac = a.connect(c.address)
            _wire(a, ac, c, c.connect(a.address))
            big, _ = _send_stuck(a, ac, c)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                if fail:
                    ac.fail("failed here")
                else:
                    ac.close(force=True)  # warned once already
            assert ac.closed and not ac._lanes_shut
            with pytest.raises(gpucx.CanceledError if not fail else gpucx.PeerError):
                big.result()
        monkeypatch.setattr(gendpoint, "_FORCE_CLOSE_WARNED", False)
        idle = a.connect(c.address)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            idle.close(force=True)
        assert not idle._lanes_shut


def test_heartbeat_failing_a_blocking_send_over_tcp_shuts_the_sockets_first(
    monkeypatch,
):
    """The heartbeat fails an endpoint whose peer stopped answering while a
    blocking send on it (no tracked request: the wait's own operation)
    waits over TCP: the sockets are shut down before the force close (b
    sees the connection end), and the send fails with PeerError naming the
    silence.  (b in a context of its own: nothing progresses it.)"""
    monkeypatch.setenv("GPUCX_PEER_TIMEOUT", "1")
    tls = {"TLS": "tcp,self"}
    with gpucx.Context(config=tls) as ca, gpucx.Context(config=tls) as cb:
        a, b = ca.create_worker(), cb.create_worker()
        ab, ba = _wire_up(a, b)
        # b answers a ping (sent once a wait lasts 0.2 T), then takes the send.
        req = ab.send_nb(np.ones(8 << 20, np.uint8), tag=1)
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            a.progress()
            b.progress()
        assert a._engine.beats[ab].answered
        r = b.recv_nb(np.zeros(8 << 20, np.uint8), tag=1)
        while not (req.done() and r.done()):
            a.progress()
            b.progress()
        # b stops; a's blocking send waits until the heartbeat fails it.
        with pytest.raises(gpucx.PeerError, match="did not answer"):
            ab.send(np.ones(8 << 20, np.uint8), tag=2, timeout=10)
        assert ab.closed and ab._lanes_shut
        assert _sees_the_end(b, ba), "the connection was not shut down"
        ba.close()


@pytest.mark.timeout(120)
def test_heartbeat_fails_a_frozen_peer_across_hosts(hosts):
    """Two emulated hosts: the heartbeat (GPUCX_PEER_TIMEOUT=2) fails the
    endpoint of a peer that stopped (SIGSTOP) while this side's 8 MiB send
    to it is stuck on the TCP socket (TCP_USER_TIMEOUT chosen long, so
    that the kernel does not reset the connection first, as it would at
    0.6 T by default): the endpoint's sockets are shut down before its
    force close, and this side outlives the resumed peer closing its
    endpoint (the exit status is checked)."""
    a, b = hosts
    env = {"GPUCX_PEER_TIMEOUT": "2", "UCX_TCP_USER_TIMEOUT": "60s"}
    victim = b.python(PEERS, "victim", "hb", label="hb victim", env=env)
    sender = a.python(PEERS, "releaser", "hb", label="hb sender", env=env)
    try:
        va, sa = victim.get(), sender.get()
        victim.put(sa)
        sender.put(va)
        assert victim.get() == "ready"
        end = time.monotonic() + 10
        while not _stopped(victim.proc.pid):
            assert time.monotonic() < end, "the victim did not stop"
            time.sleep(0.002)
        sender.put("go")
        seen = sender.get(timeout=30)
        assert seen["answered"], seen
        assert seen["error"] == "PeerError", seen
        assert "did not answer for 2 s" in seen["message"], seen
        assert seen["closed"] and seen["lanes_shut"], seen
        os.kill(victim.proc.pid, signal.SIGCONT)
        assert victim.get() == "resumed"
        victim.put("bye")
        assert victim.get() == "closed"
        sender.put("closed")
        assert sender.get() == "alive"
        victim.put("exit")
        sender.put("exit")
        victim.join(15)
        sender.join(15)
    finally:
        for p in (victim, sender):
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.proc.kill()
                p.proc.wait(5)
