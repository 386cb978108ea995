"""The client side of ``gpucx bench``: plan the points, run them, collect."""

from __future__ import annotations

import dataclasses
import sys

import gpucx

from . import limits as _limits
from . import perftest as _perftest
from .errors import BenchSetupError
from .memory import cuda_problem
from .report import ProgressBar, environment, plot_problem
from .session import (
    BadControlMessage,
    PeerGone,
    Session,
    connect_remote,
    quote,
    reply_field,
    spawn_local,
)
from .sizes import format_size
from .suites import (
    API_PATHS,
    APIS,
    DEFAULT_TESTS,
    MAX_ITERS,
    MAX_TIMEOUT,
    MAX_WINDOW,
    PREPARED_TESTS,
    TESTS,
    Params,
)

__all__ = ["BenchOptions", "validate", "plan", "run_bench", "default_iters"]

#: Sizes plain ``gpucx bench`` measures.
DEFAULT_SIZES = (8, 1 << 20)


@dataclasses.dataclass
class BenchOptions:
    tests: tuple[str, ...] = DEFAULT_TESTS
    sizes: tuple[int, ...] | None = None
    iters: int | None = None
    warmup: int | None = None
    window: int = 32
    memory: tuple[str, str] = ("host", "host")
    device: int = 0
    #: Deprecated spelling of api="python".
    use_async: bool = False
    #: The path measured: "c", "python" or "prepared" (see suites.API_PATHS).
    api: str = "c"
    tls: str | None = None
    error_handling: bool = True
    client: str | None = None
    timeout: float = 120.0
    vs_perftest: bool = False
    #: With vs_perftest: run ucx_perftest before gpucx at each point (a
    #: harness alternating the order cancels what the order does).
    perftest_first: bool = False
    plot: str | None = None
    progress: bool = True


def _api(opts: BenchOptions) -> str:
    """The path measured (``use_async=True`` is the older ``api="python"``)."""
    return "python" if opts.use_async and opts.api == "c" else opts.api


def default_iters(size: int, kind: str) -> int:
    """Iterations for a point: many small messages, fewer large ones, so
    each point takes well under a second on a laptop-class host.  A
    bandwidth point moves 1 GiB (at most 100,000 messages, at least 100):
    at 30 GB/s, 256 MiB passed in 8 ms, and such short runs of
    ``ucx_perftest`` itself read anywhere from 10 to 45 GB/s."""
    if kind == "lat":
        return max(100, min(10000, (64 << 20) // max(size, 1)))
    return max(100, min(100000, (1 << 30) // max(size, 1)))


def validate(opts: BenchOptions) -> None:
    """Refuse what cannot run, before any process starts.

    Raises
    ------
    BenchSetupError
        Unknown test, CUDA without a
        GPU, no matplotlib for ``--plot``, no ucx_perftest for
        ``--vs-perftest``, counts out of range (the limits the peer
        checks: iters and warmup up to 2**32, window up to 65536, timeout
        up to 1e6 s).
    """
    if not opts.tests:
        raise BenchSetupError("no test given")
    for name in opts.tests:
        if name not in TESTS:
            raise BenchSetupError(
                f"unknown test {name!r}: choose from {', '.join(TESTS)}"
            )
    if opts.api not in APIS:
        raise BenchSetupError(
            f"--api must be one of {', '.join(APIS)}, not {opts.api!r}"
        )
    if opts.api != "c" and opts.use_async and opts.api != "python":
        raise BenchSetupError(f"--async means --api python, not --api {opts.api}")
    if opts.api == "prepared":
        other = [t for t in opts.tests if t not in PREPARED_TESTS]
        if other:
            raise BenchSetupError(
                f"--api prepared measures {', '.join(PREPARED_TESTS)} only, "
                f"not {', '.join(other)}"
            )
    if opts.iters is not None and not 1 <= opts.iters <= MAX_ITERS:
        raise BenchSetupError(f"--iters must be in [1, {MAX_ITERS}], not {opts.iters}")
    if opts.warmup is not None and not 0 <= opts.warmup <= MAX_ITERS:
        raise BenchSetupError(
            f"--warmup must be in [0, {MAX_ITERS}], not {opts.warmup}"
        )
    if not 1 <= opts.window <= MAX_WINDOW:
        raise BenchSetupError(
            f"--window must be in [1, {MAX_WINDOW}], not {opts.window}"
        )
    if not 0 < opts.timeout <= MAX_TIMEOUT:
        raise BenchSetupError(
            f"--timeout must be in (0, {MAX_TIMEOUT:g}], not {opts.timeout}"
        )
    if opts.device < 0:
        raise BenchSetupError(f"--device must be >= 0, not {opts.device}")
    kinds = set(opts.memory) if opts.client is None else {opts.memory[0]}
    if "cuda" in kinds:
        problem = cuda_problem(opts.device)
        if problem:
            raise BenchSetupError(problem)
    if opts.plot:
        problem = plot_problem()
        if problem:
            raise BenchSetupError(problem)
    if opts.vs_perftest:
        if opts.client is not None:
            raise BenchSetupError(
                "--vs-perftest runs ucx_perftest on this host; it cannot be "
                "combined with --client"
            )
        _perftest.perftest_binary()


def plan(opts: BenchOptions) -> list[Params]:
    """Every point to measure, in order."""
    points = []
    for name in opts.tests:
        cls = TESTS[name]
        sizes = opts.sizes or DEFAULT_SIZES
        if cls.fixed_sizes is not None:
            sizes = cls.fixed_sizes
        for size in sizes:
            iters = opts.iters or default_iters(size, cls.kind)
            warmup = opts.warmup if opts.warmup is not None else max(10, iters // 10)
            points.append(
                Params(
                    test=name,
                    size=size,
                    iters=iters,
                    warmup=warmup,
                    window=opts.window,
                    client_mem=opts.memory[0],
                    server_mem=opts.memory[1],
                    use_async=_api(opts) != "c",
                    timeout=opts.timeout,
                    api=_api(opts),
                )
            )
    return points


class BenchFailed(RuntimeError):
    """A point failed while running (the message names it)."""


class _PeerFailed(Exception):
    """The peer answered with an error (its message, as sent)."""


def _answer(reply: dict) -> dict:
    """Check a reply of the peer: ``{"error": str}`` (raised as
    :class:`_PeerFailed`) or ``{"ok": true, ...}``.

    Raises
    ------
    BadControlMessage
        For anything else.
    """
    if "error" in reply:
        raise _PeerFailed(str(reply_field(reply, "error", str)))
    if reply.get("ok") is not True:
        raise BadControlMessage(
            f"the peer's reply is neither ok nor an error: {quote(reply)}"
        )
    return reply


def run_point(sess: Session, p: Params) -> dict:
    """Measure one point; return its result record.

    Raises
    ------
    BenchFailed
        When either side fails, the peer goes away or the point times out.
    """
    where = f"{p.test} {format_size(p.size)}"
    try:
        reply = _answer(sess.call({"op": "run", "params": p.to_dict()}, p.timeout))
        test = TESTS[p.test](sess, p, server=False)
        figures = test.run(reply)
        _answer(sess.recv_ctrl(p.timeout))
        proto = _protocol(test)
    except _PeerFailed as exc:
        raise BenchFailed(f"{where}: {exc}") from None
    except (gpucx.UCXError, PeerGone) as exc:
        raise BenchFailed(f"{where}: {exc}") from exc
    return {
        "test": p.test,
        "kind": test.kind,
        "size": p.size,
        "iters": p.iters,
        "warmup": p.warmup,
        "window": p.window if test.kind == "bw" else 1,
        "memory": f"{p.client_mem}:{p.server_mem}",
        "mode": "async" if p.use_async else "blocking",
        "api": test.fixed_api or p.api,
        "api_path": API_PATHS[test.fixed_api or p.api],
        "latency_note": test.latency_note,
        **figures,
        **proto,
    }


def _protocol(test) -> dict:
    """``protocol`` (UCX's description and transports, e.g. "software
    emulation sysv/memory", or None where UCX does not tell) and
    ``protocol_slow`` of the client side of a point (gpucx.protocols)."""
    try:
        row = test.protocol()
    except (gpucx.UCXError, ValueError):
        row = None  # no report: the row says "-" rather than failing the run
    if row is None:
        return {"protocol": None, "protocol_slow": None}
    return {"protocol": row.short, "protocol_slow": row.slow}


def _point_dict(p: Params) -> dict:
    """What :func:`_perftest_point` reads of a result, from the plan."""
    return {"test": p.test, "size": p.size, "iters": p.iters, "warmup": p.warmup}


def _perftest_point(opts: BenchOptions, r: dict) -> dict:
    cls = TESTS[r["test"]]
    if cls.perftest is None:
        return {"error": "no ucx_perftest equivalent"}
    try:
        pt = _perftest.run_perftest(
            cls.perftest,
            r["size"],
            r["iters"],
            r["warmup"],
            tls=opts.tls,
            error_handling=opts.error_handling,
            memory=opts.memory,
            timeout=opts.timeout,
        )
    except _perftest.PerftestError as exc:
        return {"error": str(exc)}
    pt["test"] = cls.perftest
    return pt


def _ratio(r: dict) -> float | None:
    pt = r.get("perftest") or {}
    if r["kind"] == "bw":
        a, b = r["bandwidth_gbs"], pt.get("bandwidth_gbs")
        return a / b if a and b else None
    # Medians: on a shared host the averages are dominated by the outliers.
    a, b = r["latency_us"], pt.get("latency_us")
    return b / a if a and b else None


def run_bench(opts: BenchOptions, stream=sys.stderr) -> dict:
    """Run every point and return the JSON-ready document.

    Raises
    ------
    BenchSetupError
        See :func:`validate`.
    BenchFailed
        When a point fails (the message names it).
    """
    validate(opts)
    points = plan(opts)
    try:
        if opts.client is not None:
            sess = connect_remote(
                opts.client, opts.tls, opts.error_handling, opts.device, opts.timeout
            )
        else:
            sess = spawn_local(opts.tls, opts.error_handling, opts.device, opts.timeout)
    except (gpucx.UCXError, PeerGone) as exc:
        where = opts.client or "the local peer"
        raise BenchFailed(f"cannot connect to {where}: {exc}") from exc
    results = []
    transports: list = []
    bar = ProgressBar(len(points), opts.progress, stream)
    try:
        for p in points:
            pt = None
            if opts.vs_perftest and opts.perftest_first:
                pt = _perftest_point(opts, _point_dict(p))
            r = run_point(sess, p)
            if not transports:
                try:
                    transports = sess.ep.transports
                except gpucx.UCXError:
                    transports = []
            if opts.vs_perftest:
                r["perftest"] = pt if pt is not None else _perftest_point(opts, r)
                r["ratio"] = _ratio(r)
            results.append(r)
            bar.update(f"{p.test} {format_size(p.size)}")
        try:
            _answer(sess.call({"op": "quit"}, timeout=30))
        except (_PeerFailed, gpucx.UCXError, PeerGone) as exc:
            raise BenchFailed(f"quit: {exc}") from None
        sess.finished = True
    finally:
        bar.close()
        sess.close()
    # The machine's own copies beside each GPU row, timed once the peer is
    # gone.  A remote peer's rows cross the network: no copy on this host
    # bounds them (null).
    if opts.client is None:
        _limits.attach(results, opts.device)
    else:
        for r in results:
            r["limit"] = None
    return {
        "environment": environment(transports, opts.tls),
        "options": {
            **dataclasses.asdict(opts),
            "api": _api(opts),
            "tests": list(opts.tests),
            "sizes": list(opts.sizes) if opts.sizes else None,
        },
        "results": results,
    }
