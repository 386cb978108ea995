"""Handlers with a receive pool (``set_am_handler(..., into=bufs)``): the
UCX callback receives a rendezvous payload into a free pool buffer before
the handler runs."""

from __future__ import annotations

import gc
import time
import warnings
import weakref

import numpy as np
import pytest

import gpucx

from conftest import TRANSPORTS, Pair, check_transports, pump, spin

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20


def _pool(k, n=MIB):
    return [np.zeros(n, np.uint8) for _ in range(k)]


def _seq(k, n=MIB):
    return np.full(n, k % 251 + 1, np.uint8)


def _one_buffer(pair, am_id, count):
    """A handler that keeps every message, a pool of one 1 MiB buffer, and
    ``count`` rendezvous messages (bytes ``k + 1``) sent: returns ``(got,
    sends)`` once the first message is in ``got`` (the rest wait for the
    buffer it holds)."""
    got: list = []
    pair.b.set_am_handler(am_id, got.append, into=_pool(1))
    sends = [pair.ab.am_send_nb(am_id, _seq(k), proto="rndv") for k in range(count)]
    pump(pair, lambda: got)
    return got, sends


def test_rendezvous_payload_is_in_before_the_handler_runs(pair, tls):
    pool = _pool(2)
    seen = []

    def handler(msg):
        # The payload is in: an eager-looking message, data a view of a pool
        # buffer, header and reply endpoint as without a pool.
        seen.append(
            (msg.is_rndv, msg.nbytes, msg.header, bytes(msg.data[:3]), msg.reply_ep)
        )

    pair.b.set_am_handler(3, handler, into=pool)
    src = np.random.default_rng(1).integers(0, 255, 300_000, dtype=np.uint8)
    req = pair.ab.am_send_nb(3, src, header=b"h", reply=True, proto="rndv")
    pump(pair, lambda: seen)
    pair.drive(req)
    ((is_rndv, n, hdr, head, rep),) = seen
    assert (is_rndv, n, hdr, head) == (False, src.nbytes, b"h", src[:3].tobytes())
    assert rep is not None
    assert np.array_equal(pool[0][: src.nbytes], src)


def test_data_view_keeps_the_buffer_and_receive_into_copies(pair):
    got, sends = _one_buffer(pair, 3, 2)
    msg = got.pop()
    view = msg.data
    assert view.readonly and view[0] == 1
    out = np.zeros(MIB, np.uint8)
    pair.drive(msg.receive_into(out))
    assert (out == 1).all()
    with pytest.raises(gpucx.AlreadyReceivedError):
        _ = msg.data
    del msg
    # The view still holds the only buffer: the second message waits.
    spin(pair)
    assert not got and view[-1] == 1
    del view
    pump(pair, lambda: got)
    pair.drive(*sends)
    assert bytes(got[0].data[:2]) == b"\x02\x02"


def test_messages_wait_in_order_for_a_free_buffer(pair, tls):
    """Six messages, one buffer: five wait for it and are received, one at
    a time, in arrival order, as the handler lets go of the earlier ones."""
    pool = _pool(1)
    order = []

    def handler(msg):
        assert not msg.is_rndv
        order.append((int(msg.header), int(msg.data[0]), int(msg.data[-1])))

    pair.b.set_am_handler(4, handler, into=pool)
    sends = [
        pair.ab.am_send_nb(4, _seq(k), header=b"%d" % k, proto="rndv") for k in range(6)
    ]
    pump(pair, lambda: len(order) == 6)
    pair.drive(*sends)
    assert order == [(k, k + 1, k + 1) for k in range(6)]


def test_two_buffers_take_two_payloads_at_once(pair, tls):
    pool = _pool(2)
    got = []
    pair.b.set_am_handler(4, lambda m: got.append(int(m.data[0])), into=pool)
    sends = [pair.ab.am_send_nb(4, _seq(k), proto="rndv") for k in range(6)]
    pump(pair, lambda: len(got) == 6)
    pair.drive(*sends)
    assert sorted(got) == [k + 1 for k in range(6)]


def test_a_kept_message_keeps_its_buffer(pair):
    got, sends = _one_buffer(pair, 5, 3)
    first = got[0]
    spin(pair)
    assert len(got) == 1  # the others wait: the only buffer is held
    del first, got[0]
    pump(pair, lambda: len(got) == 1)
    assert got[0].data[0] == 2
    got.clear()
    pump(pair, lambda: len(got) == 1)
    assert got[0].data[0] == 3
    pair.drive(*sends)


def test_payload_larger_than_every_buffer_comes_as_rendezvous(pair):
    pool = _pool(2, 4096)
    got = []
    pair.b.set_am_handler(6, got.append, into=pool)
    req = pair.ab.am_send_nb(6, _seq(6, 8192), proto="rndv")
    pump(pair, lambda: got)
    msg = got[0]
    assert msg.is_rndv
    out = np.zeros(8192, np.uint8)
    pair.drive(msg.receive_into(out), req)
    assert (out == 7).all()


def test_smaller_buffer_first_fit(pair):
    """A payload takes the first free buffer it fits, in the order given."""
    small, large = np.zeros(1000, np.uint8), np.zeros(MIB, np.uint8)
    got = []
    pair.b.set_am_handler(
        6, lambda m: got.append((m.nbytes, m.data[0])), into=[small, large]
    )
    sends = [
        pair.ab.am_send_nb(6, _seq(1, 500_000), proto="rndv"),
        pair.ab.am_send_nb(6, _seq(2, 100_000), proto="rndv"),
        pair.ab.am_send_nb(6, _seq(3, 1000), proto="rndv"),
    ]
    pump(pair, lambda: len(got) == 3)
    pair.drive(*sends)
    # The first two need the large buffer: the second waits for the first.
    # The third fits the small one, free all along.
    assert sorted(got) == [(1000, 4), (100_000, 3), (500_000, 2)]
    assert got.index((500_000, 2)) < got.index((100_000, 3))
    assert (small == 4).all() and (large[:100_000] == 3).all()


def test_eager_messages_are_not_received_into_the_pool(pair):
    pool = _pool(1, 64)
    got = []
    pair.b.set_am_handler(7, got.append, into=pool)
    pair.drive(pair.ab.am_send_nb(7, b"abc", proto="eager"))
    pump(pair, lambda: got)
    assert bytes(got[0].data) == b"abc" and not pool[0].any()


def test_replacing_and_removing_the_pool(pair):
    first = _pool(1)
    got = []
    pair.b.set_am_handler(8, got.append, into=first)
    sends = [pair.ab.am_send_nb(8, _seq(1), proto="rndv")]
    pump(pair, lambda: got)
    held = got.pop()
    # Replaced while one of its buffers holds a message: that message
    # stays valid, the next payload goes to the new pool.
    second = _pool(1)
    pair.b.set_am_handler(8, got.append, into=second)
    sends.append(pair.ab.am_send_nb(8, _seq(2), proto="rndv"))
    pump(pair, lambda: got)
    assert held.data[0] == 2 and got.pop().data[0] == 3 and second[0][0] == 3
    ref = weakref.ref(first[0])
    del first
    gc.collect()
    assert ref() is not None  # held by the replaced pool, still busy
    del held
    # No pool: a rendezvous payload waits at the sender again; the
    # replaced pool, idle now, lets go of its buffers.
    pair.b.set_am_handler(8, got.append)
    gc.collect()
    assert ref() is None
    sends.append(pair.ab.am_send_nb(8, _seq(3), proto="rndv"))
    pump(pair, lambda: got)
    assert got[0].is_rndv
    del got[0]
    pair.drive(*sends)
    # Clearing the handler clears the pool with it.
    pair.b.set_am_handler(8, got.append, into=_pool(1))
    pair.b.set_am_handler(8, None)
    assert 8 not in pair.b._engine.am.pools


def test_pool_errors(pair):
    w = pair.b
    with pytest.raises(ValueError, match="needs a handler"):
        w.set_am_handler(1, None, into=_pool(1))
    with pytest.raises(ValueError, match="no buffer"):
        w.set_am_handler(1, print, into=[])
    with pytest.raises(TypeError, match="sequence of buffers"):
        w.set_am_handler(1, print, into=5)
    with pytest.raises(BufferError, match=r"into\[1\]"):
        w.set_am_handler(1, print, into=[bytearray(8), bytes(8)])  # read-only
    with pytest.raises(BufferError, match=r"into\[0\]"):
        w.set_am_handler(1, print, into=[np.zeros(64, np.uint8)[::2]])
    with pytest.raises(TypeError, match=r"into\[0\]"):
        w.set_am_handler(1, print, into=[object()])
    buf = np.zeros(1000, np.uint8)
    with pytest.raises(ValueError, match=r"into\[0\] and into\[2\] share memory"):
        w.set_am_handler(1, print, into=[buf, bytearray(8), buf])
    with pytest.raises(ValueError, match=r"into\[0\] and into\[1\] share memory"):
        w.set_am_handler(1, print, into=[buf[500:], buf[:501]])
    w.set_am_handler(1, print, into=[buf[500:], buf[:500], buf[:0]])  # adjacent
    w.set_am_handler(1, None)
    # Nothing was installed by the failed calls.
    assert 1 not in w._engine.am.handlers and 1 not in w._engine.am.pools
    with pytest.raises(ValueError):
        w.set_am_handler(0xFF00, print, into=_pool(1))
    w.close()
    with pytest.raises(gpucx.ClosedError):
        w.set_am_handler(1, print, into=_pool(1))


def test_device_memory_is_refused(pair):
    from fakegpu import FakeCudaArrayV2

    with pytest.raises(gpucx.UnsupportedError, match="host memory"):
        pair.b.set_am_handler(1, print, into=[FakeCudaArrayV2(np.zeros(64, np.uint8))])


def test_waiting_messages_count_in_the_queue_caps():
    """Messages waiting for a buffer count against the handler queue's
    caps: past them they are dropped (never fetched; the senders
    complete) and counted."""
    cfg = {"GPUCX_AM_QUEUE_MAX_COUNT": 3}
    with gpucx.Context(config=cfg) as ctx:
        p = Pair(ctx)
        got = []
        p.b.set_am_handler(9, got.append, into=_pool(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
            sends = [p.ab.am_send_nb(9, _seq(k), proto="rndv") for k in range(8)]
            pump(p, lambda: p.b.stats()["am_queue"].dropped == 5 and got)
            kept = got.pop()  # holds the only buffer
            s = p.b.stats()["am_queue"]
            assert (s.count, s.dropped) == (2, 5)  # two wait for the buffer
            pump(p, lambda: sum(r.done() for r in sends) >= 6)
            del kept
            pump(p, lambda: len(got) == 1)
            got.clear()
            pump(p, lambda: len(got) == 1)
            p.drive(*sends)
        assert p.b.stats()["am_queue"].count == 0


def test_worker_close_with_receives_waiting_and_held(ctx):
    p = Pair(ctx)
    got, sends = _one_buffer(p, 10, 4)
    held = got[0]  # the buffer is held; three messages wait
    spin(p, 100)
    p.b.close()
    assert held.nbytes == MIB
    del held
    got.clear()
    gc.collect()
    # The senders are answered: the waiting payloads were released.
    p.drive(*sends, timeout=20)
    p.a.close()


def test_failed_receive_reads_as_the_error():
    """A receive into the pool that fails (here: the sender's worker closed
    before the payload was fetched) reaches the handler as a message whose
    data and receive_into raise.  Over TCP: the closed sockets fail the
    receive (over shared memory UCX keeps such a fetch until the worker is
    destroyed)."""
    ctx = gpucx.Context(config=TRANSPORTS["tcp"])
    p = Pair(ctx)
    got, sends = _one_buffer(p, 11, 2)
    first = got.pop()  # the second waits for the only buffer
    spin(p, 100)
    p.ab.close(force=True)
    p.a.close()
    del first  # the waiting message starts now, from a peer that is gone
    end = time.monotonic() + 20
    while not got:
        p.b.progress()
        assert time.monotonic() < end, "the failed receive never reached the handler"
    msg = got[0]
    assert not msg.is_rndv and msg.nbytes == MIB
    with pytest.raises(gpucx.UCXError, match="handler's pool"):
        _ = msg.data
    with pytest.raises(gpucx.UCXError, match="handler's pool"):
        msg.receive_into(np.zeros(MIB, np.uint8))
    del sends, msg
    got.clear()
    p.b.close()
    ctx.close()


@pytest.mark.parametrize("tls", sorted(TRANSPORTS))
def test_pooled_handler_across_processes(tls):
    from peers_am import burst_receiver

    sizes = [0, 100, 8192, 65536, MIB, 4 * MIB, 3, MIB]
    with burst_receiver(tls, sizes) as (w, ep, q):
        got = {}

        def handler(msg):
            # The i-th message's bytes are i % 251 + 1.
            k = int(msg.data[0]) - 1 if msg.nbytes else sizes.index(0)
            assert not msg.is_rndv
            assert (np.frombuffer(msg.data, np.uint8) == k + 1).all()
            got[k] = msg.nbytes

        w.set_am_handler(11, handler, into=_pool(2, 4 * MIB))
        q.put("go")
        end = time.monotonic() + 60
        while len(got) < len(sizes):
            w.progress()
            assert time.monotonic() < end, got
        assert [got[k] for k in range(len(sizes))] == sizes
        check_transports(tls, ep.transports)


def test_progress_thread_worker_receives_into_its_pool():
    """A "multi" worker progressed by a ProgressThread: receives start in
    the progress thread's UCX callback, and again from the application's
    thread when a handler lets go of a buffer."""
    from gpucx.aio import ProgressThread

    with gpucx.Context() as ctx:
        a = ctx.create_worker()
        b = ctx.create_worker("multi")
        ab = a.connect(b.address)
        got = []
        b.set_am_handler(12, lambda m: got.append(int(m.data[-1])), into=_pool(2))
        with ProgressThread(b):
            sends = [ab.am_send_nb(12, _seq(k), proto="rndv") for k in range(8)]
            end = time.monotonic() + 30
            while len(got) < 8 or not all(s.done() for s in sends):
                a.progress()
                b.progress()  # runs the handlers
                assert time.monotonic() < end, got
        assert sorted(got) == list(range(1, 9))
        ab.close()
        b.close()
        a.close()


def test_asyncio_workers_run_pooled_handlers(ctx):
    """Under asyncio the event-driven progress runs the handlers; the
    receives that wait for a buffer start when a handler returns."""
    import asyncio

    import gpucx.aio

    async def main():
        async with gpucx.aio.Worker(ctx) as a, gpucx.aio.Worker(ctx) as b:
            ep = await a.aconnect(b.address)
            got = []
            done = asyncio.Event()

            def handler(msg):
                got.append((msg.is_rndv, int(msg.data[0]), msg.nbytes))
                if len(got) == 5:
                    done.set()

            b.set_am_handler(13, handler, into=_pool(2))
            sends = [ep.am_send_nb(13, _seq(k), proto="rndv") for k in range(5)]
            await asyncio.gather(*sends)
            await asyncio.wait_for(done.wait(), 30)
            assert sorted(got) == [(False, k + 1, MIB) for k in range(5)]

    asyncio.run(asyncio.wait_for(main(), 60))
