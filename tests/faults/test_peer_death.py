"""A peer SIGKILLed in the middle of each kind of operation.

Every pending operation on the survivor ends with PeerError (or
gpucx.TimeoutError where it has a deadline and UCX cannot tie it to the
peer) within 10 s, the survivor then serves a new process normally, and no
request is left tracked or parked.  Each case runs over shared memory and
TCP, a few rounds in the default suite and 20 rounds under ``-m faults``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

import gpucx

from .peers import AM_ID, BIG, KEEP_ID, handshake, kill, serve_new_peer, started
from conftest import transport_config

#: Longest a pending operation may take to fail once its peer is dead.
BOUND_S = 10.0
#: Rounds per case in the default suite and under ``-m faults``.
ROUNDS = 2
ROUNDS_MARKED = 20


def _kill_soon(proc, delay: float = 0.2) -> threading.Timer:
    """Kill the peer while the survivor sits in a blocking call."""
    t = threading.Timer(delay, kill, (proc,))
    t.start()
    return t


def _settle(req, timeout: float = BOUND_S):
    """Wait for ``req``: its result, or the PeerError it failed with."""
    try:
        return req.wait(timeout)
    except gpucx.PeerError as exc:
        return exc


def _wait_ep_failed(w, ep) -> None:
    end = time.monotonic() + BOUND_S
    while ep.error is None:
        assert time.monotonic() < end, "the dead peer's endpoint never failed"
        w.progress()
        time.sleep(0.001)
    assert isinstance(ep.error, gpucx.PeerError)


def _ends_at_deadline(w, ep, proc, req) -> None:
    """Kill the peer under a worker-wide receive: it ends at its deadline
    (nothing ties it to the peer), and the endpoint fails."""
    kill(proc)
    t0 = time.monotonic()
    with pytest.raises(gpucx.TimeoutError):
        req.wait(1.0)
    assert time.monotonic() - t0 < 1.5
    _wait_ep_failed(w, ep)


def case_tag_send(w, ep, remote, proc, msgs, chan):
    req = ep.send_nb(np.ones(BIG, np.uint8), tag=5)  # rendezvous, never received
    kill(proc)
    with pytest.raises(gpucx.PeerError):
        req.wait(BOUND_S)


def case_tag_recv(w, ep, remote, proc, msgs, chan):
    # Tag receives are worker-wide: UCX cannot tie a posted receive to the
    # dead peer, so it ends at its deadline.
    _ends_at_deadline(w, ep, proc, w.recv_nb(bytearray(64), tag=5))


def case_tag_recv_matched(w, ep, remote, proc, msgs, chan):
    # The peer's rendezvous send has arrived (its header is queued here) and
    # the peer stopped progressing; the receive matches it, then the peer
    # dies before the data moved.
    end = time.monotonic() + BOUND_S
    while w.probe(tag=5) is None:
        assert time.monotonic() < end, "the peer's message never came"
    chan.put("stop")
    assert chan.get(BOUND_S) == "idle"
    buf = np.zeros(BIG, np.uint8)
    req = w.recv_nb(buf, tag=5)
    kill(proc)
    with pytest.raises(gpucx.PeerError):
        req.wait(BOUND_S)


def case_am_send(w, ep, remote, proc, msgs, chan):
    req = ep.am_send_nb(AM_ID, np.ones(BIG, np.uint8), proto="rndv")
    kill(proc)
    with pytest.raises(gpucx.PeerError):
        req.wait(BOUND_S)


def case_am_receive_into(w, ep, remote, proc, msgs, chan):
    end = time.monotonic() + BOUND_S
    while not msgs:  # the peer's rendezvous AM: header here, data there
        assert time.monotonic() < end, "the peer's active message never came"
        w.progress()
    msg = msgs.pop()
    assert msg.is_rndv
    # The receive is tied to the sender through the message's reply
    # endpoint (here the survivor's own endpoint to the peer).
    assert msg.reply_ep is ep
    chan.put("got it")
    kill(proc)
    req = msg.receive_into(np.empty(BIG, np.uint8))
    with pytest.raises((gpucx.PeerError, gpucx.TimeoutError)):
        req.wait(3.0)


def case_am_recv_posted(w, ep, remote, proc, msgs, chan):
    # Posted AM receives are worker-wide like tag receives: the peer's death
    # does not fail them; the deadline withdraws the receive.
    _ends_at_deadline(w, ep, proc, w.am_recv_nb(AM_ID, bytearray(64)))


def case_am_recv_kept(w, ep, remote, proc, msgs, chan):
    # The peer's rendezvous AM waits as a kept message (KEEP_ID has posted
    # receives and no handler); the peer dies before it is received: the
    # receive that takes it fails, it does not hang.
    from gpucx._lib import lib

    reg = w._engine.am.regs[KEEP_ID]
    end = time.monotonic() + BOUND_S
    while lib.gpucx_am_kept(reg) == 0:
        assert time.monotonic() < end, "the peer's active message never came"
        w.progress()
    chan.put("got it")
    kill(proc)
    # (PeerError over TCP; over shared memory UCX cancels the fetch.)
    with pytest.raises((gpucx.PeerError, gpucx.CanceledError)):
        w.am_recv(KEEP_ID, np.empty(BIG, np.uint8), timeout=3.0)


def case_am_recv_group(w, ep, remote, proc, msgs, chan):
    # The same for receives posted together: the group ends at the deadline.
    bufs = [bytearray(64) for _ in range(4)]
    _ends_at_deadline(w, ep, proc, w.am_recv_many_nb(AM_ID, bufs))


def case_stream_recv(w, ep, remote, proc, msgs, chan):
    req = ep.stream_recv_nb(bytearray(64))
    kill(proc)
    with pytest.raises(gpucx.PeerError):
        req.wait(BOUND_S)


def _rma_then_flush(w, ep, post, proc):
    """An RMA operation may finish before the peer's death is noticed
    (shared memory writes straight into the peer's segment); the endpoint
    must still be reported failed, and a flush then fails."""
    req = post()
    kill(proc)
    out = _settle(req)
    assert out is None or isinstance(out, (int, gpucx.PeerError))
    _wait_ep_failed(w, ep)
    with pytest.raises(gpucx.PeerError):
        ep.flush(timeout=BOUND_S)


def case_put(w, ep, remote, proc, msgs, chan):
    rmem = ep.unpack(remote)
    src = np.ones(BIG, np.uint8)
    _rma_then_flush(w, ep, lambda: ep.put_nb(src, rmem), proc)


def case_get(w, ep, remote, proc, msgs, chan):
    rmem = ep.unpack(remote)
    dst = np.empty(BIG, np.uint8)
    _rma_then_flush(w, ep, lambda: ep.get_nb(dst, rmem), proc)


def case_put_transfer(w, ep, remote, proc, msgs, chan):
    rmem = ep.unpack(remote)
    src = np.ones(BIG // 4, np.uint8)
    xfer = ep.prepare_put([(src, rmem, i * (BIG // 4)) for i in range(4)])
    _rma_then_flush(w, ep, xfer.run_nb, proc)


def case_atomic(w, ep, remote, proc, msgs, chan):
    # UCX's own atomics, on an endpoint without peer error handling: only
    # gpucx's liveness check can notice the death (see the guide).  gpucx's
    # emulated atomics on default endpoints: tests/test_atomic_emulated.py.
    rmem = ep.unpack(remote)
    req = ep.fetch_add_nb(rmem, 1)
    kill(proc)
    out = _settle(req)
    assert isinstance(out, (int, gpucx.PeerError))
    _wait_ep_failed(w, ep)
    with pytest.raises(gpucx.PeerError):
        ep.flush(timeout=BOUND_S)


def case_flush(w, ep, remote, proc, msgs, chan):
    req = ep.send_nb(np.ones(BIG, np.uint8), tag=5)  # keeps the flush waiting
    _kill_soon(proc)
    with pytest.raises(gpucx.PeerError):
        ep.flush(timeout=BOUND_S)
    with pytest.raises(gpucx.PeerError):
        req.wait(BOUND_S)


def case_recv_array(w, ep, remote, proc, msgs, chan):
    _kill_soon(proc)
    with pytest.raises(gpucx.PeerError):
        ep.recv_array(timeout=BOUND_S)


def case_aio(w, ep, remote, proc, msgs, chan):
    async def main():
        req = ep.send_nb(np.ones(BIG, np.uint8), tag=5)
        asyncio.get_running_loop().call_later(0.1, kill, proc)
        with pytest.raises(gpucx.PeerError):
            await asyncio.wait_for(req, BOUND_S)

    asyncio.run(main())


CASES = {name[5:]: f for name, f in dict(globals()).items() if name.startswith("case_")}


def run_case(op: str, tls: str, rounds: int, thread_mode: str = "single") -> None:
    case = CASES[op]
    role = {
        "am_receive_into": "am_rndv",
        "am_recv_kept": "am_keep",
        "atomic": "amo",
        "tag_recv_matched": "tag_rndv",
    }.get(op, "idle")
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker(thread_mode)
        msgs: list = []
        w.set_am_handler(AM_ID, msgs.append)
        w.am_recv_nb(KEEP_ID, bytearray(1)).cancel()  # registers the id
        for _ in range(rounds):
            with started(role, tls) as (proc, chan):
                ep, remote = handshake(w, chan, error_handling=op != "atomic")
                t0 = time.monotonic()
                case(w, ep, remote, proc, msgs, chan)
                assert time.monotonic() - t0 < BOUND_S + 1
                # Later operations on the endpoint fail at once, not by a hang.
                _wait_ep_failed(w, ep)
                with pytest.raises(gpucx.PeerError):
                    ep.send(np.ones(BIG, np.uint8), tag=6)
                ep.close()
        # A third process: served as if nothing happened.
        serve_new_peer(w, tls)
        w.progress()
        assert not w._engine.pending, f"requests left tracked: {w._engine.pending}"
        if (op, tls) != ("am_receive_into", "shm") and thread_mode != "multi":
            assert not w._engine.parked, f"operations left parked: {w._engine.parked}"
        # else: UCX keeps a rendezvous AM receive from a dead shared-memory
        # peer until the worker is destroyed; gpucx parks it with its buffer
        # (in "multi" mode, every operation UCX held on the dead endpoint).
        assert not w._engine.watched
        w.close()
        assert not w._engine.pending and not w._engine.parked


#: (operation, transport) pairs.  Not atomics over TCP: UCX offers them
#: only without peer error handling, where it aborts the survivor's process
#: when the peer dies with a software atomic outstanding ("'abort' is not
#: implemented for protocol amo/fetch/sw", UCX 1.22); see the guide.
PAIRS = [(op, tls) for op in sorted(CASES) for tls in ("shm", "tcp")]
PAIRS.remove(("atomic", "tcp"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("op", "tls"), PAIRS)
def test_peer_killed_mid_operation(op, tls):
    run_case(op, tls, ROUNDS)


@pytest.mark.faults
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("op", "tls"), PAIRS)
def test_peer_killed_mid_operation_repeated(op, tls):
    run_case(op, tls, ROUNDS_MARKED)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_listener_endpoint_reports_death(tls):
    """An endpoint accepted by a Listener has no peer identity for gpucx to
    check, but UCX's TCP connection-manager lane reports the death even
    when the data moves over shared memory."""
    with gpucx.Context(config=transport_config(tls, listener=True)) as ctx:
        w = ctx.create_worker()
        with w.listen(host="127.0.0.1") as lst:
            for _ in range(ROUNDS):
                with started("idle", tls, via_listener=True) as (proc, chan):
                    ep, _ = handshake(w, chan, listener=lst)
                    assert not w._engine.watched
                    req = ep.send_nb(np.ones(BIG, np.uint8), tag=5)
                    kill(proc)
                    t0 = time.monotonic()
                    with pytest.raises(gpucx.PeerError):
                        req.wait(BOUND_S)
                    assert time.monotonic() - t0 < BOUND_S
                    ep.close()
        serve_new_peer(w, tls)
        assert not w._engine.pending and not w._engine.parked


#: In "multi" thread mode gpucx does not force-close a dead peer's endpoint
#: (another thread may be posting on it): it fails the endpoint and its
#: requests itself, and UCX's endpoint lives until the worker closes.
MULTI = ["tag_send", "flush", "stream_recv", "put", "aio", "recv_array"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", MULTI)
def test_peer_killed_multi_thread_worker(op):
    run_case(op, "shm", ROUNDS, thread_mode="multi")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_pooled_fetch_from_a_killed_peer(tls):
    """A handler's receive pool (``set_am_handler(..., into=)``): the
    peer's rendezvous message waits for the pool's only buffer, the peer
    dies, then the buffer is given back.  The fetch that starts then fails
    promptly and reaches the handler as a message whose data raises; the
    buffer serves the next peer."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w, local = ctx.create_worker(), ctx.create_worker()
        msgs: list = []
        w.set_am_handler(AM_ID, msgs.append, into=[np.zeros(BIG, np.uint8)])
        # A message from a worker of this process takes the only buffer.
        sent = local.connect(w.address).am_send_nb(
            AM_ID, np.ones(BIG, np.uint8), proto="rndv"
        )
        end = time.monotonic() + BOUND_S
        while not msgs or not sent.done():
            w.progress()
            local.progress()
            assert time.monotonic() < end, "the local message never came"
        blocker = msgs.pop()
        with started("am_rndv", tls) as (proc, chan):
            ep, _ = handshake(w, chan)
            end = time.monotonic() + BOUND_S
            while w.stats()["am_queue"].count == 0:  # it waits for the buffer
                w.progress()
                assert time.monotonic() < end, "the peer's message never came"
            chan.put("got it")
            kill(proc)
            time.sleep(0.2)
            del blocker  # the waiting fetch starts, from a dead peer
            end = time.monotonic() + BOUND_S
            while not msgs:
                w.progress()
                assert time.monotonic() < end, "the failed fetch never came"
            with pytest.raises((gpucx.PeerError, gpucx.CanceledError)):
                _ = msgs.pop().data
            ep.close()
        # The message is gone once the exception's traceback is: the buffer
        # is free again, and the next peer's message lands in it.
        gc.collect()
        sent = local.connect(w.address).am_send_nb(
            AM_ID, np.full(BIG, 5, np.uint8), proto="rndv"
        )
        end = time.monotonic() + BOUND_S
        while not msgs:
            w.progress()
            local.progress()
            assert time.monotonic() < end, "the pool did not recover"
        assert msgs[0].data[-1] == 5
        msgs.clear()
        sent.wait(BOUND_S)
