"""The gpucx:// comm contract against real distributed (tests/peers_dask.py
for the peers in other processes)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import dask.config  # noqa: E402
from distributed.comm import connect, listen  # noqa: E402
from distributed.comm.core import CommClosedError, FatalCommClosedError  # noqa: E402
from distributed.comm.registry import backends, get_backend  # noqa: E402
from distributed.protocol import Serialized, deserialize, to_serialize  # noqa: E402
from distributed.utils_test import gen_test  # noqa: E402

import gpucx  # noqa: E402
import gpucx.aio  # noqa: E402
from gpucx.dask import GpucxBackend, GpucxConnector  # noqa: E402
from gpucx.dask import _framing as fr  # noqa: E402
from gpucx.dask import _runtime as rt  # noqa: E402
from gpucx.request import INPROGRESS  # noqa: E402

from conftest import channel_pair, spawn  # noqa: E402
from peers_dask import comm_server  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ADDR = "gpucx://127.0.0.1"


async def echo(comm):
    try:
        while True:
            msg = await comm.read()
            await comm.write(msg)
    except CommClosedError:
        pass
    finally:
        await comm.close()


@contextlib.asynccontextmanager
async def comm_to_peer(tls, mode):
    """``(comm, proc)``: a comm to a spawned ``comm_server`` peer running
    ``mode``, with ``distributed-gpucx.tls`` set to ``tls`` while it is
    used; the peer process is killed at the end."""
    ours, theirs = channel_pair()
    proc = spawn(comm_server, tls, theirs, mode)
    try:
        _, addr = ours.get(30)
        with dask.config.set({"distributed-gpucx.tls": tls}):
            comm = await connect(addr, timeout=20)
            ours.get(30)
            yield comm, proc
    finally:
        proc.kill()
        proc.join(10)


async def get_pair(**kw):
    """A connected (client, server) comm pair and its listener."""
    q: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        await q.put(comm)

    lst = await listen(ADDR + ":0", handle, **kw)
    client = await connect(lst.contact_address, **kw)
    server = await asyncio.wait_for(q.get(), 10)
    return client, server, lst


def test_registered_through_the_entry_point():
    assert isinstance(get_backend("gpucx"), GpucxBackend)


def test_importing_gpucx_does_not_import_distributed():
    code = "import sys, gpucx, gpucx.aio; print('distributed' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@gen_test()
async def test_client_server_many_concurrent():
    async with listen(ADDR + ":0", echo, xxx="ignored") as lst:
        assert lst.listen_address.startswith("gpucx://127.0.0.1:")
        assert lst.contact_address == lst.listen_address

        async def client(i):
            comm = await connect(lst.contact_address, xxx="ignored")
            assert comm.peer_address == lst.contact_address
            for j in range(3):
                await comm.write({"i": i, "j": j})
                assert await comm.read() == {"i": i, "j": j}
            await comm.close()

        await asyncio.gather(*(client(i) for i in range(20)))


@gen_test()
async def test_wildcard_listener_contact_address():
    async with listen("gpucx://0.0.0.0:0", echo) as lst:
        assert lst.listen_address.startswith("gpucx://0.0.0.0:")
        host = lst.contact_address.split("://")[1].rsplit(":", 1)[0]
        assert host not in ("0.0.0.0", "")
        comm = await connect(lst.contact_address)
        await comm.write(b"ping")
        assert await comm.read() == b"ping"
        await comm.close()


@gen_test()
async def test_frames_of_every_shape():
    client, server, lst = await get_pair()
    try:
        big = np.random.default_rng(1).integers(0, 255, 9 << 20, dtype="u1")
        msgs = [
            {"empty": to_serialize(np.empty(0, "f8"))},
            {"bytes": b"", "more": b"x" * 100},
            {"big": to_serialize(big)},
            {
                "small": to_serialize(np.arange(10.0)),
                "big": to_serialize(big[:100_000]),
            },
            # More frames than fit in one control message (separate table).
            {"many": [to_serialize(np.full(3, i, "i4")) for i in range(5000)]},
        ]
        for msg in msgs:
            # (A large write completes once the peer has received it.)
            n, got = await asyncio.gather(client.write(msg), server.read())
            assert isinstance(n, int) and n >= 0
            assert got.keys() == msg.keys()
        np.testing.assert_array_equal(got["many"][4999], np.full(3, 4999, "i4"))
        _, back = await asyncio.gather(
            server.write({"big": to_serialize(big)}), client.read()
        )
        np.testing.assert_array_equal(back["big"], big)
        back["big"][0] = 7  # received arrays are writable
    finally:
        await client.close()
        await server.close()
        lst.stop()


@gen_test()
async def test_received_arrays_do_not_share_buffers():
    client, server, lst = await get_pair()
    try:
        a, b = np.arange(5.0), np.arange(5.0) + 10
        await client.write({"a": to_serialize(a), "b": to_serialize(b)})
        got = await server.read()
        got["a"][:] = -1
        np.testing.assert_array_equal(got["b"], b)
    finally:
        await client.close()
        await server.close()
        lst.stop()


@gen_test()
async def test_deserialize_false_on_either_end():
    payload = np.random.default_rng(2).random(1 << 20)  # 8 MB
    q: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        await q.put(await comm.read())
        await comm.close()

    async with listen(ADDR + ":0", handle, deserialize=False) as lst:
        comm = await connect(lst.contact_address, deserialize=False)
        await comm.write({"x": to_serialize(payload)})
        got = await asyncio.wait_for(q.get(), 10)
        assert isinstance(got["x"], Serialized)
        np.testing.assert_array_equal(
            deserialize(got["x"].header, got["x"].frames), payload
        )
        await comm.close()


@gen_test()
async def test_addresses_same_host_repr_extra_info():
    client, server, lst = await get_pair()
    try:
        assert client.peer_address == lst.contact_address
        assert client.peer_address == server.local_address
        assert client.local_address == server.peer_address
        assert client.local_address.startswith("gpucx://127.0.0.1:")
        assert client.same_host and server.same_host
        assert client.extra_info == {} and server.extra_info == {}
        assert "closed" not in repr(client)
        assert client._local_addr == client.local_address
        assert client._peer_addr == client.peer_address
    finally:
        await client.close()
        server.abort()
        lst.stop()
    assert "closed" in repr(client) and "closed" in repr(server)
    assert client.closed() and server.closed()


@gen_test()
async def test_closed_explicitly_fails_inflight_and_later_reads():
    for closer in ("client", "server"):
        client, server, lst = await get_pair()
        a, b = (client, server) if closer == "client" else (server, client)
        ra = asyncio.ensure_future(a.read())
        rb = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.05)
        await a.close()
        t0 = time.monotonic()
        for fut in (ra, rb):
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(fut, 5)
        assert time.monotonic() - t0 < 2
        for comm in (a, b):
            with pytest.raises(CommClosedError):
                await comm.read()
            with pytest.raises(CommClosedError):
                await comm.write({})
            assert comm.closed()
        await b.close()
        lst.stop()


@gen_test()
async def test_closed_implicitly_by_the_server():
    async def handle(comm):
        await comm.close()

    async with listen(ADDR + ":0", handle) as lst:
        for _ in range(2):
            comm = await connect(lst.contact_address)
            with pytest.raises(CommClosedError):
                await comm.write({})
                await asyncio.wait_for(comm.read(), 5)
            await comm.close()


@gen_test()
async def test_message_written_before_close_is_delivered():
    client, server, lst = await get_pair()
    await server.write({"last": 1})
    await server.close()
    assert await client.read() == {"last": 1}
    with pytest.raises(CommClosedError):
        await client.read()
    await client.close()
    lst.stop()


@gen_test()
async def test_cancelled_read_and_write_abort_the_comm():
    client, server, lst = await get_pair()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.read(), 0.05)
    assert client.closed()
    await server.close()
    lst.stop()
    # A write of a large message the peer never reads, cancelled midway.
    client, server, lst = await get_pair()
    big = np.ones(32 << 20, "u1")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(server.write({"x": to_serialize(big)}), 0.05)
    assert server.closed()
    await client.close()
    lst.stop()


@gen_test()
async def test_connect_to_a_dead_address_raises_oserror_quickly():
    async with listen(ADDR + ":0", echo) as lst:
        addr = lst.contact_address
    t0 = time.monotonic()
    with pytest.raises(OSError):
        await connect(addr, timeout=0.3)
    assert time.monotonic() - t0 < 2


class FlakyConnector(GpucxConnector):
    failures = 0

    async def connect(self, address, deserialize=True, **kw):
        if FlakyConnector.failures < 2:
            FlakyConnector.failures += 1
            raise OSError("first attempts fail")
        return await super().connect(address, deserialize, **kw)


class FlakyBackend(GpucxBackend):
    def get_connector(self):
        return FlakyConnector()


@gen_test()
async def test_connect_retries_oserrors():
    backends["gpucx-flaky"] = FlakyBackend()
    try:
        async with listen(ADDR + ":0", echo) as lst:
            port = lst.contact_address.rsplit(":", 1)[1]
            comm = await connect(f"gpucx-flaky://127.0.0.1:{port}", timeout=5)
            await comm.write(1)
            assert await comm.read() == 1
            assert FlakyConnector.failures == 2
            await comm.close()
    finally:
        del backends["gpucx-flaky"]


@gen_test()
async def test_listener_stop_during_the_dask_handshake():
    started = asyncio.Event()

    async def handle(comm):
        pytest.fail("the handler must not run for a comm of a stopped listener")

    lst = await listen(ADDR + ":0", handle)
    # A bare gpucx connection: the listener now waits for our Dask handshake.
    comm = await GpucxConnector().connect(lst.contact_address.split("://")[1])
    info = await asyncio.wait_for(comm.read(), 5)  # the listener's handshake
    assert "compression" in info
    started.set()
    # What Server._stop_listeners does: stop() leaves comms alone (they may
    # be established), abort_handshaking_comms() drops those in Dask's
    # handshake.
    lst.stop()
    lst.abort_handshaking_comms()
    t0 = time.monotonic()
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(comm.read(), 5)
    assert time.monotonic() - t0 < 2
    await comm.close()


@gen_test()
async def test_listener_stop_drops_a_half_open_connection():
    lst = await listen(ADDR + ":0", echo)
    port = int(lst.contact_address.rsplit(":", 1)[1])
    lw = rt.acquire("event")
    try:
        # Connected, but no gpucx HELLO: the listener's handshake waits.
        ep = await lw.aw.aconnect(("127.0.0.1", port))
        for _ in range(100):
            if lst._handshakes:
                break
            await asyncio.sleep(0.01)
        assert lst._handshakes
        lst.stop()
        for _ in range(100):
            if not lst._handshakes:
                break
            await asyncio.sleep(0.01)
        assert not lst._handshakes
        # The listener closed its side: our endpoint fails.
        req = ep.send_nb(b"x", 1, True)
        with pytest.raises(gpucx.PeerError):
            await asyncio.wait_for(req, 5)
        ep.close(force=True)
    finally:
        rt.release(lw)


@gen_test()
async def test_garbage_control_message_closes_the_comm():
    client, server, lst = await get_pair()
    # Write a control message that claims more than the cap, straight on the
    # comm's tag: the reader must refuse it before allocating.
    bad = fr.pack_header(0, 1, 1 << 60) + fr.pack_table([1 << 60], [fr.HOST])
    await client._ep.asend(bad, client._stag)
    with pytest.raises(CommClosedError, match="cap"):
        await server.read()
    assert server.closed()
    await client.close()
    lst.stop()


@gen_test()
async def test_encryption_is_refused():
    with pytest.raises(FatalCommClosedError, match="does not encrypt"):
        await listen(ADDR + ":0", echo, ssl_context=object())
    with (
        dask.config.set({"distributed.comm.require-encryption": True}),
        pytest.raises(FatalCommClosedError, match="does not encrypt"),
    ):
        await connect(ADDR + ":1", timeout=1)


@pytest.mark.parametrize("tls", ["tcp", "sm,tcp"])
@gen_test(timeout=60)
async def test_peer_killed_fails_pending_read_and_write(tls):
    async with comm_to_peer(tls, "silent") as (comm, proc):
        # A peer on this host gets a data endpoint (shared memory).
        assert comm._dep is not comm._ep
        await comm._dep.aflush()
        transports = {t for t, _ in comm._dep.transports}
        if tls == "sm,tcp":
            assert transports & {"sysv", "posix", "cma"}, transports
        reader = asyncio.ensure_future(comm.read())
        # 64 MiB the peer never receives: a rendezvous send left pending.
        writer = asyncio.ensure_future(
            comm.write({"x": to_serialize(np.ones(64 << 20, "u1"))})
        )
        await asyncio.sleep(0.2)
        proc.kill()
        t0 = time.monotonic()
        for fut in (reader, writer):
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(fut, 10)
        assert time.monotonic() - t0 < 3
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await comm.read()
        await comm.close()


@pytest.mark.parametrize("tls", ["tcp", "sm,tcp"])
@gen_test(timeout=60)
async def test_peer_killed_mid_transfer_to_us(tls):
    async with comm_to_peer(tls, "stream") as (comm, proc):
        got = await asyncio.wait_for(comm.read(), 20)
        assert got["x"].nbytes == 64 << 20
        reader = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.01)
        proc.kill()
        with pytest.raises(CommClosedError):
            # Whatever had fully arrived may still come; then it fails.
            for _ in range(4):
                await asyncio.wait_for(reader, 10)
                reader = asyncio.ensure_future(comm.read())
        await comm.close()


def _held(lw) -> list:
    """Operations of ``lw``'s worker that UCX has not let go of."""
    w = lw.w
    return [r for r in w._engine.pending if r._slot.status == INPROGRESS] + [
        s for s, *_ in w._engine.parked if s.status == INPROGRESS
    ]


async def _dead_peer_with_a_message_on_its_way(comm, proc) -> None:
    """Let the peer's 64 MiB message (control message and the rendezvous
    request of its frame) reach us unread, then kill the peer."""
    assert comm._dep is not comm._ep  # a data endpoint: no error handling
    await asyncio.sleep(0.5)
    proc.kill()
    proc.join(10)


@pytest.mark.parametrize("tls", ["tcp", "sm,tcp"])
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
@gen_test(timeout=60)
async def test_a_dead_peers_unread_frame_is_not_received(tls, pidfd, monkeypatch):
    """A message whose frame was still in the dead peer's memory fails the
    read, and leaves nothing behind: the comm sees the peer is gone before
    it posts the frame's receive (over the data endpoint, without peer
    error handling, UCX would leave a receive matched to the dead peer's
    message pending until canceled).  Also where the peer's liveness comes
    from ``/proc`` (no pidfd)."""
    if not pidfd:

        def no_pidfd(pid):
            raise OSError(38, "pidfd_open not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    async with comm_to_peer(tls, "write-pending") as (comm, proc):
        dep = comm._dep.endpoint
        assert (comm._w._engine.pidfds[dep] >= 0) == pidfd
        await _dead_peer_with_a_message_on_its_way(comm, proc)
        lw = comm._lw
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(comm.read(), 10)
        assert _held(lw) == []
        assert lw.w.stranded_bytes == 0
        await comm.close()


@gen_test(timeout=60)
async def test_a_send_cut_short_by_the_peers_death_is_counted_and_limited(caplog):
    """A 64 MiB frame the peer had not fetched when it died stays with UCX
    (the data endpoint has no peer error handling, and UCX neither cancels
    a send nor force-closes such an endpoint): the write fails, the frame
    counts in the worker's ``stranded_bytes`` against ``max-stranded-bytes``
    (``GPUCX_MAX_STRANDED_BYTES`` of the comm's context), past it new comms
    of the loop get no data endpoint (one warning), and the frame is freed
    when the loop's last comm closes its worker."""
    tls = "sm,tcp"
    big = np.ones(64 << 20, "u1")
    freed = weakref.ref(big)
    with dask.config.set({"distributed-gpucx.max-stranded-bytes": "32MiB"}):
        # A second comm keeps the loop's worker open, as in a Dask worker.
        async with comm_to_peer(tls, "silent") as (keep, _):
            lw = keep._lw
            async with comm_to_peer(tls, "silent") as (comm, proc):
                assert comm._lw is lw and comm._dep is not comm._ep
                writer = asyncio.ensure_future(comm.write({"x": to_serialize(big)}))
                del big
                await asyncio.sleep(0.3)
                assert not writer.done()  # the peer does not read
                proc.kill()
                with pytest.raises(CommClosedError):
                    await asyncio.wait_for(writer, 10)
                del writer
            assert not lw.w.closed
            assert lw.ctx.max_stranded_bytes == 32 << 20
            assert lw.w.stranded_bytes == 64 << 20
            assert freed() is not None
            for _ in range(2):  # refused twice, one warning
                async with comm_to_peer(tls, "silent") as (other, _):
                    assert other._lw is lw
                    assert other._dep is other._ep  # the connection's endpoint
                    await other.close()
            await keep.close()
    assert caplog.text.count("max-stranded-bytes") == 1
    assert lw.w.closed and lw.w.stranded_bytes == 0  # the worker closed
    gc.collect()
    assert freed() is None


def test_env_is_not_written(monkeypatch):
    before = dict(os.environ)
    with dask.config.set({"distributed-gpucx.tls": "tcp"}):
        cfg = rt.context_config()
    assert cfg["TLS"] == "tcp"
    assert dict(os.environ) == before


@pytest.mark.parametrize("tls", ["tcp", "sm,tcp"])
@gen_test(timeout=60)
async def test_peer_process_closing_cleanly_delivers_everything_first(tls):
    """A peer process that writes and closes (and lives on): every message
    arrives before ``CommClosedError``, and the data endpoint to the live
    peer is closed normally, not failed."""
    async with comm_to_peer(tls, "burst-close") as (comm, _):
        dep = comm._dep.endpoint
        await asyncio.sleep(0.5)  # the peer has written and closed by now
        for i in range(20):
            msg = await asyncio.wait_for(comm.read(), 10)
            assert msg["i"] == i and int(msg["x"][0]) == i
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(comm.read(), 10)
        assert dep.error is None
        await comm.close()
        assert dep.closed and dep.error is None
