"""Dask's comm contract for gpucx://: issue 33's defects, and distributed's
generic comm checks.

The ``check_*`` helpers and the tests that use them are written here after
the checks of dask/distributed's ``distributed/comm/tests/test_comms.py``
(``check_client_server``, ``check_comm_closed_implicit``/``explicit``,
``check_many_listeners``, ``check_listener_deserialize``,
``check_connector_deserialize``, ``check_deserialize_roundtrip``,
``check_deserialize_eoferror``, ``check_repr``, ``check_addresses``,
``check_connect_timeout``, ``test_comm_closed_on_write_error``,
``test_comm_closed_on_read_error``, ``test_retry_connect``,
``test_handshake_slow_comm``), pointed at ``gpucx://``; none of their code
is copied.  The numbered tests are issue 33's items.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

distributed = pytest.importorskip("distributed")

import dask.config  # noqa: E402
from distributed.comm import connect, listen, parse_host_port  # noqa: E402
from distributed.comm.core import CommClosedError, FatalCommClosedError  # noqa: E402
from distributed.comm.registry import get_backend  # noqa: E402
from distributed.protocol import (  # noqa: E402
    Serialized,
    deserialize,
    serialize,
    to_serialize,
)
from distributed.utils import get_ip  # noqa: E402
from distributed.utils_test import gen_test  # noqa: E402

import gpucx.dask.comm as gcomm  # noqa: E402
from gpucx.dask import _runtime as rt  # noqa: E402

pytestmark = pytest.mark.timeout(60)

EXTERNAL_IP4 = get_ip()


async def echo_once(comm):
    msg = await comm.read()
    await comm.write(msg)
    await comm.close()


async def comm_pair(addr="gpucx://127.0.0.1", **kw):
    """``(client, server)`` comms over a listener that is stopped again."""
    q: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        await q.put(comm)

    lst = await listen(addr, handle, **kw)
    client = await connect(lst.contact_address, **kw)
    server = await asyncio.wait_for(q.get(), 10)
    lst.stop()
    return client, server


def host_is(host, port=None):
    def check(loc):
        h, p = parse_host_port(loc)
        assert h == host
        assert p == port if port is not None else 1023 < p < 65536

    return check


# -- ported: check_client_server ------------------------------------------


async def check_client_server(addr, check_listen=None, check_contact=None):
    seen = []

    async def handle(comm):
        assert comm.peer_address.startswith("gpucx://")
        msg = await comm.read()
        seen.append(msg["key"])
        await comm.write({"op": "pong", "data": msg["data"]})
        await comm.close()

    lst = await listen(addr, handle, xxx="bar")  # unknown kwargs are ignored
    scheme, loc = lst.listen_address.split("://")
    assert scheme == "gpucx"
    if check_listen:
        check_listen(loc)
    if check_contact:
        check_contact(lst.contact_address.split("://")[1])

    async def client(key, delay=0):
        comm = await connect(lst.contact_address, xxx="bar")
        assert comm.peer_address == lst.contact_address
        await asyncio.sleep(delay)
        await comm.write({"op": "ping", "key": key, "data": b"x" * key})
        assert await comm.read() == {"op": "pong", "data": b"x" * key}
        await comm.close()

    await client(1234)
    await asyncio.gather(*(client(i, 0.02) for i in range(20)))
    assert set(seen) == {1234} | set(range(20))
    lst.stop()


@gen_test()
async def test_client_server_addresses():
    await check_client_server("gpucx://127.0.0.1", host_is("127.0.0.1"))
    await check_client_server(
        "gpucx://0.0.0.0", host_is("0.0.0.0"), host_is(EXTERNAL_IP4)
    )


# Issue 33, item 7: an empty host is reported as 0.0.0.0, as tcp:// does.
@gen_test()
async def test_7_empty_host_reports_0000():
    await check_client_server("gpucx://", host_is("0.0.0.0"), host_is(EXTERNAL_IP4))
    async with listen("gpucx://", echo_once) as lst:
        assert lst.listen_address.startswith("gpucx://0.0.0.0:")
        assert lst.get_host_port()[0] == "0.0.0.0"


# -- ported: closed implicitly / explicitly --------------------------------


@gen_test()
async def test_comm_closed_implicit():
    async def handle(comm):
        await comm.close()

    async with listen("gpucx://127.0.0.1", handle) as lst:
        comm = await connect(lst.contact_address)
        with pytest.raises(CommClosedError):
            await comm.write({})
            await comm.read()
        comm = await connect(lst.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()


@gen_test()
async def test_comm_closed_explicit():
    a, b = await comm_pair()
    a_read = asyncio.ensure_future(a.read())
    b_read = asyncio.ensure_future(b.read())
    await asyncio.sleep(0)
    await a.close()
    for fut in (a_read, b_read):
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(fut, 5)
    for comm in (a, b):
        with pytest.raises(CommClosedError):
            await comm.read()
        with pytest.raises(CommClosedError):
            await comm.write({})
    await b.close()


# -- ported: many listeners ------------------------------------------------


@gen_test()
async def test_many_listeners():
    for addr in ("gpucx://127.0.0.1", "gpucx://0.0.0.0", "gpucx://"):
        lsts = [await listen(addr, echo_once) for _ in range(20)]
        assert len({lst.listen_address for lst in lsts}) == 20
        assert len({lst.contact_address for lst in lsts}) == 20
        for lst in lsts:
            lst.stop()


# -- ported: deserialize (listener and connector sides) --------------------


async def check_listener_deserialize(deserialize_flag, msg, check):
    q: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        try:
            q.put_nowait(await comm.read())
        except Exception as exc:
            q.put_nowait(exc)
        finally:
            await comm.close()

    # The comm outlives its listener (issue 33, item 1).
    async with listen("gpucx://", handle, deserialize=deserialize_flag) as lst:
        comm = await connect(lst.contact_address)
    await comm.write(msg)
    out = await asyncio.wait_for(q.get(), 10)
    if isinstance(out, Exception):
        raise out
    check(out)
    await comm.close()


async def check_connector_deserialize(deserialize_flag, msg, check):
    done = asyncio.Event()

    async def handle(comm):
        try:
            await comm.write(msg)
            await done.wait()
        finally:
            await comm.close()

    async with listen("gpucx://", handle) as lst:
        comm = await connect(lst.contact_address, deserialize=deserialize_flag)
    try:
        out = await asyncio.wait_for(comm.read(), 10)
        done.set()
    finally:
        await comm.close()
    check(out)


def _check_out(msg_orig, payload, deserialize_flag):
    def check(out):
        out = dict(out)
        to_ser = out.pop("to_ser")
        ser = out.pop("ser")
        rest = {k: v for k, v in msg_orig.items() if k not in ("to_ser", "ser")}
        assert out == rest
        (to_ser,) = to_ser
        if deserialize_flag:
            assert to_ser == payload
            assert ser == payload or bytes(ser) == payload
        else:
            assert isinstance(ser, Serialized)
            assert deserialize(ser.header, ser.frames) == payload
            if isinstance(to_ser, Serialized):
                assert deserialize(to_ser.header, to_ser.frames) == payload
            else:
                assert to_ser == to_serialize(payload)

    return check


@gen_test()
async def test_deserialize_on_listener_and_connector():
    for payload in (456, os.urandom(1 << 20) * 8):  # small, then 8 MiB
        msg = {
            "op": "update",
            "x": b"abc",
            "to_ser": [to_serialize(payload)],
            "ser": Serialized(*serialize(payload)),
        }
        for flag in (False, True):
            await check_listener_deserialize(flag, msg, _check_out(msg, payload, flag))
            await check_connector_deserialize(flag, msg, _check_out(msg, payload, flag))


@gen_test()
async def test_deserialize_roundtrip():
    data = os.urandom(1 << 20) * 4
    msg = {
        "op": "update",
        "x": data,
        "to_ser": [to_serialize(data)],
        "ser": Serialized(*serialize(data)),
    }
    for flag in (True, False):
        a, b = await comm_pair(deserialize=flag)
        # A large write completes once the peer reads it (rendezvous, as
        # with ucx://; docs/dask.md): write and read together.
        _, back = await asyncio.gather(a.write(msg), b.read())
        _, got = await asyncio.gather(b.write(back), a.read())
        assert sorted(got) == sorted(msg)
        assert got["op"] == msg["op"] and got["x"] == msg["x"]
        if flag:
            assert isinstance(got["to_ser"][0], (bytes, bytearray))
            assert isinstance(got["ser"], (bytes, bytearray))
        else:
            assert isinstance(got["to_ser"][0], (to_serialize, Serialized))
            assert isinstance(got["ser"], Serialized)
        await a.close()
        await b.close()


def _raise_eof():
    raise EOFError


class _EOFOnLoad:
    def __reduce__(self):
        return _raise_eof, ()


@gen_test()
async def test_deserialize_eoferror_closes_the_comm():
    async def handle(comm):
        await comm.write({"data": to_serialize(_EOFOnLoad())})
        with pytest.raises(CommClosedError):
            await comm.read()

    async with listen("gpucx://127.0.0.1", handle) as lst:
        comm = await connect(lst.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()


# -- ported: repr and addresses --------------------------------------------


@gen_test()
async def test_repr_and_addresses():
    a, b = await comm_pair()
    assert a.peer_address == b.local_address
    assert a.local_address == b.peer_address
    assert a.local_address in repr(b) and b.local_address in repr(a)
    assert "closed" not in repr(a) and "closed" not in repr(b)
    await a.close()
    assert "closed" in repr(a)
    assert a.local_address in repr(a) and b.peer_address in repr(a)
    await b.close()
    assert "closed" in repr(b)


# -- ported: read and write errors (and issue 33, item 3) -----------------


class CustomBase(BaseException):
    """Neither a connection loss nor KeyboardInterrupt (which would stop the
    test's loop)."""


@pytest.mark.parametrize("exc_type", [BufferError, CustomBase, KeyboardInterrupt])
@gen_test()
async def test_3_write_error_aborts_and_propagates(exc_type, monkeypatch):
    a, b = await comm_pair()

    async def fail(frames):
        raise exc_type()

    monkeypatch.setattr(a, "_send_frames", fail)
    if exc_type is KeyboardInterrupt:
        # Not awaited in a task: asyncio would stop the loop with it.
        with pytest.raises(KeyboardInterrupt):
            a.write("x").send(None)
    else:
        with pytest.raises(exc_type):
            await a.write("x")
    assert a.closed()
    with pytest.raises(CommClosedError):  # the peer sees a closed comm
        await asyncio.wait_for(b.read(), 5)
    await a.close()
    await b.close()


@pytest.mark.parametrize("exc_type", [TypeError, CustomBase])
@gen_test()
async def test_3_read_error_aborts_and_propagates(exc_type, monkeypatch):
    a, b = await comm_pair()

    async def fail(buf):
        raise exc_type("a bug")

    monkeypatch.setattr(a, "_recv", fail)
    with pytest.raises(exc_type):
        await a.read()
    assert a.closed()
    await a.close()
    await b.close()


@gen_test()
async def test_3_connection_errors_still_become_commclosederror(monkeypatch):
    import gpucx

    a, b = await comm_pair()

    async def fail(buf):
        raise gpucx.PeerError("gone", -25)

    monkeypatch.setattr(a, "_recv", fail)
    with pytest.raises(CommClosedError):
        await a.read()
    assert a.closed()
    await b.close()


@gen_test()
async def test_read_timeout_closes_the_comm():
    a, b = await comm_pair()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(a.read(), 0.01)
    assert a.closed()
    await a.close()
    await b.close()


# -- ported: retry, handshake, connect timeout ----------------------------


@gen_test()
async def test_slow_comm_still_completes_the_handshake(monkeypatch):
    # distributed >= 2026 no longer bounds the handshake by the connect
    # timeout (dask/distributed#7698): a slow comm only takes longer.
    read, write = gcomm.GpucxComm.read, gcomm.GpucxComm.write

    async def slow_read(self, *a, **kw):
        await asyncio.sleep(0.1)
        return await read(self, *a, **kw)

    async def slow_write(self, *a, **kw):
        await asyncio.sleep(0.1)
        return await write(self, *a, **kw)

    monkeypatch.setattr(gcomm.GpucxComm, "read", slow_read)
    monkeypatch.setattr(gcomm.GpucxComm, "write", slow_write)
    async with listen("gpucx://127.0.0.1", echo_once) as lst:
        comm = await connect(lst.contact_address)
        await comm.write(b"test")
        assert await comm.read() == b"test"
        await comm.close()


@gen_test()
async def test_connect_timeout_to_nobody():
    async with listen("gpucx://127.0.0.1", echo_once) as lst:
        addr = lst.contact_address
    t0 = time.monotonic()
    with pytest.raises(OSError):
        await connect(addr, timeout=0.15)
    assert 0.1 <= time.monotonic() - t0 <= 1.5


# -- issue 33, item 1: stop() leaves established comms alone ---------------


@gen_test()
async def test_1_listener_stop_leaves_established_comms_alone():
    served = asyncio.Event()
    go_on = asyncio.Event()

    async def handle(comm):
        served.set()
        await go_on.wait()  # a request being served while the server stops
        await comm.write(await comm.read())
        await comm.close()

    lst = await listen("gpucx://127.0.0.1", handle)
    addr = lst.contact_address
    comm = await connect(addr)
    await asyncio.wait_for(served.wait(), 5)
    lst.stop()
    assert lst.contact_address == addr  # still says where it listened
    go_on.set()
    await comm.write({"still": "here"})
    assert await asyncio.wait_for(comm.read(), 5) == {"still": "here"}
    await comm.close()
    # New connections are refused.
    with pytest.raises(OSError):
        await connect(addr, timeout=0.3)


# -- issue 33, item 2: IPv6 refused before UCX (never a crash) -------------

_IPV6_SCRIPT = """
import asyncio
from distributed.comm import connect, listen
from distributed.comm.core import FatalCommClosedError

async def main():
    for addr in ("gpucx://[::1]:0", "gpucx://[::]:0"):
        try:
            await listen(addr, lambda comm: None)
        except FatalCommClosedError as exc:
            assert "IPv6" in str(exc), exc
        else:
            raise SystemExit("listen on IPv6 was not refused")
    try:
        await connect("gpucx://[::1]:45678", timeout=5)
    except FatalCommClosedError as exc:
        assert "IPv6" in str(exc), exc
    else:
        raise SystemExit("connect to IPv6 was not refused")
    print("refused")

asyncio.run(main())
"""


_IPV6_WORKS = """
import asyncio
from distributed.comm import connect, listen
from distributed.comm.core import FatalCommClosedError

async def echo(comm):
    await comm.write(await comm.read())
    await comm.close()

async def main():
    for addr in ("gpucx://[::1]:0", "gpucx://"):
        async with listen(addr, echo) as lst:
            assert lst.listen_address.startswith("gpucx://[:"), lst.listen_address
            port = lst.get_host_port()[1]
            comm = await connect(f"gpucx://[::1]:{port}")
            await comm.write({"x": b"y" * 100_000})
            assert await comm.read() == {"x": b"y" * 100_000}
            await comm.close()
    try:
        await connect("gpucx://127.0.0.1:45678", timeout=5)
    except FatalCommClosedError as exc:
        assert "IPv6" in str(exc), exc
    else:
        raise SystemExit("IPv4 was not refused in IPv6 mode")
    print("ipv6 ok")

asyncio.run(main())
"""


def _run(script, **env):
    return subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_2_ipv6_is_refused_with_a_clear_error():
    # In a process of its own: without the refusal UCX aborts the process.
    out = _run(_IPV6_SCRIPT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused" in out.stdout
    assert "UCX  ERROR" not in out.stdout + out.stderr


def test_2_ipv6_works_with_ucx_set_to_ipv6():
    out = _run(_IPV6_WORKS, UCX_TCP_AF_PRIO="inet6")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ipv6 ok" in out.stdout


def test_2_no_deprecated_get_ipv6():
    assert not hasattr(gcomm, "get_ipv6")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local = get_backend("gpucx").get_local_address_for("127.0.0.1:8786")
    assert local == "127.0.0.1"
    with pytest.raises(FatalCommClosedError, match="IPv6"):
        get_backend("gpucx").get_local_address_for("[::1]:8786")


# -- issue 33, item 4: loop workers and dropped comms ----------------------


async def _leave_open():
    """Open a listener and a comm pair and close none of them; return the
    loop's worker."""
    q: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        await q.put(comm)

    lst = await listen("gpucx://127.0.0.1", handle)
    comm = await connect(lst.contact_address)
    server = await asyncio.wait_for(q.get(), 10)
    lw = rt._workers[asyncio.get_running_loop()]
    _leave_open.keep = (lst, comm, server)  # type: ignore[attr-defined]
    return lw


def test_4_loop_worker_closed_when_the_loop_ends():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        lw = asyncio.run(_leave_open())
        assert lw.w._h is None, "the loop's UCX worker outlived its loop"
        assert lw.loop not in rt._workers
        # A loop closed without shutting down: its worker goes on the next
        # acquire.
        loop = asyncio.new_event_loop()
        lw2 = loop.run_until_complete(_leave_open())
        loop.close()
        assert lw2.w._h is not None
        asyncio.run(_leave_open())
        assert lw2.w._h is None and loop not in rt._workers
        del _leave_open.keep  # type: ignore[attr-defined]
    gc.collect()


@gen_test()
async def test_4_dropped_comm_is_closed(caplog):
    a, b = await comm_pair()
    lw = a._lw
    refs = lw.refs
    with caplog.at_level(logging.WARNING, logger="gpucx.dask"):
        del a
        gc.collect()
    assert any("dangling" in r.getMessage() for r in caplog.records)
    assert lw.refs == refs - 1
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(b.read(), 5)
    await b.close()


# -- issue 33, items 5 and 6: port reuse, busy ports -----------------------


_DYING_SERVER = """
import asyncio, os
from distributed.comm import listen

async def main():
    async def handle(comm):
        await comm.read()
        os._exit(0)  # the kernel closes the server's side first: TIME_WAIT

    lst = await listen("gpucx://127.0.0.1:0", handle)
    print(lst.get_host_port()[1], flush=True)
    await asyncio.sleep(30)

asyncio.run(main())
"""


@gen_test()
async def test_5_port_reusable_right_after_the_previous_listener():
    # A scheduler restarted on its port while the old one's connections
    # are in TIME_WAIT.
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        comm = await connect(f"gpucx://127.0.0.1:{port}")
        await comm.write(1)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    comm.abort()
    lst = await listen(f"gpucx://127.0.0.1:{port}", echo_once)
    comm = await connect(lst.contact_address)
    await comm.write(1)
    assert await comm.read() == 1
    await comm.close()
    lst.stop()


@gen_test()
async def test_6_busy_port_raises_eaddrinuse(capfd):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            with pytest.raises(OSError) as info:
                await listen(f"gpucx://{host}:{port}", echo_once)
            assert info.value.errno == errno.EADDRINUSE
    out, err = capfd.readouterr()
    assert "UCX  ERROR" not in out + err  # gpucx's error, once (item 8)
    assert not rt._workers  # the failed listen released the worker


@gen_test(timeout=60)
async def test_6_worker_port_range_skips_a_busy_port():
    from distributed import Scheduler, Worker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        async with (
            Scheduler(protocol="gpucx", dashboard_address=":0") as s,
            Worker(s.address, host="127.0.0.1", port=f"{port}:{port + 3}") as w,
        ):
            assert w.address.startswith("gpucx://127.0.0.1:")
            assert port < int(w.address.rsplit(":", 1)[1]) <= port + 3


# -- issue 33, item 8: no UCX noise at a LocalCluster's close --------------


def test_8_local_cluster_closes_quietly(capfd):
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            protocol="gpucx",
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as c,
    ):
        futs = c.map(lambda x: x + 1, range(20))
        assert sum(c.gather(futs)) == sum(range(1, 21))
    out, err = capfd.readouterr()
    assert "UCX  WARN" not in out + err
    assert "UCX  ERROR" not in out + err


# -- issue 33, item 9: no poll mode -----------------------------------------


def test_9_poll_progress_is_removed():
    with (
        dask.config.set({"distributed-gpucx.progress": "poll"}),
        pytest.warns(FutureWarning, match="poll was removed"),
    ):
        s = rt.settings()
    assert s.progress == "event"
