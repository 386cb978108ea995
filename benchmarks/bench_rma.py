"""Put/get bandwidth, 8-byte put latency and fetch-add latency: gpucx
between two processes against UCX's own ucx_perftest, in the same run.

    python benchmarks/bench_rma.py [--tls TLS] [--quick] [--rounds R] [--error-handling]

gpucx side: the owner process allocates and exports a region; the client
process (this one) unpacks the token and measures

* put / get bandwidth: ``ep.put_nb``/``ep.get_nb`` of one message size,
  at most 16 outstanding, then ``ep.flush()``; bytes / time (MiB/s, like
  perftest);
* put latency: ping-pong of 8-byte puts, each side polling its own memory
  for the peer's value; one-way = half the round trip (like ucp_put_lat);
* fetch-add: blocking ``ep.fetch_add`` latency (median), and the average
  time per operation of windowed ``ep.fetch_add_nb`` (16 outstanding).
  ``ucx_perftest -t ucp_fadd`` is a streaming test: its "latency" column
  is time per operation with many outstanding, so the blocking latency is
  compared with its median and the windowed figure with its average.

* 8-byte put message rate: a prepared transfer (``ep.prepare_put``) of
  ``RATE_BATCH`` 8-byte entries, two runs in flight, against the message
  rate of ``ucx_perftest -t ucp_put_bw -s 8``.

Endpoints are created without peer error handling by default, as
ucx_perftest does (UCX offers atomic protocols only there).
``--error-handling`` creates them with it (gpucx's default) and runs
perftest with ``-e``; the atomic rows are left out then.  Latencies are
medians.  The VM's speed drifts, so the runs are interleaved rounds and the
table gives the median over rounds of each figure and of the within-round
ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
PORT = 13400
#: Outstanding put_nb/get_nb requests in the bandwidth loops.
WINDOW = 16
#: Entries of the prepared 8-byte transfer of the message-rate row.
RATE_BATCH = 1000
#: Messages of the message-rate figures.
RATE_ITERS = 1_000_000


def _config(tls):
    return None if tls == "default" else {"TLS": tls}


# -- gpucx ------------------------------------------------------------------------


def owner(tls, conn, nbytes, eh=False):
    import gpucx

    with gpucx.Context(config=_config(tls)) as ctx:
        w = ctx.create_worker()
        region = ctx.allocate(nbytes)
        mem = region.as_array(np.uint64)
        mem[:] = 0
        conn.send((w.address, region.remote().to_bytes()))
        address, blob = conn.recv()
        ep = w.connect(address, error_handling=eh)
        key = ep.unpack(blob)
        word = np.zeros(1, np.uint64)
        progress = w.progress
        # Poll between commands, as ucx_perftest's server does during its
        # put/get tests.
        while True:
            while not conn.poll(0):
                for _ in range(1000):  # a syscall per 1000 polls only
                    progress()
            cmd = conn.recv()
            if cmd[0] == "pong":
                n = cmd[1]
                for i in range(1, n + 1):
                    while mem[0] != i:
                        w.progress()
                    word[0] = i
                    ep.put(word, key, 0)
                conn.send("ok")
            elif cmd[0] == "bye":
                break
        key.close()
        ep.close(force=True)
        region.close()


def _window(op, buf, key, n, depth=WINDOW):
    """``n`` non-blocking operations, at most ``depth`` outstanding."""
    reqs = []
    for _ in range(n):
        if len(reqs) == depth:
            reqs.pop(0).wait()
        reqs.append(op(buf, key, 0))
    for r in reqs:
        r.wait()


def gpucx_side(tls, sizes, iters, lat_iters, alloc_src=True, eh=False):
    import gpucx

    big = max(sizes)
    parent, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(
        target=owner, args=(tls, child_conn, big, eh)
    )
    child.start()
    out = {}
    try:
        with gpucx.Context(config=_config(tls)) as ctx:
            w = ctx.create_worker()
            mine = ctx.allocate(4096)
            mymem = mine.as_array(np.uint64)
            mymem[:] = 0
            address, blob = parent.recv()
            ep = w.connect(address, error_handling=eh)
            parent.send((w.address, mine.remote().to_bytes()))
            key = ep.unpack(blob)
            # Like ucx_perftest, the local buffers are mapped by UCX too.
            src_region = ctx.allocate(big) if alloc_src else None
            src = src_region.as_array() if alloc_src else np.ones(big, np.uint8)
            for size in sizes:
                n = iters[size]
                buf = src[:size]
                for name, op in (("put_bw", ep.put_nb), ("get_bw", ep.get_nb)):
                    _window(op, buf, key, 3)
                    ep.flush()
                    t0 = time.perf_counter()
                    _window(op, buf, key, n)
                    ep.flush()
                    dt = time.perf_counter() - t0
                    out[(name, size)] = size * n / dt / MiB
                # Prepared transfers: WINDOW entries per run, one C call
                # posts them all; two runs in flight.
                for name, prep in (
                    ("put_bw_xfer", ep.prepare_put),
                    ("get_bw_xfer", ep.prepare_get),
                ):
                    with prep([(buf, key, 0)] * WINDOW) as xfer:
                        xfer.run()
                        runs = max(1, n // WINDOW)
                        t0 = time.perf_counter()
                        prev = xfer.run_nb()
                        for _ in range(runs - 1):
                            nxt = xfer.run_nb()
                            prev.wait()
                            prev = nxt
                        prev.wait()
                        ep.flush()
                        dt = time.perf_counter() - t0
                    out[(name, size)] = size * WINDOW * runs / dt / MiB
                for name, op in (
                    ("put_bw_blocking", ep.put),
                    ("get_bw_blocking", ep.get),
                ):
                    for _ in range(3):
                        op(buf, key, 0)
                    ep.flush()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        op(buf, key, 0)
                    ep.flush()
                    dt = time.perf_counter() - t0
                    out[(name, size)] = size * n / dt / MiB
            # 8-byte put ping-pong.
            word = np.zeros(1, np.uint64)
            parent.send(("pong", lat_iters))
            times = np.empty(lat_iters)
            for i in range(1, lat_iters + 1):
                t0 = time.perf_counter_ns()
                word[0] = i
                ep.put(word, key, 0)
                while mymem[0] != i:
                    w.progress()
                times[i - 1] = time.perf_counter_ns() - t0
            assert parent.recv() == "ok"
            out[("put_lat", 8)] = float(np.median(times[lat_iters // 10 :])) / 2e3
            # 8-byte put message rate: a prepared transfer, two runs in flight.
            with ep.prepare_put([(src[:8], key, 0)] * RATE_BATCH) as xfer:
                xfer.run()
                runs = RATE_ITERS // RATE_BATCH
                t0 = time.perf_counter()
                prev = xfer.run_nb()
                for _ in range(runs - 1):
                    nxt = xfer.run_nb()
                    prev.wait()
                    prev = nxt
                prev.wait()
                ep.flush()
                out[("put_rate_xfer", 8)] = (
                    runs * RATE_BATCH / (time.perf_counter() - t0)
                )
            if eh:  # UCX selects no atomic protocol with peer error handling
                parent.send(("bye",))
                key.close()
                ep.close(force=True)
                mine.close()
                if src_region is not None:
                    src_region.close()
                return out
            # Fetch-add latency.
            for _ in range(100):
                ep.fetch_add(key, 1, 8)
            times = np.empty(lat_iters)
            for i in range(lat_iters):
                t0 = time.perf_counter_ns()
                ep.fetch_add(key, 1, 8)
                times[i] = time.perf_counter_ns() - t0
            out[("fadd_lat", 8)] = float(np.median(times)) / 1e3
            # Fetch-add rate: windowed fetch_add_nb, time per operation.
            t0 = time.perf_counter_ns()
            reqs = []
            for _ in range(lat_iters):
                if len(reqs) == WINDOW:
                    reqs.pop(0).wait()
                reqs.append(ep.fetch_add_nb(key, 1, 8))
            for r in reqs:
                r.wait()
            out[("fadd_rate", 8)] = (time.perf_counter_ns() - t0) / lat_iters / 1e3
            parent.send(("bye",))
            key.close()
            ep.close(force=True)
            mine.close()
            if src_region is not None:
                src_region.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    return out


# -- ucx_perftest -----------------------------------------------------------------


def perftest(test, size, n, tls, eh=False):
    import libucx

    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.join(root, "lib")
    env.setdefault("UCX_MM_ERROR_HANDLING", "y")
    if tls != "default":
        env["UCX_TLS"] = tls
    global PORT
    PORT += 1
    args = ["-t", test, "-s", str(size), "-n", str(n), "-p", str(PORT)]
    if eh:
        args.append("-e")
    srv = subprocess.Popen(
        [exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(1.0)
        res = subprocess.run(
            [exe, "localhost", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        srv.wait(30)
    for line in res.stdout.splitlines():
        if line.startswith("Final:"):
            f = [float(x) for x in re.split(r"\s+", line.strip())[1:]]
            # iterations, p50, avg, overall (latency or overhead, usec),
            # then bandwidth avg/overall (MB/s = MiB/s), rate avg/overall.
            return {"p50": f[1], "avg": f[2], "bw": f[5], "rate": f[7]}
    raise RuntimeError(
        f"ucx_perftest {test} printed no result:\n{res.stdout}{res.stderr}"
    )


#: Bandwidth figures and the perftest test each is compared with.
ROWS = {
    "put_bw": "ucp_put_bw",
    "put_bw_blocking": "ucp_put_bw",
    "put_bw_xfer": "ucp_put_bw",
    "get_bw": "ucp_get",
    "get_bw_blocking": "ucp_get",
    "get_bw_xfer": "ucp_get",
}


def _size_name(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size >> 10} KiB"


def one_round(tls, sizes, iters, lat_iters, eh=False) -> dict:
    """Every figure once: name -> (gpucx, perftest, ratio).  Each perftest
    run follows the gpucx runs of its test directly."""
    g = gpucx_side(tls, sizes, iters, lat_iters, eh=eh)
    out = {}
    for size in sizes:
        for test in ("ucp_put_bw", "ucp_get"):
            p = perftest(test, size, iters[size], tls, eh)["bw"]
            for name, t in ROWS.items():
                if t == test:
                    v = g[(name, size)]
                    out[f"{name} {_size_name(size)}"] = ("MiB/s", v, p, v / p)
    p = perftest("ucp_put_lat", 8, lat_iters, tls, eh)["p50"]
    v = g[("put_lat", 8)]
    out["put_lat 8 B (one-way, p50)"] = ("us", v, p, p / v)
    p = perftest("ucp_put_bw", 8, RATE_ITERS, tls, eh)["rate"]
    v = g[("put_rate_xfer", 8)]
    out["put 8 B prepared (msg/s)"] = ("msg/s", v, p, v / p)
    if eh:
        return out
    pf = perftest("ucp_fadd", 8, lat_iters, tls)
    v = g[("fadd_lat", 8)]
    out["fetch_add 8 B (blocking, p50)"] = ("us", v, pf["p50"], pf["p50"] / v)
    v = g[("fadd_rate", 8)]
    out["fetch_add_nb 8 B (per op, avg)"] = ("us", v, pf["avg"], pf["avg"] / v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tls", default="default", help="default, tcp, sm,self ...")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--sizes", default="1M,16M", help="message sizes, e.g. 256K,1M,4M")
    ap.add_argument(
        "--error-handling",
        action="store_true",
        help="endpoints with peer error handling, perftest -e (no atomics)",
    )
    args = ap.parse_args()
    units = {"K": 1 << 10, "M": MiB}
    sizes = [
        int(x[:-1]) * units[x[-1].upper()] if x[-1].upper() in units else int(x)
        for x in args.sizes.split(",")
    ]
    # About 2 GiB (at least 100 messages) per figure; --quick: 50 MiB.
    iters = {s: max(100, (2 << 30) // s) for s in sizes}
    lat_iters = 10000
    if args.quick:
        iters = {s: max(10, (50 * MiB) // s) for s in sizes}
        lat_iters = 2000
    # The VM has fast and slow periods: each round puts every gpucx figure
    # next to its perftest run, and the ratio is taken within the round.
    eh = args.error_handling
    rounds = [
        one_round(args.tls, sizes, iters, lat_iters, eh) for _ in range(args.rounds)
    ]
    print(
        f"medians over {args.rounds} interleaved rounds, window {WINDOW}, "
        f"peer error handling {'on' if eh else 'off'}"
    )
    print(f"tls={args.tls} python={sys.version.split()[0]} cpus={os.cpu_count()}")
    print(
        f"{'test':30} {'unit':6} {'gpucx':>10} {'perftest':>10} {'ratio':>6}"
        "  ratio range"
    )
    for name, first in rounds[0].items():
        g, p, q = (statistics.median(r[name][i] for r in rounds) for i in (1, 2, 3))
        lo = min(r[name][3] for r in rounds)
        hi = max(r[name][3] for r in rounds)
        print(f"{name:30} {first[0]:6} {g:10.3f} {p:10.3f} {q:6.2f}  {lo:.2f}-{hi:.2f}")
    print("ratio: gpucx/perftest for bandwidth, perftest/gpucx for latency (so")
    print("above 1 is better for gpucx in both), taken within each round")


if __name__ == "__main__":
    main()
