"""Prepared transfers (``Endpoint.prepare_put``/``prepare_get``): lists of
puts or gets checked once and posted with one C call per run; two workers in
one process and two processes, over each transport family."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpucx
import gpucx.aio

from conftest import transport_config
from peers_rma import pattern
from test_rma import await_note, background, exported, notified_puts, owner_session

pytestmark = pytest.mark.timeout(120)

#: (offset, nbytes) of a scatter list: sizes from 0 bytes to 1 MiB, in no
#: particular order, with gaps between them that must stay untouched.
LAYOUT = [(5000, 1 << 20), (0, 1), (7, 0), (100, 4093), (4300, 600)]
SPAN = 5000 + (1 << 20) + 64


def _scatter(seed):
    return [pattern(seed + i, n) for i, (_, n) in enumerate(LAYOUT)]


def _expected(srcs, span=SPAN):
    want = np.zeros(span, np.uint8)
    for (off, n), src in zip(LAYOUT, srcs, strict=True):
        want[off : off + n] = src
    return want


def test_put_transfer_scatters_and_reruns_with_current_data(pair, tls):
    mem, region, key = exported(pair, SPAN)
    srcs = _scatter(1)
    with pair.ab.prepare_put(
        [(s, key, off) for s, (off, _) in zip(srcs, LAYOUT, strict=True)]
    ) as x:
        assert x.kind == "put" and len(x) == len(LAYOUT)
        assert x.nbytes == sum(n for _, n in LAYOUT)
        assert x.endpoint is pair.ab
        pair.drive(x.run_nb())
        with background(pair.b):
            pair.ab.flush()
        # Byte by byte on the owner's side, the gaps included.
        assert np.array_equal(mem, _expected(srcs))
        # A run sends what the buffers hold when it runs.
        for i, s in enumerate(srcs):
            s[:] = pattern(50 + i, len(s))
        assert pair.drive(x.run_nb()) == [None]
        with background(pair.b):
            pair.ab.flush()
        assert np.array_equal(mem, _expected(srcs))
    assert x.closed
    key.close()
    region.close()


def test_get_transfer_gathers(pair, tls):
    mem, region, key = exported(pair, SPAN)
    mem[:] = pattern(9, SPAN)
    outs = [np.zeros(n, np.uint8) for _, n in LAYOUT]
    x = pair.ab.prepare_get(
        [(o, key, off) for o, (off, _) in zip(outs, LAYOUT, strict=True)]
    )
    assert x.kind == "get"
    pair.drive(x.run_nb())
    for (off, n), out in zip(LAYOUT, outs, strict=True):
        assert np.array_equal(out, mem[off : off + n]), (off, n)
    x.close()
    region.close()


def test_entries_may_use_several_keys(pair, tls):
    mem1, region1, key1 = exported(pair, 256)
    mem2, region2, key2 = exported(pair, 256)
    x = pair.ab.prepare_put(
        [(b"one", key1, 10), (b"two", key2, 20), (b"three", key1, 100)]
    )
    pair.drive(x.run_nb())
    with background(pair.b):
        pair.ab.flush()
    assert bytes(mem1[10:13]) == b"one" and bytes(mem1[100:105]) == b"three"
    assert bytes(mem2[20:23]) == b"two"
    assert mem1.sum() == sum(b"one" + b"three") and mem2.sum() == sum(b"two")
    back = [bytearray(3), bytearray(5)]
    g = pair.ab.prepare_get([(back[0], key2, 20), (back[1], key1, 100)])
    pair.drive(g.run_nb())
    assert back == [bytearray(b"two"), bytearray(b"three")]
    region1.close()
    region2.close()


def test_typed_and_non_contiguous_sources(pair):
    mem, region, key = exported(pair, 64)
    x = pair.ab.prepare_put([(np.arange(4, dtype=np.uint32), key, 0)])
    pair.drive(x.run_nb())
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(mem[:16].view(np.uint32), [0, 1, 2, 3])
    with pytest.raises(BufferError):
        pair.ab.prepare_put([(np.arange(8)[::2], key, 0)])
    region.close()


def test_put_transfer_notify_arrives_after_all_data(pair, tls):
    mem, region, key = exported(pair, SPAN)
    srcs = _scatter(3)
    x = pair.ab.prepare_put(
        [(s, key, off) for s, (off, _) in zip(srcs, LAYOUT, strict=True)]
    )
    for round_ in range(4):
        for i, s in enumerate(srcs):
            s[:] = pattern(100 * round_ + i, len(s))
        req = x.run_nb(notify=b"round %d" % round_)
        notes = await_note(pair)
        # Every entry's data is in place when the notification is.
        assert np.array_equal(mem, _expected(srcs)), round_
        assert [note for _, note in notes] == [b"round %d" % round_]
        assert notes[0][0] is pair.ba
        pair.drive(req)
    region.close()


def test_get_transfer_notify_after_reads(pair, tls):
    mem, region, key = exported(pair, 4096)
    mem[:] = pattern(4, 4096)
    outs = [np.zeros(1000, np.uint8), np.zeros(96, np.uint8)]
    x = pair.ab.prepare_get([(outs[0], key, 0), (outs[1], key, 4000)])
    req = x.run_nb(notify=b"read")
    notes = await_note(pair)
    pair.drive(req)
    assert [note for _, note in notes] == [b"read"]
    assert np.array_equal(outs[0], mem[:1000])
    assert np.array_equal(outs[1], mem[4000:])
    region.close()


def test_blocking_run_with_notify(pair):
    mem, region, key = exported(pair, 256)
    x = pair.ab.prepare_put([(b"abc", key, 0), (b"xyz", key, 200)])
    with background(pair.b):
        assert x.run(timeout=30, notify=b"done") is None
    notes = pair.b.notifications(timeout=10)
    assert [note for _, note in notes] == [b"done"]
    assert bytes(mem[:3]) == b"abc" and bytes(mem[200:203]) == b"xyz"
    g = pair.ab.prepare_get([(bytearray(3), key, 200)])
    with background(pair.b):
        g.run(timeout=30)
    region.close()


def test_runs_in_flight_together(pair, tls):
    mem, region, key = exported(pair, 1 << 22)
    src = pattern(6, 1 << 20)
    x = pair.ab.prepare_put([(src, key, i << 20) for i in range(4)])
    reqs = [x.run_nb() for _ in range(6)]
    pair.drive(*reqs)
    with background(pair.b):
        pair.ab.flush()
    assert np.array_equal(mem.reshape(4, -1), np.tile(src, (4, 1)))
    region.close()


def test_empty_transfer(pair):
    x = pair.ab.prepare_put([])
    assert len(x) == 0 and x.nbytes == 0
    req = x.run_nb()
    assert req.done() and req.wait() is None
    x.run()
    req = x.run_nb(notify=b"nothing moved")
    notes = await_note(pair)
    pair.drive(req)
    assert [note for _, note in notes] == [b"nothing moved"]
    assert len(pair.ab.prepare_get(iter(()))) == 0


def test_awaitable_in_asyncio(tls):
    import asyncio

    async def main():
        with gpucx.Context(config=transport_config(tls)) as ctx:
            async with gpucx.aio.Worker(ctx) as a, gpucx.aio.Worker(ctx) as b:
                ep = a.connect(b.address)
                mem = np.zeros(64, np.uint8)
                region = ctx.register(mem)
                key = ep.unpack(region.remote())
                x = ep.prepare_put([(b"hello", key, 0), (b"world", key, 32)])
                assert await x.run_nb(notify=b"aio") is None
                while not (notes := b.notifications()):
                    await asyncio.sleep(0.001)
                assert [n for _, n in notes] == [b"aio"]
                assert bytes(mem[:5]) == b"hello" and bytes(mem[32:37]) == b"world"
                region.close()

    asyncio.run(main())


def test_multi_thread_worker_runs_from_threads(tls):
    with gpucx.Context(config=transport_config(tls)) as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ep = a.connect(b.address)
        mem = np.zeros(8 * 4096, np.uint8)
        region = ctx.register(mem)
        key = ep.unpack(region.remote())
        stop = threading.Event()
        errors = []

        def drive_b():
            while not stop.is_set():
                b.progress()

        def client(t):
            try:
                srcs = [pattern(10 * t + j, 4096) for j in range(2)]
                x = ep.prepare_put(
                    [(s, key, (2 * t + j) * 4096) for j, s in enumerate(srcs)]
                )
                for _ in range(20):
                    x.run_nb().wait(30)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        pump = threading.Thread(target=drive_b, daemon=True)
        pump.start()
        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ep.flush(timeout=30)
        stop.set()
        pump.join(10)
        assert not errors, errors
        for t in range(4):
            for j in range(2):
                i = 2 * t + j
                assert np.array_equal(
                    mem[i * 4096 : (i + 1) * 4096], pattern(10 * t + j, 4096)
                )
        region.close()


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, exc, match",
    [
        (
            (bytearray(b"x"), "KEY"),
            TypeError,
            "entry 1: must be a .buf, rkey, offset. tuple",
        ),
        ([bytearray(b"x"), "KEY", 0], TypeError, "entry 1: must be"),
        ((bytearray(b"x"), "KEY", 0, 1), TypeError, "entry 1: must be"),
        ((bytearray(b"x"), None, 0), TypeError, "entry 1: expected a RemoteKey"),
        (
            (bytearray(b"x"), "KEY", 1.5),
            TypeError,
            "entry 1: put: offset must be an int|entry 1: get: offset must be an int",
        ),
        (
            (bytearray(b"x") * 2, "KEY", 63),
            ValueError,
            "entry 1: .*offset=63 nbytes=2 .* 64 bytes",
        ),
        ((bytearray(b"x"), "KEY", -1), ValueError, "entry 1: .*offset=-1"),
        ((object(), "KEY", 0), TypeError, "entry 1: .*is not a buffer"),
    ],
    ids=[
        "pair",
        "list",
        "quad",
        "not-a-key",
        "float-offset",
        "past-end",
        "negative",
        "not-a-buffer",
    ],
)
def test_bad_entries_refused(pair, entry, exc, match):
    mem, region, key = exported(pair, 64)
    entry = (
        tuple(key if e == "KEY" else e for e in entry)
        if type(entry) is tuple
        else [key if e == "KEY" else e for e in entry]
    )
    for prepare in (pair.ab.prepare_put, pair.ab.prepare_get):
        with pytest.raises(exc, match=match):
            prepare([(bytearray(4), key, 0), entry])
    assert not mem.any()
    region.close()


def test_entries_must_be_iterable(pair):
    with pytest.raises(TypeError, match="iterable of .buf, rkey, offset."):
        pair.ab.prepare_put(42)


def test_key_of_another_endpoint_refused(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(ValueError, match="entry 0: .*unpacked on"):
        pair.ba.prepare_put([(b"x", key, 0)])
    region.close()


def test_read_only_region_refuses_put_transfer(pair):
    data = b"constant data!"
    region = pair.ctx.register(data, writable=False)
    key = pair.ab.unpack(region.remote())
    with pytest.raises(ValueError, match="read-only"):
        pair.ab.prepare_put([(b"x", key, 0)])
    out = bytearray(len(data))
    pair.drive(pair.ab.prepare_get([(out, key, 0)]).run_nb())
    assert bytes(out) == data
    region.close()


def test_get_transfer_into_read_only_buffer_refused(pair):
    mem, region, key = exported(pair, 64)
    with pytest.raises(BufferError):
        pair.ab.prepare_get([(b"12345678", key, 0)])
    region.close()


def test_notify_too_large_or_without_am(pair):
    mem, region, key = exported(pair, 64)
    x = pair.ab.prepare_put([(b"x", key, 0)])
    with pytest.raises(ValueError, match="at most"):
        x.run_nb(notify=bytes(gpucx.ops.rma.NOTIFY_MAX + 1))
    with pytest.raises(ValueError, match="at most"):
        x.run(notify=bytes(gpucx.ops.rma.NOTIFY_MAX + 1))
    region.close()
    with gpucx.Context(features={"rma"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        mem = np.zeros(8, np.uint8)
        region = ctx.register(mem)
        x = ep.prepare_put([(b"x", ep.unpack(region.remote()), 0)])
        with pytest.raises(gpucx.UnsupportedError, match="'am' feature"):
            x.run_nb(notify=b"n")
        region.close()


def test_closed_transfer_key_or_endpoint_refused(pair):
    mem, region, key = exported(pair, 64)
    x = pair.ab.prepare_put([(b"x", key, 0)])
    x.close()
    x.close()
    assert "closed" in repr(x)
    with pytest.raises(gpucx.ClosedError, match="Transfer is closed"):
        x.run_nb()
    with pytest.raises(gpucx.ClosedError, match="Transfer is closed"):
        x.run()
    y = pair.ab.prepare_get([(bytearray(1), key, 0)])
    key.close()
    with pytest.raises(gpucx.ClosedError, match="RemoteKey"):
        y.run_nb()
    mem2, region2, key2 = exported(pair, 64)
    z = pair.ab.prepare_put([(b"x", key2, 0)])
    pair.ab.close(force=True)
    with pytest.raises(gpucx.ClosedError, match="Endpoint"):
        z.run_nb()
    with pytest.raises(gpucx.ClosedError):
        pair.ab.prepare_put([])
    region.close()
    region2.close()


def test_key_close_waits_for_a_running_transfer(pair, tls):
    mem, region, key = exported(pair, 1 << 22)
    src = pattern(7, 1 << 21)
    req = pair.ab.prepare_put([(src, key, 0), (src, key, 1 << 21)]).run_nb()
    with background(pair.b):
        key.close()  # waits (bounded) for the run that uses it
        assert req.done()
        pair.ab.flush()
    assert key.closed
    assert np.array_equal(mem, np.concatenate([src, src]))
    region.close()


def test_run_timeout_when_the_target_does_not_progress():
    """Over TCP the target must progress for RMA to complete: a blocking run
    against a worker nobody progresses ends at its timeout."""
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        mem = np.zeros(64 << 20, np.uint8)
        region = ctx.register(mem)
        key = ep.unpack(region.remote())
        x = ep.prepare_get([(np.empty(64 << 20, np.uint8), key, 0)])
        with pytest.raises(gpucx.TimeoutError):
            x.run(timeout=0.5)
        # The canceled run is parked, not lost: progressing both ends it.
        ep.close(force=True)
        region.close()


# -- two processes ------------------------------------------------------------------


def test_transfers_across_processes(tls):
    size = 4 << 20
    with owner_session(tls, size) as (q, w, ep, key):
        # TCP needs the owner to progress: it serves until the next command,
        # so run blocking calls while it does.
        srcs = _scatter(20)
        with ep.prepare_put(
            [(s, key, off) for s, (off, _) in zip(srcs, LAYOUT, strict=True)]
        ) as x:
            x.run(timeout=60)
        ep.flush(timeout=60)
        want = _expected(srcs)
        q.put(("verify", 0, want.tobytes()))
        assert q.get(60) == ("verified", True)
        outs = [np.zeros(n, np.uint8) for _, n in LAYOUT]
        with ep.prepare_get(
            [(o, key, off) for o, (off, _) in zip(outs, LAYOUT, strict=True)]
        ) as g:
            g.run(timeout=60)
        for (off, n), out in zip(LAYOUT, outs, strict=True):
            assert np.array_equal(out, want[off : off + n])
        # Notified runs, the region written in four quarters out of order.
        quarter = size // 4

        def run_notified(seed):
            src = pattern(seed, size)
            x = ep.prepare_put(
                [
                    (src[i * quarter : (i + 1) * quarter], key, i * quarter)
                    for i in (3, 1, 0, 2)
                ]
            )
            # The run's request holds what it uses: x itself may go.
            return x.run_nb(notify=b"seed=%d" % seed)

        notified_puts(q, w, [200, 201, 202], run_notified)
