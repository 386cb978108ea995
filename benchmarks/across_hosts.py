"""gpucx against ``ucx_perftest`` between two emulated hosts (issue 35).

    python benchmarks/across_hosts.py [--rate 10gbit] [--json PATH]

Makes two network namespaces joined through a bridge (tests/hosts.py: each
host with its own hostname, IPC namespace and /dev/shm, so UCX reaches the
other by TCP only), then, in one run: ``gpucx bench --server`` on host a and
``--client`` on host b (tag_lat at 8 B, tag_bw at 1 MiB and 16 MiB), and
``ucx_perftest`` the same way (``-t tag_lat``/``tag_bw``, the same sizes).
``--rate`` slows the link (tc on the wire; default: the veth's own speed).
Root and Linux namespaces are needed; everything is torn down at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import hosts as hostlib  # noqa: E402

from gpucx.bench.perftest import parse_csv, perftest_binary  # noqa: E402

POINTS = (("tag_lat", 8, 20000), ("tag_bw", 1 << 20, 2000), ("tag_bw", 16 << 20, 200))


def gpucx_point(a, b, test: str, size: int, iters: int) -> dict:
    cli = [sys.executable, "-m", "gpucx.cli", "bench"]
    srv, port = hostlib.start_bench_server(a)
    out = Path(f"/tmp/across-hosts-{test}-{size}.json")
    client = b.popen(
        [*cli, "--client", f"{a.address}:{port}", "-t", test, "-s", str(size),
         "-n", str(iters), "--no-progress", "--timeout", "120", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = client.communicate(timeout=300)
    if client.returncode != 0:
        raise RuntimeError(f"gpucx bench client failed: {err[-500:]}")
    srv.proc.kill()
    (r,) = json.loads(out.read_text())["results"]
    return {"latency_us": r.get("latency_us"), "bandwidth_gbs": r.get("bandwidth_gbs")}


def perftest_point(a, b, test: str, size: int, iters: int) -> dict:
    exe, env = perftest_binary()
    env = {**env, "UCX_TLS": "tcp,self"}
    port = "13345"
    args = ["-t", test, "-s", str(size), "-n", str(iters), "-p", port, "-v", "-f"]
    server = a.popen([exe, *args], env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT)  # fmt: skip
    time.sleep(1.0)
    client = b.popen([exe, a.address, *args], env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT)  # fmt: skip
    text, _ = client.communicate(timeout=300)
    server.kill()
    fig = parse_csv(text)
    return {"latency_us": fig["latency_us"], "bandwidth_gbs": fig["bandwidth_gbs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", help="slow the link to this tc rate, e.g. 10gbit")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with hostlib.make_hosts() as (a, b):
        if args.rate:
            hostlib.slow_link([a, b], args.rate)
        for test, size, iters in POINTS:
            g = gpucx_point(a, b, test, size, iters)
            p = perftest_point(a, b, test, size, iters)
            rows.append({"test": test, "size": size, "gpucx": g, "perftest": p})
    print("| test | size | gpucx | ucx_perftest | gpucx/perftest |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        g, p = r["gpucx"], r["perftest"]
        if r["test"].endswith("_lat"):
            cell = (f"{g['latency_us']:.2f} us", f"{p['latency_us']:.2f} us",
                    p["latency_us"] / g["latency_us"])  # fmt: skip
        else:
            cell = (f"{g['bandwidth_gbs']:.3f} GB/s", f"{p['bandwidth_gbs']:.3f} GB/s",
                    g["bandwidth_gbs"] / p["bandwidth_gbs"])  # fmt: skip
        print(f"| {r['test']} | {r['size']} | {cell[0]} | {cell[1]} | {cell[2]:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
