"""The waits of a worker's engine (gpucx._engine): wait_for and wait_closing
(the loops that listener accept, recv_array, notifications, endpoint close
and the benchmark's control channel go through)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gpucx

from conftest import Pair


def wait_for(worker, *args, **kwargs):
    return worker._engine.wait_for(*args, **kwargs)


def wait_closing(worker, done, end, others=()):
    return worker._engine.wait_closing(done, end, [o._engine for o in others])


pytestmark = pytest.mark.timeout(30)


def test_wait_for_returns_the_ready_value_when_something_arrives(pair):
    # A message in flight to b: b's wait ends when its receive completed.
    buf = np.zeros(8, np.uint8)
    req = pair.b.recv_nb(buf, tag=7)
    pair.ab.send_nb(np.full(8, 5, np.uint8), tag=7)
    got = wait_for(pair.b, lambda: req.done() and "done", 10, "nothing came")
    assert got == "done" and (buf == 5).all()


@pytest.mark.parametrize("poll", [False, True], ids=["sleep", "poll"])
def test_wait_for_times_out_with_a_message_or_returns_false(pair, poll):
    t0 = time.monotonic()
    with pytest.raises(gpucx.TimeoutError, match="no widget within 0.2 s") as ei:
        wait_for(pair.a, lambda: 0, 0.2, "no widget", poll=poll)
    assert ei.value.status_name == "UCS_ERR_TIMED_OUT"
    assert wait_for(pair.a, lambda: [], 0.05, poll=poll) == []
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("poll", [False, True], ids=["sleep", "poll"])
def test_wait_for_check_ends_the_wait(pair, poll):
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError, match="peer gone"):
        wait_for(pair.a, lambda: False, 10, "never", check, poll=poll)
    assert len(calls) == 2


def test_wait_for_sleeps_on_the_worker_and_wakes_on_traffic(pair):
    # Nothing to do for a while: the wait sleeps (little CPU), then a message
    # from another thread's worker wakes it well before the timeout.
    buf = np.zeros(4, np.uint8)
    req = pair.b.recv_nb(buf, tag=3)

    def later():
        time.sleep(0.3)
        r = pair.ab.send_nb(np.ones(4, np.uint8), tag=3)
        end = time.monotonic() + 10
        while not r.done() and time.monotonic() < end:
            pass

    t = threading.Thread(target=later)
    t0 = time.monotonic()
    t.start()
    try:
        assert wait_for(pair.b, req.done, 10, "no message")
    finally:
        t.join(15)
    assert 0.25 < time.monotonic() - t0 < 8
    assert (buf == 1).all()


def test_wait_closing_progresses_the_others_and_keeps_its_end(pair):
    # b's receive completes only when a progresses its send: wait_closing on
    # b with a among the others finishes it.
    buf = np.zeros(1 << 16, np.uint8)
    req = pair.b.recv_nb(buf, tag=9)
    pair.ab.send_nb(np.full(1 << 16, 2, np.uint8), tag=9)
    end = time.monotonic() + 10
    assert wait_closing(pair.b, lambda: req.done(), end, [pair.a])
    assert (buf == 2).all()
    t0 = time.monotonic()
    assert not wait_closing(pair.b, lambda: False, time.monotonic() + 0.1)
    assert 0.09 < time.monotonic() - t0 < 5


# -- a blocking wait runs handlers as their messages arrive -----------------------

#: A spin longer than any test here: a wait that ran handlers only once the
#: spin is over would run them too late for the test's peer.
_LONG_SPIN = {"GPUCX_SPIN_US": 40e6}


def _peer_thread(pair, body):
    """Run ``body(stop)`` on a thread that alone uses worker ``a`` (its
    endpoint ``pair.ab``); the returned join also re-raises its error."""
    stop = threading.Event()
    errors: list = []

    def run():
        try:
            body(stop)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        stop.set()
        t.join(20)
        assert not t.is_alive(), "the peer thread hung"
        if errors:
            raise errors[0]

    return join


def _handler_then_tag(pair, ran, delay=0.0):
    """The peer of the handler-before-completion tests: after ``delay`` s an
    active message to id 4, then, once b's handler set ``ran``, 3s to tag 9."""

    def peer(stop):
        end = time.monotonic() + 15
        time.sleep(delay)
        _settle(pair.ab.am_send_nb(4, np.ones(8, np.uint8)), end)
        while not ran.is_set():
            pair.a.progress()
            if stop.is_set() or time.monotonic() > end:
                return
        _settle(pair.ab.send_nb(np.full(8, 3, np.uint8), tag=9), end)

    return peer


def _settle(req, end):
    while not req.done():
        if time.monotonic() > end:
            raise AssertionError("the peer's operation did not finish")


@pytest.mark.parametrize(
    "receive",
    [
        lambda w, buf: w.recv_nb(buf, tag=9).wait(15),
        lambda w, buf: w.recv(buf, tag=9),  # posted and spun in one C call
    ],
    ids=["request-wait", "blocking-call"],
)
def test_a_wait_runs_a_handler_before_its_own_operation_completes(receive):
    # b waits for tag 9, which a sends only once b's handler has run for a
    # message a sent first: the wait must run the handler while it spins
    # (a spin of 40 s, past the test's timeout).
    with gpucx.Context(config=_LONG_SPIN) as ctx:
        pair = Pair(ctx)
        ran = threading.Event()
        pair.b.set_am_handler(4, lambda msg: ran.set())

        buf = np.zeros(8, np.uint8)
        join = _peer_thread(pair, _handler_then_tag(pair, ran))
        t0 = time.monotonic()
        try:
            receive(pair.b, buf)
        finally:
            join()
        assert ran.is_set() and (buf == 3).all()
        assert time.monotonic() - t0 < 10


def test_a_wait_inside_a_handler_waits_without_running_the_next_ones():
    # Handlers do not nest: while the first one waits, the second message is
    # due but stays queued; the wait goes on in C (no Python loop on the
    # queue) and completes, then the second handler runs.
    with gpucx.Context(config=_LONG_SPIN) as ctx:
        pair = Pair(ctx)
        order: list = []
        got = np.zeros(8, np.uint8)

        def handler(msg):
            order.append(("start", msg.header))
            if msg.header == b"first":
                pair.b.recv_nb(got, tag=9).wait(15)
            order.append(("end", msg.header))

        pair.b.set_am_handler(4, handler)

        def peer(stop):
            end = time.monotonic() + 15
            for h in (b"first", b"second"):
                _settle(pair.ab.am_send_nb(4, np.ones(8, np.uint8), header=h), end)
            time.sleep(0.3)  # the second message is queued meanwhile
            _settle(pair.ab.send_nb(np.full(8, 7, np.uint8), tag=9), end)

        join = _peer_thread(pair, peer)
        try:
            wait_for(pair.b, lambda: len(order) == 4, 15, "the two handlers")
        finally:
            join()
        assert order == [
            ("start", b"first"),
            ("end", b"first"),
            ("start", b"second"),
            ("end", b"second"),
        ]
        assert (got == 7).all()


def test_a_wait_keeps_its_deadline_while_messages_stream_in():
    # Messages arrive all the time, each stopping the spin for its handler:
    # the wait still ends at its timeout, canceled.
    with gpucx.Context(config=_LONG_SPIN) as ctx:
        pair = Pair(ctx)
        seen = []
        pair.b.set_am_handler(4, lambda msg: seen.append(1))

        def peer(stop):
            # Until the test stops it: once b's wait is over nobody drains
            # b, and a send may then stay pending (the context's close
            # settles it).
            while not stop.is_set():
                req = pair.ab.am_send_nb(4, np.ones(8, np.uint8))
                while not req.done() and not stop.is_set():
                    pass

        join = _peer_thread(pair, peer)
        t0 = time.monotonic()
        req = pair.b.recv_nb(np.zeros(8, np.uint8), tag=9)
        try:
            with pytest.raises(gpucx.TimeoutError):
                req.wait(0.5)
            took = time.monotonic() - t0
        finally:
            join()
        assert 0.45 < took < 10
        assert len(seen) > 10
        assert req.done() and isinstance(req.exception(), gpucx.CanceledError)


# -- an await's spin (gpucx.aio) runs them too ------------------------------------


class _AioPair:
    """An asyncio worker ``b`` (spinning ``spin_us`` per await) and a plain
    worker ``a`` of the same context, ``ab`` connected to ``b``."""

    def __init__(self, ctx, spin_us):
        import gpucx.aio

        self.b = gpucx.aio.Worker(ctx, spin_us=spin_us)
        self.a = ctx.create_worker()
        self.ab = self.a.connect(self.b.address)


def test_an_await_runs_a_handler_while_it_spins():
    # As in the blocking test above, the tag message comes only once b's
    # handler ran, and b's await spins for 40 s before it would park.
    import asyncio

    with gpucx.Context() as ctx:

        async def main():
            pair = _AioPair(ctx, spin_us=40e6)
            ran = threading.Event()
            pair.b.set_am_handler(4, lambda msg: ran.set())

            buf = np.zeros(8, np.uint8)
            # b spins by the time the message comes.
            join = _peer_thread(pair, _handler_then_tag(pair, ran, delay=0.3))
            t0 = time.monotonic()
            try:
                got = await pair.b.recv_nb(buf, tag=9)
            finally:
                join()
            assert got.nbytes == 8 and ran.is_set() and (buf == 3).all()
            assert time.monotonic() - t0 < 10
            pair.b.close()

        asyncio.run(main())


def test_a_handler_error_during_an_await_spin_leaves_the_request_pending():
    # The handler's exception ends the await that ran it; the receive is
    # not canceled, and a later await gets the message.
    import asyncio

    with gpucx.Context() as ctx:

        async def main():
            pair = _AioPair(ctx, spin_us=40e6)
            pair.b.set_am_handler(4, lambda msg: 1 / 0)
            buf = np.zeros(8, np.uint8)
            req = pair.b.recv_nb(buf, tag=9)

            def peer(stop):
                time.sleep(0.3)  # b spins by then
                _settle(pair.ab.am_send_nb(4, np.ones(8, np.uint8)), end)

            end = time.monotonic() + 15
            join = _peer_thread(pair, peer)
            try:
                with pytest.raises(ZeroDivisionError):
                    await req
            finally:
                join()
            assert time.monotonic() < end and not req.done()
            send = pair.ab.send_nb(np.full(8, 5, np.uint8), tag=9)
            assert (await req).nbytes == 8 and (buf == 5).all()
            _settle(send, end)
            pair.b.close()

        asyncio.run(main())
