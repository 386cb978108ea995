"""gpucx.bench.limits: the machine's copies beside each GPU row of bench.

The copies run over the real ctypes bindings of gpucx.mem.cuda.Driver and
``tests/fakecuda/libcuda_fake.c``, a test double for the missing GPU (its
"device" memory is host memory, its copies memmove, its timing events
report the elapsed time a test sets).  The cuda-marked twin on a real GPU
is tests/test_cuda.py::test_copy_limits_on_the_gpu.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from gpucx.bench import limits
from gpucx.bench.report import format_table
from gpucx.bench.runner import BenchOptions, run_bench
from gpucx.bench.suites import TESTS
from gpucx.mem import cuda as gcuda

from fakegpu import build_fake_libcuda

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture(scope="module")
def fake_lib_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakecuda")
    # Named as the real one, for the subprocess tests (LD_LIBRARY_PATH).
    return build_fake_libcuda(d / "libcuda.so.1")


@pytest.fixture
def drv(fake_lib_path):
    d = gcuda.Driver.load(fake_lib_path)
    d._lib.fake_reset()
    d._lib.fake_set_elapsed.argtypes = [ctypes.c_float]
    d._lib.fake_set_slow.argtypes = [ctypes.c_float, ctypes.c_int]
    d._lib.fake_async_bytes.restype = ctypes.c_size_t
    previous = gcuda.set_driver(d)
    limits.clear_cache()
    yield d
    limits.clear_cache()
    d._lib.fake_reset()
    gcuda.restore_driver(previous)


def _live(d) -> tuple[int, int, int]:
    return (
        d._lib.fake_allocs_live(),
        d._lib.fake_streams_live(),
        d._lib.fake_events_live(),
    )


# -- the measurement ------------------------------------------------------------


def test_reps_follow_a_byte_budget():
    per_round = limits.BUDGET // limits.ROUNDS
    assert limits.reps_for(MiB) == per_round // MiB
    assert limits.reps_for(8) == limits.MAX_REPS
    assert limits.reps_for(1 << 34) == limits.MIN_REPS
    assert limits.reps_for(0) == limits.MAX_REPS
    assert limits.reps_for(MiB, budget=8 * MiB) == limits.MIN_REPS


@pytest.mark.parametrize("kind", limits.KINDS)
def test_measure_is_bytes_over_the_events_time(drv, kind):
    drv._lib.fake_set_elapsed(2.0)
    reps = limits.reps_for(MiB)
    gbps = limits.measure(kind, MiB, device=1)
    assert gbps == pytest.approx(MiB * reps / 2.0e6)
    # Warm-up copies, then ROUNDS timed rounds of reps copies, on a stream
    # of its own (not the legacy default stream).
    copies = drv._lib.fake_async_copies()
    warm = copies - limits.ROUNDS * reps
    assert 3 <= warm <= 20
    assert drv._lib.fake_async_bytes() == copies * MiB
    assert drv._lib.fake_async_last_stream() >= 0x5000
    assert drv.current_context() == 0xC1  # device 1 made current
    assert _live(drv) == (0, 0, 0)  # every allocation, stream, event freed


@pytest.mark.parametrize(
    "slow, rounds, ms",
    [
        (0, limits.ROUNDS, 1.0),
        # A slow first round: the later ones are faster, the figure theirs.
        (1, limits.ROUNDS, 1.0),
        # Slow rounds, then a faster one: one more round to see it hold.
        (limits.ROUNDS - 1, limits.ROUNDS + 1, 1.0),
        # Every round alike slow: the slow figure stands.
        (99, limits.ROUNDS, 4.0),
    ],
)
def test_rounds_go_on_while_they_get_faster(drv, slow, rounds, ms):
    drv._lib.fake_set_elapsed(1.0)
    drv._lib.fake_set_slow(4.0, slow)
    reps = limits.reps_for(MiB)
    assert limits.measure("d2h_pinned", MiB) == pytest.approx(MiB * reps / (ms * 1e6))
    warm = max(3, min(reps // 10, 20))
    assert drv._lib.fake_async_copies() == warm + rounds * reps


def test_measure_is_cached_per_kind_size_and_device(drv):
    first = limits.measure("d2d", MiB, 0)
    copies = drv._lib.fake_async_copies()
    drv._lib.fake_set_elapsed(4.0)
    assert limits.measure("d2d", MiB, 0) == first
    assert drv._lib.fake_async_copies() == copies  # nothing copied again
    assert limits.measure("d2d", MiB, 1) == pytest.approx(first / 4)
    assert limits.measure("h2d_pinned", MiB, 0) == pytest.approx(first / 4)
    twice = 2 * MiB * limits.reps_for(2 * MiB) / 4e6
    assert limits.measure("d2d", 2 * MiB, 0) == pytest.approx(twice)
    limits.clear_cache()
    assert limits.measure("d2d", MiB, 0) == pytest.approx(first / 4)


def test_no_elapsed_time_gives_no_figure(drv):
    drv._lib.fake_set_elapsed(0.0)
    assert limits.measure("d2d", MiB) is None


def test_a_failed_allocation_is_reported_and_frees_the_rest(drv):
    drv._lib.fake_set_alloc_limit(ctypes.c_size_t(MiB))
    with pytest.raises(limits.LimitError) as info:
        limits.measure("h2d_pinned", 2 * MiB, device=1)
    assert str(info.value) == (
        "h2d_pinned copy of 2M bytes on device 1: cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"
    )
    assert _live(drv) == (0, 0, 0)
    # Not cached: once memory is there, the copy is measured.
    drv._lib.fake_set_alloc_limit(ctypes.c_size_t(0))
    assert limits.measure("h2d_pinned", 2 * MiB, device=1) > 0


def test_without_a_driver_or_device_no_figure(drv):
    with pytest.raises(limits.LimitError, match="device 5: .*has 2 CUDA device"):
        limits.measure("d2d", MiB, device=5)
    gcuda.set_driver(None, "no CUDA driver (libcuda.so.1: test)")
    with pytest.raises(limits.LimitError, match="no CUDA driver"):
        limits.measure("d2h_pageable", MiB)


@pytest.mark.parametrize(
    "kind, size, match",
    [("h2d", MiB, "unknown copy 'h2d'"), ("d2d", 0, "size must be an int >= 1")],
)
def test_measure_refuses_bad_arguments(kind, size, match):
    with pytest.raises(ValueError, match=match):
        limits.measure(kind, size)


# -- which copy a row is set against -------------------------------------------------


def test_every_bandwidth_test_has_a_direction():
    """A new bandwidth test in gpucx.bench.suites must say where its data
    flows; latency tests (round trips) carry no limit."""
    bw = {name for name, cls in TESTS.items() if cls.kind == "bw"}
    assert set(limits.DIRECTIONS) == bw
    for name, cls in TESTS.items():
        if cls.kind == "lat":
            assert limits.row_kind(name, "cuda:cuda") is None


@pytest.mark.parametrize(
    "test, memory, kind",
    [
        ("tag_bw", "cuda:cuda", "d2d"),
        ("tag_bw", "cuda", "d2d"),
        ("put_bw", "cuda:cuda", "d2d"),
        ("get_bw", "cuda:cuda", "d2d"),
        ("am_bw", "cuda:cuda", "d2d"),
        ("stream_bw", "cuda:cuda", "d2d"),
        ("array_bw", "cuda:cuda", "d2d"),
        # The client sends: host memory on the server receives.
        ("tag_bw", "cuda:ucx", "d2h_pinned"),
        ("am_bw", "cuda:host", "d2h_pageable"),
        ("put_bw", "cuda:ucx", "d2h_pinned"),
        ("tag_bw", "ucx:cuda", "h2d_pinned"),
        ("put_bw", "host:cuda", "h2d_pageable"),
        ("am_bw", "host:cuda", "h2d_pageable"),
        # get_bw: the client reads the server's memory.
        ("get_bw", "cuda:ucx", "h2d_pinned"),
        ("get_bw", "cuda:host", "h2d_pageable"),
        ("get_bw", "ucx:cuda", "d2h_pinned"),
        ("get_bw", "host:cuda", "d2h_pageable"),
        # array_bw: recv_array allocates memory of the sender's kind, or
        # device memory on a cuda server (the staging path for host data).
        ("array_bw", "cuda:host", "d2d"),
        ("array_bw", "host:cuda", "h2d_pageable"),
        ("array_bw", "ucx:cuda", "h2d_pinned"),
        ("array_bw", "host", None),
        # No GPU memory, or a round trip.
        ("tag_bw", "host:ucx", None),
        ("put_bw", "ucx", None),
        ("tag_lat", "cuda", None),
        ("put_lat", "host:cuda", None),
        ("fadd_lat", "cuda", None),
    ],
)
def test_row_kind(test, memory, kind):
    assert limits.row_kind(test, memory) == kind


def _row(test="tag_bw", memory="cuda:cuda", size=MiB, gbps=30.0) -> dict:
    return {
        "test": test,
        "kind": TESTS[test].kind,
        "size": size,
        "iters": 10,
        "latency_us": None,
        "latency_p99_us": None,
        "latency_avg_us": 1.0,
        "bandwidth_gbs": gbps,
        "msg_rate": 1.0,
        "memory": memory,
        "api": "c",
    }


class _Timer:
    """Stands in for limits.measure: fixed figures, calls recorded."""

    def __init__(self, **gbps):
        self.gbps = gbps
        self.calls: list[tuple] = []

    def __call__(self, kind, size, device):
        self.calls.append((kind, size, device))
        value = self.gbps[kind]
        if isinstance(value, Exception):
            raise value
        return value


def test_row_limit_figures():
    t = _Timer(d2d=200.0, h2d_pageable=15.0, h2d_pinned=50.0)
    assert limits.row_limit(_row(), 3, t) == {
        "kind": "d2d",
        "gbps": 200.0,
        "fraction": 0.15,
    }
    # NumPy memory on the host end: the pageable copy, with the pinned one.
    assert limits.row_limit(_row(memory="host:cuda"), 3, t) == {
        "kind": "h2d_pageable",
        "gbps": 15.0,
        "fraction": 2.0,
        "pinned": {"kind": "h2d_pinned", "gbps": 50.0, "fraction": 0.6},
    }
    assert t.calls == [
        ("d2d", MiB, 3),
        ("h2d_pageable", MiB, 3),
        ("h2d_pinned", MiB, 3),
    ]
    for r in (_row(memory="host:ucx"), _row("tag_lat"), _row(size=0)):
        assert limits.row_limit(r, 0, t) is None
    assert len(t.calls) == 3  # no copy measured for those


def test_row_limit_says_why_a_copy_has_no_figure():
    t = _Timer(d2h_pinned=limits.LimitError("d2h_pinned copy: no memory"))
    assert limits.row_limit(_row(memory="cuda:ucx"), 0, t) == {
        "kind": "d2h_pinned",
        "gbps": None,
        "fraction": None,
        "error": "d2h_pinned copy: no memory",
    }
    t = _Timer(d2d=None)  # no elapsed time
    assert limits.row_limit(_row(), 0, t)["fraction"] is None


def test_attach_over_the_fake_driver(drv):
    """attach times each copy once (cache) and gives every row its limit."""
    drv._lib.fake_set_elapsed(1.0)
    rows = [
        _row("tag_bw", "cuda:cuda"),
        _row("put_bw", "cuda:cuda"),
        _row("tag_bw", "cuda:ucx"),
        _row("tag_lat", "cuda:cuda"),
        _row("tag_bw", "host:host"),
    ]
    limits.attach(rows, device=1)
    assert [r["limit"] and r["limit"]["kind"] for r in rows] == [
        "d2d",
        "d2d",
        "d2h_pinned",
        None,
        None,
    ]
    reps = limits.reps_for(MiB)
    assert rows[0]["limit"]["gbps"] == pytest.approx(MiB * reps / 1e6)
    assert rows[0]["limit"]["fraction"] == pytest.approx(30.0 / (MiB * reps / 1e6))
    warm = max(3, min(reps // 10, 20))
    assert drv._lib.fake_async_copies() == 2 * (warm + limits.ROUNDS * reps)


# -- the table and the JSON ------------------------------------------------------------


def test_table_shows_limit_columns_only_when_a_row_has_one():
    plain = format_table([_row(memory="host")])
    assert "limit" not in plain
    rows = [_row(), _row(memory="host:cuda"), _row("tag_lat"), _row(memory="cuda:ucx")]
    rows[0]["limit"] = {"kind": "d2d", "gbps": 200.0, "fraction": 0.15}
    rows[1]["limit"] = {
        "kind": "h2d_pageable",
        "gbps": 15.0,
        "fraction": 2.0,
        "pinned": {"kind": "h2d_pinned", "gbps": None, "fraction": None, "error": "E2"},
    }
    rows[2]["limit"] = None
    rows[3]["limit"] = {"kind": "d2h_pinned", "gbps": None, "fraction": None}
    rows[3]["limit"]["error"] = "d2h_pinned copy of 1M bytes on device 0: E1"
    lines = format_table(rows).splitlines()
    assert lines[0].endswith("limit  limit GB/s  of limit")
    assert lines[2].split()[-3:] == ["d2d", "200.000", "0.15"]
    assert lines[3].split()[-3:] == ["h2d_pageable", "15.000", "2"]
    assert lines[4].split()[-3:] == ["-", "-", "-"]
    assert lines[5].split()[-3:] == ["d2h_pinned", "-", "-"]
    text = "\n".join(lines)
    assert "of limit = BW / limit" in text
    assert "limit not measured: d2h_pinned copy of 1M bytes on device 0: E1" in text
    assert "limit not measured: E2" in text


def test_run_bench_rows_carry_limits(monkeypatch):
    """run_bench gives every row a "limit" once the points ran: null for
    host memory, the copy's figure (here a stand-in) for a GPU row."""
    doc = run_bench(
        BenchOptions(
            tests=("tag_bw", "tag_lat"),
            sizes=(4096,),
            iters=20,
            warmup=2,
            progress=False,
        )
    )
    assert [r["limit"] for r in doc["results"]] == [None, None]
    # A host run posing as a GPU one: row_kind says d2d, the copy 10 GB/s.
    monkeypatch.setattr(limits, "row_kind", lambda test, memory: "d2d")
    calls = []
    monkeypatch.setattr(
        limits, "measure", lambda kind, size, device: calls.append(device) or 10.0
    )
    doc = run_bench(
        BenchOptions(
            tests=("tag_bw",),
            sizes=(4096,),
            iters=20,
            warmup=2,
            device=0,
            progress=False,
        )
    )
    (r,) = doc["results"]
    assert r["limit"] == {
        "kind": "d2d",
        "gbps": 10.0,
        "fraction": pytest.approx(r["bandwidth_gbs"] / 10.0),
    }
    assert calls == [0]
    json.dumps(doc)  # JSON-ready


# -- python -m gpucx.bench.limits -----------------------------------------------------


def _main(args, libdir=None):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = libdir or ""
    return subprocess.run(
        [sys.executable, "-m", "gpucx.bench.limits", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )


def test_main_prints_the_figures(fake_lib_path, tmp_path):
    out = tmp_path / "limits.json"
    p = _main(
        ["-s", "1M,64K", "--device", "1", "--json", str(out)],
        os.path.dirname(fake_lib_path),
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["copy", "GB/s", "1M", "64K"]
    assert [line.split()[0] for line in lines[1:6]] == list(limits.KINDS)
    # The fake's events say 1 ms: 1M x 341 copies / 1 ms = 357.6 GB/s.
    assert limits.reps_for(MiB) == 341
    assert lines[1].split()[1] == "357.6"
    assert "device 1: cuMemcpyAsync" in lines[6]
    doc = json.loads(out.read_text())
    assert doc["device"] == 1 and doc["sizes"] == [MiB, 65536]
    assert set(doc["gbps"]) == set(limits.KINDS)
    assert doc["gbps"]["d2d"]["1M"] == pytest.approx(MiB * 341 / 1e6)


def test_main_without_a_driver_exits_1():
    if os.path.exists("/dev/nvidiactl"):  # pragma: no cover - a GPU host
        pytest.skip("this host has a CUDA driver")
    p = _main(["-s", "1M"])
    assert p.returncode == 1
    assert p.stderr.startswith("gpucx.bench.limits: error: d2d copy of 1M bytes")
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("sizes", ["1Q", "0"])
def test_main_bad_sizes_exit_2(sizes):
    p = _main(["-s", sizes])
    assert p.returncode == 2 and "error:" in p.stderr
