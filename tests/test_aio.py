"""asyncio integration: event-driven progress, awaitable requests."""

from __future__ import annotations

import asyncio
import os
import resource
import time

import numpy as np
import pytest

import gpucx
import gpucx.aio
from gpucx import _address, _internal, _liveness

from conftest import channel_pair, join_ok, spawn
from peers_aio import aio_die_after_connect, aio_echo_server, aio_peer_to_kill

pytestmark = pytest.mark.timeout(90)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("mode", ["event", "poll"])
def test_two_aio_workers_on_one_loop(tls, ctx, mode):
    async def main():
        async with (
            gpucx.aio.Worker(ctx, progress=mode) as a,
            gpucx.aio.Worker(ctx, progress=mode) as b,
        ):
            ep = await a.aconnect(b.address)
            for n in (0, 8, 100_000, 4 << 20):
                src = np.arange(n, dtype=np.uint8)
                out = np.zeros(n, np.uint8)
                recv = asyncio.ensure_future(b.arecv(out, tag=n))
                await ep.asend(src, tag=n)
                assert await recv == (n, n)
                assert np.array_equal(out, src)

    run(main())


def test_thousand_concurrent_awaits(ctx):
    async def main():
        async with gpucx.aio.Worker(ctx) as a, gpucx.aio.Worker(ctx) as b:
            ep = await a.aconnect(b.address)
            outs = np.zeros((1000, 2), np.int64)
            recvs = [
                asyncio.ensure_future(b.arecv(outs[i], tag=i)) for i in range(1000)
            ]
            sends = [ep.asend(np.array([i, -i], np.int64), tag=i) for i in range(1000)]
            await asyncio.gather(*sends)
            infos = await asyncio.gather(*recvs)
            assert [i.tag for i in infos] == list(range(1000))
            assert np.array_equal(outs[:, 0], np.arange(1000))

    run(main())


def test_bare_request_is_awaitable(ctx):
    async def main():
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        out = bytearray(5)
        req = b.recv_nb(out, tag=3)
        ep.send_nb(b"await", tag=3)
        assert await req == (3, 5)
        assert out == b"await"

    run(main())


def test_cancel_pending_receive_leaves_worker_usable(ctx):
    async def main():
        async with gpucx.aio.Worker(ctx) as a, gpucx.aio.Worker(ctx) as b:
            ep = await a.aconnect(b.address)
            task = asyncio.ensure_future(b.arecv(bytearray(8), tag=99))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            out = bytearray(2)
            recv = asyncio.ensure_future(b.arecv(out, tag=99))
            await ep.asend(b"ok", tag=99)
            assert await recv == (99, 2) and out == b"ok"
            # The canceled receive settled (as canceled) and is not tracked.
            assert not b.worker._engine.pending

    run(main())


def test_wait_for_timeout(ctx):
    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(w.arecv(bytearray(4), tag=5), 0.1)
            lst = w.listen(host="127.0.0.1")
            with pytest.raises(gpucx.TimeoutError):
                await w.aaccept(lst, timeout=0.1)

    run(main())


def test_aaccept_needs_a_listener(ctx):
    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            with pytest.raises(ValueError, match="listen"):
                await w.aaccept()

    run(main())


def test_aconnect_to_nobody_raises_peer_error(ctx):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            with pytest.raises(gpucx.PeerError):
                await w.aconnect(("127.0.0.1", port))

    run(main())


def test_bad_progress_mode(ctx):
    with pytest.raises(ValueError, match="progress"):
        gpucx.aio.Worker(ctx, progress="turbo")


def test_idle_worker_uses_no_cpu(ctx):
    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            pending = asyncio.ensure_future(w.arecv(bytearray(8), tag=1))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.sleep(2.0)
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            wall = time.monotonic() - t0
            cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
            pending.cancel()
            return cpu / wall

    assert run(main()) < 0.2


def test_closing_worker_removes_reader_and_fails_waiters(ctx):
    async def main():
        w = gpucx.aio.Worker(ctx)
        fd = w.fileno()
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(w.arecv(bytearray(8), tag=1))
        await asyncio.sleep(0.01)
        w.close()
        with pytest.raises(gpucx.ClosedError):
            await task
        assert not loop.remove_reader(fd)  # nothing was registered any more

    run(main())


def test_progress_thread_completes_requests_without_progress_calls():
    with gpucx.Context() as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ep = a.connect(b.address)
        with gpucx.aio.ProgressThread(a), gpucx.aio.ProgressThread(b):
            out = np.zeros(1 << 20, np.uint8)
            req = b.recv_nb(out, tag=1)
            snd = ep.send_nb(np.ones(1 << 20, np.uint8), tag=1)  # rendezvous
            end = time.monotonic() + 10
            while req._slot.status == 1 and time.monotonic() < end:
                time.sleep(0.001)  # no progress() call from this thread
            assert req._slot.status == 0
            assert req.wait(5) == (1, 1 << 20)
            snd.wait(5)
            assert out.all()


def test_progress_thread_needs_multi_mode(ctx):
    with pytest.raises(ValueError, match="multi"):
        gpucx.aio.ProgressThread(ctx.create_worker())


def test_aio_across_processes():
    ch, theirs = channel_pair()
    n = 50
    child = spawn(aio_echo_server, theirs, n)

    async def main():
        with gpucx.Context(config={"TLS": "tcp"}) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                ep = await w.aconnect(("127.0.0.1", ch.get(60)))
                for i in range(n):
                    src = np.arange(1024, dtype=np.int64) + i
                    out = np.empty_like(src)
                    recv = asyncio.ensure_future(w.arecv(out, tag=i))
                    await ep.asend(src, tag=i)
                    await recv
                    assert np.array_equal(out, src * 2)
                ch.put("bye")

    run(main())
    join_ok(child, 60)


def test_peer_death_fails_awaiting_tasks():
    ch, theirs = channel_pair()
    child = spawn(aio_die_after_connect, theirs)

    async def main():
        with gpucx.Context(config={"TLS": "tcp"}) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                ep = await w.aconnect(("127.0.0.1", ch.get(60)))
                big = [ep.asend(np.ones(8 << 20, np.uint8), tag=i) for i in range(4)]
                tasks = [asyncio.ensure_future(t) for t in big]
                await asyncio.sleep(0.05)
                ch.put("die")
                results = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), 20
                )
                assert all(isinstance(r, gpucx.PeerError) for r in results), results

    run(main())
    child.join(30)
    assert child.exitcode is not None and child.exitcode < 0


@pytest.mark.parametrize(
    "tls,via", [("tcp", "address"), ("shm", "address"), ("default", "listener")]
)
def test_wait_closed_reports_a_killed_peer(tls, via):
    """``wait_closed`` resolves with the endpoint's PeerError soon after the
    peer process is killed, with nothing else pending on the endpoint: over
    TCP (UCX's error callback), shared memory (gpucx's liveness check) and a
    listener connection."""
    from conftest import transport_config

    ch, theirs = channel_pair()
    child = spawn(aio_peer_to_kill, tls, via, theirs)

    async def main():
        cfg = transport_config(tls, listener=via == "listener")
        with gpucx.Context(config=cfg) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                where = ch.get(60)
                if via == "listener":
                    ep = await w.aconnect(("127.0.0.1", where))
                else:
                    ep = w.connect(where)
                await ep.asend(b"hello", tag=7)
                first = asyncio.ensure_future(ep.wait_closed())
                second = asyncio.ensure_future(ep.wait_closed())
                await asyncio.sleep(0.3)
                assert not first.done()
                second.cancel()  # one waiter giving up leaves the others
                t0 = time.monotonic()
                ch.put("die")
                err = await asyncio.wait_for(first, 15)
                took = time.monotonic() - t0
                assert isinstance(err, gpucx.PeerError), err
                assert isinstance(ep.error, gpucx.PeerError)
                assert took < 5, took
                again = await asyncio.wait_for(ep.wait_closed(), 1)
                assert isinstance(again, gpucx.PeerError)
                ep.close()

    run(main())
    child.join(30)
    assert child.exitcode is not None and child.exitcode < 0


def test_a_killed_local_peer_is_seen_through_its_pidfd():
    """With gpucx's liveness check of local peers once every 30 s, a killed
    peer over shared memory (where UCX reports nothing) still fails its
    endpoint at once: the driver watches the peer's pidfd on the loop."""
    if _liveness.open_pidfd(os.getpid(), _address.proc_start_time()) < 0:
        pytest.skip("no pidfds on this kernel")  # the 30 s check still runs
    from conftest import transport_config

    ch, theirs = channel_pair()
    child = spawn(aio_peer_to_kill, "shm", "address", theirs)

    async def main():
        cfg = {**transport_config("shm"), "GPUCX_PEER_CHECK_INTERVAL": 30}
        with gpucx.Context(config=cfg) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                ep = w.connect(ch.get(60))
                await ep.asend(b"hello", tag=7)
                closed = asyncio.ensure_future(ep.wait_closed())
                pending = asyncio.ensure_future(w.arecv(bytearray(8), tag=9))
                await asyncio.sleep(0.2)
                assert not closed.done() and not pending.done()
                core = w._drv.engine
                assert len(core.pidfds) == 1  # the peer's pidfd, in the set
                assert w._drv.pfd == core.pfd >= 0  # the set on the loop
                ch.put("die")
                err = await asyncio.wait_for(closed, 10)
                assert isinstance(err, gpucx.PeerError), err
                assert "died" in str(err)
                assert core.pidfds == {}  # out of the set and closed
                pending.cancel()
                ep.close()

    run(main())
    child.join(30)
    assert child.exitcode is not None and child.exitcode < 0


def test_wait_closed_on_local_close(ctx):
    """Closing the endpoint (or its worker) here resolves ``wait_closed``
    with None; an endpoint closed already answers at once."""

    async def main():
        a = gpucx.aio.Worker(ctx)
        b = gpucx.aio.Worker(ctx)
        ep = b.connect(a.address)
        ep2 = b.connect(a.address)
        waiting = asyncio.ensure_future(ep.wait_closed())
        waiting2 = asyncio.ensure_future(ep2.wait_closed())
        await asyncio.sleep(0.05)
        assert not waiting.done() and not waiting2.done()
        ep.close()
        assert await asyncio.wait_for(waiting, 5) is None
        assert await asyncio.wait_for(ep.wait_closed(), 1) is None
        b.close()  # the worker takes ep2 with it
        assert await asyncio.wait_for(waiting2, 5) is None
        a.close()

    run(main())


def test_spin_is_configurable_and_adapts(ctx):
    """``spin_us`` sets the busy-poll before parking; spins that miss halve
    the next down to none (with a full-length probe every few awaits), one
    that sees its completion restores it."""

    async def main():
        with pytest.raises(ValueError, match="spin_us"):
            gpucx.aio.Worker(ctx, spin_us=-1)
        a = gpucx.aio.Worker(ctx, spin_us=100)
        b = gpucx.aio.Worker(ctx, spin_us=0)
        drv = a._drv
        assert drv._spin_ns == 100_000 and b._drv._spin_ns == 0
        assert b._drv._spin_len() == 0
        ep = b.connect(a.address)
        for n in range(3):  # nothing comes within the spin: it shrinks
            task = asyncio.ensure_future(a.arecv(bytearray(8), tag=n))
            await asyncio.sleep(0)
            await ep.asend(b"x" * 8, tag=n)
            await task
        assert drv._spin_cur == 100_000 >> 3
        while drv._spin_cur:
            drv._spin_done(drv._spin_len(), False)
        lengths = [drv._spin_len() for _ in range(gpucx.aio._SPIN_PROBE_EVERY)]
        assert lengths[-1] == 100_000 and not any(lengths[:-1])  # one probe
        drv._spin_done(lengths[-1], False)  # a missed probe: off again
        assert drv._spin_cur == 0 and drv._spin_len() == 0
        drv._spin_skip = 1
        drv._spin_done(drv._spin_len(), True)  # a probe that hits
        assert drv._spin_len() == 100_000
        b.close()
        a.close()

    run(main())


def test_faces_delegate_every_public_attribute(ctx):
    # The faces delegate through properties written on the class (no
    # __getattr__, which mypy could not see through): every public
    # attribute of the object a face wraps is there, and reads the
    # wrapped object's.
    from gpucx.endpoint import Endpoint
    from gpucx.listener import Listener
    from gpucx.worker import Worker

    for face, core in (
        (gpucx.aio.Endpoint, Endpoint),
        (gpucx.aio.Listener, Listener),
        (gpucx.aio.Worker, Worker),
    ):
        assert "__getattr__" not in vars(face)
        public = [n for n in dir(core) if not n.startswith("_")]
        assert [n for n in public if not hasattr(face, n)] == [], face

    async def main():
        async with gpucx.aio.Worker(ctx) as w:
            lst = w.listen(0, "127.0.0.1")
            ep = w.connect(w.address)
            assert w.thread_mode == w.worker.thread_mode == "single"
            assert w.address == w.worker.address and not w.closed
            assert (lst.port, lst.host) == (lst.listener.port, "127.0.0.1")
            assert ep.peer == ep.endpoint.peer and ep.worker is w.worker
            assert ep.send_nb.__self__ is ep.endpoint
            with pytest.raises(AttributeError):
                ep.no_such_attribute  # noqa: B018
            ep.close()
            assert ep.closed
            lst.close()

    run(main())


def test_progress_thread_takes_an_aio_worker(ctx):
    # As when the face forwarded every attribute: the thread progresses the
    # face's worker.
    async def main():
        async with gpucx.aio.Worker(ctx, thread_mode="multi") as w:
            with gpucx.aio.ProgressThread(w) as t:
                ep = w.worker.connect(w.address)
                buf = bytearray(8)
                req = w.worker.recv_nb(buf, tag=9)
                ep.send(b"12345678", tag=9)
                deadline = time.monotonic() + 10
                while not req.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert req.done() and bytes(buf) == b"12345678"
                assert t._engine is _internal.engine(w.worker)
                ep.close()

    run(main())
