"""The machine's own copy speed, the limit beside each GPU row of ``gpucx bench``.

A row of ``gpucx bench`` that moves CUDA memory is set against the copy the
hardware does between the same two kinds of memory, in the same direction,
at the same size, measured in the same run on the same device:

========================  =====================================================
kind                      the copy (``cuMemcpyAsync`` on one stream)
========================  =====================================================
``d2d``                   device memory to device memory
``h2d_pinned``            page-locked host memory (``cuMemAllocHost``) to device
``d2h_pinned``            device to page-locked host memory
``h2d_pageable``          pageable host memory (a NumPy array) to device
``d2h_pageable``          device to pageable host memory (a NumPy array)
========================  =====================================================

Each figure is ``size * reps`` bytes over the time between two CUDA events
recorded on the stream around ``reps`` queued copies (after a few warm-up
copies; the fastest of three or more such rounds), in GB/s (1e9 bytes per second; a
device-to-device copy counts its bytes once, not read and written).
``reps`` follows a byte budget as ``gpucx bench``'s own iterations do
(:func:`reps_for`).  Figures are cached per (kind, size, device) for the
life of the process: a bench run with many rows at one size measures each
copy once.

Which copy a row is set against (:func:`row_kind`): the direction of the data
follows the test (``get_bw``: the server's memory into the client's; every
other bandwidth test: the client's into the server's; ``array_bw``: the
server's ``recv_array`` allocates memory of the sender's kind, or device
memory on a ``cuda`` server), ``cuda`` is
device memory, ``ucx`` (host memory mapped by UCX) is set against the
pinned copy and ``host`` (NumPy memory) against the pageable one, the JSON
adding the pinned figure beside it.  Host-only rows and latency tests (a
round trip, not a stream of copies) carry no limit.

``python -m gpucx.bench.limits -s 1M,64M`` prints the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy

from ..errors import UnsupportedError
from ..mem import cuda as _cuda
from .sizes import format_size, parse_sizes

__all__ = [
    "KINDS",
    "BUDGET",
    "ROUNDS",
    "MAX_ROUNDS",
    "LimitError",
    "reps_for",
    "measure",
    "clear_cache",
    "row_kind",
    "row_limit",
    "attach",
    "main",
]

#: The copies measured, in the order they are printed.
KINDS = ("d2d", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")

#: Bytes one figure copies (``reps_for``): 1 GiB, as a ``gpucx bench``
#: bandwidth point moves, in :data:`ROUNDS` timed rounds of which the
#: fastest counts.  The figure is a bound, and copies now and then run at
#: half speed for tens of milliseconds (on an H100, a 16 MiB pinned figure
#: read 26 GB/s once where every other read 55): after the first
#: :data:`ROUNDS`, rounds go on, up to :data:`MAX_ROUNDS`, while the latest
#: is more than 10% faster than every one before it.
BUDGET = 1 << 30
ROUNDS = 3
MAX_ROUNDS = 6
_STEADY = 1.1
#: Fewest and most copies one round times: enough for the events'
#: resolution (about half a microsecond) at large sizes, and a bound on the
#: time small ones take.  Each queued copy costs the host a few
#: microseconds, which bounds the small figures: on an H100, device to
#: device at 1 MiB read 114 to 208 GB/s from run to run (CuPy's alike).
MIN_REPS = 4
MAX_REPS = 10000

#: Where the data of each bandwidth test flows: "client>server",
#: "server>client", or "client>alike" (the receiver allocates memory of the
#: sender's kind, ``recv_array``'s default allocator, or device memory when
#: the server's memory is CUDA).  Tests not named here
#: (latency tests) carry no limit; tests/test_bench_limits.py checks that
#: every bandwidth test of ``gpucx.bench.suites`` is named.
DIRECTIONS = {
    "tag_bw": "client>server",
    "am_bw": "client>server",
    "stream_bw": "client>server",
    "put_bw": "client>server",
    "get_bw": "server>client",
    "array_bw": "client>alike",
}

_SIDES = {"cuda": "d", "host": "pageable", "ucx": "pinned", "reg": "pinned"}


class LimitError(RuntimeError):
    """A copy could not be measured (no driver, no such device, a failed
    allocation or copy); the message names why."""


def reps_for(size: int, budget: int = BUDGET) -> int:
    """Copies in each of the :data:`ROUNDS` timed rounds of a figure:
    ``budget`` bytes in all, within [:data:`MIN_REPS`, :data:`MAX_REPS`]
    per round."""
    return max(MIN_REPS, min(MAX_REPS, budget // ROUNDS // max(size, 1)))


_cache: dict[tuple[str, int, int], float | None] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every figure measured so far (the next :func:`measure` times
    its copy again)."""
    with _cache_lock:
        _cache.clear()


def measure(
    kind: str, size: int, device: int = 0, budget: int = BUDGET
) -> float | None:
    """GB/s of the ``kind`` copy of ``size`` bytes on ``device``, cached.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    size : int
        Bytes per copy (> 0).
    device : int
        CUDA device ordinal.
    budget : int
        Bytes to copy in all (see :func:`reps_for`); not part of the cache
        key: the first figure for a (kind, size, device) is kept.

    Returns
    -------
    float or None
        The figure; None when the events report no elapsed time.

    Raises
    ------
    ValueError
        For an unknown ``kind`` or a ``size`` below 1.
    LimitError
        When the copy cannot be measured (the message says why).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown copy {kind!r}: choose from {', '.join(KINDS)}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, not {size!r}")
    key = (kind, size, device)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        try:
            with _cuda.device_context(device=device):
                gbps = _time_copies(_cuda.driver(), kind, size, reps_for(size, budget))
        except (UnsupportedError, _cuda.DriverError, ValueError) as exc:
            raise LimitError(
                f"{kind} copy of {format_size(size)} bytes on device {device}: {exc}"
            ) from None
        _cache[key] = gbps
        return gbps


def _time_copies(drv: Any, kind: str, size: int, reps: int) -> float | None:
    """Queue ``reps`` copies on a new stream between two timing events, in
    :data:`ROUNDS` rounds or more (up to :data:`MAX_ROUNDS`, while the
    latest is more than 10% faster than all before it); GB/s of the
    fastest."""
    undo: list[Callable[[], object]] = []
    try:
        stream = drv.stream_create()
        undo.append(lambda: drv.stream_destroy(stream))
        start = drv.timing_event_create()
        undo.append(lambda: drv.event_destroy(start))
        end = drv.timing_event_create()
        undo.append(lambda: drv.event_destroy(end))
        dev = drv.mem_alloc(size)
        undo.append(lambda: drv.mem_free(dev))
        if kind == "d2d":
            other = drv.mem_alloc(size)
            undo.append(lambda: drv.mem_free(other))
        elif kind.endswith("_pinned"):
            other = drv.mem_alloc_host(size)
            undo.append(lambda: drv.mem_free_host(other))
        else:
            # NumPy's memory, as gpucx bench's "host" kind: pages touched
            # first, so the copies do not time the kernel faulting them in.
            array = numpy.ones(size, numpy.uint8)
            other = array.ctypes.data
        src, dst = (other, dev) if kind.startswith("h2d") else (dev, other)
        for _ in range(max(3, min(reps // 10, 20))):
            drv.memcpy_async(dst, src, size, stream)
        drv.stream_synchronize(stream)
        times: list[float] = []
        for n in range(MAX_ROUNDS):
            drv.event_record(start, stream)
            for _ in range(reps):
                drv.memcpy_async(dst, src, size, stream)
            drv.event_record(end, stream)
            drv.event_synchronize(end)
            last = drv.event_elapsed_ms(start, end)
            improving = bool(times) and last * _STEADY < min(times)
            times.append(last)
            if n + 1 >= ROUNDS and not improving:
                break
        ms = min(times)
    finally:
        for fn in reversed(undo):
            fn()
    return size * reps / (ms * 1e6) if ms > 0 else None


# -- rows of gpucx bench ------------------------------------------------------


def row_kind(test: str, memory: str) -> str | None:
    """The copy a ``gpucx bench`` row is set against, or None.

    ``memory`` is the row's ``"CLIENT:SERVER"`` (or one kind for both).
    None for latency tests and for rows with no CUDA memory on either end.
    """
    flow = DIRECTIONS.get(test)
    if flow is None:
        return None
    client, _, server = memory.partition(":")
    server = server or client
    if flow == "client>server":
        src, dst = client, server
    elif flow == "server>client":
        src, dst = server, client
    else:
        # recv_array allocates the sender's kind, unless the server's
        # memory is CUDA: the bench then receives into device memory.
        src, dst = client, "cuda" if "cuda" in (client, server) else "host"
    if src == dst == "cuda":
        return "d2d"
    if src == "cuda" and dst in _SIDES:
        return f"d2h_{_SIDES[dst]}"
    if dst == "cuda" and src in _SIDES:
        return f"h2d_{_SIDES[src]}"
    return None


def _figure(kind: str, gbps: float | None, row_gbps: float | None) -> dict:
    fraction = row_gbps / gbps if gbps and row_gbps is not None else None
    return {"kind": kind, "gbps": gbps, "fraction": fraction}


def row_limit(
    r: dict, device: int = 0, measure_fn: Callable[..., float | None] | None = None
) -> dict | None:
    """The ``"limit"`` of a result row: ``{"kind", "gbps", "fraction"}``
    (``fraction`` = the row's ``bandwidth_gbs`` / ``gbps``), or None.

    A pageable kind adds ``"pinned"``, the same for the pinned copy (the
    hardware's bound; UCX may stage pageable memory through pinned
    buffers).  When the copy cannot be measured, ``gbps`` and ``fraction``
    are None and ``"error"`` says why.  ``measure_fn(kind, size, device)``
    defaults to :func:`measure`.
    """
    fn = measure_fn or measure
    kind = row_kind(r["test"], r.get("memory", "host:host"))
    if kind is None or r["size"] < 1:
        return None
    kinds = [kind]
    if kind.endswith("_pageable"):
        kinds.append(kind.replace("_pageable", "_pinned"))
    row_gbps = r.get("bandwidth_gbs")
    out: list[dict] = []
    for k in kinds:
        try:
            out.append(_figure(k, fn(k, r["size"], device), row_gbps))
        except LimitError as exc:
            out.append({**_figure(k, None, None), "error": str(exc)})
    limit = out[0]
    if len(out) > 1:
        limit["pinned"] = out[1]
    return limit


def attach(
    results: Iterable[dict],
    device: int = 0,
    measure_fn: Callable[..., float | None] | None = None,
) -> None:
    """Give every result row its ``"limit"`` (:func:`row_limit`; None for
    rows that carry none)."""
    for r in results:
        r["limit"] = row_limit(r, device, measure_fn)


# -- python -m gpucx.bench.limits ---------------------------------------------


def _gbps_text(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if v >= 10 else f"{v:.3g}"


def main(argv: list[str] | None = None) -> int:
    """``python -m gpucx.bench.limits [-s SIZES] [--device N] [--json FILE]``:
    print the copy figures (GB/s) of this machine, one row per kind.

    Exit status: 0, 1 when a copy cannot be measured (one line says why),
    2 for bad arguments.
    """
    p = argparse.ArgumentParser(
        prog="python -m gpucx.bench.limits",
        description="The copy speeds gpucx bench sets GPU rows against: "
        "cuMemcpyAsync on one stream, timed with CUDA events.",
    )
    p.add_argument("-s", "--sizes", default="1M,16M,64M", help="default 1M,16M,64M")
    p.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write JSON")
    args = p.parse_args(argv)
    try:
        sizes = [s for s in parse_sizes(args.sizes) if s > 0]
    except ValueError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("no size above 0")
    figures: dict[str, dict[str, float | None]] = {}
    try:
        for kind in KINDS:
            figures[kind] = {
                format_size(n): measure(kind, n, args.device) for n in sizes
            }
    except LimitError as exc:
        print(f"gpucx.bench.limits: error: {exc}", file=sys.stderr)
        return 1
    head = ["copy GB/s", *(format_size(n) for n in sizes)]
    rows = [head] + [[k, *(_gbps_text(v) for v in figures[k].values())] for k in KINDS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    print(
        f"device {args.device}: cuMemcpyAsync on one stream, timed with CUDA "
        f"events, the fastest of {ROUNDS}..{MAX_ROUNDS} rounds of "
        f"{BUDGET // ROUNDS / (1 << 20):.0f} MiB ({MIN_REPS}..{MAX_REPS} "
        "copies); pinned = cuMemAllocHost, pageable = NumPy memory"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": args.device, "sizes": sizes, "gbps": figures},
                f,
                indent=2,
                sort_keys=True,
            )
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
