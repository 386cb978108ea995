"""The heartbeat (gpucx/_heartbeat.py): a peer that stops progressing
(SIGSTOP) while this side only waits for it fails the waiting operations
with PeerError within about GPUCX_PEER_TIMEOUT; one that progresses, one
that never answered, and the option 0 do not.  Two processes on this host
(shared memory); tests/test_hosts.py has the case across hosts."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)

T = 1.0
BIG = 8 << 20


def _peer(q_in, q_out, mode: str) -> None:
    """The other side: connects back to the test's worker (so that it has an
    endpoint, and answers pings), says its pid and address, then does what
    the test says: "progress" (until told to stop; sends tag 1 then, and
    waits for a receive from the test with its endpoint: the operation an
    abort notice must fail), "late-recv" (progresses, receives the big
    message only after 3 T), "thread" and "handler-wait" (_quiet_peer)."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker(thread_mode="multi" if mode == "thread" else "single")
        addr = q_in.get()
        ep = None if mode == "no-endpoint" else w.connect(addr)
        region = ctx.allocate(BIG)  # what the test gets
        q_out.put((os.getpid(), w.address, region.remote().to_bytes()))
        if mode in ("thread", "handler-wait"):
            _quiet_peer(w, ep, mode, q_in, q_out)
            return
        if mode == "late-recv":
            end = time.monotonic() + 3 * T
            while time.monotonic() < end:
                w.progress()
                time.sleep(0.001)
            buf = np.empty(BIG, np.uint8)
            w.recv(buf, tag=1, timeout=10)
            q_out.put("received")
            q_in.get()
            return
        # Progress (answering pings) until the test has its answer, with a
        # rendezvous send to the test pending (never received).
        mine = ep.send_nb(np.ones(BIG, np.uint8), tag=8) if ep is not None else None
        while q_in.empty():
            w.progress()
            time.sleep(0.001)
        q_in.get()
        if mine is None:
            return
        # Thawed: the send pending towards the test must fail at once (the
        # abort notice, or UCX seeing the connection closed), not at its
        # deadline.
        t = time.monotonic()
        try:
            mine.wait(10)
            q_out.put(["ok", time.monotonic() - t, ""])
        except gpucx.UCXError as exc:
            q_out.put([type(exc).__name__, time.monotonic() - t, str(exc)])
        q_in.get()


def _quiet_peer(w, ep, mode: str, q_in, q_out) -> None:
    """A peer whose Python dispatches nothing for 3 T while the test waits
    on it, though its worker progresses.  It progresses (and dispatches)
    until the test says "quiet"; then, in mode "thread", it leaves its
    worker to a ProgressThread alone (the main thread sleeps 3 T); in mode
    "handler-wait", the handler of the test's message (id 5) waits 3 T in a
    blocking receive (the worker progresses in that wait, but no other
    handler can run meanwhile).  Then it receives the test's big message
    (tag 1) and says "received" (or, the test having failed its endpoint,
    the error that ended the receive)."""
    thread = gpucx.aio.ProgressThread(w) if mode == "thread" else None
    ran = []

    def busy(msg) -> None:
        try:
            w.recv_nb(np.empty(8, np.uint8), tag=7).wait(3 * T)
        except gpucx.TimeoutError:
            ran.append(True)

    w.set_am_handler(5, busy)
    while q_in.empty():
        w.progress()
        time.sleep(0.001)
    if q_in.get() is None:  # the fixture's teardown
        return
    if thread is not None:
        time.sleep(3 * T)  # no Python progress: the thread's alone
    else:
        end = time.monotonic() + 10
        while not ran and time.monotonic() < end:
            w.progress()
            time.sleep(0.001)
    buf = np.empty(BIG, np.uint8)
    try:
        w.recv_nb(buf, tag=1).wait(10, ep=ep)
        q_out.put("received" if buf.all() else "wrong data")
    except gpucx.UCXError as exc:
        q_out.put(type(exc).__name__)
    q_in.get()
    if thread is not None:
        thread.stop()


@pytest.fixture
def pair(monkeypatch):
    """(worker, endpoint to the peer, peer process, queues) with
    GPUCX_PEER_TIMEOUT=T; the peer is thawed and joined at the end."""
    made = []

    def make(mode="progress", timeout=T, tls=None):
        monkeypatch.setenv("GPUCX_PEER_TIMEOUT", str(timeout))
        if tls is not None:
            monkeypatch.setenv("UCX_TLS", tls)
        spawn = mp.get_context("spawn")
        q_in, q_out = spawn.Queue(), spawn.Queue()
        proc = spawn.Process(target=_peer, args=(q_in, q_out, mode))
        proc.start()
        ctx = gpucx.Context()
        w = ctx.create_worker()
        made.append((ctx, w, proc, q_in))
        q_in.put(w.address)
        pid, address, remote = q_out.get(timeout=30)
        ep = w.connect(address)
        ep.remote = remote  # for "get"
        return w, ep, proc, q_in, q_out

    yield make
    for ctx, w, proc, q_in in made:
        os.kill(proc.pid, signal.SIGCONT)
        q_in.put(None)
        q_in.put(None)
        # Progress while the peer ends: its context's close flushes its
        # endpoint to this worker, which needs this side's progress, and
        # its rendezvous send (tag 8) waits for a receive.
        if not w.closed:
            w.recv_nb(np.empty(BIG, np.uint8), tag=8)
        end = time.monotonic() + 10
        while proc.is_alive() and time.monotonic() < end:
            w.progress()
            proc.join(0.005)
        if proc.is_alive():
            proc.kill()
        ctx.close()


def _serves_another_peer(w) -> None:
    """A round trip with a fresh worker of this process."""
    ctx = w._context
    with ctx.create_worker() as other:
        there, back = w.connect(other.address), other.connect(w.address)
        out, into = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        reqs = [other.recv_nb(into, tag=3), there.send_nb(out, tag=3)]
        end = time.monotonic() + 10
        while not all(r.done() for r in reqs) and time.monotonic() < end:
            w.progress()
            other.progress()
        for r in reqs:
            r.result()
        assert (into == out).all()
        there.close(force=True)
        back.close(force=True)


def _answered_once(w, ep) -> None:
    """Wait briefly on the peer, so that it answers a ping (a peer that
    never answered is never failed)."""
    with pytest.raises(gpucx.TimeoutError):
        w.recv_nb(np.empty(8, np.uint8), tag=99).wait(0.6, ep=ep)
    assert w._engine.beats[ep].answered


def _freeze_later(pid: int, after: float) -> threading.Timer:
    t = threading.Timer(after, os.kill, (pid, signal.SIGSTOP))
    t.start()
    return t


def _post(kind: str, w, ep):
    """A blocking wait on the peer: a rendezvous send it must fetch, a get
    of its memory, a receive of its message (with its endpoint)."""
    if kind == "send":
        return lambda: ep.send(np.ones(BIG, np.uint8), tag=1, timeout=10)
    if kind == "get":
        key = ep.unpack(ep.remote)
        return lambda: ep.get(np.empty(BIG, np.uint8), key, timeout=10)
    if kind == "recv":
        return lambda: w.recv_nb(np.empty(16, np.uint8), tag=1).wait(10, ep=ep)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["send", "get", "recv"])
def test_frozen_local_peer_fails_what_waits_on_it(pair, kind):
    """The peer is stopped (SIGSTOP) while this side waits on it: PeerError
    naming the silence within about T; once thawed, the peer's own pending
    operation with this side fails at once (the abort notice)."""
    # Over shared memory a get is a CMA read that needs no peer: over TCP
    # UCX asks the peer's progress for the data.
    w, ep, proc, q_in, q_out = pair(tls="tcp" if kind == "get" else None)
    op = _post(kind, w, ep)
    _answered_once(w, ep)
    os.kill(proc.pid, signal.SIGSTOP)
    t = time.monotonic()
    with pytest.raises(gpucx.PeerError, match="did not answer for 1 s"):
        op()
    took = time.monotonic() - t
    # Counted from the peer's last answer (during the short wait, up to
    # PING_AFTER * T before this one), looked at every T/10.
    assert 0.6 * T <= took < T + 1.0, took
    # The endpoint stays failed; the worker serves another peer.
    with pytest.raises(gpucx.PeerError):
        ep.send(np.ones(8, np.uint8), tag=2)
    _serves_another_peer(w)
    os.kill(proc.pid, signal.SIGCONT)
    q_in.put("done")
    name, seconds, why = q_out.get(timeout=20)
    assert name == "PeerError" and seconds < 2.0, (name, seconds, why)


def test_frozen_peer_fails_a_pending_request_in_a_progress_loop(pair):
    """A request (not a blocking wait) on the frozen peer, a rendezvous send
    progressed by the user's own progress() loop, fails the same way."""
    w, ep, proc, q_in, q_out = pair()
    req = ep.send_nb(np.ones(BIG, np.uint8), tag=1)
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # the first ping goes after 0.2 T
        w.progress()
    assert w._engine.beats[ep].answered
    os.kill(proc.pid, signal.SIGSTOP)
    t = time.monotonic()
    while not req.done() and time.monotonic() < t + 5 * T:
        w.progress()
        time.sleep(0.0005)
    assert req.done()
    with pytest.raises(gpucx.PeerError, match="did not answer"):
        req.result()
    assert time.monotonic() - t < T + 1.0


def test_a_progressing_peer_is_not_failed(pair):
    """A peer that keeps progressing but receives only after 3 T: the send
    waits that long and completes; no PeerError."""
    w, ep, proc, q_in, q_out = pair("late-recv")
    t = time.monotonic()
    ep.send(np.ones(BIG, np.uint8), tag=1, timeout=20)
    assert time.monotonic() - t > 2 * T
    assert q_out.get(timeout=10) == "received"
    assert ep.error is None


def test_a_peer_that_never_answered_is_not_failed(pair):
    """A peer without an endpoint of its own has no handler for the ping
    (the case of a peer that is not gpucx, or has no "am" feature): it is
    never failed for silence; the wait ends at its own deadline."""
    w, ep, proc, q_in, q_out = pair("no-endpoint")
    _freeze_later(proc.pid, 0.3)
    with pytest.raises(gpucx.TimeoutError):
        ep.send(np.ones(BIG, np.uint8), tag=1, timeout=2.5 * T)
    assert ep.error is None


def test_option_zero_turns_the_heartbeat_off(pair):
    """GPUCX_PEER_TIMEOUT=0: no heartbeat; the frozen peer's wait ends at
    its deadline."""
    w, ep, proc, q_in, q_out = pair(timeout=0)
    assert ep not in w._engine.beats
    _freeze_later(proc.pid, 0.3)
    with pytest.raises(gpucx.TimeoutError):
        w.recv_nb(np.empty(16, np.uint8), tag=1).wait(2.5 * T, ep=ep)


def test_raw_endpoints_are_never_pinged():
    """An endpoint made with raw=True (a peer that may not be gpucx) is not
    heard; a gpucx worker address and a (host, port) connection are."""
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        raw = a.connect(bytes(b.ucx_address), raw=True)
        framed = a.connect(b.address)
        assert raw not in a._engine.beats
        assert framed in a._engine.beats
        raw.close()
        framed.close()
        assert not a._engine.beats


def test_info_says_what_the_heartbeat_does():
    """`gpucx info` (text and --json) says the heartbeat's period and
    deadline at GPUCX_PEER_TIMEOUT, and "off" at 0."""
    from gpucx import info

    assert info._heartbeat(0) == "off"
    assert "every 2 s" in info._heartbeat(10) and "after 10 s" in info._heartbeat(10)


def test_a_side_that_was_away_does_not_blame_its_peer(monkeypatch):
    """This side stops looking for longer than T (stopped, or computing)
    while a healthy peer's operation waits: the silence it did not watch is
    not the peer's; its first look afterwards starts the clock again."""
    monkeypatch.setenv("GPUCX_PEER_TIMEOUT", str(T))
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab, _ba = a.connect(b.address), b.connect(a.address)
        req = ab.send_nb(np.ones(BIG, np.uint8), tag=1)
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # b answers a ping (after 0.2 T)
            a.progress()
            b.progress()
        assert not req.done() and a._engine.beats[ab].answered
        time.sleep(2 * T)  # away: nobody progresses
        for _ in range(4 * 256):  # a looks (every 256 progress calls)
            a.progress()
        assert not req.done() and ab.error is None
        into = np.empty(BIG, np.uint8)
        r = b.recv_nb(into, tag=1)
        while not (req.done() and r.done()):
            a.progress()
            b.progress()
        req.result()
        assert into.all()


def test_frozen_peer_fails_an_awaited_request(pair):
    """An ``await`` in gpucx.aio (no blocking wait, no progress loop of the
    user's) on the frozen peer fails the same way: the event-loop driver
    looks at the heartbeat on a timer (``Engine.beat``)."""
    import asyncio

    w, ep, proc, q_in, q_out = pair()
    _answered_once(w, ep)

    async def main():
        req = ep.send_nb(np.ones(BIG, np.uint8), tag=1)
        os.kill(proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(gpucx.PeerError, match="did not answer"):
            await asyncio.wait_for(gpucx.aio.wait_request(req), 5 * T)
        return time.monotonic() - t

    took = asyncio.run(main())
    assert took < T + 1.0, took


@pytest.mark.parametrize(
    "mode, tls", [("thread", None), ("handler-wait", None), ("thread", "tcp")]
)
def test_a_peer_progressed_without_python_dispatch_answers(pair, mode, tls):
    """A peer whose worker progresses while its Python dispatches no active
    message for 3 T (a ProgressThread alone; a handler blocked in a long
    wait) answers the pings from C: the send waits on it for longer than T
    and completes, no PeerError.  Over shared memory, and over TCP (the
    pong sent from inside the TCP transport's progress)."""
    w, ep, proc, q_in, q_out = pair(mode, tls=tls)
    _answered_once(w, ep)
    q_in.put("quiet")
    if mode == "handler-wait":
        ep.am_send(5, b"")
    t = time.monotonic()
    ep.send(np.ones(BIG, np.uint8), tag=1, timeout=20)
    assert time.monotonic() - t > 2 * T
    assert q_out.get(timeout=10) == "received"
    assert ep.error is None


def test_a_frozen_peer_with_a_progress_thread_still_fails(pair):
    """The same ProgressThread peer stopped with SIGSTOP: nothing progresses
    its worker, nothing answers; PeerError within about T."""
    w, ep, proc, q_in, q_out = pair("thread")
    _answered_once(w, ep)
    q_in.put("quiet")
    os.kill(proc.pid, signal.SIGSTOP)
    t = time.monotonic()
    with pytest.raises(gpucx.PeerError, match="did not answer for 1 s"):
        ep.send(np.ones(BIG, np.uint8), tag=1, timeout=10)
    assert time.monotonic() - t < T + 1.0
    os.kill(proc.pid, signal.SIGCONT)  # thawed: told by the abort notice
    assert q_out.get(timeout=20) == "PeerError"


def test_pings_are_answered_in_c_and_malformed_ones_dropped(monkeypatch):
    """Two workers of this process, b never dispatching: a ping with an
    8-byte token and a reply endpoint gets a pong carrying that token,
    answered inside b's progress (its handler queue stays empty); a token
    of another length, or a ping without a reply endpoint, gets none."""
    from gpucx import _heartbeat as hb
    from gpucx._lib import lib
    from gpucx.ops import am as _am

    monkeypatch.setenv("GPUCX_PEER_TIMEOUT", "0")  # no pings of gpucx's own
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab, _ba = a.connect(b.address), b.connect(a.address)  # b answers
        pongs = []
        _am.set_internal_handler(
            a._engine, hb.PONG_AM_ID, lambda m: pongs.append(m.header)
        )

        def ping(header: bytes, reply: bool = True):
            req = _am.send_internal_nb(
                ab, hb.PING_AM_ID, b"", header=header, reply=reply
            )
            end = time.monotonic() + 0.3
            while time.monotonic() < end and not pongs:
                a.progress()
                lib.gpucx_progress(b._engine.state)  # UCX only: no dispatch
            req.wait(1)

        ping(b"\x01\x02\x03")
        ping(b"9" * 16)
        ping(b"no-reply", reply=False)
        assert pongs == []
        ping(b"token-42")
        assert pongs == [b"token-42"]
        assert b._engine.am.state.tail == 0  # nothing queued for b's Python
