"""The ``gpucx`` command: ``gpucx info`` and ``gpucx bench``.

Argument errors print one line (``gpucx bench: error: ...``) and exit with
code 2; a benchmark that fails while running exits with code 1.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: object, code: int = 2) -> int:
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code


# -- gpucx info ----------------------------------------------------------------------


def _info_parser(sub) -> None:
    p = sub.add_parser("info", help="UCX version, transports, memory types")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _cmd_info(args) -> int:
    from ._stdio import take_stdout
    from .info import collect, format_info

    # The JSON is read by programs: UCX's log (stdout by default) goes to
    # stderr meanwhile.
    out = take_stdout() if args.json else None
    info = collect()
    if out is not None:
        out.write((json.dumps(info, indent=2, sort_keys=True) + "\n").encode())
    else:
        print(format_info(info))
    return 0


# -- gpucx bench ---------------------------------------------------------------------


def _bench_parser(sub) -> None:
    from .bench.suites import DEFAULT_TESTS, TESTS

    p = sub.add_parser(
        "bench",
        help="latency and bandwidth between two processes",
        description=(
            "Measure gpucx latency and bandwidth between this process and a peer "
            "(started on this host unless --client is given). Latency is "
            "one-way (half a round trip), like ucx_perftest."
        ),
    )
    p.add_argument(
        "-t",
        "--test",
        action="append",
        default=None,
        metavar="TEST",
        help=f"test(s) to run, comma-separated or repeated: {', '.join(TESTS)} "
        f"(default: {','.join(DEFAULT_TESTS)})",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "-s",
        "--sizes",
        default=None,
        help="message sizes, e.g. 8,1K,1M,16M (default: 8,1M)",
    )
    g.add_argument(
        "--sweep", default=None, help="size sweep LO:HI[:FACTOR], e.g. 8:64M (factor 2)"
    )
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help="measured iterations per point (default: by size)",
    )
    p.add_argument(
        "-w",
        "--warmup",
        type=int,
        default=None,
        help="warm-up iterations per point (default: iters/10)",
    )
    p.add_argument(
        "-W",
        "--window",
        type=int,
        default=32,
        help="outstanding operations in bandwidth tests (default 32)",
    )
    p.add_argument(
        "-m",
        "--memory",
        default="host",
        help="host (NumPy), ucx (host memory mapped by UCX, as ucx_perftest "
        "uses), reg (NumPy registered with the context: pinned where CUDA is "
        "initialised), cuda, or CLIENT:SERVER such as host:cuda",
    )
    p.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    p.add_argument(
        "--api",
        choices=("c", "python", "prepared"),
        default="c",
        help="the path measured: c (default: loops in C, the transport's "
        "speed), python (the Request API, one call per message), prepared "
        "(put_bw/get_bw/am_bw through prepared lists: ep.prepare_put, "
        "prepare_get, prepare_am)",
    )
    p.add_argument(
        "--async",
        dest="use_async",
        action="store_true",
        help="same as --api python",
    )
    p.add_argument(
        "--tls", default=None, help="UCX transports (UCX_TLS), e.g. tcp or sm,self"
    )
    p.add_argument(
        "--no-error-handling",
        action="store_true",
        help="endpoints without peer error handling",
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="serve one remote client (see --host/--port)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="--server: address to listen on (default 127.0.0.1; 0.0.0.0 or :: "
        "for every interface, with a warning)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=13338,
        help="--server: port (0 = any free one; default 13338)",
    )
    p.add_argument(
        "--client",
        metavar="HOST:PORT",
        default=None,
        help="run against gpucx bench --server at HOST:PORT",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one point may take before it fails (default 120)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        default=None,
        help="write every figure and the environment as JSON",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="plot bandwidth and latency against size (needs matplotlib)",
    )
    p.add_argument(
        "--vs-perftest",
        action="store_true",
        help="also run ucx_perftest with the same settings; print ratios",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bench_options(args):
    from .bench.errors import BenchSetupError
    from .bench.memory import parse_memory
    from .bench.runner import BenchOptions
    from .bench.sizes import parse_sizes, parse_sweep
    from .bench.suites import DEFAULT_TESTS

    tests: list[str] = []
    for item in args.test or [",".join(DEFAULT_TESTS)]:
        tests += [t.strip() for t in item.split(",") if t.strip()]
    try:
        sizes = None
        if args.sizes is not None:
            sizes = tuple(parse_sizes(args.sizes))
        elif args.sweep is not None:
            sizes = tuple(parse_sweep(args.sweep))
    except ValueError as exc:
        raise BenchSetupError(str(exc)) from None
    if args.timeout <= 0:
        raise BenchSetupError(f"--timeout must be > 0, not {args.timeout}")
    return BenchOptions(
        tests=tuple(dict.fromkeys(tests)),
        sizes=sizes,
        iters=args.iters,
        warmup=args.warmup,
        window=args.window,
        memory=parse_memory(args.memory),
        device=args.device,
        use_async=args.use_async,
        api=args.api,
        tls=args.tls,
        error_handling=not args.no_error_handling,
        client=args.client,
        timeout=args.timeout,
        vs_perftest=args.vs_perftest,
        plot=args.plot,
        progress=not args.no_progress,
    )


def _cmd_bench(args) -> int:
    prog = "gpucx bench"
    from .bench.errors import BenchSetupError

    if args.server:
        if args.client:
            return _fail(prog, "--server and --client exclude each other")
        if not 0 <= args.port < 65536:
            return _fail(prog, f"--port must be in 0..65535, not {args.port}")
        from .bench.peer import serve_listener
        from .bench.suites import DEFAULT_TESTS, TESTS

        tests: list[str] = []
        for item in args.test or [",".join(DEFAULT_TESTS)]:
            tests += [t.strip() for t in item.split(",") if t.strip()]
        unknown = [t for t in tests if t not in TESTS]
        if unknown:
            return _fail(
                prog, f"unknown test {unknown[0]!r}: choose from {', '.join(TESTS)}"
            )
        serve_listener(
            args.host,
            args.port,
            args.tls,
            not args.no_error_handling,
            args.device,
            args.timeout,
            tests=tests,
        )
        return 0
    try:
        opts = _bench_options(args)
        from .bench.runner import BenchFailed, run_bench

        doc = run_bench(opts)
    except BenchSetupError as exc:
        return _fail(prog, exc)
    except BenchFailed as exc:
        return _fail(prog, exc, 1)
    from .bench.report import format_table, write_json, write_plot

    print(format_table(doc["results"], with_perftest=opts.vs_perftest))
    tr = ", ".join(sorted({f"{t}/{d}" for t, d in doc["environment"]["transports"]}))
    print(f"UCX {doc['environment']['ucx_version']}, transports: {tr or 'unknown'}")
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        write_plot(args.plot, doc["results"])
    return 0


def main(argv=None) -> int:
    """Entry point of the ``gpucx`` console script."""
    parser = _Parser(prog="gpucx", description="gpucx tools")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _info_parser(sub)
    _bench_parser(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Report stray arguments under the subcommand's name, on one line.
        owner = sub.choices.get(args.command, parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "info":
        return _cmd_info(args)
    if args.command == "bench":
        try:
            return _cmd_bench(args)
        except KeyboardInterrupt:
            # The peer process is killed by the session's cleanup.
            print("gpucx bench: interrupted", file=sys.stderr)
            return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
