"""The benchmark engine: size parsing, the C timing loops, the peer protocol.

The C loops are exercised with two workers in one process (the responder
runs in a thread: cffi releases the GIL during the C call) and across two
real processes; the engine runs its own peer process.  Speed is never
asserted.
"""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from peers_bench import c_loop_peer

import gpucx
from gpucx import info as _info
from gpucx._internal import am_recv_registration
from gpucx._lib import ffi, lib
from gpucx.bench import perftest as _perftest
from gpucx.bench.memory import BenchSetupError, alloc, parse_memory
from gpucx.bench.report import ProgressBar, format_table
from gpucx.bench.runner import (
    BenchFailed,
    BenchOptions,
    default_iters,
    plan,
    run_bench,
    run_point,
    validate,
)
from gpucx.bench.session import ACK_TAG, DATA_TAG, PeerGone, spawn_local
from gpucx.bench.sizes import format_size, parse_size, parse_sizes, parse_sweep
from gpucx.bench.suites import TESTS, Params

from conftest import channel_pair, join_ok, spawn

pytestmark = pytest.mark.timeout(120)

HOST = int(gpucx.MemoryType.HOST)
SECOND = 10**9
BENCH_TLS = {"default": None, "tcp": "tcp", "shm": "sm,self"}


# -- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, n",
    [
        ("0", 0),
        ("8", 8),
        ("1K", 1024),
        ("1k", 1024),
        ("64KiB", 65536),
        ("16M", 16 << 20),
        ("2G", 2 << 30),
        (" 1MB ", 1 << 20),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5K", "8T", "1K1", "99G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


def test_parse_sizes_keeps_order_drops_duplicates():
    assert parse_sizes("8,1K,8,1M") == [8, 1024, 1 << 20]
    with pytest.raises(ValueError, match="no sizes"):
        parse_sizes(" , ")


def test_parse_sweep():
    assert parse_sweep("8:64") == [8, 16, 32, 64]
    assert parse_sweep("8:1K:4") == [8, 32, 128, 512, 1024]
    assert parse_sweep("0:4") == [0, 1, 2, 4]
    assert parse_sweep("1M:1M") == [1 << 20]
    for bad, msg in (
        ("8", "LO:HI"),
        ("64:8", "LO is larger"),
        ("8:64:1", "FACTOR"),
        ("8:64:x", "FACTOR"),
        ("a:b", "bad size"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_sweep(bad)


def test_format_size():
    assert [format_size(n) for n in (8, 1024, 1536, 1 << 20, 3 << 30)] == [
        "8",
        "1K",
        "1536",
        "1M",
        "3G",
    ]


def test_parse_memory():
    assert parse_memory("host") == ("host", "host")
    assert parse_memory("host:CUDA") == ("host", "cuda")
    assert parse_memory("ucx") == ("ucx", "ucx")
    assert parse_memory("ucx:host") == ("ucx", "host")
    assert parse_memory("reg:cuda") == ("reg", "cuda")
    for bad in ("gpu", "host:cuda:host", "", "pinned"):
        with pytest.raises(BenchSetupError, match="bad --memory .*ucx, reg"):
            parse_memory(bad)


def test_alloc_host():
    a = alloc("host", 100, fill=3)
    assert a.nbytes == 100 and a.dtype == np.uint8 and int(a.sum()) == 300
    assert alloc("host", 0).nbytes == 0
    with pytest.raises(BenchSetupError, match="bad --memory kind"):
        alloc("gpu", 10)


def test_alloc_ucx_maps_with_the_context():
    with gpucx.Context() as ctx:
        a = alloc("ucx", 4096, fill=5, ctx=ctx)
        assert a.nbytes == 4096 and int(a.sum()) == 5 * 4096
        assert alloc("ucx", 0, ctx=ctx).nbytes == 0
        # The buffer is UCX-mapped memory: a region of ctx holds it.
        regions = [r for r in ctx._children if isinstance(r, gpucx.MemoryRegion)]
        assert any(r.address == a.ctypes.data for r in regions)
    with pytest.raises(BenchSetupError, match="no gpucx.Context"):
        alloc("ucx", 10)


def test_alloc_ucx_for_a_gpu_peer_on_a_host_without_cuda():
    """Facing a GPU peer, ``ucx`` memory is mapped with a CUDA context
    current where this host can move CUDA memory (tests/test_cuda.py checks
    that it is pinned); without CUDA it is mapped as always."""
    with gpucx.Context(config={"TLS": "self,sm,tcp"}) as ctx:
        assert not ctx.cuda_available
        a = alloc("ucx", 4096, fill=3, ctx=ctx, gpu_peer=True)
        assert a.nbytes == 4096 and int(a.sum()) == 3 * 4096
        regions = [r for r in ctx._children if isinstance(r, gpucx.MemoryRegion)]
        assert any(r.address == a.ctypes.data for r in regions)


def test_alloc_reg_registers_numpy_memory_with_the_context():
    with gpucx.Context() as ctx:
        a = alloc("reg", 4096, fill=7, ctx=ctx)
        assert a.nbytes == 4096 and int(a.sum()) == 7 * 4096
        assert isinstance(a, np.ndarray) and a.base is not None
        regions = [r for r in ctx._children if isinstance(r, gpucx.MemoryRegion)]
        assert any(r.address == a.ctypes.data and r.nbytes == 4096 for r in regions)
        assert alloc("reg", 0, ctx=ctx).nbytes == 0
    with pytest.raises(BenchSetupError, match="--memory reg: no gpucx.Context"):
        alloc("reg", 10)


def test_bench_runs_with_registered_numpy_memory():
    doc = run_bench(
        BenchOptions(
            tests=("tag_bw", "put_bw", "get_bw"),
            sizes=(65536,),
            iters=20,
            warmup=2,
            memory=("reg", "host"),
            progress=False,
        )
    )
    rs = doc["results"]
    assert [r["test"] for r in rs] == ["tag_bw", "put_bw", "get_bw"]
    assert all(r["bandwidth_gbs"] > 0 and r["memory"] == "reg:host" for r in rs)


# -- planning ------------------------------------------------------------------------


def test_plan_defaults_and_fixed_sizes():
    pts = plan(BenchOptions())
    assert [(p.test, p.size) for p in pts] == [
        ("tag_lat", 8),
        ("tag_lat", 1 << 20),
        ("tag_bw", 8),
        ("tag_bw", 1 << 20),
    ]
    assert all(p.warmup >= 10 and p.iters >= 100 for p in pts)
    fadd = plan(BenchOptions(tests=("fadd_lat",), sizes=(1, 1 << 20), iters=5))
    assert [(p.size, p.iters, p.warmup) for p in fadd] == [(8, 5, 10)]


def test_default_iters_bounds():
    assert default_iters(8, "lat") == 10000
    assert default_iters(64 << 20, "bw") == 100
    # A bandwidth point moves 1 GiB, within 100..100,000 messages.
    assert default_iters(1 << 20, "bw") == 1024
    assert default_iters(8, "bw") == 100000
    assert default_iters(1 << 30, "lat") == 100


def test_params_round_trip():
    p = Params("tag_bw", 8, 10, 1, window=4, server_mem="host", use_async=True)
    assert Params.from_dict(p.to_dict()) == p


def test_validate_rejects_unknown_and_bad_counts():
    for opts, msg in (
        (BenchOptions(tests=("nope",)), "unknown test"),
        (BenchOptions(tests=()), "no test"),
        (BenchOptions(iters=0), "--iters"),
        (BenchOptions(warmup=-1), "--warmup"),
        (BenchOptions(window=0), "--window"),
        (BenchOptions(device=-1), "--device"),
        (BenchOptions(vs_perftest=True, client="h:1"), "--vs-perftest"),
    ):
        with pytest.raises(BenchSetupError, match=msg):
            validate(opts)


# -- the C loops, two workers in one process -----------------------------------------


def _park_pending(w, slots, n, keep):
    """Never free a slot UCX still holds: park it on its worker."""
    for i in range(n):
        if slots[i].status == lib.UCS_INPROGRESS:
            w._engine.park(slots + i, (slots, keep))


def _acked(fn, w, ep, head, buf, tail, window, timeout_ns):
    """Run a C stream that ends with an acknowledgement:
    ``fn(worker, ep, *head, buf, nbytes, HOST, *tail, window, timeout_ns,
    slots, ack, elapsed)``; returns (status, elapsed ns)."""
    out = ffi.new("uint64_t *")
    slots = ffi.new("gpucx_slot_t[]", window + 1)
    ack = ffi.new("uint64_t *")
    st = fn(
        w._h,
        ep._h if ep is not None else ffi.NULL,
        *head,
        ffi.from_buffer(buf),
        buf.nbytes,
        HOST,
        *tail,
        window,
        timeout_ns,
        slots,
        ack,
        out,
    )
    _park_pending(w, slots, window + 1, (buf, ack))
    return st, out[0]


def _pp(fn, w, ep, head, sbuf, rbuf, rmt, tail, rtt, timeout_ns):
    """Run a C ping-pong: ``fn(worker, ep, *head, sbuf, HOST, rbuf, rmt,
    nbytes, *tail, timeout_ns, slots, rtt, elapsed)``; returns (status,
    elapsed ns)."""
    out = ffi.new("uint64_t *")
    rtt_p = ffi.NULL if rtt is None else ffi.cast("uint64_t *", rtt.ctypes.data)
    slots = ffi.new("gpucx_slot_t[]", 2)
    st = fn(
        w._h,
        ep._h,
        *head,
        ffi.from_buffer(sbuf),
        HOST,
        ffi.from_buffer(rbuf),
        rmt,
        sbuf.nbytes,
        *tail,
        timeout_ns,
        slots,
        rtt_p,
        out,
    )
    _park_pending(w, slots, 2, (sbuf, rbuf, rtt))
    return st, out[0]


def _stream(w, ep, send, buf, iters, window, timeout_ns=20 * SECOND):
    tail = (DATA_TAG, ACK_TAG, iters)
    return _acked(
        lib.gpucx_bench_tag_stream, w, ep, (send,), buf, tail, window, timeout_ns
    )


def _pingpong(w, ep, initiator, sbuf, rbuf, iters, rtt=None, timeout_ns=20 * SECOND):
    return _pp(
        lib.gpucx_bench_tag_pingpong,
        w,
        ep,
        (initiator,),
        sbuf,
        rbuf,
        HOST,
        (DATA_TAG, iters),
        rtt,
        timeout_ns,
    )


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*args)))
    t.start()
    return t, box


@pytest.mark.parametrize("size", [0, 8, 65536, 1 << 20])
@pytest.mark.parametrize("window", [1, 4, 64])
def test_c_stream_moves_the_data(pair, tls, size, window):
    src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    t, box = _in_thread(_stream, pair.b, pair.ba, 0, dst, 20, window)
    st, ns = _stream(pair.a, pair.ab, 1, src, 20, window)
    t.join(30)
    assert st == lib.UCS_OK and ns > 0
    assert box["r"][0] == lib.UCS_OK and box["r"][1] > 0
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("size", [8, 65536, 1 << 20])
def test_c_pingpong_records_round_trips(pair, tls, size):
    a_s = np.full(size, 1, np.uint8)
    a_r = np.zeros(size, np.uint8)
    b_s = np.full(size, 2, np.uint8)
    b_r = np.zeros(size, np.uint8)
    rtt = np.zeros(50, np.uint64)
    t, box = _in_thread(_pingpong, pair.b, pair.ba, 0, b_s, b_r, 50)
    st, ns = _pingpong(pair.a, pair.ab, 1, a_s, a_r, 50, rtt)
    t.join(30)
    assert st == lib.UCS_OK and box["r"][0] == lib.UCS_OK
    assert (rtt > 0).all() and int(rtt.sum()) <= ns
    assert (a_r == 2).all() and (b_r == 1).all()


def test_c_stream_times_out_without_a_receiver(pair):
    """The sender's acknowledgement never comes: TIMED_OUT, nothing leaks."""
    st, ns = _stream(pair.a, pair.ab, 1, np.ones(8, np.uint8), 4, 2, SECOND // 5)
    assert st == lib.UCS_ERR_TIMED_OUT
    assert ns >= SECOND // 5
    with pytest.raises(gpucx.TimeoutError):
        gpucx.errors.check(st, "bench")


def test_c_pingpong_times_out_without_a_responder(pair):
    b = np.zeros(8, np.uint8)
    st, _ = _pingpong(pair.a, pair.ab, 1, np.ones(8, np.uint8), b, 3, None, SECOND // 5)
    assert st == lib.UCS_ERR_TIMED_OUT


def test_c_stream_reports_truncation(pair):
    """A receive buffer smaller than the messages fails the receiving loop."""
    t, box = _in_thread(
        _stream, pair.b, pair.ba, 0, np.zeros(4, np.uint8), 2, 2, SECOND
    )
    st, _ = _stream(pair.a, pair.ab, 1, np.ones(64, np.uint8), 2, 2, SECOND)
    t.join(30)
    assert box["r"][0] == lib.UCS_ERR_MESSAGE_TRUNCATED
    assert st == lib.UCS_ERR_TIMED_OUT  # no acknowledgement came


@pytest.mark.parametrize("get", [0, 1], ids=["put", "get"])
@pytest.mark.parametrize("window", [1, 16])
def test_c_rma_stream_moves_the_data(pair, tls, get, window):
    size = 1 << 16
    target = np.full(size, 3, np.uint8)
    local = np.full(size, 9, np.uint8) if not get else np.zeros(size, np.uint8)
    memh = ffi.new("ucp_mem_h *")
    addr, length, mtype = ffi.new("uint64_t *"), ffi.new("size_t *"), ffi.new("int *")
    rkey_buf = ffi.new("void **")
    rkey_len = ffi.new("size_t *")
    rkey = ffi.new("ucp_rkey_h *")
    ctx = pair.ctx
    st = lib.gpucx_mem_map(
        ctx._h, ffi.from_buffer(target), size, HOST, 0, 0, memh, addr, length, mtype
    )
    assert st == lib.UCS_OK
    try:
        assert lib.gpucx_rkey_pack(ctx._h, memh[0], rkey_buf, rkey_len) == 0
        assert lib.gpucx_rkey_unpack(pair.ab._h, rkey_buf[0], rkey) == 0
        stop = threading.Event()
        t = threading.Thread(
            target=lambda: [pair.b.progress() for _ in iter(stop.is_set, True)]
        )
        t.start()
        out = ffi.new("uint64_t *")
        slots = ffi.new("gpucx_slot_t[]", window + 1)
        try:
            st = lib.gpucx_bench_rma_stream(
                pair.a._h,
                pair.ab._h,
                get,
                ffi.from_buffer(local),
                size,
                HOST,
                target.ctypes.data,
                rkey[0],
                20,
                window,
                20 * SECOND,
                slots,
                out,
            )
        finally:
            stop.set()
            t.join(30)
        assert st == lib.UCS_OK and out[0] > 0
        assert (target == 9).all() if not get else (local == 3).all()
        lib.gpucx_rkey_destroy(rkey[0])
    finally:
        lib.gpucx_free(rkey_buf[0])
        assert lib.gpucx_mem_unmap(ctx._h, memh[0]) == lib.UCS_OK


def test_rkey_handle_only_takes_rkeys():
    from gpucx._internal import rkey_handle

    class Fake:
        _h = ffi.new("int *")

    assert rkey_handle(object()) is None and rkey_handle(Fake()) is None
    real = ffi.cast("ucp_rkey_h", 0)

    class Key:
        _h = real

    assert rkey_handle(Key()) is real


# -- the active-message C loops -------------------------------------------------------

AM = 7


def _am_stream(w, ep, buf, iters, window, timeout_ns=20 * SECOND):
    fn, tail = lib.gpucx_bench_am_stream, (ACK_TAG, iters)
    return _acked(fn, w, ep, (AM,), buf, tail, window, timeout_ns)


def _am_pingpong(
    w, ep, initiator, sbuf, rbuf, iters, rtt=None, timeout_ns=20 * SECOND, **bad
):
    """``bad``: ``reg`` or ``rmt`` in place of the real ones."""
    reg = bad["reg"] if "reg" in bad else am_recv_registration(w, AM)
    return _pp(
        lib.gpucx_bench_am_pingpong,
        w,
        ep,
        (reg, AM, initiator),
        sbuf,
        rbuf,
        bad.get("rmt", HOST),
        (iters,),
        rtt,
        timeout_ns,
    )


def _am_receive_and_ack(w, ep, dst, n):
    """The receiving side of the AM stream: n posted receives, then the ack."""
    w.am_recv_many_nb(AM, [dst] * n).wait(30)
    ep.send(np.zeros(1, np.uint64), tag=ACK_TAG)


@pytest.mark.parametrize("size", [0, 8, 1 << 20])
@pytest.mark.parametrize("window", [1, 16])
def test_c_am_stream_moves_the_data(pair, tls, size, window):
    src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    t, _ = _in_thread(_am_receive_and_ack, pair.b, pair.ba, dst, 20)
    st, ns = _am_stream(pair.a, pair.ab, src, 20, window)
    t.join(30)
    assert st == lib.UCS_OK and ns > 0
    assert np.array_equal(src, dst)


def test_c_am_stream_refuses_an_empty_window(pair):
    st, _ = _am_stream(pair.a, pair.ab, np.ones(8, np.uint8), 4, 0)
    assert st == lib.UCS_ERR_INVALID_PARAM


def test_c_am_stream_times_out_without_an_acknowledgement(pair):
    """Nobody acknowledges: TIMED_OUT; the messages wait, kept, for a
    receive the peer posts later."""
    st, ns = _am_stream(pair.a, pair.ab, np.full(8, 4, np.uint8), 3, 2, SECOND // 5)
    assert st == lib.UCS_ERR_TIMED_OUT and ns >= SECOND // 5
    dst = np.zeros(8, np.uint8)
    pair.b.am_recv_many_nb(AM, [dst] * 3).wait(10)
    assert (dst == 4).all()


@pytest.mark.parametrize("size", [8, 1 << 20])
def test_c_am_pingpong_records_round_trips(pair, tls, size):
    a_s, a_r = np.full(size, 1, np.uint8), np.zeros(size, np.uint8)
    b_s, b_r = np.full(size, 2, np.uint8), np.zeros(size, np.uint8)
    am_recv_registration(pair.b, AM)  # before the first message can come
    rtt = np.zeros(50, np.uint64)
    t, box = _in_thread(_am_pingpong, pair.b, pair.ba, 0, b_s, b_r, 50)
    st, ns = _am_pingpong(pair.a, pair.ab, 1, a_s, a_r, 50, rtt)
    t.join(30)
    assert st == lib.UCS_OK and box["r"][0] == lib.UCS_OK
    assert (rtt > 0).all() and int(rtt.sum()) <= ns
    assert (a_r == 2).all() and (b_r == 1).all()


def test_c_am_pingpong_times_out_and_withdraws_its_receive(pair):
    """No responder: TIMED_OUT, and the posted receive is withdrawn (a later
    message goes to the next receive, not into the loop's buffer)."""
    loop_buf = np.zeros(8, np.uint8)
    st, _ = _am_pingpong(
        pair.a, pair.ab, 1, np.ones(8, np.uint8), loop_buf, 3, None, SECOND // 5
    )
    assert st == lib.UCS_ERR_TIMED_OUT
    pair.b.am_recv_nb(AM, np.zeros(8, np.uint8))  # b's copy of the message
    pair.ba.am_send(AM, np.full(8, 6, np.uint8))
    later = np.zeros(8, np.uint8)
    pair.a.am_recv_nb(AM, later).wait(10)
    assert (later == 6).all() and (loop_buf == 0).all()


def test_c_am_pingpong_reports_truncation(pair):
    """A responder's buffer smaller than the message fails its loop."""
    am_recv_registration(pair.b, AM)
    t, box = _in_thread(
        _am_pingpong, pair.b, pair.ba, 0, np.ones(4, np.uint8), np.zeros(4, np.uint8), 2
    )
    st, _ = _am_pingpong(
        pair.a,
        pair.ab,
        1,
        np.ones(64, np.uint8),
        np.zeros(64, np.uint8),
        2,
        None,
        SECOND // 2,
    )
    t.join(30)
    assert box["r"][0] == lib.UCS_ERR_MESSAGE_TRUNCATED
    assert st == lib.UCS_ERR_TIMED_OUT  # no echo came


def test_c_am_pingpong_needs_a_registration_and_host_memory(pair):
    st, _ = _am_pingpong(
        pair.a,
        pair.ab,
        1,
        np.ones(8, np.uint8),
        np.zeros(8, np.uint8),
        1,
        reg=ffi.NULL,
    )
    assert st == lib.UCS_ERR_INVALID_PARAM
    cuda = int(gpucx.MemoryType.CUDA)  # never touched: refused before posting
    st, _ = _am_pingpong(
        pair.a, pair.ab, 1, np.ones(8, np.uint8), np.zeros(8, np.uint8), 1, rmt=cuda
    )
    assert st == lib.UCS_ERR_INVALID_PARAM


# -- the C loops across two processes ------------------------------------------------


@pytest.mark.parametrize("test", ["stream", "pingpong"])
def test_c_loops_across_processes(tls, test):
    size, iters = 1 << 16, 30
    q, theirs = channel_pair()
    child = spawn(c_loop_peer, tls, theirs, test, size, iters, 8)
    try:
        with gpucx.Context(
            config={"default": None, "tcp": {"TLS": "tcp"}, "shm": {"TLS": "sm,self"}}[
                tls
            ]
        ) as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)
            src = np.full(size, 5, np.uint8)
            if test == "stream":
                st, ns = _stream(w, ep, 1, src, iters, 8)
            else:
                st, ns = _pingpong(w, ep, 1, src, np.zeros(size, np.uint8), iters)
            assert st == lib.UCS_OK and ns > 0
            pst, head, pns = q.get(60)
            assert pst == lib.UCS_OK and pns > 0
            assert head == bytes([5] * 16)
            q.put("bye")
    finally:
        join_ok(child, 60)


# -- the engine with its own peer process --------------------------------------------


@pytest.mark.parametrize("use_async", [False, True], ids=["c-loop", "async"])
def test_run_bench_tag_tests(tls, use_async):
    doc = run_bench(
        BenchOptions(
            sizes=(8, 65536),
            iters=40,
            warmup=4,
            window=8,
            tls=BENCH_TLS[tls],
            use_async=use_async,
            progress=False,
        )
    )
    rs = doc["results"]
    assert [(r["test"], r["size"]) for r in rs] == [
        ("tag_lat", 8),
        ("tag_lat", 65536),
        ("tag_bw", 8),
        ("tag_bw", 65536),
    ]
    assert all(r["bandwidth_gbs"] > 0 and r["msg_rate"] > 0 for r in rs)
    assert doc["environment"]["transports"]
    assert doc["environment"]["tls"] == (BENCH_TLS[tls] or "default")


@pytest.mark.parametrize(
    ("name", "memory"),
    [(t, ("host", "host")) for t in sorted(set(TESTS) - {"tag_lat", "tag_bw"})]
    + [(t, ("ucx", "ucx")) for t in sorted(TESTS)]
    + [("put_bw", ("host", "ucx")), ("am_bw", ("ucx", "host"))],
)
def test_run_bench_other_areas(name, memory):
    """The am/stream/rma/atomic/array tests run end to end (atomics need
    endpoints without peer error handling); with ``-m ucx`` (host buffers
    mapped by UCX, as ucx_perftest's, on either side) every test does."""
    doc = run_bench(
        BenchOptions(
            tests=(name,),
            sizes=(8, 65536),
            iters=20,
            warmup=2,
            window=4,
            memory=memory,
            progress=False,
            error_handling=name != "fadd_lat",
        )
    )
    assert doc["results"] and all(r["bandwidth_gbs"] > 0 for r in doc["results"])


@pytest.mark.parametrize(
    "perftest_first", [False, True], ids=["gpucx-first", "perftest-first"]
)
def test_vs_perftest_runs_in_the_order_asked(perftest_first, monkeypatch):
    """Each point runs ucx_perftest right after gpucx, or right before it
    with ``perftest_first`` (compare.py alternates by round); both orders
    give both figures and the ratio."""
    from gpucx.bench import runner

    calls = []
    real_point, real_perftest = runner.run_point, runner._perftest.run_perftest

    def gpucx_point(sess, p):
        calls.append(("gpucx", p.test))
        return real_point(sess, p)

    def perftest_point(test, *args, **kw):
        calls.append(("perftest", test))
        return real_perftest(test, *args, **kw)

    monkeypatch.setattr(runner, "run_point", gpucx_point)
    monkeypatch.setattr(runner._perftest, "run_perftest", perftest_point)
    doc = run_bench(
        BenchOptions(
            tests=("tag_bw",),
            sizes=(8,),
            iters=40,
            warmup=4,
            vs_perftest=True,
            perftest_first=perftest_first,
            progress=False,
        )
    )
    order = [who for who, _ in calls]
    assert order == (["perftest", "gpucx"] if perftest_first else ["gpucx", "perftest"])
    (r,) = doc["results"]
    assert r["bandwidth_gbs"] > 0 and r["perftest"]["bandwidth_gbs"] > 0
    assert r["perftest"]["test"] == TESTS["tag_bw"].perftest
    assert r["ratio"] > 0


def test_progress_bar_draws():
    s = io.StringIO()
    bar = ProgressBar(2, True, s)
    bar.update("tag_lat 8")
    bar.update("tag_bw 1M")
    bar.close()
    assert "gpucx bench" in s.getvalue()
    quiet = io.StringIO()
    bar = ProgressBar(1, False, quiet)
    bar.update("x")
    bar.close()
    assert quiet.getvalue() == ""


def test_peer_reports_its_errors():
    """A point the peer refuses fails with the peer's one-line reason."""
    with spawn_local(None, True, 0, 30.0) as sess:
        reply = sess.call({"op": "run", "params": {"test": "tag_lat"}})
        assert "error" in reply and reply["error"].startswith("peer:")
        reply = sess.call({"op": "bogus"})
        assert "unknown control message" in reply["error"]
        with pytest.raises(BenchFailed, match="tag_bw 8: peer:.*bad --memory"):
            run_point(sess, Params("tag_bw", 8, 5, 1, server_mem="nvram"))
        # The peer still serves after refusing.
        r = run_point(sess, Params("tag_lat", 8, 5, 1))
        assert r["latency_us"] > 0
        assert sess.call({"op": "quit"}) == {"ok": True}
        sess.finished = True
    assert sess._proc.returncode == 0


def test_peer_death_is_reported_not_hung():
    sess = spawn_local(None, True, 0, 30.0)
    try:
        sess._proc.kill()
        sess._proc.wait(10)
        with pytest.raises((PeerGone, BenchFailed, gpucx.UCXError)):
            run_point(sess, Params("tag_lat", 8, 5, 1, timeout=10))
    finally:
        sess.close()


# -- perftest and info parsing -------------------------------------------------------

PERFTEST_CSV = """\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
[thread 0]1577,1.042,634.241,634.241,1576.69,1576.69,1577,1577
2000,0.436,940.135,698.938,1063.68,1430.74,1064,1431
"""


def test_parse_perftest_csv():
    r = _perftest.parse_csv(PERFTEST_CSV)
    assert r["iterations"] == 2000
    assert r["latency_us"] == pytest.approx(0.436)
    assert r["latency_avg_us"] == pytest.approx(698.938)
    assert r["bandwidth_gbs"] == pytest.approx(1430.74 * (1 << 20) / 1e9)
    assert r["msg_rate"] == 1431
    with pytest.raises(_perftest.PerftestError, match="no figures"):
        _perftest.parse_csv("connect() failed\n")


def test_run_perftest_failure_is_reported(monkeypatch):
    """A bad test name fails at once (no retry on another port) and the
    message quotes perftest's error, not the end of its usage text."""
    ports = []
    free_port = _perftest._free_port

    def counted():
        ports.append(free_port())
        return ports[-1]

    monkeypatch.setattr(_perftest, "_free_port", counted)
    with pytest.raises(_perftest.PerftestError, match="failed: Invalid option"):
        _perftest.run_perftest("no_such_test", 8, 10, 1, timeout=30)
    assert len(ports) == 1


def test_perftest_setup_race_is_told_from_other_failures():
    refused = (
        "[1795709319.357504] [vm:13028:0]        perftest.c:438  UCX  ERROR "
        "client failed. connect() failed: Connection refused\n"
        "[1795709319.357549] [vm:13028:0]        perftest.c:902  UCX  ERROR "
        "failed to setup RTE transport: Input/output error\n"
    )
    assert _perftest._SETUP_RACE.search(refused)
    assert _perftest._error_line(refused) == (
        "client failed. connect() failed: Connection refused"
    )
    usage = "[1] [vm:1:0] perftest_params.c:622  UCX  ERROR Invalid option\n  Usage:"
    assert not _perftest._SETUP_RACE.search(usage)
    assert _perftest._error_line(usage) == "Invalid option"
    assert _perftest._error_line("just text\nlast line\n") == "last line"
    assert _perftest._error_line("") == ""


UCX_INFO = """\
# Memory domain: self
#     Component: self
#         memory types: host (access,reg_nonblock,reg,cache)
#      Transport: self
#         Device: memory
# Memory domain: tcp
#     Component: tcp
#         memory types:
#      Transport: tcp
#         Device: eth0
#      Transport: tcp
#         Device: lo
# Memory domain: cuda_cpy
#     Component: cuda_cpy
#         memory types: host (reg), cuda (access,alloc,reg,detect)
#      Transport: cuda_copy
#         Device: cuda
"""


def test_parse_ucx_info():
    d = _info.parse_ucx_info(UCX_INFO)
    assert [x["domain"] for x in d] == ["self", "tcp", "cuda_cpy"]
    assert d[1]["transports"] == [["tcp", "eth0"], ["tcp", "lo"]]
    assert d[1]["memory_types"] == []
    assert d[2]["memory_types"] == ["host", "cuda"]


def test_info_collect():
    info = _info.collect()
    assert "HOST" in info["memory_types"]
    assert {"self", "tcp"} <= set(info["transports"])
    assert info["cuda"]["can_move_cuda_memory"] in (True, False)


def test_table_notes_one_way_latency():
    r = {
        "test": "tag_lat",
        "size": 8,
        "iters": 1,
        "latency_us": 1.0,
        "latency_p99_us": 2.0,
        "latency_avg_us": 1.5,
        "bandwidth_gbs": 0.1,
        "msg_rate": 5.0,
        "ratio": 0.5,
        "perftest": {"latency_us": 0.5, "bandwidth_gbs": 0.2},
    }
    text = format_table([r], with_perftest=True)
    assert "one-way" in text and "0.5" in text.splitlines()[2]


def _bw_row(memory: str) -> dict:
    return {
        "test": "tag_bw",
        "size": 1 << 20,
        "iters": 1,
        "latency_us": None,
        "latency_p99_us": None,
        "latency_avg_us": 100.0,
        "bandwidth_gbs": 10.0,
        "msg_rate": 1.0,
        "ratio": 0.2,
        "memory": memory,
        "perftest": {"latency_us": 20.0, "bandwidth_gbs": 47.0},
    }


@pytest.mark.parametrize(
    "memory, noted",
    [
        ("host", True),
        ("cuda:host", True),
        ("host:ucx", True),
        ("ucx", False),
        ("cuda", False),
        ("cuda:ucx", False),
    ],
)
def test_table_says_when_host_memory_is_not_perftest_s(memory, noted):
    """NumPy host memory against perftest's UCX-mapped buffers is not like for
    like (on a GPU, receiving into it ran at a fifth of perftest's speed):
    the table says so, and names -m ucx."""
    text = format_table([_bw_row(memory)], with_perftest=True)
    assert ("-m ucx in place of host" in text) == noted
    assert "-m ucx in place of host" not in format_table([_bw_row(memory)])
