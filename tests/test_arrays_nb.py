"""recv_array_nb: posted array receives (read-ahead), between workers of
one process and across real processes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import gpucx
from gpucx.ops.arrays import ArrayRequest

from conftest import Pair, pump, spin

pytestmark = pytest.mark.timeout(120)

#: Sizes across UCX's protocols: short, eager, rendezvous.
SIZES = [1, 100, 5000, 1 << 18]


def arrays(k: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        n = SIZES[i % len(SIZES)] // 8 or 1
        out.append(rng.standard_normal(n) if i % 2 else rng.integers(0, 9, (n, 1)))
    return out


def sends(pair, arrs) -> list:
    return [pair.ab.send_array_nb(a) for a in arrs]


def check_same(got, want) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)


def test_posted_before_the_arrays_come_in_order(pair):
    want = arrays(12)
    reqs = [pair.ba.recv_array_nb() for _ in want]
    assert all(isinstance(r, ArrayRequest) and not r.done() for r in reqs)
    results = pair.drive(*sends(pair, want), *reqs)[len(want) :]
    for got, a in zip(results, want, strict=True):
        check_same(got, a)


def test_posted_after_the_arrays_came(pair):
    want = arrays(4, 1)
    s = sends(pair, want)
    pump(pair, lambda: sum(map(len, pair.b._engine.am.arrays.values())) == 4)
    reqs = [pair.ba.recv_array_nb() for _ in want]
    for got, a in zip(pair.drive(*s, *reqs)[4:], want, strict=True):
        check_same(got, a)


def test_many_posted_each_wait_returns_its_array(pair):
    want = [np.full(1 << 15, i, np.int32) for i in range(64)]  # 128 KiB: rndv
    reqs = [pair.ba.recv_array_nb() for _ in want]
    s = sends(pair, want)
    pair.drive(*s)
    for i, r in enumerate(reqs):
        check_same(r.wait(10), want[i])
    assert not pair.b._engine.am.array_waiters
    assert not pair.b._engine.pending


def test_wait_blocks_until_a_sender_thread_sends(pair):
    import threading

    want = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
    req = pair.ba.recv_array_nb()
    t = threading.Thread(target=lambda: pair.ab.send_array(want, timeout=30))
    t.start()
    try:
        check_same(req.wait(30), want)
    finally:
        t.join(30)


def test_blocking_recv_array_takes_what_no_request_took(pair):
    want = arrays(3, 2)
    req = pair.ba.recv_array_nb()
    s = sends(pair, want)
    pair.drive(*s, req)
    check_same(req.result(), want[0])
    check_same(pair.ba.recv_array(timeout=5), want[1])
    check_same(pair.ba.recv_array(timeout=5), want[2])


def test_timeout_before_the_array_withdraws_and_loses_nothing(pair):
    first, second = pair.ba.recv_array_nb(), pair.ba.recv_array_nb()
    t0 = time.monotonic()
    with pytest.raises(gpucx.TimeoutError, match="no array arrived"):
        first.wait(0.2)
    assert time.monotonic() - t0 < 2
    assert first.done() and first.cancelled()
    with pytest.raises(gpucx.CanceledError):
        first.result()
    want = np.arange(10)
    pair.drive(pair.ab.send_array_nb(want), second)
    check_same(second.result(), want)  # the array went to the next request


def test_cancel_before_the_array_withdraws(pair):
    req = pair.ba.recv_array_nb()
    assert req.cancel() is True
    assert req.cancelled() and req.cancel() is False
    with pytest.raises(gpucx.CanceledError):
        req.wait(1)
    want = np.ones(3)
    pair.drive(pair.ab.send_array_nb(want))
    check_same(pair.ba.recv_array(timeout=5), want)  # not lost


def test_max_bytes_fails_one_request_the_next_gets_the_next_array(pair):
    big, small = np.zeros(1000, np.uint8), np.arange(5, dtype=np.uint8)
    r1 = pair.ba.recv_array_nb(max_bytes=100)
    r2 = pair.ba.recv_array_nb(max_bytes=100)
    pair.drive(pair.ab.send_array_nb(big), pair.ab.send_array_nb(small))
    pump(pair, lambda: r1.done() and r2.done())
    with pytest.raises(ValueError, match="more than max_bytes=100"):
        r1.wait(1)
    check_same(r2.wait(1), small)


def test_bad_arguments_fail_when_posted(pair):
    with pytest.raises(ValueError, match=">= 0"):
        pair.ba.recv_array_nb(max_bytes=-1)
    with pytest.raises(TypeError, match="int or None"):
        pair.ba.recv_array_nb(max_bytes=1.5)
    with pytest.raises(TypeError, match="stream must be"):
        pair.ba.recv_array_nb(stream=object())
    with pytest.raises(ValueError, match="stream handle must be >= 0"):
        pair.ba.recv_array_nb(stream=-1)
    assert not pair.b._engine.am.array_waiters


def test_custom_allocator_is_called_when_the_array_comes(pair):
    calls = []

    def allocator(nbytes, memory_type):
        calls.append((nbytes, memory_type))
        return bytearray(nbytes)

    req = pair.ba.recv_array_nb(allocator)
    spin(pair, 50)
    assert calls == []  # nothing came yet
    want = np.arange(6, dtype=np.int16).reshape(2, 3)
    pair.drive(pair.ab.send_array_nb(want), req)
    assert calls == [(12, int(gpucx.MemoryType.HOST))]
    check_same(req.result(), want)


def test_allocator_failure_fails_one_request(pair):
    def allocator(nbytes, memory_type):
        raise MemoryError("no room")

    r1 = pair.ba.recv_array_nb(allocator)
    r2 = pair.ba.recv_array_nb()
    a, b = np.ones(4), np.zeros(4)
    pair.drive(pair.ab.send_array_nb(a), pair.ab.send_array_nb(b))
    pump(pair, lambda: r1.done() and r2.done())
    with pytest.raises(MemoryError, match="array was dropped"):
        r1.result()
    check_same(r2.result(), b)


def test_closed_endpoint(pair):
    req = pair.ba.recv_array_nb()
    pair.ba.close(force=True)
    with pytest.raises(gpucx.ClosedError):
        req.wait(5)
    with pytest.raises(gpucx.ClosedError):
        pair.ba.recv_array_nb()


def test_worker_close_fails_posted_requests(ctx):
    pair = Pair(ctx)
    req = pair.ba.recv_array_nb()
    t0 = time.monotonic()
    pair.b.close()
    assert time.monotonic() - t0 < 5  # nothing waited for the request
    assert req.done()
    with pytest.raises(gpucx.ClosedError, match="worker closed"):
        req.result()


def test_cancel_during_the_transfer(pair):
    # The array matched (its rendezvous transfer posted): cancel is UCX's
    # request cancel, which a rendezvous fetch already under way may not
    # honour; either way the request settles once the sender progresses.
    want = np.ones(1 << 20, np.uint8)
    req = pair.ba.recv_array_nb()
    s = pair.ab.send_array_nb(want, proto="rndv")
    pump(pair, lambda: req.protocol is not None or req.done())
    if not req.done():
        assert req.cancel() is True
    pump(pair, lambda: req.done() and s.done())
    if req.cancelled():
        with pytest.raises(gpucx.CanceledError):
            req.result()
    else:
        check_same(req.result(), want)
    assert not pair.b._engine.pending


def test_awaitable(ctx):
    import threading

    want = np.arange(1 << 16, dtype=np.int64)  # 512 KiB: rendezvous

    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            a = ctx.create_worker()
            ab = a.connect(w.worker.address)
            ep = w.connect(a.address)
            req = ep.recv_array_nb()
            stop = threading.Event()

            def sender():
                s = ab.send_array_nb(want)
                while not stop.is_set() and not s.done():
                    a.progress()
                while not stop.is_set():  # the receiver fetches from a
                    a.progress()
                    time.sleep(0.0005)

            t = threading.Thread(target=sender, daemon=True)
            t.start()
            try:
                return await asyncio.wait_for(req, 10)
            finally:
                stop.set()
                t.join(5)

    check_same(asyncio.run(main()), want)


# -- across processes ------------------------------------------------------------


def _array_sender(chan, count: int, tls_name: str) -> None:
    """Connect to the receiver, send ``count`` arrays, wait for "bye"."""
    from conftest import transport_config

    with gpucx.Context(config=transport_config(tls_name)) as ctx:
        w = ctx.create_worker()
        ep = w.connect(chan.get(60))
        chan.put(w.address)
        for i in range(count):
            ep.send_array(np.full(1 << (i % 18), i, np.int32), timeout=60)
        while chan.get(60) != "bye":
            pass


@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_window_across_processes(tls_name):
    from conftest import channel_pair, join_ok, spawn, transport_config

    count, window = 40, 8
    q, theirs = channel_pair()
    child = spawn(_array_sender, theirs, count, tls_name)
    try:
        with gpucx.Context(config=transport_config(tls_name)) as ctx:
            w = ctx.create_worker()
            q.put(w.address)
            ep = w.connect(q.get(60))
            posted = [ep.recv_array_nb() for _ in range(window)]
            for i in range(count):
                got = posted.pop(0).wait(60)
                if i + window < count:
                    posted.append(ep.recv_array_nb())
                assert got.shape == (1 << (i % 18),) and (got == i).all()
            q.put("bye")
    finally:
        join_ok(child, 90)


def _idle_peer(chan, tls_name: str) -> None:
    from conftest import transport_config

    with gpucx.Context(config=transport_config(tls_name)) as ctx:
        w = ctx.create_worker()
        ep = w.connect(chan.get(60))
        chan.put(w.address)
        ep.send_array(np.ones(3), timeout=60)
        while True:
            w.progress()
            time.sleep(0.001)


@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_peer_death_fails_posted_requests(tls_name):
    import os
    import signal

    from conftest import channel_pair, spawn, transport_config

    q, theirs = channel_pair()
    child = spawn(_idle_peer, theirs, tls_name)
    try:
        with gpucx.Context(config=transport_config(tls_name)) as ctx:
            w = ctx.create_worker()
            q.put(w.address)
            ep = w.connect(q.get(60))
            first = ep.recv_array_nb()
            second, third = ep.recv_array_nb(), ep.recv_array_nb()
            check_same(first.wait(30), np.ones(3))
            os.kill(child.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(gpucx.PeerError):
                second.wait(20)
            assert time.monotonic() - t0 < 12
            end = time.monotonic() + 12
            while not third.done():  # fails without a wait too
                assert time.monotonic() < end
                time.sleep(0.01)
            with pytest.raises(gpucx.PeerError):
                third.result()
    finally:
        child.join(10)
