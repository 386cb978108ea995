"""Endpoint modes: ``worker.connect(address, mode="same-host")``.

An endpoint to a process on this host without UCX peer error handling (so
UCX may take single-copy ``cma`` for large messages), looked after by
gpucx: the peer process is watched, a close with operations pending parks
the endpoint with the worker's engine until they are done, and what given
up operations hold is counted (``Worker.stranded_bytes``) and capped
(``GPUCX_MAX_STRANDED_BYTES``).  Real processes throughout
(tests/peers_modes.py).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib

import numpy as np
import pytest
from peers_modes import receiver_peer

import gpucx
from gpucx import _address

from conftest import channel_pair, spawn

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@contextlib.contextmanager
def peer_process(config=None):
    """``(channel, process, address)`` of a :func:`receiver_peer`; killed
    at the end."""
    ours, theirs = channel_pair()
    proc = spawn(receiver_peer, theirs, config)
    try:
        yield ours, proc, ours.get(30)
    finally:
        proc.kill()
        proc.join(10)


def _progress_until(w, cond, timeout: float = 10.0) -> float:
    """Progress ``w`` until ``cond()``; the seconds it took (fails on
    timeout)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        w.progress()
        time.sleep(0.001)
    return time.monotonic() - t0


def _pending_send(ep, w, nbytes: int, tag: int = 7):
    """A rendezvous send of ``nbytes`` the peer has not received, started
    (its RTS out): UCX holds it until the peer fetches it."""
    buf = np.ones(nbytes, "u1")
    req = ep.send_nb(buf, tag)
    for _ in range(50):
        w.progress()
    assert not req.done()
    return req


def test_same_host_endpoint_moves_large_messages_with_cma():
    with (
        peer_process() as (chan, _proc, addr),
        gpucx.Context() as ctx,
    ):
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        checked = w.connect(addr)  # peer error handling: no cma
        for e in (ep, checked):
            chan.put(("recv", 8 * MiB, 1))
            e.send(np.ones(8 * MiB, "u1"), 1)
            assert chan.get(30) == ("got", 8 * MiB)
        if ("cma", "memory") not in ep.transports:
            pytest.skip(f"no cma here ({ep.transports})")
        assert ("cma", "memory") not in checked.transports
        proto = ep.protocol("tag", 8 * MiB)
        assert proto is not None and "cma" in proto.config, proto
        assert w.stranded_bytes == 0
        ep.close()
        checked.close()
        chan.put("bye")


def test_peer_killed_mid_send_fails_pending_ops_with_peer_error():
    """A 32 MiB rendezvous send the peer never fetched: its death fails it
    with PeerError within the liveness bound (UCX never would: no error
    handling), it stays with UCX (counted in stranded_bytes) until the
    worker closes, and the endpoint is failed."""
    with peer_process() as (_chan, proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        req = _pending_send(ep, w, 32 * MiB)
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(gpucx.PeerError, match=f"peer process {proc.pid} died"):
            req.wait(10)
        assert time.monotonic() - t0 < 3
        assert isinstance(ep.error, gpucx.PeerError)
        assert ep.closed
        with pytest.raises(gpucx.PeerError):
            ep.send(b"x", 1)
        assert w.stranded_bytes == 32 * MiB
        ep.close()  # nothing left to do
        assert w.stranded_bytes == 32 * MiB
        w.close()
        assert w.stranded_bytes == 0


def test_close_with_pending_ops_parks_and_closes_once_idle():
    """A close with a send pending returns at once (the endpoint is closed
    for the user); the worker keeps the UCX endpoint until the send is done,
    counting its bytes meanwhile, then flush-closes it."""
    with peer_process() as (chan, _proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        req = _pending_send(ep, w, 16 * MiB)
        t0 = time.monotonic()
        ep.close(force=True)  # a force close is not UCX's to do here
        assert time.monotonic() - t0 < 0.5
        assert ep.closed
        with pytest.raises(gpucx.ClosedError):
            ep.send(b"x", 1)
        e = w._engine
        assert len(e.parked_eps) == 1
        assert w.stranded_bytes == 16 * MiB
        chan.put(("recv", 16 * MiB, 7))
        # Waiting for the send goes on (UCX still does it): no ClosedError.
        assert req.wait(10) is None
        _progress_until(w, lambda: not e.parked_eps)
        assert chan.get(30) == ("got", 16 * MiB)
        assert w.stranded_bytes == 0
        assert not e.watched and not e.pidfds  # the parked peer's watch went
        chan.put("bye")


def test_parked_endpoint_whose_peer_dies_fails_its_ops():
    with peer_process() as (_chan, proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        req = _pending_send(ep, w, 16 * MiB)
        ep.close()
        assert len(w._engine.parked_eps) == 1
        proc.kill()
        with pytest.raises(gpucx.PeerError, match="died"):
            req.wait(10)
        _progress_until(w, lambda: not w._engine.parked_eps)
        assert w.stranded_bytes == 16 * MiB  # UCX keeps it until the close
        w.close()
        assert w.stranded_bytes == 0


def test_close_of_an_idle_endpoint_is_immediate():
    with peer_process() as (chan, _proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        chan.put(("recv", 4, 3))
        ep.send(b"ping", 3)
        assert chan.get(30) == ("got", 4)
        ep.close()
        assert ep.closed and ep.error is None
        assert not w._engine.parked_eps and w.stranded_bytes == 0
        chan.put("bye")


def test_same_process_workers():
    """Two workers of one process: no liveness to watch, the rest holds."""
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address, mode="same-host")
        req = _pending_send(ep, a, 8 * MiB)
        ep.close()
        assert a.stranded_bytes == 8 * MiB
        out = np.empty(8 * MiB, "u1")
        r = b.recv_nb(out, 7)
        t0 = time.monotonic()
        while a._engine.parked_eps or not r.done():
            assert time.monotonic() - t0 < 10
            a.progress()
            b.progress()
        assert req.done() and out[-1] == 1
        assert a.stranded_bytes == 0


def test_the_cap_refuses_new_same_host_endpoints():
    cfg = {"GPUCX_MAX_STRANDED_BYTES": 4 * MiB}
    with (
        peer_process() as (_c1, dying, addr1),
        peer_process() as (chan, _p2, addr2),
        gpucx.Context(config=cfg) as ctx,
    ):
        assert ctx.max_stranded_bytes == 4 * MiB
        w = ctx.create_worker()
        ep = w.connect(addr1, mode="same-host")
        req = _pending_send(ep, w, 4 * MiB)
        dying.kill()
        with pytest.raises(gpucx.PeerError):
            req.wait(10)
        assert w.stranded_bytes == 4 * MiB
        with pytest.raises(
            gpucx.UnsupportedError, match=r"hold 4194304 bytes.*MAX_STRANDED_BYTES"
        ):
            w.connect(addr2, mode="same-host")
        # The caller's fallback: an endpoint with peer error handling.
        ok = w.connect(addr2)
        chan.put(("recv", 2, 1))
        ok.send(b"hi", 1)
        assert chan.get(30) == ("got", 2)
        # Another worker strands nothing: the cap is per worker.
        w2 = ctx.create_worker()
        w2.connect(addr2, mode="same-host").close()
        chan.put("bye")


def test_no_cap():
    with (
        peer_process() as (_c, dying, addr),
        gpucx.Context(config={"GPUCX_MAX_STRANDED_BYTES": 0}) as ctx,
    ):
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        req = _pending_send(ep, w, 4 * MiB)
        dying.kill()
        with pytest.raises(gpucx.PeerError):
            req.wait(10)
        b = ctx.create_worker()
        w.connect(b.address, mode="same-host").close()  # still allowed


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_check_peer(pidfd, monkeypatch):
    if not pidfd:

        def no_pidfd(pid):
            raise OSError(38, "pidfd_open not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    with peer_process() as (_chan, proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(addr, mode="same-host")
        assert (w._engine.pidfds[ep] >= 0) == pidfd
        ep.check_peer()  # alive: nothing
        proc.kill()
        proc.join(10)
        with pytest.raises(gpucx.PeerError, match=f"process {proc.pid} died"):
            ep.check_peer()
        assert ep.closed and ep.error is not None
        with pytest.raises(gpucx.PeerError):
            ep.check_peer()
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(w.address)
        ep.close()
        with pytest.raises(gpucx.ClosedError):
            ep.check_peer()


def test_wrong_arguments_are_refused():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        addr = w.address
        with pytest.raises(ValueError, match="mode must be None or 'same-host'"):
            w.connect(addr, mode="local")
        with pytest.raises(ValueError, match="leave error_handling out"):
            w.connect(addr, mode="same-host", error_handling=True)
        with pytest.raises(ValueError, match="needs a gpucx worker address"):
            w.connect(w.ucx_address, mode="same-host", raw=True)
        with pytest.raises(ValueError, match="needs a gpucx worker address"):
            w.connect(("127.0.0.1", 1), mode="same-host")
        with pytest.raises(gpucx.InvalidAddressError):
            w.connect(w.ucx_address, mode="same-host")
        # error_handling=False says the same as the mode: accepted.
        w.connect(addr, mode="same-host", error_handling=False).close()


def test_liveness_off_refuses():
    with gpucx.Context(config={"GPUCX_PEER_CHECK_INTERVAL": 0}) as ctx:
        w = ctx.create_worker()
        with pytest.raises(gpucx.UnsupportedError, match="PEER_CHECK_INTERVAL=0"):
            w.connect(w.address, mode="same-host")


def _reframed(addr: bytes, **changes) -> bytes:
    """``addr`` with its trailer's identity changed (valid checksum)."""
    ucx, ident = _address.parse(addr)
    ident = ident._replace(**changes)
    head = ucx + struct.pack(
        "<4sBBHIIQQ16s",
        _address.MAGIC,
        _address.VERSION,
        0,
        ident.node_key,
        len(ucx),
        ident.pid,
        ident.pidns,
        ident.start_time,
        ident.boot_id,
    )
    return head + struct.pack("<I", zlib.crc32(head))


def test_identity_refusals():
    with peer_process() as (chan, proc, addr), gpucx.Context() as ctx:
        w = ctx.create_worker()
        ident = _address.parse(addr)[1]
        assert ident.node_key == _address.own_identity().node_key != 0
        with pytest.raises(gpucx.UnsupportedError, match="does not run on this host"):
            w.connect(_reframed(addr, boot_id=bytes(range(16))), mode="same-host")
        with pytest.raises(gpucx.UnsupportedError, match="does not run on this host"):
            w.connect(_reframed(addr, pidns=ident.pidns + 1), mode="same-host")
        other = ident.node_key ^ 1 or 2
        with pytest.raises(gpucx.UnsupportedError, match="another host name"):
            w.connect(_reframed(addr, node_key=other), mode="same-host")
        # A writer that predates the node key (0) is taken at its word.
        w.connect(_reframed(addr, node_key=0), mode="same-host").close()
        chan.put("bye")
        proc.join(10)
        with pytest.raises(gpucx.PeerError, match="is gone"):
            w.connect(addr, mode="same-host")


_OTHER_HOST_CLIENT = """
import sys, gpucx
addr = bytes.fromhex(sys.stdin.readline().strip())
w = gpucx.Context().create_worker()
try:
    w.connect(addr, mode="same-host")
except gpucx.UnsupportedError as exc:
    print("refused:", exc, flush=True)
else:
    print("accepted", flush=True)
w.connect(addr).close(force=True)
print("plain ok", flush=True)
"""


def test_a_peer_on_another_host_is_refused(hosts):
    """A process on an emulated host (tests/hosts.py: its own boot id, host
    name, IPC and mount namespaces, the same kernel) is refused, with the
    reason, by a process on the other; an endpoint with peer error handling
    is made.  (The node key alone, same boot id: the test above.)"""
    server = hosts[0].python(
        "-c",
        "import sys, gpucx; w = gpucx.Context().create_worker(); "
        "print(w.address.hex(), flush=True); sys.stdin.readline()",
    )
    addr = server.readline().strip()
    client = hosts[1].python("-c", _OTHER_HOST_CLIENT)
    assert client.proc.stdin is not None
    client.proc.stdin.write(addr + "\n")
    client.proc.stdin.flush()
    line = client.readline()
    assert line.startswith("refused:"), line
    assert "does not run on this host (another boot id" in line
    assert client.readline().strip() == "plain ok"
    client.join()
    server.put("bye")


def test_held_bytes_sizes_what_operations_keep():
    from gpucx.endpoint import _held_bytes
    from gpucx.mem.buffer import acquire

    assert _held_bytes(acquire(b"abcd", False)[3]) == 4
    assert _held_bytes(acquire(bytearray(10), True)[3]) == 10
    arr = np.ones((3, 5), "f8")
    assert _held_bytes(acquire(arr, False)[3]) == arr.nbytes
    assert _held_bytes(None) == 0
    assert _held_bytes(object()) == 0
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address, mode="same-host")
        big = np.ones(8 * MiB, "u1")
        req = ep.send_nb([big, b"x" * 100], 9)  # an IOV send
        for _ in range(50):
            a.progress()
        assert not req.done()
        ep.close()
        assert a.stranded_bytes == 8 * MiB + 100
        r = b.recv_nb(np.empty(8 * MiB + 100, "u1"), 9)
        _progress_until(a, lambda: r.done() and a.stranded_bytes == 0)


def test_an_aio_worker_connects_in_same_host_mode():
    """``gpucx.aio.Worker.connect``/``aconnect`` take the mode as the core
    worker does (a same-host endpoint to a worker of this process)."""
    import asyncio

    async def main():
        with gpucx.Context() as ctx:
            async with gpucx.aio.Worker(ctx) as aw, gpucx.aio.Worker(ctx) as peer:
                ep = aw.connect(peer.address, mode="same-host")
                ep2 = await aw.aconnect(peer.address, mode="same-host")
                plain = aw.connect(peer.address)
                assert plain.endpoint.mode is None
                for e in (ep, ep2, plain):
                    if e is not plain:
                        assert e.endpoint.mode == "same-host"
                    e.close()

    asyncio.run(main())
