"""Atomics: UCX's own path against gpucx's emulation, in the same run.

    python benchmarks/bench_atomics.py [--tls default,tcp] [--rounds 3] [--n 20000]

Two processes: an owner registers and exports a counter and progresses its
worker; the client (this process) measures, on one endpoint each,

* ``ucx``: ``worker.connect(..., error_handling=False)``: UCX's atomic
  protocol (``ucp_atomic_op_nbx``);
* ``emulated``: the default endpoint (peer error handling), where UCX 1.22
  has no atomic protocol and gpucx runs the atomic over its own active
  messages, applied in C at the owner;

and for each: the median latency of a blocking ``ep.fetch_add`` and the
rate of ``ep.fetch_add_nb`` with 64 outstanding (batches of 256 calls: the
median batch, and the best one, which is what the path can do when
neither process is descheduled).  ``ucx_perftest -t
ucp_fadd`` (no ``-e``: it has no protocol with error handling either) runs
in the same round as the reference.  Rounds are interleaved; the table
gives medians over rounds, and the ratios are computed within each round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np
from bench_rma import perftest

WINDOW = 64
#: fetch_add_nb calls per timed batch; the rate is that of the median batch
#: (a shared VM deschedules a process now and then: the mean would measure
#: the scheduler).
BATCH = 256


def _config(tls):
    return None if tls == "default" else {"TLS": tls}


def owner(tls, conn, allocate=False):
    import gpucx

    with gpucx.Context(config=_config(tls)) as ctx:
        w = ctx.create_worker()
        if allocate:
            region = ctx.allocate(8)
            mem = region.as_array(np.uint64)
            mem[:] = 0
        else:
            mem = np.zeros(1, np.uint64)
            region = ctx.register(mem)
        conn.send((w.address, region.remote().to_bytes()))
        while not conn.poll(0):
            for _ in range(1000):
                w.progress()
        conn.recv()
        conn.send(int(mem[0]))
        del mem
        region.close()


def client(tls, n, allocate=False):
    import gpucx

    parent, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(
        target=owner, args=(tls, child_conn, allocate)
    )
    child.start()
    out = {}
    total = 0
    try:
        with gpucx.Context(config=_config(tls)) as ctx:
            w = ctx.create_worker()
            address, blob = parent.recv()
            for path, eh in (("ucx", False), ("emulated", True)):
                ep = w.connect(address, error_handling=eh)
                key = ep.unpack(blob)
                for _ in range(200):
                    ep.fetch_add(key, 1)
                times = np.empty(n)
                for i in range(n):
                    t0 = time.perf_counter_ns()
                    ep.fetch_add(key, 1)
                    times[i] = time.perf_counter_ns() - t0
                out[(path, "lat")] = float(np.median(times)) / 1e3
                batches = np.empty(n // BATCH)
                for b in range(len(batches)):
                    t0 = time.perf_counter_ns()
                    reqs = []
                    for _ in range(BATCH):
                        if len(reqs) == WINDOW:
                            reqs.pop(0).wait()
                        reqs.append(ep.fetch_add_nb(key, 1))
                    for r in reqs:
                        r.wait()
                    batches[b] = time.perf_counter_ns() - t0
                out[(path, "rate")] = BATCH / (float(np.median(batches)) / 1e9)
                out[(path, "peak")] = BATCH / (float(batches.min()) / 1e9)
                total += 200 + n + len(batches) * BATCH
                key.close()
                ep.close(force=True)
            parent.send("bye")
            assert parent.recv() == total, "the counter is off"
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tls", default="default,tcp", help="families, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=20000, help="operations per figure")
    ap.add_argument(
        "--allocate",
        action="store_true",
        help="the counter in memory UCX allocates (ctx.allocate) instead of NumPy",
    )
    args = ap.parse_args()
    for tls in args.tls.split(","):
        rows: dict = {}
        for _ in range(args.rounds):
            g = client(tls, args.n, args.allocate)
            p = perftest("ucp_fadd", 8, args.n, tls)
            for path in ("ucx", "emulated"):
                rows.setdefault(f"{path} lat", []).append(g[(path, "lat")])
                rows.setdefault(f"{path} rate", []).append(g[(path, "rate")])
                rows.setdefault(f"{path} peak", []).append(g[(path, "peak")])
            rows.setdefault("perftest lat", []).append(p["p50"])
            rows.setdefault("perftest rate", []).append(p["rate"])
            rows.setdefault("lat emulated/ucx", []).append(
                g[("emulated", "lat")] / g[("ucx", "lat")]
            )
            rows.setdefault("rate emulated/ucx", []).append(
                g[("emulated", "rate")] / g[("ucx", "rate")]
            )
            rows.setdefault("peak emulated/ucx", []).append(
                g[("emulated", "peak")] / g[("ucx", "peak")]
            )
        med = {k: statistics.median(v) for k, v in rows.items()}
        mem = "ctx.allocate" if args.allocate else "NumPy"
        print(f"\n### {tls}, {mem} ({args.rounds} rounds, {args.n} ops per figure)\n")
        print(
            "| path | blocking fetch_add p50 | fetch_add_nb rate, median batch "
            "| best batch |"
        )
        print("|---|---:|---:|---:|")
        for label, key in (
            ("UCX (`error_handling=False`)", "ucx"),
            ("gpucx emulation (default endpoint)", "emulated"),
        ):
            print(
                f"| {label} | {med[key + ' lat']:.2f} us | "
                f"{med[key + ' rate'] / 1e3:.0f} kops/s | "
                f"{med[key + ' peak'] / 1e3:.0f} kops/s |"
            )
        print(
            f"| ucx_perftest ucp_fadd (reference) | {med['perftest lat']:.2f} us | "
            f"{med['perftest rate'] / 1e3:.0f} kops/s (overall) | |"
        )
        print(
            f"\nemulated/ucx within rounds: latency {med['lat emulated/ucx']:.2f}x, "
            f"rate {med['rate emulated/ucx']:.2f}x, best batch "
            f"{med['peak emulated/ucx']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
