"""Framed worker addresses: every malformed one is refused before UCX sees
it; hypothesis mutates real addresses (a fast sample here, 10,000+ cases
under ``-m fuzz``)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpucx
from gpucx import _address, _liveness

TRAILER = _address.TRAILER_LEN


@pytest.fixture
def stand_in():
    """A sleeping child process, and ``frame(worker)``: the worker's UCX
    address framed as if the worker ran in that child (its pid and start
    time), so that gpucx's liveness checks watch the child, which a test
    may kill."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = _address.proc_start_time(child.pid)

    def frame(worker) -> bytes:
        return _reframe(
            worker.ucx_address,
            pid=child.pid,
            start=start,
            boot=_address._boot,
            pidns=_address._ns,
        )

    try:
        yield child, start, frame
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def world():
    """A context with two workers; ``peer``'s address is the one mutated."""
    with gpucx.Context() as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        yield w, peer


def _reframe(ucx: bytes, **fields) -> bytes:
    """A trailer with chosen fields and a valid checksum."""
    f = dict(
        magic=_address.MAGIC,
        version=_address.VERSION,
        ucx_len=len(ucx),
        pid=os.getpid(),
        pidns=0,
        start=0,
        boot=bytes(16),
    )
    f.update(fields)
    head = ucx + struct.pack(
        "<4sBBHIIQQ16s",
        f["magic"],
        f["version"],
        0,
        0,
        f["ucx_len"],
        f["pid"],
        f["pidns"],
        f["start"],
        f["boot"],
    )
    return head + struct.pack("<I", zlib.crc32(head))


def test_address_is_ucx_address_plus_trailer(world):
    w, peer = world
    addr = peer.address
    assert addr[: len(peer.ucx_address)] == peer.ucx_address
    assert len(addr) == len(peer.ucx_address) + TRAILER
    ucx, ident = _address.parse(addr)
    assert ucx == peer.ucx_address
    assert ident.pid == os.getpid()
    assert ident.start_time == _address.proc_start_time()
    assert _address.is_local(ident)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda a: a[:-1], "no gpucx trailer"),  # cut short: trailer misread
        (lambda a: a + b"\0", "no gpucx trailer"),
        (lambda a: a[:TRAILER], "too short"),
        (lambda a: a[:5] + bytes([a[5] ^ 1]) + a[6:], "checksum"),
        (lambda a: a[:-1] + bytes([a[-1] ^ 0x80]), "checksum"),
    ],
    ids=["truncated", "extended", "trailer-only", "ucx-bit-flip", "crc-bit-flip"],
)
def test_malformed_framed_address(world, mutate, words):
    w, peer = world
    with pytest.raises(gpucx.InvalidAddressError, match=words):
        w.connect(mutate(peer.address))


def test_trailer_fields_checked(world):
    w, peer = world
    ucx = peer.ucx_address
    with pytest.raises(gpucx.InvalidAddressError, match="format version 9"):
        w.connect(_reframe(ucx, version=9))
    with pytest.raises(gpucx.InvalidAddressError, match="says the UCX part has"):
        w.connect(_reframe(ucx, ucx_len=len(ucx) - 1))
    ep = w.connect(_reframe(ucx))  # a well-formed trailer: accepted
    ep.close(force=True)


def test_raw_ucx_address_refused_unless_raw(world):
    w, peer = world
    with pytest.raises(gpucx.InvalidAddressError, match="raw=True"):
        w.connect(peer.ucx_address)
    ep = w.connect(peer.ucx_address, raw=True)
    assert not w._engine.watched  # no identity, no liveness checks
    ep.close(force=True)


def test_local_peer_watched_and_unwatched_on_close(world):
    w, peer = world
    other = _reframe(peer.ucx_address, pid=1, boot=_address._boot, pidns=_address._ns)
    ep = w.connect(other)
    assert w._engine.watched[ep][:2] == (1, 0)
    ep.close(force=True)
    assert ep not in w._engine.watched


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_local_peer_checked_through_its_pidfd_until_unwatched(
    pidfd, monkeypatch, stand_in
):
    """A watched peer is checked with a select of its pidfd, opened when the
    peer is watched and closed when its endpoint closes or the peer is found
    dead; /proc confirms a death (and is the whole check without pidfds)."""
    if not pidfd:

        def no_pidfd(pid):
            raise OSError(38, "pidfd_open not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    child, start, frame = stand_in
    with gpucx.Context() as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        closed, ep = w.connect(frame(peer)), w.connect(frame(peer))
        for e in (closed, ep):
            assert w._engine.watched[e][:2] == (child.pid, start)
            assert _liveness.check_peer(w._engine, e) is False  # alive
            fd = w._engine.pidfds[e]
            assert (fd >= 0) == pidfd
            if pidfd:
                assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        closed.close(force=True)
        assert closed not in w._engine.watched and closed not in w._engine.pidfds
        child.kill()
        child.wait()
        assert _liveness.check_peer(w._engine, ep) is True  # dead: failed
        assert ep not in w._engine.watched and ep not in w._engine.pidfds
        assert isinstance(ep.error, gpucx.PeerError)
        assert f"peer process {child.pid} died" in str(ep.error)


def test_proc_alive():
    assert _liveness.proc_alive(os.getpid(), _address.proc_start_time())
    assert not _liveness.proc_alive(os.getpid(), _address.proc_start_time() + 1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = _address.proc_start_time(child.pid)
    end = time.monotonic() + 30
    while _liveness.proc_alive(child.pid, start):  # exits: a zombie, unreaped
        assert time.monotonic() < end
        time.sleep(0.01)
    assert _address.proc_start_time(child.pid) == start  # still in /proc
    child.wait()
    assert not _liveness.proc_alive(child.pid, start)
    assert _address.proc_start_time(child.pid) is None


def test_peer_check_interval_option():
    with gpucx.Context(config={"GPUCX_PEER_CHECK_INTERVAL": 0.5}) as ctx:
        assert ctx.create_worker()._engine.peer_interval == 0.5
        assert "GPUCX_PEER_CHECK_INTERVAL" not in ctx.config  # never for UCX
    with gpucx.Context(config={"gpucx_peer_check_interval": "0"}) as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        other = _reframe(
            peer.ucx_address, pid=1, boot=_address._boot, pidns=_address._ns
        )
        w.connect(other).close(force=True)
        assert w._engine.peer_interval == 0 and not w._engine.watched  # checks off
    with pytest.raises(ValueError, match="unknown gpucx option"):
        gpucx.Context(config={"GPUCX_NO_SUCH": 1})
    with pytest.raises(ValueError, match="number >= 0"):
        gpucx.Context(config={"GPUCX_PEER_CHECK_INTERVAL": -1})
    with pytest.raises(ValueError, match="number >= 0"):
        gpucx.Context(config={"GPUCX_PEER_CHECK_INTERVAL": "soon"})


# -- fuzzing ----------------------------------------------------------------

_mutation = st.one_of(
    st.tuples(st.just("zero"), st.integers(0, 10_000), st.integers(1, 16)),
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64), st.just(0)),
)


def _apply(addr: bytes, m) -> bytes:
    kind, a, b = m
    if kind == "zero":
        i = a % len(addr)
        return addr[:i] + bytes(min(b, len(addr) - i)) + addr[i + b :]
    if kind == "flip":
        i = a % len(addr)
        return addr[:i] + bytes([addr[i] ^ b]) + addr[i + 1 :]
    if kind == "cut":
        return addr[: a % len(addr)]
    return addr + a


def _check(w, blob: bytes, original: bytes) -> None:
    if blob == original:
        w.connect(blob).close(force=True)
        return
    with pytest.raises(gpucx.InvalidAddressError):
        w.connect(blob)


def _fuzz_mutations(world, mutations):
    w, peer = world
    original = peer.address
    blob = original
    for m in mutations:
        blob = _apply(blob, m) if blob else blob
    _check(w, blob, original)


def _fuzz_random(world, blob):
    w, peer = world
    _check(w, blob, peer.address)


_quick = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
_long = settings(
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@_quick
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutated_address(world, mutations):
    _fuzz_mutations(world, mutations)


@_quick
@given(blob=st.binary(max_size=512))
def test_fuzz_random_bytes(world, blob):
    _fuzz_random(world, blob)


@pytest.mark.fuzz
@pytest.mark.timeout(1800)
@_long
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutated_address_long(world, mutations):
    _fuzz_mutations(world, mutations)


@pytest.mark.fuzz
@pytest.mark.timeout(1800)
@_long
@given(blob=st.binary(max_size=512))
def test_fuzz_random_bytes_long(world, blob):
    _fuzz_random(world, blob)


def test_address_bytes_reach_a_peer_intact(world):
    """The framed address survives pickling, hex, bytearray, memoryview."""
    w, peer = world
    for form in (bytearray(peer.address), memoryview(peer.address)):
        ep = w.connect(form)
        ep.close(force=True)
    assert np.frombuffer(peer.address, np.uint8).nbytes == len(peer.address)


@pytest.mark.parametrize("wait", ["stream_recv", "recv_array"])
def test_a_blocking_wait_wakes_when_a_watched_peer_exits(wait, stand_in):
    """Blocking waits sleep on the watched peers' pidfds beside the UCX
    event fd: with the periodic check once every 30 s, a local peer's exit
    still ends a wait on its endpoint at once, with PeerError rather than
    the 20 s timeout (``block`` for stream_recv, ``wait_for`` for
    recv_array), and its pidfd leaves the set; the set closes with the
    worker."""
    if _liveness.open_pidfd(os.getpid(), _address.proc_start_time()) < 0:
        pytest.skip("no pidfds on this kernel")  # the periodic check remains
    child, _, frame = stand_in
    with gpucx.Context(config={"GPUCX_PEER_CHECK_INTERVAL": 30}) as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        ep = w.connect(frame(peer))
        assert w._engine.pidfds[ep] >= 0 and w._engine.pfd >= 0  # opened when watched
        killer = threading.Timer(0.3, child.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(gpucx.PeerError, match=f"process {child.pid} died"):
            if wait == "stream_recv":
                ep.stream_recv(bytearray(8), timeout=20)
            else:
                ep.recv_array(timeout=20)
        assert time.monotonic() - t0 < 20  # not the timeout
        killer.join()
        assert ep not in w._engine.pidfds and ep not in w._engine.watched
        w.close()
        assert w._engine.pset is None and w._engine.pfd == -1


def test_a_pidfd_left_for_an_unwatched_endpoint_is_closed_by_the_next_check(
    stand_in,
):
    """On a "multi" worker a check on one thread may reopen the pidfd of an
    endpoint another thread just unwatched; the next check closes it, so a
    readable one cannot keep waking the worker's sleeps."""
    child, start, frame = stand_in
    with gpucx.Context() as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        ep = w.connect(frame(peer))
        _liveness.unwatch(w._engine, ep)
        _liveness.keep_pidfd(w._engine, ep, child.pid, start)  # the other thread
        assert ep in w._engine.pidfds and ep not in w._engine.watched
        _liveness.check(w._engine, force=True)
        assert ep not in w._engine.pidfds
