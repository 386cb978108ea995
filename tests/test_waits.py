"""The wait helpers of gpucx.request: wait_for and wait_closing (the loops
that listener accept, recv_array, notifications, endpoint close and the
benchmark's control channel go through)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx.request import wait_closing, wait_for

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
