"""Memory a peer can make a worker hold is bounded (docs/reliability.md,
"Bounded queues").

Every queue a peer fills without the application's help -- kept active
messages, the put-with-notify queue, the array queues and the
handler queue of a worker progressed by a ``ProgressThread`` -- has a count
and a byte cap (``GPUCX_*`` options).  Past a cap messages are dropped and
counted in ``Worker.stats()``, one warning is raised (not one per message),
and the worker keeps working.  Two workers of one context here; the
two-process floods are in tests/test_flood.py.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import gpucx
from gpucx.ops import am as _am
from gpucx.ops import rma as _rma

from conftest import TRANSPORTS, Pair, pump

pytestmark = pytest.mark.timeout(60)


def _ctx(tls="default", **caps):
    cfg = dict(TRANSPORTS[tls] or {})
    cfg.update({f"GPUCX_{k.upper()}": v for k, v in caps.items()})
    return gpucx.Context(config=cfg)


def _drops(record):
    return [w for w in record if issubclass(w.category, gpucx.DroppedMessagesWarning)]


@pytest.mark.parametrize("tls", sorted(TRANSPORTS))
def test_kept_messages_stop_at_the_count_cap(tls):
    with _ctx(tls, am_kept_max_count=8) as ctx:
        p = Pair(ctx)
        buf = bytearray(8)
        first = p.b.am_recv_nb(5, buf)  # id 5 keeps what finds no receive
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            sends = [
                p.ab.am_send_nb(5, k.to_bytes(8, "little"), proto="eager")
                for k in range(30)
            ]
            p.drive(first, *sends)
            pump(p, lambda: p.b.stats()["am_kept"].dropped == 21)
        s = p.b.stats()["am_kept"]
        assert (s.count, s.bytes, s.max_count) == (8, 64, 8)
        assert s.dropped_bytes == 21 * 8
        assert len(_drops(record)) == 1
        assert "GPUCX_AM_KEPT_MAX_COUNT" in str(_drops(record)[0].message)
        # The kept ones are the oldest, in order; the worker keeps working.
        got = []
        for _ in range(8):
            p.drive(p.b.am_recv_nb(5, buf))
            got.append(int.from_bytes(buf, "little"))
        assert got == list(range(1, 9))
        assert p.b.stats()["am_kept"].count == 0
        p.drive(p.ab.am_send_nb(5, b"after", proto="eager"), p.b.am_recv_nb(5, buf))
        assert bytes(buf[:5]) == b"after"


def test_kept_messages_stop_at_the_byte_cap():
    with _ctx(am_kept_max_bytes=4000) as ctx:
        p = Pair(ctx)
        p.b.am_recv_nb(6, bytearray(1)).cancel()  # registers the id
        sends = [p.ab.am_send_nb(6, bytes(1000), proto="eager") for _ in range(10)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            p.drive(*sends)
            pump(p, lambda: p.b.stats()["am_kept"].dropped == 6)
        s = p.b.stats()["am_kept"]
        assert (s.count, s.bytes, s.max_bytes) == (4, 4000, 4000)


def test_rendezvous_past_the_cap_is_never_fetched_and_the_sender_completes():
    with _ctx(am_kept_max_count=2) as ctx:
        p = Pair(ctx)
        p.b.am_recv_nb(7, bytearray(1)).cancel()
        data = np.ones(1 << 20, np.uint8)
        sends = [p.ab.am_send_nb(7, data, proto="rndv") for _ in range(5)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            pump(p, lambda: p.b.stats()["am_kept"].dropped == 3)
            # The three dropped sends completed; the two kept wait for a receive.
            pump(p, lambda: sum(r.done() for r in sends) == 3)
            s = p.b.stats()["am_kept"]
            assert (s.count, s.bytes, s.dropped_bytes) == (2, 0, 0)
            bufs = [np.zeros(1 << 20, np.uint8) for _ in range(2)]
            assert p.drive(p.b.am_recv_many_nb(7, bufs), *sends)[0] == [1 << 20] * 2
        assert all((b == 1).all() for b in bufs)


def test_notifications_stop_at_the_caps():
    with _ctx(notify_max_count=5, notify_max_bytes=1 << 20) as ctx:
        p = Pair(ctx)
        sends = [
            _am.send_internal_nb(p.ab, _rma.NOTIFY_AM_ID, bytes([k]) * 100)
            for k in range(20)
        ]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            p.drive(*sends)
            pump(p, lambda: p.b.stats()["notify"].dropped == 15)
        assert len(_drops(record)) == 1
        s = p.b.stats()["notify"]
        assert (s.count, s.bytes, s.dropped_bytes) == (5, 500, 1500)
        got = p.b.notifications()
        assert [n[1][0] for n in got] == [0, 1, 2, 3, 4]
        assert p.b.stats()["notify"].count == 0
    with _ctx(notify_max_bytes=250) as ctx:
        p = Pair(ctx)
        sends = [
            _am.send_internal_nb(p.ab, _rma.NOTIFY_AM_ID, bytes(100)) for _ in range(4)
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            p.drive(*sends)
            pump(p, lambda: p.b.stats()["notify"].dropped == 2)
        assert len(p.b.notifications()) == 2


def test_array_queue_stops_at_the_count_cap():
    with _ctx(array_queue_max_count=4) as ctx:
        p = Pair(ctx)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            p.drive(*[p.ab.send_array_nb(np.full(16, k, np.int32)) for k in range(12)])
            pump(p, lambda: p.b.stats()["arrays"].dropped == 8)
        assert len(_drops(record)) == 1
        s = p.b.stats()["arrays"]
        assert (s.count, s.bytes) == (4, 4 * (64 + 20))  # payload + header
        assert [int(p.ba.recv_array(timeout=5)[0]) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(gpucx.TimeoutError):
            p.ba.recv_array(timeout=0.2)
        p.ab.send_array(np.arange(3))
        assert p.ba.recv_array(timeout=5).tolist() == [0, 1, 2]
        assert p.b.stats()["arrays"].count == 0


def test_array_queue_byte_cap_is_shared_by_senders():
    """The array caps bound all senders together: a peer cannot multiply
    them by connecting again and again."""
    with _ctx(array_queue_max_bytes=1000) as ctx:
        recv = ctx.create_worker()
        s1, s2 = ctx.create_worker(), ctx.create_worker()
        e1, e2 = s1.connect(recv.address), s2.connect(recv.address)
        r1, r2 = recv.connect(s1.address), recv.connect(s2.address)

        def settle(reqs, count):
            end = time.monotonic() + 10
            while not all(x.done() for x in reqs) or (
                recv.stats()["arrays"].count + recv.stats()["arrays"].dropped < count
            ):
                for w in (s1, s2, recv):
                    w.progress()
                assert time.monotonic() < end

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            # 300 bytes + a 20-byte header each: three fit in 1000 bytes.
            settle([e1.send_array_nb(np.full(300, 1, np.uint8)) for _ in range(2)], 2)
            settle([e2.send_array_nb(np.full(300, 2, np.uint8)) for _ in range(2)], 4)
            s = recv.stats()["arrays"]
            assert (s.count, s.bytes, s.dropped) == (3, 960, 1)
            # Taking s1's arrays frees room for s2's next one.
            assert [int(r1.recv_array(timeout=5)[0]) for _ in range(2)] == [1, 1]
            settle([e2.send_array_nb(np.full(300, 3, np.uint8))], 3)
        got = [int(r2.recv_array(timeout=5)[0]) for _ in range(2)]
        assert got == [2, 3]
        assert recv.stats()["arrays"].count == 0


def test_handler_queue_of_a_progress_thread_worker_is_capped():
    from gpucx.aio import ProgressThread

    with _ctx(am_queue_max_count=10) as ctx:
        a = ctx.create_worker()
        b = ctx.create_worker("multi")
        ab = a.connect(b.address)
        got = []
        b.set_am_handler(9, lambda m: got.append(bytes(m.data)))
        with ProgressThread(b), warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            sends = [
                ab.am_send_nb(9, bytes([k]) * 64, proto="eager") for k in range(40)
            ]
            end = time.monotonic() + 10
            while (
                not all(s.done() for s in sends) or b.stats()["am_queue"].dropped < 30
            ):
                a.progress()
                time.sleep(0.001)
                assert time.monotonic() < end
            s = b.stats()["am_queue"]
            assert (s.count, s.bytes, s.dropped) == (10, 640, 30)
            b.progress()
        assert [g[0] for g in got] == list(range(10))
        assert b.stats()["am_queue"].count == 0


def test_one_warning_for_many_drops_then_rate_limited():
    with _ctx(am_kept_max_count=1) as ctx:
        p = Pair(ctx)
        p.b.am_recv_nb(8, bytearray(1)).cancel()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(3):
                p.drive(*[p.ab.am_send_nb(8, b"x", proto="eager") for _ in range(50)])
                pump(p, lambda: p.b.stats()["am_kept"].count == 1)
                for _ in range(20):
                    p.b.progress()
        assert p.b.stats()["am_kept"].dropped == 149
        assert len(_drops(record)) == 1


def test_stats_of_a_quiet_worker(ctx):
    w = ctx.create_worker()
    stats = w.stats()
    assert sorted(stats) == ["am_kept", "am_queue", "arrays", "notify"]
    for s in stats.values():
        assert (s.count, s.bytes, s.dropped, s.dropped_bytes) == (0, 0, 0, 0)
        assert s.max_count > 0 and s.max_bytes > 0
    w.close()
    with pytest.raises(gpucx.ClosedError):
        w.stats()


def test_caps_default_and_zero_means_no_limit():
    from gpucx import config

    with gpucx.Context() as ctx:
        s = ctx.create_worker().stats()
        assert s["am_kept"].max_count == config.GPUCX_OPTIONS["AM_KEPT_MAX_COUNT"]
        assert s["notify"].max_bytes == config.GPUCX_OPTIONS["NOTIFY_MAX_BYTES"]
    with _ctx(am_kept_max_count=0) as ctx:
        p = Pair(ctx)
        p.b.am_recv_nb(4, bytearray(1)).cancel()
        p.drive(*[p.ab.am_send_nb(4, b"y", proto="eager") for _ in range(100)])
        pump(p, lambda: p.b.stats()["am_kept"].count == 100)
        assert p.b.stats()["am_kept"].dropped == 0


@pytest.mark.parametrize(
    "key",
    [
        "GPUCX_AM_KEPT_MAX_COUNT",
        "GPUCX_NOTIFY_MAX_BYTES",
        "gpucx_array_queue_max_count",
    ],
)
@pytest.mark.parametrize("value", ["lots", -1, 2.5])
def test_cap_options_are_checked(key, value):
    with pytest.raises(ValueError, match=key):
        gpucx.Context(config={key: value})


# -- C queues shared between a ProgressThread and the application ---------------


def test_notifications_pushed_by_a_progress_thread_and_popped_concurrently():
    """The notification queue is locked: a ProgressThread pushing while
    two application threads pop loses and repeats nothing."""
    import threading

    from gpucx.aio import ProgressThread

    n = 3000
    with _ctx(notify_max_count=0, notify_max_bytes=0) as ctx:
        a = ctx.create_worker()
        b = ctx.create_worker("multi")
        ab = a.connect(b.address)
        got: list = []
        done = threading.Event()

        def take():
            while not done.is_set() or b.stats()["notify"].count:
                got.extend(_rma._pop_notification(b._engine) or () for _ in range(8))

        with ProgressThread(b):
            takers = [threading.Thread(target=take) for _ in range(2)]
            for t in takers:
                t.start()
            for k in range(0, n, 100):
                a_reqs = [
                    _am.send_internal_nb(ab, _rma.NOTIFY_AM_ID, j.to_bytes(4, "little"))
                    for j in range(k, k + 100)
                ]
                for r in a_reqs:
                    r.wait(10)
            end = time.monotonic() + 20
            while b.stats()["notify"].count + len([g for g in got if g]) < n:
                a.progress()
                time.sleep(0.001)
                assert time.monotonic() < end
            done.set()
            for t in takers:
                t.join(10)
        notes = sorted(int.from_bytes(g[1], "little") for g in got if g)
        assert notes == list(range(n))
        assert b.stats()["notify"].count == 0


def test_listener_ring_filled_by_a_progress_thread_and_drained_by_two_threads():
    """Connection requests pushed by a ProgressThread and accepted by two
    threads at once: each accepted exactly once."""
    import threading

    from gpucx.aio import ProgressThread

    n = 12
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        server = ctx.create_worker("multi")
        lst = server.listen(host="127.0.0.1")
        accepted: list = []

        def accept(k):
            for _ in range(k):
                accepted.append(lst.accept(timeout=20))

        with ProgressThread(server):
            takers = [threading.Thread(target=accept, args=(n // 2,)) for _ in range(2)]
            for t in takers:
                t.start()
            clients = [ctx.create_worker() for _ in range(n)]
            eps = [c.connect(("127.0.0.1", lst.port)) for c in clients]  # noqa: F841
            end = time.monotonic() + 20
            while any(t.is_alive() for t in takers):
                for c in clients:
                    c.progress()
                assert time.monotonic() < end
        assert len(accepted) == n and len({id(e) for e in accepted}) == n
        for e in accepted:
            e.close(force=True)


def test_messages_of_a_cleared_handler_warn_once_per_id():
    with _ctx() as ctx:
        p = Pair(ctx)
        p.b.set_am_handler(12, lambda m: None)
        p.b.set_am_handler(12, None)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            p.drive(*[p.ab.am_send_nb(12, bytes(k + 1)) for k in range(50)])
            for _ in range(50):
                p.b.progress()
        noted = [r for r in record if "no handler is set" in str(r.message)]
        assert len(noted) == 1
