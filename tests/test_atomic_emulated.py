"""Atomics on default endpoints (peer error handling): gpucx runs them over
its own active messages and the target applies them in C.  The target's
checks, two processes racing on a third, cancel and peer death."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx._lib import ffi, lib
from gpucx.ops import atomic as atomic_ops

from conftest import TRANSPORTS, channel_pair, join_ok, spawn
from peers_rma import adder_default, idle_owner
from test_rma import background

pytestmark = pytest.mark.timeout(60)

DT = {4: np.uint32, 8: np.uint64}


@pytest.fixture
def pair(ctx):
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    assert atomic_ops.emulated(ab)
    return ctx, a, b, ab


def _raw(ep, key, raddr, base, size, *, op=None, nbytes=8, value=1):
    """Post an emulated fetch_add with fields a hostile (or buggy) initiator
    chooses, past every check gpucx makes on the initiator's side."""
    amo = ffi.new("gpucx_amo_t *")
    lib.gpucx_atomic(
        ep._engine.state,
        ep._h,
        1,
        lib.GPUCX_AMO_ADD if op is None else op,
        1,
        value,
        0,
        nbytes,
        raddr,
        key._h,
        base,
        size,
        amo,
    )
    return atomic_ops._AmoRequest(
        True,
        ep._engine,
        ffi.addressof(amo, "slot"),
        amo,
        "fetch_add",
        None,
        ep,
        None,
        key,
    )


def _drive(b, req, timeout=10.0):
    end = time.monotonic() + timeout
    while not req.done() and time.monotonic() < end:
        b.progress()
    return req


@pytest.mark.parametrize("nbytes", [4, 8])
def test_every_op_on_default_endpoints(pair, tls, nbytes):
    ctx, a, b, ab = pair
    mask = (1 << (8 * nbytes)) - 1
    mem = np.array([7, 10, 0b1100, 0b1010, 5, 100, 0b0110, 0b0001, 6], DT[nbytes])
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    o = nbytes
    with background(b):
        assert ab.fetch_add(key, 5, o, nbytes=nbytes) == 10
        assert ab.fetch_and(key, 0b0110, 2 * o, nbytes=nbytes) == 0b1100
        assert ab.fetch_or(key, 0b0101, 3 * o, nbytes=nbytes) == 0b1010
        assert ab.fetch_xor(key, 1, 4 * o, nbytes=nbytes) == 5
        assert ab.swap(key, mask, 0, nbytes=nbytes) == 7
        assert ab.compare_swap(key, 1, 2, 0, nbytes=nbytes) == mask  # no swap
        assert ab.compare_swap(key, mask, 3, 0, nbytes=nbytes) == mask
        ab.atomic_add(key, -1, 5 * o, nbytes=nbytes)
        ab.atomic_and(key, 0b0100, 6 * o, nbytes=nbytes)
        ab.atomic_or(key, 0b0010, 7 * o, nbytes=nbytes)
        ab.atomic_xor(key, 0b0011, 8 * o, nbytes=nbytes)
        reqs = [
            ab.fetch_add_nb(key, -1, 1 * o, nbytes=nbytes),
            ab.swap_nb(key, 9, 0, nbytes=nbytes),
            ab.compare_swap_nb(key, 9, 4, 0, nbytes=nbytes),
            ab.fetch_or_nb(key, 0, 2 * o, nbytes=nbytes),
            ab.atomic_xor_nb(key, 1, 4 * o, nbytes=nbytes),
        ]
        got = [r.wait(10) for r in reqs]
    assert got == [15, 3, 9, 0b0100, None]
    assert list(mem) == [4, 14, 0b0100, 0b1111, 5, 99, 0b0100, 0b0011, 0b0101]
    region.close()


def test_values_wrap_within_the_word(pair):
    ctx, a, b, ab = pair
    mem = np.zeros(2, np.uint32)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    with background(b):
        assert ab.fetch_add(key, -1, 0, nbytes=4) == 0
        assert ab.fetch_add(key, 2, 0, nbytes=4) == 0xFFFFFFFF
    assert list(mem) == [1, 0]
    region.close()


# -- what the target refuses (checked in C, at the target) -------------------


def test_target_refuses_what_it_did_not_export(pair):
    ctx, a, b, ab = pair
    mem = np.zeros(4, np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    base, size = region.address, region.nbytes
    cases = [
        # a region the token does not match (a forged, larger size)
        ((base + 8, base, size + 8), gpucx.UCXError, "no exported writable"),
        # one past the end, and straddling it
        ((base + size, base, size), gpucx.UCXError, "outside the target"),
        ((base - 8, base, size), gpucx.UCXError, "outside the target"),
        # unaligned
        ((base + 3, base, size), gpucx.UCXError, "alignment"),
    ]
    for args, exc, text in cases:
        req = _drive(b, _raw(ab, key, *args))
        with pytest.raises(exc, match=text):
            req.result()
    req = _drive(b, _raw(ab, key, base, base, size, op=99))  # no such operation
    with pytest.raises(gpucx.UCXError, match="operation"):
        req.result()
    req = _drive(b, _raw(ab, key, base, base, size, nbytes=2))
    with pytest.raises(gpucx.UCXError, match="size"):
        req.result()
    assert not mem.any()
    # The same request within bounds is applied.
    assert _drive(b, _raw(ab, key, base + 24, base, size)).result() is None
    assert list(mem) == [0, 0, 0, 1]
    region.close()


def test_target_refuses_read_only_unexported_and_closed_regions(pair):
    ctx, a, b, ab = pair
    ro_mem = np.zeros(2, np.uint64)
    ro = ctx.register(ro_mem, writable=False)
    hidden = np.zeros(2, np.uint64)
    unexported = ctx.register(hidden)  # registered, no token ever made
    mem = np.zeros(2, np.uint64)
    closed = ctx.register(mem)
    ckey = ab.unpack(closed.remote())
    rkey = ab.unpack(ro.remote())
    for r in (ro, unexported):
        req = _drive(b, _raw(ab, rkey, r.address, r.address, r.nbytes))
        with pytest.raises(gpucx.UCXError, match="no exported writable"):
            req.result()
    addr, n = closed.address, closed.nbytes
    closed.close()
    with pytest.raises(gpucx.UCXError, match="no exported writable"):
        _drive(b, _raw(ab, ckey, addr, addr, n)).result()
    assert not ro_mem.any() and not hidden.any() and not mem.any()
    ro.close()
    unexported.close()


def test_target_without_amo_feature_refuses():
    with gpucx.Context(features={"tag", "am", "rma"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)
        mem = np.zeros(1, np.uint64)
        region = ctx.register(mem)
        key = ab.unpack(region.remote())
        req = _drive(b, ab.fetch_add_nb(key, 1))
        with pytest.raises(gpucx.UnsupportedError, match='"amo" feature'):
            req.result()
        assert mem[0] == 0
        region.close()


def test_target_without_am_feature_never_answers_timeout_bounds_the_wait():
    """A target whose context lacks "am" has no handler for gpucx's atomics:
    UCX drops the request, nothing answers; timeout= bounds the wait."""
    with gpucx.Context() as c1, gpucx.Context(features={"tag", "rma", "amo"}) as c2:
        a, b = c1.create_worker(), c2.create_worker()
        ab = a.connect(b.address)
        mem = np.zeros(1, np.uint64)
        region = c2.register(mem)
        key = ab.unpack(region.remote())
        t0 = time.monotonic()
        for call in (ab.fetch_add, ab.atomic_add):
            with pytest.raises(gpucx.TimeoutError):
                call(key, 1, timeout=0.3)
        with pytest.raises(gpucx.TimeoutError):
            ab.compare_swap(key, 0, 1, timeout=0.3)
        assert time.monotonic() - t0 < 10
        for _ in range(20):
            b.progress()
        assert mem[0] == 0
        key.close()
        region.close()


def test_initiator_without_am_feature_says_so():
    with gpucx.Context(features={"tag", "rma", "amo"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)
        region = ctx.register(np.zeros(1, np.uint64))
        key = ab.unpack(region.remote())
        for call in (ab.fetch_add, ab.fetch_add_nb):
            with pytest.raises(gpucx.UnsupportedError, match='"am" feature'):
                call(key, 1)
        region.close()


# -- cancel and peer death ----------------------------------------------------


def test_blocking_atomic_canceled_by_close(pair):
    """A blocking atomic whose endpoint is closed while it waits raises
    CanceledError (the target never answers: its worker does not progress)."""
    ctx, a, b, ab = pair
    mem = np.zeros(1, np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    ba = b.connect(a.address)
    a.set_am_handler(7, lambda msg: ab.close(force=True))
    ba.am_send_nb(7, b"close it")  # dispatched while fetch_add waits
    for _ in range(20):
        b.progress()
    with pytest.raises(gpucx.CanceledError):
        ab.fetch_add(key, 1)
    assert mem[0] == 0
    region.close()


def test_nb_atomic_canceled_by_close(pair):
    ctx, a, b, ab = pair
    region = ctx.register(np.zeros(1, np.uint64))
    key = ab.unpack(region.remote())
    req = ab.fetch_add_nb(key, 1)
    req.done()
    ab.close(force=True)
    with pytest.raises(gpucx.CanceledError):
        req.wait(5)
    region.close()


def test_worker_close_flushes_a_pending_atomic(ctx):
    """Closing the worker flush-closes its endpoints: an emulated atomic
    still waiting for its reply completes (the peer, a sibling worker here,
    is progressed by the close)."""
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    mem = np.zeros(1, np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    req = ab.fetch_add_nb(key, 1)
    a.close()
    assert req.result() == 0
    assert mem[0] == 1
    region.close()


def test_timed_out_atomic_then_late_reply(pair):
    """A wait that times out cancels the wait for the reply; the target may
    still apply the operation (it was sent), and its late reply is ignored."""
    ctx, a, b, ab = pair
    mem = np.zeros(1, np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    req = ab.fetch_add_nb(key, 1)
    with pytest.raises(gpucx.TimeoutError):
        req.wait(0.2)
    for _ in range(50):  # the target applies it and replies; nobody waits
        b.progress()
        a.progress()
    assert mem[0] == 1
    with background(b):
        assert ab.fetch_add(key, 1) == 1
    assert mem[0] == 2
    region.close()


@pytest.mark.parametrize("tls", ["shm", "tcp"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nb"])
def test_peer_death_mid_atomic_raises_peer_error(tls, blocking):
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        w = ctx.create_worker()
        ours, theirs = channel_pair()
        child = spawn(idle_owner, tls, theirs)
        _, address, blob = ours.get(60)
        ep = w.connect(address)
        key = ep.unpack(blob)
        killer = threading.Timer(0.5, child.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(gpucx.PeerError):
            if blocking:
                ep.fetch_add(key, 1)
            else:
                ep.fetch_add_nb(key, 1).wait(30)
        assert time.monotonic() - t0 < 20
        killer.join()
        child.join(10)


# -- contention: two processes, one counter, default endpoints ---------------


@pytest.mark.timeout(40)
@pytest.mark.parametrize("tls", ["shm", "tcp"])
def test_two_processes_count_to_20000(tls):
    n_ops, nbytes = 10_000, 8
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        w = ctx.create_worker()
        mem = np.zeros(2, DT[nbytes])
        region = ctx.register(mem)
        chans, children = [], []
        for _ in range(2):
            ours, theirs = channel_pair()
            children.append(spawn(adder_default, tls, theirs, n_ops, nbytes))
            ours.put((w.address, region.remote().to_bytes()))
            chans.append(ours)
        results = []
        try:
            # The owner progresses: emulated atomics are applied by its
            # worker, in C, when it progresses.
            pending = list(chans)
            end = time.monotonic() + 35
            while pending and time.monotonic() < end:
                for _ in range(64):  # progress; sleep on the event fd when idle
                    lib.gpucx_worker_sleep(w._h, w._engine.efd, -1, 1)
                for c in list(pending):
                    if c._conn.poll(0):
                        kind, olds = c.get(5)
                        results.append(olds)
                        pending.remove(c)
            assert not pending, "the adders did not finish"
            assert mem[0] == 2 * n_ops
            assert sorted(results[0] + results[1]) == list(range(2 * n_ops))
            for c in chans:
                c.put("bye")
        finally:
            for p in children:
                join_ok(p, 30)
        region.close()
