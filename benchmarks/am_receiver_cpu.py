"""Where an AM receiver's CPU goes at 1 MiB: copying, or everything else.

Between two processes on one host without peer error handling, UCX moves a
1 MiB active message by rendezvous with CMA: the *receiver* copies the
payload out of the sender (``process_vm_readv``).  The receiver is then the
bottleneck, and its throughput is the copy speed times the share of its CPU
time spent copying.  That share is far steadier than wall-clock bandwidth
on a VM whose speed drifts by tens of percent within seconds, so this
script measures it: each run goes under ``perf record -a -g``, and the
receiving thread's samples (the thread with the most samples inside the
kernel's CMA copy) are sorted into the copy, Python (libpython, cffi), UCX
and gpucx's C, and the rest, over the middle 80 % of its copying period.

Receivers: ``handler`` (a handler per message calls ``receive_into``, the
bench_am.py server), ``pool`` (a handler with a receive pool,
``set_am_handler(..., into=bufs)``: the UCX callback starts each receive),
``posted`` (receives posted ahead with
``am_recv_nb``) and ``ucx_perftest -t ucp_am_bw`` (its receive callback
posts the receive in C).

Usage (needs ``perf`` and permission to record every CPU)::

    python benchmarks/am_receiver_cpu.py [--runs N] [--messages N]
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20


def _classify(stack: str) -> str:
    if "process_vm_rw" in stack:
        return "copy"
    if "libpython" in stack or "_cffi_backend" in stack:
        return "python"
    if "libuc" in stack or "_ucx." in stack:
        return "ucx"
    return "other"


def shares(data: str) -> tuple[int, dict]:
    """(samples, {kind: share}) of the receiving thread in ``data``."""
    out = subprocess.run(
        ["perf", "script", "-i", data, "-F", "tid,time,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    samples = []
    for block in out.split("\n\n"):
        lines = block.strip().splitlines()
        try:
            tid, t = lines[0].split()[:2]
            samples.append((int(tid), float(t.rstrip(":")), "\n".join(lines[1:])))
        except (IndexError, ValueError):
            continue
    copying = collections.Counter(tid for tid, _, s in samples if "process_vm_rw" in s)
    if not copying:
        raise RuntimeError("no CMA copy sampled: is peer error handling off?")
    rx = copying.most_common(1)[0][0]
    ts = sorted(t for tid, t, s in samples if tid == rx and "process_vm_rw" in s)
    lo, hi = ts[len(ts) // 10], ts[9 * len(ts) // 10]
    kinds = collections.Counter(
        _classify(s) for tid, t, s in samples if tid == rx and lo <= t <= hi
    )
    n = sum(kinds.values())
    return n, {k: v / n for k, v in kinds.items()}


def _record(cmd: list[str], data: str) -> str:
    out = subprocess.run(
        ["perf", "record", "-a", "-g", "-o", data, "--", *cmd],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} under perf failed: {out.stderr[-800:]}")
    return out.stdout


def _record_bench(call: str, data: str) -> float:
    """Record ``bench_am.<call>`` (which returns MiB/s, or a tuple ending
    with it) in a fresh interpreter; return the MiB/s."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_am\n"
        "if __name__ == '__main__':\n"
        f"    r = bench_am.{call}\n"
        "    print(r[-1] if isinstance(r, tuple) else r)\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        return float(_record([sys.executable, f.name], data).split()[-1])
    finally:
        os.unlink(f.name)


def run_gpucx(kind: str, messages: int, data: str) -> float:
    """Record one gpucx_bw run of bench_am.py; returns its MiB/s."""
    rounds = max(1, messages // 64)
    return _record_bench(f"gpucx_bw({MIB}, 64, {kind!r}, rounds={rounds})", data)


def run_perftest(messages: int, data: str, port: int) -> float:
    """Record one ucx_perftest ucp_am_bw run (bench_am's launcher); returns
    its MiB/s."""
    return _record_bench(f"_perftest('ucp_am_bw', {MIB}, {messages}, {port})", data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=2560)
    ap.add_argument("--port", type=int, default=13590)
    a = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("am_receiver_cpu.py needs perf (linux-tools)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            for name in ("handler", "pool", "posted", "perftest"):
                data = os.path.join(tmp, f"{name}.{r}.data")
                if name == "perftest":
                    bw = run_perftest(a.messages, data, a.port + r)
                else:
                    bw = run_gpucx(
                        "am" if name == "handler" else name, a.messages, data
                    )
                n, sh = shares(data)
                rows.append((r, name, bw, n, sh))
    print("receiver CPU at 1 MiB, UCX default transports, no peer error handling")
    print(
        f"{'run':>3}  {'receiver':<9} {'MiB/s':>7} {'samples':>7}  "
        f"{'copy':>6} {'python':>6} {'ucx':>6} {'other':>6}"
    )
    for r, name, bw, n, sh in rows:
        print(
            f"{r:>3}  {name:<9} {bw:7.0f} {n:7d}  "
            + " ".join(
                f"{sh.get(k, 0):6.1%}" for k in ("copy", "python", "ucx", "other")
            )
        )


if __name__ == "__main__":
    main()
