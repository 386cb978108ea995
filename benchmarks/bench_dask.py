"""Dask comm benchmark: tcp:// against gpucx:// in one run.

    python benchmarks/bench_dask.py [--iters N] [--sizes 8,1K,...] [--tls TLS]
                                    [--schemes tcp,gpucx] [--no-cluster]
    python benchmarks/bench_dask.py --workloads [--rounds R] [--rechunk-n N]
                                    [--pulls P] [--pull-size 64M] [--json PATH]

1. Comm level: ``distributed.comm.listen`` in a spawned echo process,
   ``distributed.comm.connect`` here; one message ``{"x": to_serialize(a)}``
   carrying a NumPy array of each size goes there and back.  Prints the
   median round trip and the bandwidth (2 x size / round trip).
2. Cluster level: ``LocalCluster(protocol=..., n_workers=2, processes=True)``;
   an array made on worker A is consumed on worker B (``np.sum``), median of
   a few repeats, for each size of ``--cluster-sizes``.

3. ``--workloads``: instead, user-level workloads on one two-worker
   ``LocalCluster(processes=True)`` per scheme, both clusters up at once and
   used in turn (round r runs the schemes in rotated order, so both see the
   same minutes of a machine whose speed drifts):

   * ``rechunk``: a P2P rechunk (``array.rechunk.method: p2p``) of an
     ``N x N`` float64 array from column blocks to row blocks, so every
     output chunk takes a piece of every input chunk (half of the bytes
     cross between the two workers); the input is persisted first, the
     time is the rechunked array's ``persist`` until it is in memory.
   * ``pull``: an array of ``--pull-size`` bytes made on worker A, then a
     task on worker B (``workers=[B], allow_other_workers=False``) that
     takes it: client -> scheduler -> B fetches from A -> result.  Also
     Dask's own view of the fetch (B's ``transfer_incoming_log``
     duration).

   Prints the per-round values and the medians, and writes them as JSON
   (``--json``).

4. ``--kill N``: instead, how long after a listening peer process is
   SIGKILLed a pending ``read`` raises ``CommClosedError`` (median and range
   of N trials per scheme; gpucx over its default transports and over TCP).

``--tls`` sets ``distributed-gpucx.tls`` (UCX_TLS of the comm) for gpucx;
the default is UCX's choice (shared memory on one host).  Prints a Markdown
table with gpucx/tcp ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import numpy as np

#: What Dask's servers serialize with (arrays out of band, no pickle copy).
SERIALIZERS = ("dask", "pickle")


def _parse_size(text: str) -> int:
    """``8``, ``64K``, ``16M``: binary units."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _echo_server(scheme, tls, conn, host="127.0.0.1"):
    """Echo every message back until one says "stop"; ``conn.send`` gets
    the address listened on (``host``, a free port)."""
    import dask.config
    from distributed.comm import listen

    async def main():
        done = asyncio.Event()

        async def handle(comm):
            from distributed.comm.core import CommClosedError

            try:
                while True:
                    msg = await comm.read()
                    if msg == "stop":
                        done.set()
                        break
                    await comm.write(msg, serializers=SERIALIZERS)
            except CommClosedError:
                pass  # a comm of the connect measurement, closed by the client
            finally:
                await comm.close()

        # deserialize=False: the echo sends the frames back as they came.
        async with listen(f"{scheme}://{host}:0", handle, deserialize=False) as lst:
            conn.send(lst.contact_address)
            await done.wait()

    with dask.config.set({"distributed-gpucx.tls": tls}):
        asyncio.run(main())


def _silent_server(scheme, tls, conn):
    import dask.config
    from distributed.comm import listen

    async def main():
        async def handle(comm):
            conn.send("accepted")
            await asyncio.sleep(3600)

        async with listen(f"{scheme}://127.0.0.1:0", handle) as lst:
            conn.send(lst.contact_address)
            await asyncio.sleep(3600)

    with dask.config.set({"distributed-gpucx.tls": tls}):
        asyncio.run(main())


def kill_detection(scheme: str, trials: int, tls) -> list[float]:
    """Seconds from SIGKILL of the peer to ``CommClosedError`` of a pending
    read, per trial."""
    import dask.config
    from distributed.comm import connect
    from distributed.comm.core import CommClosedError

    ctx = mp.get_context("spawn")
    out = []

    async def once(proc, addr, parent):
        comm = await connect(addr, timeout=30)
        parent.recv()  # accepted
        reader = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.2)
        proc.kill()
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(reader, 30)
        except CommClosedError:
            pass
        out.append(time.perf_counter() - t0)
        await comm.close()

    with dask.config.set({"distributed-gpucx.tls": tls}):
        for _ in range(trials):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_silent_server, args=(scheme, tls, child), daemon=True
            )
            proc.start()
            asyncio.run(once(proc, parent.recv(), parent))
            proc.join(30)
    return out


def comm_pingpong(
    scheme: str, sizes, iters: int, tls, connects: int = 0
) -> dict[int | str, float]:
    """Median round trip (seconds) per size; under ``"connect"``, the median
    of ``connects`` fresh comms' ``connect`` plus one 8-byte round trip."""
    import dask.config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(scheme, tls, child), daemon=True)
    proc.start()
    addr = parent.recv()
    with dask.config.set({"distributed-gpucx.tls": tls}):
        out = asyncio.run(pingpong(addr, sizes, iters, connects))
    proc.join(30)
    return out


async def pingpong(addr: str, sizes, iters: int, connects: int = 0):
    """The measurement of :func:`comm_pingpong` against the echo server
    (:func:`_echo_server`) at ``addr``, which it stops at the end."""
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    out: dict[int | str, float] = {}
    comm = await connect(addr, timeout=30)
    try:
        if connects:
            times = []
            for _ in range(connects + 1):
                t0 = time.perf_counter()
                c = await connect(addr, timeout=30)
                await c.write(b"12345678")
                await c.read()
                times.append(time.perf_counter() - t0)
                await c.close()
            out["connect"] = statistics.median(times[1:])
        for size in sizes:
            msg = {"x": to_serialize(np.ones(size, "u1"))}
            n = iters if size <= 1 << 20 else max(5, iters // 20)
            for _ in range(max(3, n // 10)):  # warm up
                await comm.write(msg, serializers=SERIALIZERS)
                await comm.read()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                await comm.write(msg, serializers=SERIALIZERS)
                await comm.read()
                times.append(time.perf_counter() - t0)
            out[size] = statistics.median(times)
        await comm.write("stop")
    finally:
        await comm.close()
    return out


def cluster_transfer(scheme: str, sizes, repeats: int, tls) -> dict[int, float]:
    """Median seconds to move an array of each size from worker A to B."""
    import dask.config
    from distributed import Client, LocalCluster

    out: dict[int, float] = {}
    with (
        dask.config.set({"distributed-gpucx.tls": tls}),
        LocalCluster(
            protocol=scheme,
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as c,
    ):
        c.wait_for_workers(2)
        wa, wb = sorted(cluster.scheduler.workers)
        for size in sizes:
            times = []
            for _ in range(repeats):
                fut = c.submit(np.ones, size, "u1", workers=[wa], pure=False)
                c.gather(c.submit(len, fut, workers=[wa], pure=False))
                t0 = time.perf_counter()
                got = c.submit(np.sum, fut, workers=[wb], pure=False).result()
                times.append(time.perf_counter() - t0)
                assert got == size
                del fut
            out[size] = statistics.median(times)
    return out


def _start_cluster(scheme: str, tls, extra_config: dict):
    """A two-worker ``LocalCluster`` of ``scheme`` (worker processes) and a
    Client; returns ``(cluster, client, worker A, worker B)``."""
    import dask.config
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed-gpucx.tls": tls, **extra_config}):
        cluster = LocalCluster(
            protocol=scheme,
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        )
    client = Client(cluster, set_as_default=False)
    client.wait_for_workers(2)
    wa, wb = sorted(client.scheduler_info()["workers"])
    return cluster, client, wa, wb


def _nbytes(x) -> int:
    return int(x.nbytes)


def _incoming_log(dask_worker) -> list:
    return [
        (d.get("duration", 0.0), d.get("total", 0))
        for d in dask_worker.transfer_incoming_log
    ]


def _cpu_seconds() -> float:
    """User + system CPU seconds of this (worker) process, all threads."""
    t = os.times()
    return t.user + t.system


def _workers_cpu(client) -> float:
    return sum(client.run(_cpu_seconds).values())


def workload_rechunk(client, n: int, chunks: int) -> tuple[float, float]:
    """(seconds, CPU seconds of both workers) of a P2P rechunk of an
    ``n x n`` float64 array from ``chunks`` column blocks to as many row
    blocks (the input is persisted beforehand)."""
    import dask
    import dask.array as da
    from distributed import futures_of, wait

    c = -(-n // chunks)
    x = client.persist(da.random.random((n, n), chunks=(n, c)))
    with client.as_current():
        wait(futures_of(x))
    with dask.config.set({"array.rechunk.method": "p2p"}):
        y = x.rechunk((c, n))
    cpu0 = _workers_cpu(client)
    t0 = time.perf_counter()
    y = client.persist(y)
    with client.as_current():
        wait(futures_of(y))
    t = time.perf_counter() - t0
    cpu = _workers_cpu(client) - cpu0
    assert y.chunks[0][0] == c
    del x, y
    return t, cpu


def workload_pull(client, wa: str, wb: str, size: int, pulls: int):
    """Per pull of an array of ``size`` bytes made on A by a task on B:
    (seconds from submit to result, seconds of B's fetch in Dask's own
    ``transfer_incoming_log``)."""
    times = []
    before = len(client.run(_incoming_log, workers=[wb])[wb])
    for _ in range(pulls):
        fut = client.submit(
            np.random.random,
            size // 8,
            workers=[wa],
            allow_other_workers=False,
            pure=False,
        )
        client.gather(
            client.submit(
                _nbytes, fut, workers=[wa], allow_other_workers=False, pure=False
            )
        )
        t0 = time.perf_counter()
        got = client.submit(
            _nbytes, fut, workers=[wb], allow_other_workers=False, pure=False
        ).result()
        times.append(time.perf_counter() - t0)
        assert got == size // 8 * 8
        del fut
    log = client.run(_incoming_log, workers=[wb])[wb][before:]
    fetch = [d for d, total in log if total >= size // 2]
    if len(fetch) != pulls:  # the log is bounded; never seen short
        fetch = [float("nan")] * pulls
    return list(zip(times, fetch, strict=True))


def workloads(args, schemes) -> dict:
    """Both workloads, ``args.rounds`` rounds, schemes in rotated order;
    returns what ``--json`` writes."""
    import dask
    import distributed

    logging.getLogger("distributed").setLevel(logging.WARNING)
    extra = {}
    if args.p2p_memory:
        extra["distributed.p2p.storage.disk"] = False
    size = _parse_size(args.pull_size)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python benchmarks/bench_dask.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "tls": args.tls,
        "rechunk": {
            "n": args.rechunk_n,
            "chunks": args.rechunk_chunks,
            "bytes": args.rechunk_n**2 * 8,
            "disk": not args.p2p_memory,
        },
        "pull": {"bytes": size, "pulls_per_round": args.pulls},
        "rounds": [],
    }
    clusters = {s: _start_cluster(s, args.tls, extra) for s in schemes}
    try:
        # Warm-up, untimed: connections between the workers (the pools keep
        # them), the shuffle machinery, the workers' memory at full size.
        for s in schemes:
            _, client, wa, wb = clusters[s]
            workload_rechunk(client, args.rechunk_n, args.rechunk_chunks)
            workload_pull(client, wa, wb, size, 2)
        for r in range(args.rounds):
            order = schemes[r % len(schemes) :] + schemes[: r % len(schemes)]
            row: dict = {}
            for s in order:
                _, client, wa, wb = clusters[s]
                pulls = workload_pull(client, wa, wb, size, args.pulls)
                t, cpu = workload_rechunk(client, args.rechunk_n, args.rechunk_chunks)
                row[s] = {
                    "rechunk_s": t,
                    "rechunk_cpu_s": cpu,
                    "pull_s": [p[0] for p in pulls],
                    "pull_fetch_s": [p[1] for p in pulls],
                }
                print(
                    f"round {r + 1} {s}://: rechunk {t:.2f} s (workers' CPU "
                    f"{cpu:.2f} s), pull median "
                    f"{statistics.median(p[0] for p in pulls) * 1e3:.1f} ms "
                    f"(fetch {statistics.median(p[1] for p in pulls) * 1e3:.1f} ms)",
                    flush=True,
                )
            res["rounds"].append(row)
    finally:
        for cluster, client, _, _ in clusters.values():
            client.close()
            cluster.close()
    return res


#: (key, column, scale, format, ratio column) of the workload table.
_WL_KEYS = (
    ("rechunk", "rechunk s", 1.0, "{:.2f}", "rechunk"),
    ("cpu", "rechunk CPU s", 1.0, "{:.2f}", "CPU"),
    ("pull", "pull ms", 1e3, "{:.1f}", "pull"),
    ("fetch", "fetch ms", 1e3, "{:.1f}", "fetch"),
)


def print_workloads(res: dict, schemes) -> None:
    """The per-round table (pull and fetch: median of the round's pulls),
    its medians and the tcp/gpucx ratios (> 1: the second scheme is
    faster); adds ``median`` to ``res``."""
    gb = res["rechunk"]["bytes"] / 1e9
    mib = res["pull"]["bytes"] / (1 << 20)
    print(
        f"\nWorkloads (LocalCluster, 2 worker processes; P2P rechunk of "
        f"{res['rechunk']['n']}^2 float64 = {gb:.2f} GB, shuffle buffers on "
        f"{'disk' if res['rechunk']['disk'] else 'memory'}; pulls of "
        f"{mib:g} MiB A -> B)\n"
    )
    ratio = len(schemes) == 2
    head = ["round"] + [f"{s}:// {k[1]}" for s in schemes for k in _WL_KEYS]
    if ratio:
        head += [f"{k[4]} ratio" for k in _WL_KEYS]
    print("| " + " | ".join(head) + " |")
    print("|---" + "|---:" * (len(head) - 1) + "|")

    def cells(vals):
        out = [k[3].format(vals[s][k[0]] * k[2]) for s in schemes for k in _WL_KEYS]
        if ratio:
            a, b = (vals[s] for s in schemes)
            out += [f"{a[k[0]] / b[k[0]]:.2f}x" for k in _WL_KEYS]
        return out

    per = []
    for i, row in enumerate(res["rounds"]):
        vals = {
            s: {
                "rechunk": row[s]["rechunk_s"],
                "cpu": row[s]["rechunk_cpu_s"],
                "pull": statistics.median(row[s]["pull_s"]),
                "fetch": statistics.median(row[s]["pull_fetch_s"]),
            }
            for s in schemes
        }
        per.append(vals)
        print(f"| {i + 1} | " + " | ".join(cells(vals)) + " |")
    med = {
        s: {k[0]: statistics.median(v[s][k[0]] for v in per) for k in _WL_KEYS}
        for s in schemes
    }
    print("| median | " + " | ".join(cells(med)) + " |")
    res["median"] = med


def _fmt_size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M,64M")
    ap.add_argument("--cluster-sizes", default="1M,64M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tls", default=None, help="distributed-gpucx.tls")
    ap.add_argument("--schemes", default="tcp,gpucx")
    ap.add_argument("--no-cluster", action="store_true")
    ap.add_argument("--kill", type=int, default=0, metavar="N")
    ap.add_argument(
        "--connects",
        type=int,
        default=20,
        metavar="N",
        help="comm level: time N fresh connections (0: none)",
    )
    ap.add_argument("--workloads", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rechunk-n", type=int, default=12288)
    ap.add_argument("--rechunk-chunks", type=int, default=16)
    ap.add_argument(
        "--p2p-memory",
        action="store_true",
        help="P2P shuffle buffers in memory, not on disk",
    )
    ap.add_argument("--pulls", type=int, default=5)
    ap.add_argument("--pull-size", default="64M")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    schemes = args.schemes.split(",")
    import dask
    import distributed

    print(
        f"dask {dask.__version__}, distributed {distributed.__version__}, "
        f"gpucx tls={args.tls or 'UCX default'}"
    )
    if args.workloads:
        res = workloads(args, schemes)
        print_workloads(res, schemes)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.kill:
        print("\nPeer killed: SIGKILL -> CommClosedError of a pending read\n")
        print("| scheme | median | range |\n|---|---:|---:|")
        for s in schemes:
            for tls in [args.tls, "tcp"] if s == "gpucx" else [None]:
                t = kill_detection(s, args.kill, tls)
                name = f"{s}://" + (f" (tls={tls})" if tls else "")
                print(
                    f"| {name} | {statistics.median(t) * 1e3:.1f} ms | "
                    f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} ms |"
                )
        return
    rtt = {
        s: comm_pingpong(s, sizes, args.iters, args.tls, args.connects) for s in schemes
    }
    if args.connects:
        print(
            "\nNew comm (connect + one 8-byte round trip, median of "
            f"{args.connects}): "
            + ", ".join(f"{s}:// {rtt[s]['connect'] * 1e3:.2f} ms" for s in schemes)
        )
    head = "| size | " + " | ".join(f"{s}:// round trip | {s}:// GB/s" for s in schemes)
    print("\nComm ping-pong (distributed.comm.connect/listen, 2 processes)\n")
    ratio = len(schemes) == 2
    print(head + (" | bandwidth ratio |" if ratio else " |"))
    print("|---:" * (1 + 2 * len(schemes) + ratio) + "|")
    for size in sizes:
        cells = []
        for s in schemes:
            t = rtt[s][size]
            cells += [f"{t * 1e6:.0f} us", f"{2 * size / t / 1e9:.3f}"]
        extra = (
            f" {rtt[schemes[0]][size] / rtt[schemes[1]][size]:.2f}x |" if ratio else ""
        )
        print(f"| {_fmt_size(size)} | " + " | ".join(cells) + " |" + extra)
    if args.no_cluster:
        return
    csizes = [_parse_size(s) for s in args.cluster_sizes.split(",")]
    ct = {s: cluster_transfer(s, csizes, args.repeats, args.tls) for s in schemes}
    print("\nCluster transfer (LocalCluster, 2 worker processes, A -> B)\n")
    print(
        "| size | "
        + " | ".join(f"{s}:// time | {s}:// GB/s" for s in schemes)
        + (" | bandwidth ratio |" if ratio else " |")
    )
    print("|---:" * (1 + 2 * len(schemes) + ratio) + "|")
    for size in csizes:
        cells = []
        for s in schemes:
            t = ct[s][size]
            cells += [f"{t * 1e3:.1f} ms", f"{size / t / 1e9:.3f}"]
        extra = (
            f" {ct[schemes[0]][size] / ct[schemes[1]][size]:.2f}x |" if ratio else ""
        )
        print(f"| {_fmt_size(size)} | " + " | ".join(cells) + " |" + extra)


if __name__ == "__main__":
    main()
