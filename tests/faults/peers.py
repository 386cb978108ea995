"""Peer processes for the fault tests, started from a forkserver.

A forkserver with NumPy and gpucx preloaded forks each peer in a few
milliseconds instead of spawning a fresh interpreter (about a second); the
peer creates its own Context, which gpucx allows in a forked child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np

import gpucx

from conftest import Channel, transport_config

#: Bytes of a message large enough to go by rendezvous on every transport.
BIG = 16 << 20
#: Bytes of the region a peer exports for put/get/atomics.
REGION = 16 << 20
#: The active-message id of the tests.
AM_ID = 7
#: An id the survivor uses with posted receives only (no handler): the
#: peer's message to it waits there as a kept message.
KEEP_ID = 8

_mp = mp.get_context("forkserver")
_mp.set_forkserver_preload(["numpy", "gpucx", "conftest", "faults.peers"])


def start(role: str, tls: str, via_listener: bool = False):
    """Start a peer playing ``role``; return ``(process, channel)``."""
    a, b = _mp.Pipe(duplex=True)
    p = _mp.Process(target=_main, args=(Channel(b), role, tls, via_listener))
    p.daemon = True
    p.start()
    b.close()
    return p, Channel(a)


@contextlib.contextmanager
def started(role: str, tls: str, via_listener: bool = False):
    """:func:`start` as a context manager that reaps the peer on the way
    out (killing it if the test left it alive)."""
    proc, chan = start(role, tls, via_listener)
    try:
        yield proc, chan
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def kill(proc) -> None:
    """SIGKILL a peer (it is left unreaped: a zombie until the forkserver
    collects it, which gpucx must still see as dead)."""
    os.kill(proc.pid, signal.SIGKILL)


def _main(chan: Channel, role: str, tls: str, via_listener: bool) -> None:
    eh = role != "amo"  # UCX offers atomics only without peer error handling
    with gpucx.Context(config=transport_config(tls, via_listener)) as ctx:
        w = ctx.create_worker()
        if via_listener:
            port = chan.get()
            ep = w.connect(("127.0.0.1", port))
        else:
            chan.put(w.address)
            ep = w.connect(chan.get(), error_handling=eh)
        region = ctx.allocate(REGION)
        # Handshake: a round trip, so both directions are wired up.
        buf = bytearray(5)
        w.recv(buf, tag=1, timeout=30)
        ep.send(buf, tag=2)
        chan.put(region.remote().to_bytes())
        req = None
        if role in ("am_rndv", "am_keep"):  # an AM the survivor receives later
            am_id = AM_ID if role == "am_rndv" else KEEP_ID
            data = np.ones(BIG, np.uint8)
            req = ep.am_send_nb(am_id, data, proto="rndv", reply=role == "am_rndv")
            while not chan.poll():  # until the survivor has the header
                w.progress()
        elif role == "tag_rndv":  # a rendezvous send the survivor matches
            req = ep.send_nb(np.ones(BIG, np.uint8), tag=5)
            while not chan.poll():  # until the survivor has seen it
                w.progress()
            chan.get()
            chan.put("idle")
        elif role == "echo":  # serve one more round trip, then leave
            data = np.empty(1 << 20, np.uint8)
            info = w.recv(data, tag=3, timeout=30)
            ep.send(data[: info.nbytes], tag=4)
            ep.flush(timeout=30)
            chan.get()
            ep.close()
            region.close()
            return
        # Idle: never progress again, so the survivor's operations stay
        # pending until this process is killed.
        chan.get(timeout=120)
        del req
        time.sleep(120)


def handshake(w, chan: Channel, listener=None, error_handling: bool = True):
    """The survivor's side of a peer's start-up; returns ``(ep, remote)``."""
    if listener is not None:
        chan.put(listener.port)
        ep = listener.accept(timeout=30)
    else:
        ep = w.connect(chan.get(), error_handling=error_handling)
        chan.put(w.address)
    ep.send(b"hello", tag=1)
    back = bytearray(5)
    w.recv(back, tag=2, timeout=30)
    assert bytes(back) == b"hello"
    return ep, chan.get()


def serve_new_peer(w, tls: str) -> None:
    """The survivor serves a new process normally: connect + round trip."""
    proc, chan = start("echo", tls)
    try:
        ep, _ = handshake(w, chan)
        data = np.arange(1 << 20, dtype=np.uint8)
        back = np.empty_like(data)
        req = w.recv_nb(back, tag=4)
        ep.send(data, tag=3)
        assert req.wait(30).nbytes == data.nbytes
        assert np.array_equal(back, data)
        chan.put("bye")
        end = time.monotonic() + 30
        while proc.is_alive() and time.monotonic() < end:
            w.progress()  # the peer's flush and close need us to progress
            proc.join(0.001)
        assert proc.exitcode == 0, f"echo peer exited with {proc.exitcode}"
        ep.close()
    finally:
        if proc.is_alive():
            proc.kill()
