"""The ``gpucx`` command end to end: ``gpucx bench`` and ``gpucx info``.

Every run uses small sizes and few iterations; figures are checked for
presence and sign, never for speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

GPUCX = [sys.executable, "-m", "gpucx.cli"]
QUICK = ["-n", "50", "-w", "5", "--no-progress", "--timeout", "60"]

RESULT_KEYS = {
    "test",
    "kind",
    "size",
    "iters",
    "warmup",
    "window",
    "memory",
    "mode",
    "latency_us",
    "latency_p99_us",
    "latency_avg_us",
    "bandwidth_gbs",
    "msg_rate",
    "elapsed_s",
}
ENV_KEYS = {"ucx_version", "transports", "cpu", "gpus", "gpucx_version", "tls"}


def gpucx(*args, timeout=150, env=None):
    """Run the gpucx command; ``env``: variables added to this environment."""
    return subprocess.run(
        [*GPUCX, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def one_line_error(proc, *words):
    """Exit code 2 and exactly one stderr line naming ``words``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpucx bench: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split()[:2] == ["test", "size"], stdout
    assert set(lines[1]) <= {"-", " "}
    rows = []
    for line in lines[2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- gpucx bench: successful runs --------------------------------------------------


def test_default_run_prints_table():
    """Plain ``gpucx bench``: 8-byte tag round trip and 1 MiB tag bandwidth."""
    p = gpucx("bench", "--no-progress")
    assert p.returncode == 0, p.stderr
    rows = table_rows(p.stdout)
    got = {(r[0], r[1]) for r in rows}
    assert ("tag_lat", "8") in got and ("tag_bw", "1M") in got
    for r in rows:
        bw = float(r[6])
        assert bw >= 0
    lat8 = next(r for r in rows if r[:2] == ["tag_lat", "8"])
    assert float(lat8[3]) > 0 and float(lat8[4]) >= float(lat8[3])
    assert "one-way" in p.stdout
    assert "UCX " in p.stdout


def test_json_has_every_figure_and_environment(tmp_path):
    out = tmp_path / "bench.json"
    p = gpucx(
        "bench", "-t", "tag_lat,tag_bw", "-s", "8,64K", *QUICK, "--json", str(out)
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert set(doc["environment"]) >= ENV_KEYS
    assert doc["environment"]["transports"], doc["environment"]
    results = doc["results"]
    assert [(r["test"], r["size"]) for r in results] == [
        ("tag_lat", 8),
        ("tag_lat", 65536),
        ("tag_bw", 8),
        ("tag_bw", 65536),
    ]
    for r in results:
        assert set(r) >= RESULT_KEYS, r
        assert r["iters"] == 50 and r["warmup"] == 5
        assert r["bandwidth_gbs"] > 0 and r["msg_rate"] > 0
        assert r["latency_avg_us"] > 0 and r["elapsed_s"] > 0
        if r["kind"] == "lat":
            assert 0 < r["latency_us"] <= r["latency_p99_us"]
        else:
            assert r["latency_us"] is None


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed")
def test_plot_writes_png(tmp_path):
    png = tmp_path / "bench.png"
    p = gpucx("bench", "-s", "8,4K", *QUICK, "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vs_perftest_adds_figures_and_ratio(tmp_path):
    out = tmp_path / "bench.json"
    p = gpucx(
        "bench",
        "-t",
        "tag_lat,tag_bw",
        "-s",
        "8,64K",
        *QUICK,
        "--vs-perftest",
        "--json",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    assert "gpucx/perftest" in p.stdout.splitlines()[0]
    for row in table_rows(p.stdout):
        assert float(row[-1]) >= 0, row
    for r in json.loads(out.read_text())["results"]:
        assert r["perftest"]["latency_us"] > 0
        assert r["perftest"]["bandwidth_gbs"] > 0
        assert r["ratio"] > 0


@pytest.mark.parametrize("tls", ["tcp", "sm,self"])
def test_transport_selection(tmp_path, tls):
    out = tmp_path / "bench.json"
    p = gpucx("bench", "-s", "8,1M", *QUICK, "--tls", tls, "--json", str(out))
    assert p.returncode == 0, p.stderr
    names = {t for t, _ in json.loads(out.read_text())["environment"]["transports"]}
    if tls == "tcp":
        assert names == {"tcp"}, names
    else:
        assert names & {"posix", "sysv"} and not names & {"tcp"}, names


@pytest.mark.parametrize("env", ["UCX_LOG_LEVEL=info", "UCX_PROTO_INFO=y"])
def test_ucx_logging_on_stdout_does_not_break_the_local_peer(tmp_path, env):
    """UCX logs to stdout by default; the local peer's log lines go to stderr
    and its address handshake still works (its first log line once ended
    the run: 'unexpected line from the local peer')."""
    out = tmp_path / "bench.json"
    key, value = env.split("=")
    p = gpucx(
        "bench", "-t", "tag_bw,put_bw", "-s", "64K", *QUICK, "--json", str(out),
        env={key: value},
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout, p.stderr)
    results = json.loads(out.read_text())["results"]
    assert [r["test"] for r in results] == ["tag_bw", "put_bw"]
    assert all(r["bandwidth_gbs"] > 0 for r in results)
    if key == "UCX_LOG_LEVEL":
        # The peer's UCX reached the user (stderr), not the handshake pipe.
        assert re.search(r"UCX +INFO", p.stderr), p.stderr[-2000:]


def test_sweep_async_and_no_error_handling(tmp_path):
    out = tmp_path / "bench.json"
    p = gpucx(
        "bench",
        "--sweep",
        "8:8K:4",
        *QUICK,
        "--async",
        "--no-error-handling",
        "-W",
        "4",
        "--json",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    results = json.loads(out.read_text())["results"]
    assert sorted({r["size"] for r in results}) == [8, 32, 128, 512, 2048, 8192]
    assert {r["mode"] for r in results} == {"async"}
    assert {r["window"] for r in results if r["kind"] == "bw"} == {4}
    assert all(r["bandwidth_gbs"] > 0 for r in results)


def test_server_and_client_over_listener(tmp_path):
    server = subprocess.Popen(
        [*GPUCX, "bench", "--server", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        out = tmp_path / "bench.json"
        p = gpucx(
            "bench",
            "--client",
            f"127.0.0.1:{port}",
            "-s",
            "8,64K",
            *QUICK,
            "--json",
            str(out),
        )
        assert p.returncode == 0, p.stderr
        assert len(json.loads(out.read_text())["results"]) == 4
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        server.stdout.close()
        server.stderr.close()


# -- gpucx bench: argument errors (one line, exit code 2) --------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["-s", "12Q"], ["bad size", "12Q"]),
        (["-s", "-8"], ["bad size"]),
        (["-s", "1.5K"], ["bad size"]),
        (["-s", ","], ["bad size list"]),
        (["--sweep", "8"], ["bad sweep"]),
        (["--sweep", "1M:8"], ["LO is larger"]),
        (["--sweep", "8:1M:1"], ["FACTOR"]),
        (["-t", "tag_latency"], ["unknown test", "tag_latency"]),
        (["-t", "tag_lat,nope"], ["unknown test", "nope"]),
        (["-m", "gpu"], ["bad --memory", "gpu"]),
        (["-m", "host:cuda:cuda"], ["bad --memory"]),
        (["-n", "0"], ["--iters"]),
        (["-W", "0"], ["--window"]),
        (["--timeout", "0"], ["--timeout"]),
        (["--client", "nohostport"], ["bad --client"]),
        (["-n", "many"], ["invalid int value"]),
        (["--frobnicate"], ["unrecognized arguments"]),
        (["--sweep", "8:64", "-s", "8"], ["not allowed with"]),
    ],
)
def test_bad_arguments_one_line_exit_2(args, words):
    one_line_error(gpucx("bench", *args, timeout=60), *words)


def _cuda_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_cuda_usable(), reason="this host has a usable GPU")
# ids must not be "cuda": conftest skips items with a "cuda" keyword.
@pytest.mark.parametrize(
    "memory", ["cuda", "host:cuda", "cuda:host"], ids=["both", "server", "client"]
)
def test_cuda_without_gpu_one_line_exit_2(memory):
    one_line_error(gpucx("bench", "-m", memory, timeout=60), "--memory cuda")


@pytest.mark.skipif(_cuda_usable(), reason="this host has a usable GPU")
@pytest.mark.parametrize("extra", [[], ["--vs-perftest"]], ids=["gpucx", "perftest"])
def test_cuda_without_gpu_says_what_is_missing(extra):
    one_line_error(
        gpucx("bench", "-m", "cuda", *extra, timeout=60),
        "gpucx.UnsupportedError",
        "cuda_copy",
        "UCX_TLS",
    )


@pytest.mark.cuda
def test_cuda_memory_run(tmp_path):
    out = tmp_path / "bench.json"
    p = gpucx("bench", "-m", "cuda", "-s", "8,1M", *QUICK, "--json", str(out))
    assert p.returncode == 0, p.stderr
    results = json.loads(out.read_text())["results"]
    assert {r["memory"] for r in results} == {"cuda:cuda"}
    assert all(r["bandwidth_gbs"] > 0 for r in results)


@pytest.mark.cuda
def test_bad_device_one_line_exit_2():
    one_line_error(
        gpucx("bench", "-m", "cuda", "--device", "999", timeout=60), "--device"
    )


def test_plot_without_matplotlib_one_line_exit_2(tmp_path):
    # Hide matplotlib from the child with a module that fails to import.
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = subprocess.run(
        [*GPUCX, "bench", "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    one_line_error(p, "--plot", "matplotlib")


def test_server_and_client_together_exit_2():
    one_line_error(
        gpucx("bench", "--server", "--client", "h:1", timeout=60), "--server"
    )


def test_vs_perftest_with_client_exit_2():
    one_line_error(
        gpucx("bench", "--client", "127.0.0.1:1", "--vs-perftest", timeout=60),
        "--vs-perftest",
    )


def test_no_command_exit_2():
    p = gpucx(timeout=60)
    assert p.returncode == 2
    assert "bench" in p.stdout


# -- gpucx info ------------------------------------------------------------------


def test_info_text():
    p = gpucx("info", timeout=60)
    assert p.returncode == 0, p.stderr
    import gpucx as g

    assert ".".join(map(str, g.UCX_VERSION)) in p.stdout
    assert "memory types" in p.stdout and "HOST" in p.stdout
    assert "tcp/" in p.stdout and "CUDA" in p.stdout
    minor = ".".join(map(str, g.UCX_VERSION[:2]))
    assert f"peer on UCX {minor}.x" in p.stdout
    assert "does not cross UCX minor versions" in p.stdout


def test_info_json_with_ucx_logging_is_still_json():
    """UCX logs to stdout by default; with ``--json`` its lines go to stderr
    and stdout holds the JSON alone (``gpucx info --json | jq`` works)."""
    p = gpucx("info", "--json", timeout=60, env={"UCX_LOG_LEVEL": "info"})
    assert p.returncode == 0, p.stderr
    assert "HOST" in json.loads(p.stdout)["memory_types"]
    assert re.search(r"UCX +INFO", p.stderr), p.stderr[-2000:]


def test_info_json():
    p = gpucx("info", "--json", timeout=60)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert "HOST" in info["memory_types"]
    assert "tcp" in info["transports"] and "self" in info["transports"]
    assert os.path.isdir(info["ucx_library_dir"])
    assert set(info["cuda"]) == {
        "driver",
        "transports",
        "can_move_cuda_memory",
        "problem",
    }
    assert (info["cuda"]["problem"] is None) == info["cuda"]["can_move_cuda_memory"]
    assert info["ucx_info_error"] is None


def test_fadd_lat_with_error_handling_runs_emulated_atomics():
    """UCX offers no atomics with peer error handling; gpucx emulates them
    over active messages, so the default endpoints measure that path."""
    p = gpucx("bench", "-t", "fadd_lat", *QUICK, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "fadd_lat" in p.stdout


def test_point_that_times_out_exits_1_cleanly():
    """A point that overruns --timeout fails with exit code 1 and a last line
    naming it; rendezvous sends UCX still holds are parked, never freed (no
    crash at exit)."""
    p = gpucx(
        "bench",
        "-t",
        "tag_bw",
        "-s",
        "16M",
        "-n",
        "100",
        "--timeout",
        "0.01",
        "--no-progress",
        timeout=120,
    )
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("gpucx bench: error: tag_bw 16M:"), last
    assert "timed out" in last.lower()


# -- the server's exposure -----------------------------------------------------------


def _start_server(*extra):
    server = subprocess.Popen(
        [*GPUCX, "bench", "--server", "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = server.stdout.readline()
    info = server.stdout.readline()
    return server, line, info


def _stop(server):
    if server.poll() is None:
        server.kill()
    server.wait()
    err = server.stderr.read()
    server.stdout.close()
    server.stderr.close()
    return err


@pytest.mark.timeout(60)
def test_server_listens_on_loopback_by_default():
    server, line, info = _start_server()
    try:
        assert "listening on 127.0.0.1:" in line, line
        # Only what the default tests need: no rma, no amo.
        assert info.strip().endswith("context features tag"), info
    finally:
        err = _stop(server)
    assert "warning" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_server_warns_when_listening_on_all_interfaces(host):
    server, line, info = _start_server("--host", host)
    try:
        assert f"listening on {host}:" in line, line
    finally:
        err = _stop(server)
    assert "warning: listening on all interfaces" in err, err


@pytest.mark.timeout(60)
def test_server_enables_rma_and_amo_only_for_tests_that_need_them():
    server, line, info = _start_server("-t", "put_bw,tag_lat")
    try:
        assert info.strip().endswith("context features rma,tag"), info
    finally:
        _stop(server)
    server, line, info = _start_server("-t", "fadd_lat")
    try:
        assert info.strip().endswith("context features am,amo,rma,tag"), info
    finally:
        _stop(server)


@pytest.mark.timeout(120)
def test_server_refuses_a_test_it_was_not_started_with_then_serves_one_it_was():
    server, line, info = _start_server("--host", "127.0.0.1")
    try:
        port = int(line.rsplit(":", 1)[1])
        p = gpucx(
            "bench", "--client", f"127.0.0.1:{port}", "-t", "put_bw", "-s", "8", *QUICK
        )
        assert p.returncode != 0
        assert "start it with -t put_bw" in p.stderr, p.stderr
    finally:
        _stop(server)
    server, line, info = _start_server("-t", "fadd_lat")
    try:
        port = int(line.rsplit(":", 1)[1])
        p = gpucx("bench", "--client", f"127.0.0.1:{port}", "-t", "fadd_lat", *QUICK)
        assert p.returncode == 0, p.stderr
        assert "fadd_lat" in p.stdout
        assert server.wait(30) == 0
    finally:
        _stop(server)


def test_server_rejects_unknown_tests():
    p = gpucx("bench", "--server", "-t", "nope", timeout=60)
    assert p.returncode == 2 and "unknown test 'nope'" in p.stderr
