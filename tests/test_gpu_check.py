"""benchmarks/gpu_check.sh, the one-command GPU validation, on a machine
without a GPU: it stops at once with one clear line and exit status 3,
before installing anything or writing a report.  (The GPU run itself needs a
GPU machine: see docs/gpu.md, "Validating on a GPU".)"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from fakegpu import build_fake_libcuda

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.timeout(60)


def _run(tmp_path, path_dirs):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    env["GPU_CHECK_VENV"] = str(tmp_path / "venv")
    env["TMPDIR"] = str(tmp_path)
    env["PYTHON"] = sys.executable
    report = tmp_path / "report.md"
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", str(SCRIPT), "-o", str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )
    return p, time.monotonic() - t0, report


def _no_side_effects(tmp_path, report):
    assert not report.exists()
    assert not (tmp_path / "venv").exists()
    assert not list(tmp_path.glob("gpucx-gpu-check.*"))


def test_without_nvidia_smi_fails_fast_and_clearly(tmp_path):
    p, elapsed, report = _run(tmp_path, [])
    assert p.returncode == 3, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("gpu_check: error: no NVIDIA GPU found")
    assert "needs an NVIDIA GPU" in lines[0]
    assert elapsed < 10
    _no_side_effects(tmp_path, report)


def _fake_nvidia_smi(tmp_path, listing: str) -> pathlib.Path:
    """A stand-in nvidia-smi (test double for the missing GPU)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    fake = bindir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{listing}'\n")
    fake.chmod(0o755)
    return bindir


def test_gpu_listed_but_no_driver_fails_fast(tmp_path):
    """nvidia-smi (a fake here) lists a GPU, but libcuda.so.1 does not load."""
    bindir = _fake_nvidia_smi(tmp_path, "GPU 0: Fake GPU (UUID: GPU-0)")
    p, elapsed, report = _run(tmp_path, [bindir])
    assert p.returncode == 3, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "no CUDA driver: libcuda.so.1 does not load" in lines[0]
    assert elapsed < 10
    _no_side_effects(tmp_path, report)


def test_nvidia_smi_without_gpu_fails_fast(tmp_path):
    bindir = _fake_nvidia_smi(tmp_path, "No devices were found")
    p, _, report = _run(tmp_path, [bindir])
    assert p.returncode == 3
    assert "nvidia-smi lists no GPU" in p.stderr
    _no_side_effects(tmp_path, report)


def test_bad_usage_exits_2(tmp_path):
    p = subprocess.run(
        ["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=20
    )
    assert p.returncode == 2 and "usage:" in p.stderr


def test_no_install_uses_the_given_python_and_reports_what_it_lacks(tmp_path):
    """--no-install makes no venv and installs nothing: the steps run in
    $PYTHON as it is, and when that lacks CuPy the first step fails, the
    report says so and the script exits 1.  The GPU and its driver are test
    doubles: a fake nvidia-smi, and tests/fakecuda/libcuda_fake.c built as
    libcuda.so.1."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - a host with CuPy runs the real steps
        pytest.skip("this host has CuPy: the steps would run for real")
    bindir = _fake_nvidia_smi(tmp_path, "GPU 0: Fake GPU (UUID: GPU-0)")
    libdir = tmp_path / "fakelib"
    libdir.mkdir()
    build_fake_libcuda(libdir / "libcuda.so.1")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bindir), "/usr/bin", "/bin"])
    env["LD_LIBRARY_PATH"] = str(libdir)
    env["GPU_CHECK_VENV"] = str(tmp_path / "venv")
    env["GPU_CHECK_LOGS"] = str(tmp_path / "logs")
    env["TMPDIR"] = str(tmp_path)
    env["PYTHON"] = sys.executable
    report = tmp_path / "report.md"
    p = subprocess.run(
        ["bash", str(SCRIPT), "--no-install", "-o", str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert not (tmp_path / "venv").exists()
    text = report.read_text()
    assert "`bash benchmarks/gpu_check.sh --no-install`" in text
    assert "- CUDA driver: 12.4" in text
    assert f"| use {sys.executable} as it is (--no-install) | FAILED (exit 1) |" in text
    assert "No module named 'cupy'" in text
    # Nothing after the failed first step ran.
    assert "gpucx info reports CUDA" not in text
    assert (tmp_path / "logs").is_dir()


def test_protocol_tables_keep_each_cuda_table_once():
    """gpu_check.sh's filter of UCX_PROTO_INFO output, on what UCX 1.22
    printed for ``gpucx bench -t tag_bw -s 16M -m cuda:ucx`` on an H200
    (tests/ucx_proto_info_h200.txt, both processes): the tables whose
    operation names CUDA memory, each once, without borders, headers or
    UCX's log prefix; tables about host memory alone are left out."""
    script = SCRIPT.read_text()
    start = script.index("proto_tables() {")
    func = script[start : script.index("\n}\n", start) + 3]
    sample = ROOT / "tests" / "ucx_proto_info_h200.txt"
    p = subprocess.run(
        ["bash", "-c", func + f'proto_tables < "{sample}"'],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert p.returncode == 0, p.stderr
    blocks = [b.splitlines() for b in p.stdout.strip().split("\n\n")]
    titles = [" ".join(b[0].strip("| ").split()) for b in blocks]
    assert titles == [
        "remote memory write by ucp_put* from host memory to cuda/dev[0]",
        "tagged message by ucp_tag_send* from cuda/GPU0",
        "remote memory write by ucp_put* from host memory to cuda",
        "rendezvous data fetch into host memory from cuda",
        "rendezvous data send from cuda/GPU0 to host",
    ]
    rows = {
        t: [" ".join(r.split()) for r in b[1:]]
        for t, b in zip(titles, blocks, strict=True)
    }
    assert rows["rendezvous data fetch into host memory from cuda"] == [
        "| 0 | no data fetch | |",
        "| 1..8240 | (?) fragmented copy-in copy-out | sysv/memory |",
        "| 8241..4M | (?) zero-copy flushed write to remote, cuda_copy, frag cuda "
        "| cuda_ipc/cuda |",
        "| 4194305..inf | (?) fragmented copy-in copy-out | sysv/memory |",
    ]
    assert rows["tagged message by ucp_tag_send* from cuda/GPU0"] == [
        "| 0 | eager short | sysv/memory |",
        "| 1..inf | (?) rendezvous zero-copy flushed write to remote | cuda_ipc/cuda |",
    ]
    assert "[" not in p.stdout.split("|")[0]
    assert "+--" not in p.stdout and "Range" not in p.stdout


def _function(name: str) -> str:
    """A shell function of gpu_check.sh, to run on its own."""
    script = SCRIPT.read_text()
    start = script.index(f"{name}() {{")
    return script[start : script.index("\n}\n", start) + 3]


def test_bench_steps_cover_every_gpu_row_of_the_issue():
    """GPU to GPU, GPU and UCX-mapped host both ways, GPU and NumPy host
    memory both ways; array_bw beside the four tests for -m cuda; the
    machine's copies before them (their limits)."""
    script = SCRIPT.read_text()
    steps = [
        line.split('" ', 1)[1]
        for line in script.splitlines()
        if line.strip().startswith('step "')
    ]
    assert [s for s in steps if s.startswith("bench ")] == [
        "bench cuda array_bw",
        "bench cuda:ucx",
        "bench ucx:cuda",
        "bench cuda:host",
        "bench host:cuda",
        "bench reg:cuda",
    ]
    assert [s for s in steps if s.startswith("own_path ")] == [
        "own_path host:cuda",
        "own_path cuda:host",
    ]
    assert steps.index("copy_limits") < steps.index("bench cuda array_bw")
    assert "protocols" in steps and "pytest_cuda tests" in steps


@pytest.mark.parametrize(
    "args, tests",
    [
        ("cuda array_bw", "tag_bw,put_bw,get_bw,am_bw,array_bw"),
        ("host:cuda", "tag_bw,put_bw,get_bw,am_bw"),
    ],
)
def test_bench_step_command_line(tmp_path, args, tests):
    p = subprocess.run(
        ["bash", "-c", _function("bench") + f"bench {args}"],
        capture_output=True,
        text=True,
        env={"GPY": "echo", "LOGS": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=20,
    )
    assert p.returncode == 0, p.stderr
    memory = args.split()[0]
    assert p.stdout.split() == [
        *["-m", "gpucx.cli", "bench", "-t"],
        tests,
        *f"-s 1M,64M -m {memory} --vs-perftest --no-progress --json".split(),
        f"{tmp_path}/bench-{memory.replace(':', '-')}.json",
    ]


def test_copy_limits_step_over_a_fake_driver(tmp_path):
    """The step that prints the machine's copies, run with the fake libcuda
    (a test double) as libcuda.so.1: one row per copy, the JSON beside the
    logs."""
    libdir = tmp_path / "fakelib"
    libdir.mkdir()
    build_fake_libcuda(libdir / "libcuda.so.1")
    env = dict(os.environ)
    env.update(
        GPY=sys.executable,
        LOGS=str(tmp_path),
        GPU_CHECK_SIZES="1M,4M",
        LD_LIBRARY_PATH=str(libdir),
    )
    p = subprocess.run(
        ["bash", "-c", _function("copy_limits") + "copy_limits"],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["copy", "GB/s", "1M", "4M"]
    assert [line.split()[0] for line in lines[1:6]] == [
        "d2d",
        "h2d_pinned",
        "d2h_pinned",
        "h2d_pageable",
        "d2h_pageable",
    ]
    assert (tmp_path / "limits.json").exists()


def test_arrays_step_runs_array_bw_with_staging_on_then_off(tmp_path):
    """Issue 34's two array rows: array_bw alone at the array sizes, once
    as configured and once with GPUCX_STAGING_BYTES=0."""
    fake = tmp_path / "gpy"
    fake.write_text('#!/bin/sh\necho "STAGING=${GPUCX_STAGING_BYTES:-} $*"\n')
    fake.chmod(0o755)
    p = subprocess.run(
        ["bash", "-c", _function("arrays") + "arrays host:cuda"],
        capture_output=True,
        text=True,
        env={"GPY": str(fake), "LOGS": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=20,
    )
    assert p.returncode == 0, p.stderr
    runs = [line for line in p.stdout.splitlines() if "gpucx.cli" in line]
    out = f"{tmp_path}/arrays-host-cuda"
    common = "-m gpucx.cli bench -t array_bw -s 8,64K,1M,64M -m host:cuda --no-progress"
    assert runs == [
        f"STAGING= {common} --json {out}.json",
        f"STAGING=0 {common} --json {out}-off.json",
    ]
    steps = SCRIPT.read_text()
    assert "arrays host:cuda" in steps and "arrays cuda" in steps
    assert "tests/test_cuda_staging.py" in steps
