"""Reproducible comparison: gpucx bench vs ucx_perftest (ucxx: see ucxx_am.py).

Runs every (test, size) point ``--rounds`` times; each round measures gpucx
(its own peer process, C timing loops) and ``ucx_perftest`` (the wheel's,
same iterations, warm-up, transports and peer error handling) right after
each other, so that both see the same state of a noisy host: gpucx first in
odd rounds, perftest first in even ones, so that neither always runs second.
Prints the median of each figure and of the per-round ratios, as a Markdown
table.

    python benchmarks/compare.py                    # tag_lat, tag_bw
    python benchmarks/compare.py -t tag_bw -s 1M,16M --rounds 5 --tls sm,self
    python benchmarks/compare.py -t put_bw,get_bw,am_bw -s 8,1M,16M -m ucx \
        --both-error-modes --rounds 3
    python benchmarks/compare.py -t am_bw -s 8 -m ucx --api prepared

``--both-error-modes`` measures each round with peer error handling (gpucx's
default; perftest ``-e``) and then without; rows measured without are marked
"(no EH)".  ``--api python,c`` measures each listed path in every round
(rows marked with it), each against its own perftest run.  On a host whose
runs come out fast or slow as a whole, compare the ``top K`` column (the
mean of gpucx's K best rounds against perftest's K best, ``--top``) over
many rounds:

    python benchmarks/compare.py -t am_bw -s 1M -n 10000 -m ucx \
        --api python,c --rounds 20 --top 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from gpucx.bench.memory import parse_memory
from gpucx.bench.report import environment
from gpucx.bench.runner import BenchOptions, run_bench
from gpucx.bench.sizes import format_size, parse_sizes


def ucxx_status() -> str:
    try:
        import ucxx  # noqa: F401
    except Exception as exc:
        return f"not installable here ({type(exc).__name__}: {exc})"
    return "installed (its AM figures: benchmarks/ucxx_am.py)"


def top(rs: list[dict], k: int) -> float:
    """The mean of gpucx's ``k`` best rounds against the mean of perftest's
    ``k`` best (bandwidth tests; latency tests: their ``k`` lowest)."""
    if rs[0]["test"].split()[0].endswith("_lat"):
        g = sorted(r["latency_us"] for r in rs if r["latency_us"] is not None)
        p = sorted(
            r["perftest"]["latency_us"]
            for r in rs
            if r["perftest"].get("latency_us") is not None
        )
        g, p = g[:k], p[:k]
        return statistics.mean(p) / statistics.mean(g) if p and g and g[-1] else 0.0
    g = sorted((r["bandwidth_gbs"] for r in rs), reverse=True)[:k]
    p = sorted((r["perftest"].get("bandwidth_gbs", 0) for r in rs), reverse=True)[:k]
    return statistics.mean(g) / statistics.mean(p) if p and statistics.mean(p) else 0.0


def best(rs: list[dict]) -> float:
    """The best gpucx round against the best perftest round (``top(rs, 1)``)."""
    return top(rs, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--tests", default="tag_lat,tag_bw")
    ap.add_argument("-s", "--sizes", default="8,64K,1M,16M")
    ap.add_argument("-n", "--iters", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tls", default=None)
    ap.add_argument(
        "--api",
        default="c",
        help="the gpucx paths measured, comma-separated (gpucx bench --api: "
        "c, python, prepared)",
    )
    ap.add_argument(
        "--top",
        type=int,
        default=3,
        help="K of the 'top K' column: gpucx's K best rounds against perftest's",
    )
    ap.add_argument(
        "-m", "--memory", default="host", help="host, ucx, or CLIENT:SERVER"
    )
    ap.add_argument(
        "--no-error-handling",
        action="store_true",
        help="endpoints without peer error handling (perftest without -e)",
    )
    ap.add_argument(
        "--both-error-modes",
        action="store_true",
        help="each round measures with peer error handling, then without",
    )
    args = ap.parse_args(argv)
    apis = tuple(a for a in args.api.split(",") if a)
    bad = [a for a in apis if a not in ("c", "python", "prepared")]
    if bad or not apis or args.top < 1:
        ap.error(
            f"--api takes c, python and prepared (got {args.api!r}); "
            f"--top at least 1 (got {args.top})"
        )
    tests = tuple(t for t in args.tests.split(",") if t)
    sizes = tuple(parse_sizes(args.sizes))
    rows: dict[tuple[str, int], list[dict]] = {}
    transports = []
    t0 = time.time()
    memory = parse_memory(args.memory)
    modes = (True, False) if args.both_error_modes else (not args.no_error_handling,)
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)
        for eh in modes:
            for api in apis:
                doc = run_bench(
                    BenchOptions(
                        tests=tests,
                        sizes=sizes,
                        iters=args.iters,
                        tls=args.tls,
                        memory=memory,
                        api=api,
                        error_handling=eh,
                        vs_perftest=True,
                        # Odd rounds run perftest first at each point, so
                        # that neither side always runs right after the other.
                        perftest_first=rnd % 2 == 1,
                        progress=False,
                    )
                )
                transports = doc["environment"]["transports"]
                for r in doc["results"]:
                    r["test"] += "" if eh else " (no EH)"
                    r["test"] += f" [{api}]" if len(apis) > 1 else ""
                    rows.setdefault((r["test"], r["size"]), []).append(r)
    env = environment(transports, args.tls)
    med = statistics.median
    print(
        f"gpucx {env['gpucx_version']}, UCX {env['ucx_version']}, "
        f"{env['cpu']} x{env['cpu_count']}, GPUs: {env['gpus'] or 'none'}, "
        f"Python {platform.python_version()}"
    )
    print(f"transports: {', '.join(sorted({f'{t}/{d}' for t, d in transports}))}")
    print(f"memory: {args.memory}, api: {args.api}")
    print(
        f"rounds: {args.rounds}, wall time {time.time() - t0:.0f} s, "
        f"ucxx: {ucxx_status()}"
    )
    print()
    print(
        "| test | size | iters | gpucx lat med us | perftest lat med us "
        "| gpucx GB/s | perftest GB/s | gpucx/perftest (median of rounds) "
        f"| best/best | top {args.top} | per-round ratios |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (test, size), rs in rows.items():
        ratios = [r["ratio"] for r in rs if r.get("ratio")]
        lat = [r["latency_us"] for r in rs if r["latency_us"] is not None]
        plat = [
            r["perftest"].get("latency_us")
            for r in rs
            if r["perftest"].get("latency_us") is not None
        ]
        print(
            f"| {test} | {format_size(size)} | {rs[0]['iters']} "
            f"| {med(lat):.2f} | {med(plat):.2f} "
            if lat and plat
            else f"| {test} | {format_size(size)} | {rs[0]['iters']} | - | - ",
            end="",
        )
        print(
            f"| {med(r['bandwidth_gbs'] for r in rs):.3f} "
            f"| {med(r['perftest'].get('bandwidth_gbs', 0) for r in rs):.3f} "
            f"| {med(ratios):.2f} | {best(rs):.2f} | {top(rs, args.top):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in ratios)} |"
            if ratios
            else "| - | - | - | - | - | - |"
        )
    print()
    print(
        "Ratio: bandwidth ratio for *_bw, perftest median latency / gpucx median "
        "latency for *_lat (1 = same, higher = gpucx faster).  best/best: the "
        "best round of gpucx against the best round of perftest (each side's "
        f"figure in the host's fast periods); top {args.top}: the mean of the "
        f"{args.top} best rounds of each."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
