"""Nothing lost under load, and one worker shared by several threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpucx
import gpucx.aio

from conftest import channel_pair, join_ok, spawn
from peers_burst import burst_sender

pytestmark = pytest.mark.timeout(120)


def test_burst_from_several_senders_arrives_exactly_once_in_order():
    senders, per_sender = 3, 3334  # 10,002 messages
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        chans, procs = [], []
        for s in range(senders):
            ours, theirs = channel_pair()
            procs.append(spawn(burst_sender, theirs, s, per_sender))
            ours.put(w.address)
            chans.append(ours)
        got = {s: [] for s in range(senders)}
        buf = np.zeros(16, np.int64)
        for _ in range(senders * per_sender):
            # Any sender: the tag says who; per-sender order is per tag.
            info = w.recv(buf, tag=0, tag_mask=0, timeout=60)
            sender, seq = int(buf[0]), int(buf[1])
            assert info.tag == sender and info.nbytes == 128
            assert (buf[2:] == seq * 7 + sender).all(), "corrupted payload"
            got[sender].append(seq)
        for s in range(senders):
            assert got[s] == list(range(per_sender)), f"sender {s} out of order"
        assert w.probe(tag=0, tag_mask=0) is None  # nothing extra
        for ch in chans:
            assert ch.get(60) == "sent"
            ch.put("bye")
    for p in procs:
        join_ok(p, 60)


def test_four_threads_share_a_multi_worker():
    n, threads = 1500, 4
    errors: list = []
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker(thread_mode="multi")
        peer = ctx.create_worker(thread_mode="multi")
        ep = w.connect(peer.address)

        def sender(t):
            try:
                for i in range(n):
                    ep.send(np.full(64, t * n + i, np.int64), tag=(t << 32) | i)
            except Exception as exc:  # reported below
                errors.append(exc)

        def receiver(t):
            try:
                buf = np.zeros(64, np.int64)
                for i in range(n):
                    info = peer.recv(buf, tag=(t << 32) | i, timeout=30)
                    assert info == ((t << 32) | i, 512)
                    assert (buf == t * n + i).all(), f"thread {t} message {i}"
            except Exception as exc:
                errors.append(exc)

        workers = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
        workers += [
            threading.Thread(target=receiver, args=(t,)) for t in range(threads)
        ]
        for th in workers:
            th.start()
        for th in workers:
            th.join(90)
        assert not any(th.is_alive() for th in workers), "a thread deadlocked"
        assert errors == []


@pytest.mark.parametrize(
    ("n", "words", "proto"), [(2000, 2, "eager"), (200, 8192, "rndv")]
)
def test_posted_am_receives_with_a_progress_thread(n, words, proto):
    """A progress thread runs the UCX callback (which matches posted
    receives) while the main thread keeps posting: each message lands in
    exactly one buffer, in posting order."""
    with gpucx.Context(features={"am"}) as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ep = a.connect(b.address)
        bufs = [np.zeros(words, np.int64) for _ in range(n)]
        with gpucx.aio.ProgressThread(a), gpucx.aio.ProgressThread(b):
            reqs = []
            sends = []
            for i in range(n):
                reqs.append(b.am_recv_nb(21, bufs[i]))
                payload = np.full(words, i, np.int64)
                sends.append(ep.am_send_nb(21, payload, proto=proto))
            assert [r.wait(60) for r in reqs] == [8 * words] * n
            for s in sends:
                s.wait(60)
        for i, buf in enumerate(bufs):
            assert (buf == i).all()


@pytest.mark.parametrize(
    ("n", "words", "proto"), [(50, 2, "eager"), (10, 8192, "rndv")]
)
def test_group_am_receives_with_a_progress_thread(n, words, proto):
    """Groups of posted receives while a progress thread runs the callback
    that completes their members: each group completes once, in order."""
    with gpucx.Context(features={"am"}) as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ep = a.connect(b.address)
        groups = [[np.zeros(words, np.int64) for _ in range(n)] for _ in range(20)]
        with gpucx.aio.ProgressThread(a), gpucx.aio.ProgressThread(b):
            reqs, sends = [], []
            for g, bufs in enumerate(groups):
                reqs.append(b.am_recv_many_nb(22, bufs))
                for i in range(n):
                    payload = np.full(words, g * n + i, np.int64)
                    sends.append(ep.am_send_nb(22, payload, proto=proto))
            assert [r.wait(60) for r in reqs] == [[8 * words] * n] * len(groups)
            for s in sends:
                s.wait(60)
        for g, bufs in enumerate(groups):
            for i, buf in enumerate(bufs):
                assert (buf == g * n + i).all()


@pytest.mark.parametrize(
    ("n", "words", "proto"), [(3000, 2, "eager"), (300, 8192, "rndv")]
)
def test_kept_and_posted_am_receives_race_with_a_progress_thread(n, words, proto):
    """Messages arrive (on progress threads) while the main thread posts
    receives singly and in groups: some wait as kept messages, some find a
    posted receive; either way each lands in exactly one buffer, in order."""
    with gpucx.Context(features={"am"}) as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ep = a.connect(b.address)
        bufs = [np.zeros(words, np.int64) for _ in range(n)]
        with gpucx.aio.ProgressThread(a), gpucx.aio.ProgressThread(b):
            reqs = [b.am_recv_nb(23, bufs[0])]  # registers the id
            sends = [
                ep.am_send_nb(23, np.full(words, i, np.int64), proto=proto)
                for i in range(n)
            ]
            i = 1
            while i < n:  # alternate single receives and groups of 7
                if i % 2:
                    reqs.append(b.am_recv_nb(23, bufs[i]))
                    i += 1
                else:
                    reqs.append(b.am_recv_many_nb(23, bufs[i : i + 7]))
                    i += 7
            sizes = []
            for r in reqs:
                got = r.wait(60)
                sizes += got if isinstance(got, list) else [got]
            assert sizes == [8 * words] * n
            for s in sends:
                s.wait(60)
        for i, buf in enumerate(bufs):
            assert (buf == i).all(), i
