"""RMA: put/get at offsets, the three completion levels, put-with-notify,
bounds checks and key lifetime; two workers in one process and two
processes, over each transport family."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

import gpucx
from gpucx.mem import region as _region

from conftest import Pair, channel_pair, join_ok, spawn
from peers_rma import owner, pattern

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def background(worker):
    """Progress ``worker`` from a thread while the body blocks on its peer
    (a blocking call on one worker cannot complete while the peer worker in
    the same thread sits idle)."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            worker.progress()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def exported(pair, nbytes, fill=0):
    """A region on worker b's side and its key on endpoint a->b."""
    mem = np.full(nbytes, fill, np.uint8)
    region = pair.ctx.register(mem)
    key = pair.ab.unpack(region.remote())
    return mem, region, key


# -- put / get in one process --------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 8, 4096, 1 << 20])
@pytest.mark.parametrize("offset", [0, 3, 4096])
def test_put_get_at_offsets(pair, tls, nbytes, offset):
    mem, region, key = exported(pair, offset + nbytes + 100)
    src = pattern(nbytes + offset, nbytes)
    pair.drive(pair.ab.put_nb(src, key, offset))
    with background(pair.b):
        pair.ab.flush()
    # Verified byte by byte on the owner's side, untouched bytes included.
    assert np.array_equal(mem[offset : offset + nbytes], src)
    assert not mem[:offset].any() and not mem[offset + nbytes :].any()
    back = np.zeros(nbytes, np.uint8)
    pair.drive(pair.ab.get_nb(back, key, offset))
    assert np.array_equal(back, src)
    key.close()
    region.close()


def test_blocking_put_get_and_flush(pair, tls):
    mem, region, key = exported(pair, 1 << 16)
    src = pattern(1, 1000)
    with background(pair.b):
        pair.ab.put(src, key, 500)
        pair.ab.flush()
        assert np.array_equal(mem[500:1500], src)
        out = bytearray(1000)
        pair.ab.get(out, key, 500)
    assert bytes(out) == src.tobytes()
    region.close()


def test_put_get_typed_arrays(pair):
    mem = np.zeros(64, np.float64)
    region = pair.ctx.register(mem)
    key = pair.ab.unpack(region.remote().to_bytes())
    src = np.linspace(0, 1, 16)
    pair.drive(pair.ab.put_nb(src, key, 8 * 10))
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(mem[10:26], src)
    back = np.empty(16, np.float64)
    pair.drive(pair.ab.get_nb(back, key, 80))
    assert np.array_equal(back, src)
    region.close()


def test_put_into_allocated_region(pair, tls):
    region = pair.ctx.allocate(1 << 20)
    view = region.as_array()
    view[:] = 0
    key = pair.ab.unpack(region.remote())
    src = pattern(7, 1 << 19)
    pair.drive(pair.ab.put_nb(src, key, 1 << 19))
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(view[1 << 19 :], src) and not view[: 1 << 19].any()
    region.close()


def test_register_inside_allocated_region_shares_its_mapping(pair, tls):
    whole = pair.ctx.allocate(1 << 20)
    view = whole.as_array()
    view[:] = 0
    sub = pair.ctx.register(view[4096 : 4096 + 8192])
    assert sub.address == whole.address + 4096 and sub.nbytes == 8192
    assert sub.obj is not None and "in an allocated region" in repr(sub)
    # Same UCX keys (the shared-memory ones a peer maps), bounds of the view.
    assert sub.pack_rkey() == whole.pack_rkey()
    token = sub.remote()
    assert (token.address, token.nbytes) == (whole.address + 4096, 8192)
    key = pair.ab.unpack(token)
    src = pattern(11, 8192)
    pair.drive(pair.ab.put_nb(src, key))
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(view[4096 : 4096 + 8192], src)
    assert not view[:4096].any() and not view[4096 + 8192 :].any()
    with pytest.raises(ValueError, match="outside the remote region"):
        pair.ab.put(b"12", key, 8191)
    # Closing the view unmaps nothing: the allocation still works.
    key.close()
    sub.close()
    key2 = pair.ab.unpack(whole.remote())
    pair.drive(pair.ab.put_nb(src[:16], key2, 0))
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(view[:16], src[:16])
    key2.close()
    whole.close()


def test_register_inside_allocated_region_read_only_and_lifetime(pair):
    whole = pair.ctx.allocate(1 << 16)
    view = whole.as_array()
    ro = pair.ctx.register(view[:100], writable=False)
    assert ro.readonly
    # Read-only: its own mapping, without remote write permission, not the
    # allocation's writable one.
    assert ro._own_map and ro._h != whole._h
    key = pair.ab.unpack(ro.remote())
    with pytest.raises(ValueError, match="read-only"):
        pair.ab.put(b"x", key)
    key.close()
    rw = pair.ctx.register(view[100:200])
    # The allocation closes the regions inside it first.
    whole.close()
    assert ro.closed and rw.closed
    with pytest.raises(gpucx.ClosedError):
        rw.remote()


def test_register_outside_or_across_allocation_maps_its_own(pair):
    whole = pair.ctx.allocate(1 << 16)
    other = np.zeros(1 << 16, np.uint8)
    own = pair.ctx.register(other)
    assert "in an allocated region" not in repr(own)
    assert own.pack_rkey() != whole.pack_rkey()
    own.close()
    # Memory of another context's allocation is registered on its own.
    with gpucx.Context(features=["rma"]) as ctx2:
        r2 = ctx2.register(whole.as_array()[:64])
        assert "in an allocated region" not in repr(r2)
    whole.close()
    # After the allocation closed, nothing refers to it any more.
    assert not [r for r in _region._host_allocations.get(pair.ctx, ()) if not r.closed]


# -- completion levels ---------------------------------------------------------


def test_local_completion_makes_source_reusable(pair, tls):
    mem, region, key = exported(pair, 1 << 20)
    src = pattern(3, 1 << 20)
    sent = src.copy()
    req = pair.ab.put_nb(src, key)
    pair.drive(req)
    src[:] = 0  # reusable at local completion: the put already took the data
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(mem, sent)
    region.close()


def test_worker_flush_and_fence(pair, tls):
    mem, region, key = exported(pair, 4096)
    reqs = [pair.ab.put_nb(np.full(64, i, np.uint8), key, 64 * i) for i in range(32)]
    with background(pair.b):  # UCX's default (strong) fence waits for the peer
        pair.a.fence()
    # After the fence, this put lands after the 32 before it.
    reqs.append(pair.ab.put_nb(np.full(64, 99, np.uint8), key, 0))
    pair.drive(*reqs)
    with background(pair.b):
        pair.a.flush()
    assert np.all(mem[:64] == 99)
    for i in range(1, 32):
        assert np.all(mem[64 * i : 64 * i + 64] == i)
    region.close()


def test_flush_timeout_on_closed_worker_raises(pair):
    pair.a.close()
    with pytest.raises(gpucx.ClosedError):
        pair.a.flush()
    with pytest.raises(gpucx.ClosedError):
        pair.a.fence()


# -- put with notify -------------------------------------------------------------


def await_note(pair, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        pair.a.progress()
        notes = pair.b.notifications()
        if notes:
            return notes
        assert time.monotonic() < end, "no notification"


def test_put_with_notify_orders_data_first(pair, tls):
    n = 1 << 20
    mem, region, key = exported(pair, n)
    for round_ in range(8):
        src = pattern(round_, n)
        req = pair.ab.put_nb(src, key, notify=b"round %d" % round_)
        notes = await_note(pair)
        # The notification never arrives before the data.
        assert np.array_equal(mem, src), f"round {round_}: data not in place"
        assert [note for _, note in notes] == [b"round %d" % round_]
        # The owner's endpoint to the sender (UCX matched b->a with a->b).
        assert notes[0][0] is pair.ba
        pair.drive(req)
    region.close()


def test_blocking_put_with_notify(pair):
    mem, region, key = exported(pair, 256)
    with background(pair.b):
        pair.ab.put(b"payload", key, 10, notify=b"n1", timeout=30)
    notes = pair.b.notifications(timeout=10)
    assert [note for _, note in notes] == [b"n1"]
    assert bytes(mem[10:17]) == b"payload"
    region.close()


def test_notify_handler_runs_after_progress_in_order(pair):
    mem, region, key = exported(pair, 64)
    seen = []

    def on_note(ep, note):
        # Runs after progress returned: the data is already in place.
        seen.append((ep, note, bytes(mem[: len(note)])))

    pair.b.set_notify_handler(on_note)
    for i in range(5):
        note = b"n%d" % i
        pair.drive(pair.ab.put_nb(note, key, notify=note))
        end = time.monotonic() + 10
        while len(seen) <= i and time.monotonic() < end:
            pair.a.progress()
            pair.b.progress()
    assert [(ep, note) for ep, note, _ in seen] == [
        (pair.ba, b"n%d" % i) for i in range(5)
    ]
    assert all(data == note for _, note, data in seen)
    assert pair.b.notifications() == []  # nothing left queued
    region.close()


def test_notify_handler_exception_reaches_progress_and_removal(pair):
    mem, region, key = exported(pair, 64)

    def boom(ep, note):
        raise RuntimeError(f"handler saw {note!r}")

    pair.drive(pair.ab.put_nb(b"x", key, notify=b"first"))
    pair.drive(pair.ab.put_nb(b"y", key, notify=b"second"))
    end = time.monotonic() + 10
    while pair.b.stats()["notify"].count < 2 and time.monotonic() < end:
        pair.a.progress()
        pair.b.progress()
    pair.b.set_notify_handler(boom)
    with pytest.raises(RuntimeError, match="first"):
        pair.b.progress()
    # Removing the handler leaves the rest queued for notifications().
    pair.b.set_notify_handler(None)
    notes = pair.b.notifications(timeout=10)
    assert [note for _, note in notes] == [b"second"]
    with pytest.raises(TypeError):
        pair.b.set_notify_handler("not callable")
    region.close()


def test_concurrent_notifications_all_arrive(pair):
    # Each notification follows its own data; concurrent put-with-notify
    # calls may notify in any order.
    mem, region, key = exported(pair, 64)
    reqs = [pair.ab.put_nb(bytes([i]), key, i, notify=bytes([i])) for i in range(20)]
    pair.drive(*reqs)
    got = []
    end = time.monotonic() + 10
    while len(got) < 20 and time.monotonic() < end:
        got += [note for _, note in pair.b.notifications(timeout=0.1)]
    assert sorted(got) == [bytes([i]) for i in range(20)]
    assert bytes(mem[:20]) == bytes(range(20))
    region.close()


def test_notifications_empty_and_timeout(pair):
    assert pair.b.notifications() == []
    t0 = time.monotonic()
    assert pair.b.notifications(timeout=0.2) == []
    assert time.monotonic() - t0 >= 0.15


def test_notifications_on_closed_worker(pair):
    pair.b.close()
    with pytest.raises(gpucx.ClosedError):
        pair.b.notifications()


def test_notify_too_large_is_refused(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(ValueError, match="notify"):
        pair.ab.put_nb(b"x", key, notify=bytes(gpucx.ops.rma.NOTIFY_MAX + 1))
    region.close()


def test_notify_needs_am_feature():
    with gpucx.Context(features={"rma", "tag"}) as ctx:
        pair = Pair(ctx)
        mem, region, key = exported(pair, 64)
        with pytest.raises(gpucx.UnsupportedError, match="am"):
            pair.ab.put_nb(b"x", key, notify=b"n")
        assert pair.b.notifications() == []


# -- refusals before UCX ---------------------------------------------------------


@pytest.mark.parametrize(
    "offset, nbytes",
    [(0, 65), (64, 1), (60, 8), (-1, 1), (1 << 62, 8)],
    ids=["too-long", "at-end", "straddles", "negative", "far"],
)
def test_out_of_bounds_refused(pair, offset, nbytes):
    mem, region, key = exported(pair, 64)
    buf = np.ones(nbytes, np.uint8)
    for call in (pair.ab.put, pair.ab.put_nb, pair.ab.get, pair.ab.get_nb):
        with pytest.raises(ValueError, match=f"offset={offset} nbytes={nbytes}"):
            call(buf, key, offset)
    with pytest.raises(ValueError, match="64 bytes"):
        pair.ab.put_nb(buf, key, offset, notify=b"n")
    assert not mem.any()  # nothing reached the memory
    region.close()


def test_zero_bytes_at_end_is_allowed(pair):
    mem, region, key = exported(pair, 64)
    pair.drive(pair.ab.put_nb(b"", key, 64), pair.ab.get_nb(bytearray(), key, 64))
    region.close()


def test_offset_must_be_int(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(TypeError, match="offset"):
        pair.ab.put_nb(b"x", key, 1.5)
    region.close()


def test_key_of_another_endpoint_refused(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(ValueError, match="unpacked on"):
        pair.ba.put_nb(b"x", key)
    with pytest.raises(TypeError, match="RemoteKey"):
        pair.ab.put_nb(b"x", region.remote())
    region.close()


def test_read_only_region_refuses_put(pair):
    data = b"constant data!"
    region = pair.ctx.register(data, writable=False)
    key = pair.ab.unpack(region.remote())
    with pytest.raises(ValueError, match="read-only"):
        pair.ab.put_nb(b"x", key)
    out = bytearray(len(data))
    pair.drive(pair.ab.get_nb(out, key))
    assert bytes(out) == data
    region.close()


def test_get_into_read_only_buffer_refused(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(BufferError):
        pair.ab.get_nb(b"12345678", key)
    region.close()


# -- lifetime ----------------------------------------------------------------------


def test_key_closes_with_endpoint(pair):
    mem, region, key = exported(pair, 64)
    assert key.endpoint is pair.ab and key.nbytes == 64
    pair.ab.close(force=True)
    assert key.closed
    with pytest.raises(gpucx.ClosedError):
        pair.ab.put_nb(b"x", key)
    region.close()


def test_closed_key_refused(pair):
    mem, region, key = exported(pair, 64)
    key.close()
    key.close()
    with pytest.raises(gpucx.ClosedError, match="RemoteKey"):
        pair.ab.put_nb(b"x", key)
    region.close()


def test_unmap_with_outstanding_key(pair, tls):
    """The owner unmaps while a peer still holds a key: close returns at
    once, the key stays closeable, the region refuses further use."""
    mem, region, key = exported(pair, 4096)
    pair.drive(pair.ab.put_nb(b"before", key))
    with background(pair.b):
        pair.ab.flush()
    t0 = time.monotonic()
    region.close()
    assert time.monotonic() - t0 < 2.0
    assert region.closed and not key.closed
    with pytest.raises(gpucx.ClosedError):
        region.remote()
    key.close()
    assert key.closed
    # The endpoint still works for others.
    mem2, region2, key2 = exported(pair, 64)
    pair.drive(pair.ab.put_nb(b"after", key2))
    with background(pair.b):
        pair.ab.flush()
    assert bytes(mem2[:5]) == b"after"
    region2.close()


def test_key_close_waits_for_pending_ops(pair, tls):
    mem, region, key = exported(pair, 1 << 22)
    req = pair.ab.put_nb(pattern(5, 1 << 22), key)
    with background(pair.b):
        key.close()  # waits (bounded) for the put that uses it
        assert req.done()
        pair.ab.flush()  # remote completion before the memory goes away
    assert key.closed
    region.close()


def test_endpoint_unpack_on_closed(pair):
    mem, region, key = exported(pair, 64)
    blob = region.remote().to_bytes()
    pair.ab.close(force=True)
    with pytest.raises(gpucx.ClosedError):
        pair.ab.unpack(blob)
    region.close()


# -- two processes -------------------------------------------------------------------


@contextlib.contextmanager
def owner_session(tls, size, allocate=False):
    """A peer process owning a ``size``-byte region (peers_rma.owner), and
    this side's worker, endpoint and key to it: yields ``(q, w, ep, key)``.
    Says "bye" and checks the peer's exit on the way out."""
    from conftest import transport_config

    q, theirs = channel_pair()
    child = spawn(owner, tls, theirs, size, allocate)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            _, address, blob = q.get(60)
            ep = w.connect(address)
            q.put(("address", w.address))
            key = ep.unpack(blob)
            yield q, w, ep, key
            q.put(("bye",))
            key.close()
            ep.close(force=True)
    finally:
        join_ok(child, 60)


def notified_puts(q, w, seeds, put_nb):
    """Have the owner check its region when each notification of
    ``put_nb(seed)`` (a request of a put with notify) arrives; assert it saw
    ``pattern(seed)`` each time, notified by this side's endpoint."""
    q.put(("notified", seeds))
    for seed in seeds:
        req = put_nb(seed)
        # The owner checks its memory when the notification arrives and
        # acks; progress until then (TCP needs the initiator's progress to
        # move the data).
        while not q._conn.poll(0):
            w.progress()
        assert q.get(5) == ("ack", seed)
        req.wait(30)
    kind, result = q.get(60)
    assert [note for note, _, _ in result] == [b"seed=%d" % s for s in seeds]
    assert all(ok for _, ok, _ in result), result
    # Each notification named the owner's endpoint to this process.
    assert all(same_ep for _, _, same_ep in result), result


@pytest.mark.parametrize(
    "allocate",
    [False, True, "view"],
    ids=["registered", "allocated", "registered-in-allocated"],
)
def test_put_get_across_processes(tls, allocate):
    size = 4 << 20
    with owner_session(tls, size, allocate) as (q, w, ep, key):
        assert key.nbytes == size
        cases = [(0, 1), (1, 7), (4093, 4096), (1 << 20, 1 << 20), (size - 3, 3)]
        for offset, n in cases:
            ep.put(pattern(offset, n), key, offset)
        ep.flush()
        for offset, n in cases:
            q.put(("verify", offset, pattern(offset, n).tobytes()))
            assert q.get(60) == ("verified", True), (offset, n)
            back = np.zeros(n, np.uint8)
            ep.get(back, key, offset)
            assert np.array_equal(back, pattern(offset, n))
        with pytest.raises(ValueError, match="outside the remote region"):
            ep.put(b"12", key, size - 1)
        q.put(("read", size - 8, 8))
        assert q.get(60)[1][-3:] == pattern(size - 3, 3).tobytes()


def test_put_with_notify_across_processes(tls):
    size = 2 << 20
    with owner_session(tls, size) as (q, w, ep, key):
        notified_puts(
            q,
            w,
            list(range(100, 106)),
            lambda seed: ep.put_nb(pattern(seed, size), key, notify=b"seed=%d" % seed),
        )


class _DestroySpy:
    """Wraps gpucx.mem.remote's extension module: records each
    ``gpucx_rkey_destroy`` (with the number of operations still parked on
    the worker holding the key at that moment) and passes it on."""

    def __init__(self, lib, worker, key):
        self._lib, self._worker, self._key = lib, worker, key
        self.calls: list[int] = []

    def __getattr__(self, name):
        attr = getattr(self._lib, name)
        if name != "gpucx_rkey_destroy":
            return attr

        def destroy(h):
            self.calls.append(_parked_with(self._worker, self._key))
            return attr(h)

        return destroy


_INPROGRESS = gpucx._lib.lib.UCS_INPROGRESS


def _parked_with(worker, key) -> int:
    """Operations parked on ``worker`` that UCX still holds, using ``key``
    (as each names the keys it uses when it is made)."""
    return len(worker._engine.holding(key)[1])


def test_key_close_never_frees_a_key_a_parked_put_uses(pair, monkeypatch):
    """A blocking put that times out while UCX still holds it (emulated: the
    target does not progress, UCX cannot withdraw it) is parked with its
    key; closing the key must not free the ``ucp_rkey_h`` under it.  The
    key is freed once UCX let go of the put."""
    from gpucx import _engine
    from gpucx.mem import remote as _remote

    mem, region, key = exported(pair, 1 << 20)
    row = pair.ab.protocol("put", 1 << 20)
    src = pattern(9, 1 << 20)
    try:
        pair.ab.put(src, key, timeout=0.05)  # pair.b is not progressed
    except gpucx.TimeoutError:
        pass
    if not _parked_with(pair.a, key):
        pytest.skip(f"the put completed without its target here ({row})")
    spy = _DestroySpy(_remote.lib, pair.a, key)
    monkeypatch.setattr(_remote, "lib", spy)
    monkeypatch.setattr(_engine, "lib", spy)  # the engine's deferred free
    key.close(timeout=0.2)  # the target is idle: the put stays in UCX's hands
    assert key.closed
    assert spy.calls == []  # never freed while the put holds it
    with background(pair.b):
        deadline = time.monotonic() + 10
        while _parked_with(pair.a, key) or not spy.calls:
            pair.a.progress()
            assert time.monotonic() < deadline, (spy.calls, pair.a._engine.parked)
        # The put's completion is local (its buffer reusable); the bytes
        # are the target's once the endpoint is flushed.
        pair.ab.flush(timeout=10)
    assert spy.calls == [0]
    assert np.array_equal(mem, src)
    region.close()


def test_key_close_waits_for_the_operations_holding_it_only(pair, monkeypatch):
    """A key's close asks its worker's engine which pending operations hold
    that key (Engine.holding: each operation names the keys it uses): it
    never frees the key under one of them, and it does not wait for
    operations on another key."""
    from gpucx.mem import remote as _remote

    def pending_holding(worker, key):
        return worker._engine.holding(key)[0]

    mem, region, key = exported(pair, 1 << 22)
    _, other_region, other = exported(pair, 64)
    req = pair.ab.put_nb(pattern(4, 1 << 22), key)  # pair.b is not progressed
    if req.done():
        pytest.skip("the put completed without its target here")
    assert pending_holding(pair.a, key) == [req]
    assert pending_holding(pair.a, other) == []
    spy = _DestroySpy(_remote.lib, pair.a, key)
    monkeypatch.setattr(_remote, "lib", spy)
    t0 = time.monotonic()
    other.close(timeout=5)
    assert time.monotonic() - t0 < 2.5  # not the put's wait
    assert other.closed and len(spy.calls) == 1  # freed at once
    key.close(timeout=0.2)  # the target is idle: the put still holds the key
    assert key.closed and len(spy.calls) == 1  # never freed under the put
    with background(pair.b):
        req.wait(10)
        pair.ab.flush()
    assert np.array_equal(mem, pattern(4, 1 << 22))
    region.close()
    other_region.close()


@pytest.mark.parametrize("target_progresses", [True, False])
def test_worker_close_after_a_key_closed_under_a_parked_put(pair, target_progresses):
    """The worker's close frees a key whose parked put UCX let go of before
    the worker goes, and leaves one UCX still holds to the worker's own
    destruction (no crash either way, the close stays bounded)."""
    mem, region, key = exported(pair, 1 << 20)
    try:
        pair.ab.put(pattern(3, 1 << 20), key, timeout=0.05)
    except gpucx.TimeoutError:
        pass
    if not _parked_with(pair.a, key):
        pytest.skip("the put completed without its target here")
    key.close(timeout=0.2)
    assert pair.a._engine.parked_keys
    t0 = time.monotonic()
    if target_progresses:
        with background(pair.b):
            pair.a.close(timeout=5)
    else:
        pair.a.close(timeout=0.5)
    assert pair.a.closed and time.monotonic() - t0 < 10
    assert not pair.a._engine.parked_keys
    region.close()
