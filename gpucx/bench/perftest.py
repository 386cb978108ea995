"""Run UCX's own ``ucx_perftest`` (shipped in the libucx wheel) for comparison."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

from .errors import BenchSetupError

__all__ = ["perftest_binary", "run_perftest", "PerftestError"]


class PerftestError(RuntimeError):
    """``ucx_perftest`` failed or printed nothing we can read."""


def ucx_dirs() -> tuple[str, str]:
    """``(bin, lib)`` directories of the UCX gpucx runs on."""
    prefix = os.environ.get("GPUCX_UCX_PREFIX", "").strip()
    if prefix:
        lib = next(
            (d for d in ("lib", "lib64") if os.path.isdir(os.path.join(prefix, d))),
            "lib",
        )
        return os.path.join(prefix, "bin"), os.path.join(prefix, lib)
    import libucx

    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "bin"), os.path.join(root, "lib")


def ucx_tool(name: str) -> tuple[str, dict]:
    """Path of a UCX tool (``ucx_perftest``, ``ucx_info``) and its environment.

    Raises
    ------
    BenchSetupError
        If the tool is not there.
    """
    bindir, libdir = ucx_dirs()
    path = os.path.join(bindir, name)
    if not os.access(path, os.X_OK):
        raise BenchSetupError(f"{name} not found at {path}")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = libdir + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
    )
    return path, env


def perftest_binary() -> tuple[str, dict]:
    return ucx_tool("ucx_perftest")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_csv(text: str) -> dict:
    """The final figures of ``ucx_perftest -v -f`` output.

    Raises
    ------
    PerftestError
        If no result line is found.
    """
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if "]" in line and line.startswith("["):
            line = line.split("]", 1)[1]
        parts = line.split(",")
        if len(parts) == 8:
            try:
                rows.append([float(x) for x in parts])
            except ValueError:
                continue
    if not rows:
        raise PerftestError(f"no figures in ucx_perftest output: {text[-300:]!r}")
    it, median, _avg_lat, lat, _avg_bw, bw, _avg_mr, mr = rows[-1]
    return {
        "iterations": int(it),
        # The percentile column is the median (-R 50, the default).
        "latency_us": median,
        "latency_avg_us": lat,
        # ucx_perftest's MB is 2**20 bytes; gpucx reports GB = 1e9 bytes.
        "bandwidth_gbs": bw * (1 << 20) / 1e9,
        "msg_rate": mr,
    }


#: Server/client setups tried: the client may dial before the server
#: listens, or another process may take the port meanwhile.
_ATTEMPTS = 5
#: What ucx_perftest prints when the client could not reach the server.
_SETUP_RACE = re.compile(r"connect\(\) failed|RTE transport")


def _error_line(text: str) -> str:
    """The first error ucx_perftest printed (without UCX's log prefix),
    else its last line; "" for no output."""
    lines = text.strip().splitlines()
    for line in lines:
        _, sep, msg = line.partition(" ERROR ")
        if sep:
            return msg.strip()
    return lines[-1].strip() if lines else ""


def run_perftest(
    test: str,
    size: int,
    iters: int,
    warmup: int,
    *,
    tls: str | None = None,
    error_handling: bool = True,
    memory: tuple[str, str] = ("host", "host"),
    timeout: float = 120.0,
) -> dict:
    """Run one ``ucx_perftest`` point (server and client on this host).

    Raises
    ------
    PerftestError
        If it fails or times out.
    """
    path, env = perftest_binary()
    env["UCX_MM_ERROR_HANDLING"] = "y"
    if "cuda" in memory:
        # The GPU path options gpucx's contexts run with (config.TUNED),
        # so that both sides of a GPU row take the same UCX protocols.
        from ..config import TUNED

        for name, (value, _why) in TUNED.items():
            env.setdefault(f"UCX_{name}", value)
    if tls:
        env["UCX_TLS"] = tls
    mem = ",".join("cuda" if m == "cuda" else "host" for m in memory)
    common = [
        "-t",
        test,
        "-s",
        str(size),
        "-n",
        str(iters),
        "-w",
        str(warmup),
        "-m",
        mem,
    ]
    if error_handling:
        common.append("-e")
    last = ""
    for _attempt in range(_ATTEMPTS):
        port = _free_port()
        server = subprocess.Popen(
            [path, *common, "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            time.sleep(0.3)
            try:
                client = subprocess.run(
                    [path, "localhost", *common, "-p", str(port), "-v", "-f"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise PerftestError(
                    f"ucx_perftest -t {test} -s {size} ran over {timeout} s"
                ) from None
            if client.returncode == 0:
                figures = parse_csv(client.stdout)
                if figures["msg_rate"] > 0:
                    # The CSV rounds MB/s to two decimals: derive bandwidth
                    # from the message rate, which keeps small sizes exact.
                    figures["bandwidth_gbs"] = figures["msg_rate"] * size / 1e9
                return figures
            out = client.stderr or client.stdout
            last = _error_line(out) or f"exit code {client.returncode}"
            if not _SETUP_RACE.search(out):
                break  # a bad option or test: another port will not help
        finally:
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            if server.stderr is not None:
                server.stderr.close()
    raise PerftestError(f"ucx_perftest -t {test} -s {size} failed: {last}")
