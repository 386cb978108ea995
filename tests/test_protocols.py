"""gpucx.protocols: UCX's protocol tables parsed, the query on real
endpoints (one process and two), the slow-path warning, bench rows."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest

import gpucx
from gpucx import protocols as P
from gpucx.ops import rma as _rma

from conftest import TRANSPORTS, channel_pair, join_ok, spawn

pytestmark = pytest.mark.timeout(120)

HERE = pathlib.Path(__file__).resolve().parent
H200 = (HERE / "ucx_proto_info_h200.txt").read_text()
H100 = (HERE / "ucx_proto_info_h100_tuned.txt").read_text()


# -- the parser -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("0", (0, 0)),
        ("0..92", (0, 92)),
        ("8241..4M", (8241, 4 << 20)),
        ("4194305..inf", (4194305, None)),
        ("256K..inf", (256 << 10, None)),
        ("4G..inf", (4 << 30, None)),
        ("0..4294967295", (0, 4294967295)),
    ],
)
def test_parse_range(text, want):
    assert P.parse_range(text) == want


@pytest.mark.parametrize("text", ["", "abc", "1..", "inf", "-1..3"])
def test_parse_range_rejects(text):
    with pytest.raises(ValueError, match="not a UCX size range"):
        P.parse_range(text)


def _rows(text, title):
    return [r for r in P.parse_tables(text) if r.operation == title]


def test_h200_tables():
    rows = P.parse_tables(H200)
    assert len(rows) > 50 and all(r.source == "log" for r in rows)
    fetch = _rows(H200, "rendezvous data fetch into host memory from cuda")
    assert [(r.start, r.end) for r in fetch] == [
        (0, 0),
        (1, 8240),
        (8241, 4 << 20),
        (4194305, None),
    ]
    assert fetch[0].description == "no data fetch" and fetch[0].config == ""
    assert fetch[1].estimated and fetch[1].description == "fragmented copy-in copy-out"
    assert fetch[2].transports == ("cuda_ipc/cuda",)
    # Small copies and cuda_ipc are fine; the unbounded host copy is slow.
    assert [r.slow for r in fetch] == [False, False, False, True]
    assert (fetch[0].op, fetch[0].local_memory, fetch[0].remote_memory) == (
        "rndv_fetch",
        "host",
        "cuda",
    )
    assert fetch[0].endpoint_config == "gpucx intra-node cfg#1"
    put = _rows(H200, "remote memory write by ucp_put* from host memory to cuda/dev[0]")
    assert put and all(
        r.slow and r.short == "software emulation sysv/memory" for r in put
    )
    assert put[0].remote_memory == "cuda" and put[0].op == "put"
    tag = _rows(H200, "tagged message by ucp_tag_send* from cuda/GPU0")[0]
    assert tag.local_memory == "cuda" and not tag.slow
    variants = {r.variant for r in rows if r.op == "tag"}
    assert variants == {"", "fast-completion", "multi"}


def test_h100_tables():
    rows = P.parse_tables(H100)
    get = [r for r in rows if r.op == "get" and r.local_memory == "cuda"]
    assert get and {r.remote_memory for r in get} <= {"cuda", "host"}
    rng = [r for r in rows if (r.start, r.end) == (30788, 4 << 20)]
    assert rng and all(r.transports == ("cuda_ipc/cuda",) and not r.slow for r in rng)
    assert not any(r.slow for r in rows if "no data fetch" in r.description)


def test_ucx_120_layout_and_count_column():
    old = """
+--------------------------+-------------------------------------------+
| gpucx intra-node cfg#2   | remote memory read by ucp_get* into host memory from cuda |
+--------------------------+--------------------+---------------------+
|                   0..inf | software emulation | sysv/memory         |
+--------------------------+--------------------+---------------------+
# +-------+--------+-------------+-------------+
# | gpucx self cfg#0                            |
# | tagged message by ucp_tag_send* from host memory |
# +-------+--------+-------------+-------------+
# | Count | Range  | Description | Config      |
# +-------+--------+-------------+-------------+
# |     3 | 0..inf | eager short | self/memory |
# +-------+--------+-------------+-------------+
"""
    a, b = P.parse_tables(old)
    assert (a.op, a.endpoint_config, a.start, a.end, a.slow) == (
        "get",
        "gpucx intra-node cfg#2",
        0,
        None,
        True,
    )
    assert (b.op, b.description, b.config, b.endpoint_config) == (
        "tag",
        "eager short",
        "self/memory",
        "gpucx self cfg#0",
    )


def test_request_info_string():
    r = P.parse_request_info(
        "{proto,cb} get into cuda/GPU0 length 65536 software emulation "
        "sysv/memory 2345.6 MB/s 27.95 us"
    )
    assert (r.op, r.local_memory, r.start, r.end) == ("get", "cuda", 65536, 65536)
    assert (r.description, r.config, r.slow) == (
        "software emulation",
        "sysv/memory",
        True,
    )
    r = P.parse_request_info(
        "{proto} tag_send from cuda/GPU0 length 8388608 rendezvous pipeline "
        "cuda_copy, write to remote, frag cuda 60% on cuda_ipc/cuda and 40% on "
        "rc_mlx5/mlx5_0:1 - not available"
    )
    assert r.description == "rendezvous pipeline cuda_copy, write to remote, frag cuda"
    assert r.transports == ("cuda_ipc/cuda", "rc_mlx5/mlx5_0:1") and not r.slow
    assert P.parse_request_info("{} <no debug info>") is None


@pytest.mark.parametrize(
    "desc, config, local, remote, end, slow",
    [
        ("software emulation", "tcp/lo", "host", "host", None, False),
        ("software emulation", "sysv/memory", "host", "cuda", None, True),
        ("software emulation", "sysv/memory", "cuda", "cuda", 8, True),
        ("no data fetch", "", "host", "cuda", None, False),
        ("fragmented copy-in copy-out", "sysv/memory", "host", "host", None, False),
        ("fragmented copy-in copy-out", "sysv/memory", "host", "cuda", 8240, False),
        ("fragmented copy-in copy-out", "posix/memory", "cuda", "host", None, True),
        ("copy-in", "cuda_copy/cuda", "cuda", "host", None, False),
        (
            "rendezvous zero-copy read from remote",
            "cma/memory",
            "host",
            "host",
            None,
            False,
        ),
    ],
)
def test_slow_rule(desc, config, local, remote, end, slow):
    assert P.is_slow(desc, config, local, remote, end) is slow


# -- real endpoints ------------------------------------------------------------------


@pytest.fixture(params=sorted(TRANSPORTS))
def pair2(request):
    ctx = gpucx.Context(config=TRANSPORTS[request.param])
    a, b = ctx.create_worker(), ctx.create_worker()
    ab, ba = a.connect(b.address), b.connect(a.address)
    yield ctx, a, b, ab, ba
    ctx.close()


def _drive(a, b, *reqs, timeout=10.0):
    import time

    end = time.monotonic() + timeout
    while not all(r.done() for r in reqs):
        a.progress()
        b.progress()
        assert time.monotonic() < end, "requests still pending"
    return [r.result() for r in reqs]


def test_query_between_workers(pair2):
    ctx, a, b, ab, ba = pair2
    with pytest.raises(ValueError, match="unknown operation"):
        ab.protocol("bogus", 8)
    with pytest.raises(ValueError, match="nbytes"):
        ab.protocol("tag", -1)
    big = np.ones(1 << 20, np.uint8)
    rbuf = np.zeros(1 << 20, np.uint8)
    _drive(a, b, ab.send_nb(big[:8], tag=5), b.recv_nb(rbuf[:8], tag=5))
    _drive(a, b, ab.send_nb(big, tag=6), b.recv_nb(rbuf, tag=6))
    small = ab.protocol("tag", 8)
    assert small is not None and small.source == "ucp_ep_print_info"
    assert small.covers(8) and small.local_memory == "host" and small.description
    large = ab.protocol("tag", 1 << 20, memory="host")
    assert large is not None and large.covers(1 << 20)
    assert all(isinstance(r, P.Protocol) for r in ab.protocols())
    # Remote-key operations: UCX reports them for a request in flight.
    region = ctx.register(rbuf)
    rkey = ab.unpack(region.remote())
    for op in ("put", "get"):
        req, row = _rma.probe_nb(ab, op, big, rkey)
        _drive(a, b, req)
        assert row is not None and row.op == op and row.source == "ucp_request_query"
        assert row.start == row.end == 1 << 20 and row.remote_memory == "host"
        assert ab.protocol(op, 1 << 20, ("host", "host")) == row
    with pytest.raises(ValueError, match="probe: op"):
        _rma.probe_nb(ab, "tag", big, rkey)
    ab.close()
    with pytest.raises(gpucx.ClosedError):
        ab.protocols()


def test_request_protocol_while_in_flight():
    ctx = gpucx.Context(config={"TLS": "sm,self"})
    with ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)
        dst = np.zeros(1 << 20, np.uint8)
        rkey = ab.unpack(ctx.register(dst).remote())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gpucx.SlowPathWarning)
            req = ab.get_nb(np.ones(1 << 20, np.uint8), rkey)
        row = req.protocol
        _drive(a, b, req)
        assert req.protocol is None  # done: UCX's request is gone
        if row is not None:
            assert row.op == "get" and row.start == 1 << 20


def test_slow_warning_fires_once(monkeypatch):
    """The warning machinery, on this host's real emulated gets: the rule
    is widened to flag host-to-host emulation (not slow by itself, see
    test_slow_rule), and the keys are marked as not host keys (the gate a
    key to device memory opens: host-to-host puts and gets skip the check),
    so that a machine without a GPU can take the path."""
    monkeypatch.setattr(P, "_warned", set())
    rule = P.is_slow

    def widened(description, config, local="", remote="", end=None):
        if "software emulation" in description.lower():
            return True
        return rule(description, config, local, remote, end)

    monkeypatch.setattr(P, "is_slow", widened)
    ctx = gpucx.Context(config={"TLS": "sm,self"})
    with ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)  # peer error handling: UCX emulates gets
        dst = np.zeros(1 << 20, np.uint8)
        rkey = ab.unpack(ctx.register(dst).remote())
        rkey._host = False
        buf = np.ones(1 << 20, np.uint8)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            reqs = [ab.get_nb(buf, rkey) for _ in range(3)]
            _drive(a, b, *reqs)
        slow = [w for w in seen if issubclass(w.category, gpucx.SlowPathWarning)]
        row = ab.protocol("get", 1 << 20)
        if row is None or not row.slow:
            pytest.skip(f"UCX does not emulate gets here ({row})")
        assert len(slow) == 1, [str(w.message) for w in slow]
        msg = str(slow[0].message)
        assert "software emulation" in msg and "get of 1048576 bytes" in msg
        assert slow[0].filename == __file__  # points at the caller
        # A second endpoint of the same configuration: not again.
        ab2 = a.connect(b.address)
        rkey2 = ab2.unpack(ctx.register(dst).remote())
        rkey2._host = False
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            _drive(a, b, ab2.get_nb(buf, rkey2))
        assert not [w for w in again if issubclass(w.category, gpucx.SlowPathWarning)]


def test_no_warning_without_error_handling(monkeypatch):
    monkeypatch.setattr(P, "_warned", set())
    ctx = gpucx.Context(config={"TLS": "sm,self"})
    with ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address, error_handling=False)
        dst = np.zeros(1 << 20, np.uint8)
        rkey = ab.unpack(ctx.register(dst).remote())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            req, row = _rma.probe_nb(ab, "get", np.ones(1 << 20, np.uint8), rkey)
            _drive(a, b, req)
        if row is not None and row.slow:
            pytest.skip(f"UCX emulates gets here too ({row})")
        assert not [w for w in seen if issubclass(w.category, gpucx.SlowPathWarning)]


# -- two processes -------------------------------------------------------------------


def _owner(chan, tls):
    import numpy as np

    import gpucx

    cfg = TRANSPORTS[tls]
    with gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        mem = np.zeros(1 << 20, np.uint8)
        region = ctx.register(mem)
        chan.put((w.address, region.remote().to_bytes()))
        for _ in range(2):  # "go on" (receive the send), "done"
            while not chan.poll(0):
                w.progress()
            if chan.get() == "go on":
                w.recv(np.zeros(1 << 16, np.uint8), tag=9, timeout=30)


@pytest.mark.parametrize("tls", sorted(TRANSPORTS))
def test_query_across_processes(tls):
    ours, theirs = channel_pair()
    proc = spawn(_owner, theirs, tls)
    try:
        address, token = ours.get()
        with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
            w = ctx.create_worker()
            ep = w.connect(address)
            ep.send(np.ones(1 << 16, np.uint8), tag=9)
            tag = ep.protocol("tag", 1 << 16)
            assert tag is not None and tag.covers(1 << 16)
            rkey = ep.unpack(gpucx.RemoteMemory.from_bytes(token))
            ours.put("go on")  # the owner progresses until its recv is done
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", gpucx.SlowPathWarning)
                row = _rma.probe(ep, "get", np.zeros(4096, np.uint8), rkey, timeout=30)
            assert row is not None and row.op == "get" and row.covers(4096)
            assert ep.protocol("get", 4096) == row
            ours.put("done")
    finally:
        join_ok(proc, 60)


# -- bench ---------------------------------------------------------------------------


@pytest.mark.parametrize("error_handling", [True, False])
def test_bench_rows_carry_protocol(error_handling):
    from gpucx.bench.report import format_table
    from gpucx.bench.runner import BenchOptions, run_bench

    doc = run_bench(
        BenchOptions(
            tests=("get_bw", "put_bw", "tag_bw", "am_bw"),
            sizes=(8, 1 << 20),
            iters=20,
            warmup=2,
            error_handling=error_handling,
            progress=False,
        )
    )
    rs = doc["results"]
    assert len(rs) == 8
    for r in rs:
        assert isinstance(r["protocol"], str) and r["protocol"], r
        assert isinstance(r["protocol_slow"], bool)
    table = format_table(rs)
    assert table.splitlines()[0].split()[-2:] == ["protocol", "api"]
    assert rs[0]["protocol"] in table
