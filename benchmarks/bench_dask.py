"""Dask comm benchmark: tcp:// against gpucx:// in one run.

    python benchmarks/bench_dask.py [--iters N] [--sizes 8,1K,...] [--tls TLS]
                                    [--schemes tcp,gpucx] [--no-cluster]

1. Comm level: ``distributed.comm.listen`` in a spawned echo process,
   ``distributed.comm.connect`` here; one message ``{"x": to_serialize(a)}``
   carrying a NumPy array of each size goes there and back.  Prints the
   median round trip and the bandwidth (2 x size / round trip).
2. Cluster level: ``LocalCluster(protocol=..., n_workers=2, processes=True)``;
   an array made on worker A is consumed on worker B (``np.sum``), median of
   a few repeats, for each size of ``--cluster-sizes``.

3. ``--kill N``: instead, how long after a listening peer process is
   SIGKILLed a pending ``read`` raises ``CommClosedError`` (median and range
   of N trials per scheme; gpucx over its default transports and over TCP).

``--tls`` sets ``distributed-gpucx.tls`` (UCX_TLS of the comm) for gpucx;
the default is UCX's choice (shared memory on one host).  Prints a Markdown
table with gpucx/tcp ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
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


def _echo_server(scheme, tls, conn):
    import dask.config
    from distributed.comm import listen

    async def main():
        done = asyncio.Event()

        async def handle(comm):
            try:
                while True:
                    msg = await comm.read()
                    if msg == "stop":
                        break
                    await comm.write(msg, serializers=SERIALIZERS)
            finally:
                await comm.close()
                done.set()

        # deserialize=False: the echo sends the frames back as they came.
        async with listen(f"{scheme}://127.0.0.1:0", handle, deserialize=False) as lst:
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


def comm_pingpong(scheme: str, sizes, iters: int, tls) -> dict[int, float]:
    """Median round trip (seconds) per size."""
    import dask.config
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(scheme, tls, child), daemon=True)
    proc.start()
    addr = parent.recv()
    out: dict[int, float] = {}

    async def main():
        comm = await connect(addr, timeout=30)
        try:
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

    with dask.config.set({"distributed-gpucx.tls": tls}):
        asyncio.run(main())
    proc.join(30)
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
    args = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    schemes = args.schemes.split(",")
    import dask
    import distributed

    print(
        f"dask {dask.__version__}, distributed {distributed.__version__}, "
        f"gpucx tls={args.tls or 'UCX default'}"
    )
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
    rtt = {s: comm_pingpong(s, sizes, args.iters, args.tls) for s in schemes}
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
