"""Dask comms between two emulated hosts: gpucx:// against tcp://, with
gpucx's core in the same run (issue 35).

    python benchmarks/dask_across_hosts.py [--rate 1gbit] [--rounds 3]
                                           [--iters 400] [--json PATH]

Makes two network namespaces joined through a bridge (tests/hosts.py: each
host with its own hostname, IPC namespace, /dev/shm and boot id, so UCX
reaches the other by TCP only and gpucx:// opens no same-host data
endpoint), then, per round and in rotated order:

* ``gpucx://`` and ``tcp://``: the comm-level ping-pong of
  benchmarks/bench_dask.py (its echo server, ``_echo_server``, listening on
  host a's address; its measurement, ``pingpong``, on host b): one message
  ``{"x": to_serialize(array)}`` there and back, 8 B and 64 MiB, the
  median round trip; bandwidth = 2 x size / round trip (the bytes each
  way over the time both took).
* gpucx's core: ``gpucx bench --server`` on host a, ``--client`` on host b
  (benchmarks/across_hosts.py's ``gpucx_point``): ``tag_lat``, the same
  ping-pong of one message at a time, 8 B and 64 MiB (a round trip is
  twice its one-way figure).

``--rate`` slows each direction of the link (tc on the wire).  Root and
Linux namespaces are needed; everything is torn down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import hosts as hostlib  # noqa: E402

SIZES = (8, 64 << 20)
SCHEMES = ("gpucx", "tcp")
#: What each round measures: gpucx's core, then the Dask schemes.
KINDS = ("core", *SCHEMES)
#: What a child prints before its answer (UCX may write to stdout too).
MARK = "RESULT "


class _Say:
    """The ``conn`` of ``bench_dask._echo_server``: its address goes to the
    parent process as a marked line of stdout."""

    def send(self, obj) -> None:
        print(MARK + json.dumps(obj), flush=True)


def _child_echo(scheme: str, host: str) -> None:
    from bench_dask import _echo_server

    _echo_server(scheme, None, _Say(), host)


def _child_pingpong(addr: str, iters: str) -> None:
    from bench_dask import pingpong

    out = asyncio.run(pingpong(addr, SIZES, int(iters)))
    print(MARK + json.dumps({str(k): v for k, v in out.items()}), flush=True)


def _answer(peer: hostlib.Peer, timeout: float) -> object:
    end = time.monotonic() + timeout
    while True:
        line = peer.readline(max(1.0, end - time.monotonic()))
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])


def dask_point(a, b, scheme: str, iters: int) -> dict[int, float]:
    """Median round trip (s) per size of ``SIZES`` for ``scheme``, echo
    server on ``a``, client on ``b``."""
    me = str(Path(__file__).resolve())
    echo = a.python(me, "--child-echo", scheme, a.address, label=f"{scheme} echo")
    try:
        addr = _answer(echo, 60)
        client = b.python(me, "--child-pingpong", str(addr), str(iters))
        out = _answer(client, 600)
        client.join(30)
        echo.join(30)
    finally:
        echo.proc.kill()
    assert isinstance(out, dict)
    return {int(k): float(v) for k, v in out.items()}


def core_point(a, b, iters: int) -> dict[int, float]:
    """gpucx's core across the link: the median tag round trip (s) per size
    of ``SIZES`` (``tag_lat``: a ping-pong as the comm level's, one message
    at a time; its one-way figure is half the round trip)."""
    from across_hosts import gpucx_point

    out = {}
    for size in SIZES:
        n = iters * 10 if size <= 1 << 20 else max(10, iters // 20)
        out[size] = 2 * gpucx_point(a, b, "tag_lat", size, n)["latency_us"] * 1e-6
    return out


def _table(rounds: list[dict]) -> None:
    big = SIZES[1]

    def cells(r):
        c, g, t = (r[k] for k in KINDS)
        gbs = [f"{2 * big / x[big] / 1e9:.3f}" for x in (c, g, t)]
        return [
            *(f"{x[8] * 1e6:.0f}" for x in (c, g, t)),
            f"{t[8] / g[8]:.2f}",
            *gbs,
            f"{t[big] / g[big]:.2f}",
        ]

    print(
        "\n| round | core 8 B RTT us | gpucx:// 8 B RTT us | tcp:// 8 B RTT us "
        "| tcp/gpucx 8 B RTT | core 64 MiB GB/s | gpucx:// 64 MiB GB/s "
        "| tcp:// 64 MiB GB/s | gpucx/tcp 64 MiB GB/s |"
    )
    print("|---" + "|---:" * 8 + "|")
    for i, r in enumerate(rounds):
        print(f"| {i + 1} | " + " | ".join(cells(r)) + " |")
    med = {
        k: {n: statistics.median(r[k][n] for r in rounds) for n in SIZES} for k in KINDS
    }
    print("| median | " + " | ".join(cells(med)) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", help="slow the link to this tc rate, e.g. 1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=400, help="8 B round trips")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import dask
    import distributed

    print(
        f"dask {dask.__version__}, distributed {distributed.__version__}, "
        f"{platform.node()}, {os.cpu_count()} CPUs, link "
        f"{args.rate or 'veth speed'}",
        flush=True,
    )
    rounds = []
    with hostlib.make_hosts() as (a, b):
        if args.rate:
            hostlib.slow_link([a, b], args.rate)
        kinds = list(KINDS)
        for r in range(args.rounds):
            order = kinds[r % 3 :] + kinds[: r % 3]
            row: dict = {}
            for k in order:
                if k == "core":
                    row[k] = core_point(a, b, args.iters)
                else:
                    row[k] = dask_point(a, b, k, args.iters)
                print(f"round {r + 1} {k}: {row[k]}", flush=True)
            rounds.append(row)
    _table(rounds)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{k: {str(n): v for n, v in r[k].items()} for k in r} for r in rounds],
                indent=1,
            )  # fmt: skip
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-echo":
        _child_echo(*sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-pingpong":
        _child_pingpong(*sys.argv[2:])
    else:
        main()
