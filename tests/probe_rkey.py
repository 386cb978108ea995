"""Probe: what UCX does with a damaged packed remote key (not a test).

Each case runs in its own process, since UCX may crash: a real token is
re-sealed around a damaged packed key (so the token checksum passes, as a
crafted token would), unpacked on an endpoint, then used for a put and a
get.  Prints how each kind of damage ended (exit code, last step reached).

Usage::

    .venv/bin/python tests/probe_rkey.py [--cases N] [--tls default|tcp|sm,self]

The figures in benchmarks/RESULTS.md ("Fuzzing") came from 20 cases per
kind over the default transports.
"""

from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys
import time

KINDS = ("flip", "rand", "trunc", "ext", "garbage")


def _damage(rkey: bytes, kind: str, rng: random.Random) -> bytes:
    k = bytearray(rkey)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            k[rng.randrange(len(k))] ^= 1 << rng.randrange(8)
    elif kind == "rand":
        for _ in range(rng.randint(1, 8)):
            k[rng.randrange(len(k))] = rng.randrange(256)
    elif kind == "trunc":
        k = k[: rng.randrange(1, len(k))]
    elif kind == "ext":
        k += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        k = bytearray(rng.randrange(256) for _ in range(rng.randint(1, 200)))
    return bytes(k)


def child(seed: int, tls: str, kind: str) -> None:
    import numpy as np

    import gpucx

    ctx = gpucx.Context(config=None if tls == "default" else {"TLS": tls})
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    arr = np.zeros(4096, np.uint8)
    r = ctx.register(arr).remote()
    bad = gpucx.RemoteMemory(
        r.address, r.nbytes, r.memory_type, _damage(r.rkey, kind, random.Random(seed))
    )
    print("unpack", flush=True)
    try:
        key = ab.unpack(bad.to_bytes())
    except gpucx.UCXError as exc:
        print("refused", exc.status_name, flush=True)
        return
    print("rma", flush=True)
    reqs = [
        ab.put_nb(np.ones(64, np.uint8), key, 0),
        ab.get_nb(np.zeros(64, np.uint8), key, 0),
    ]
    end = time.monotonic() + 5
    while not all(q.done() for q in reqs) and time.monotonic() < end:
        a.progress()
        b.progress()
    try:
        print("done", [q.result() if q.done() else "pending" for q in reqs])
    except gpucx.UCXError as exc:
        print("failed", type(exc).__name__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--tls", default="default")
    p.add_argument("--child", nargs=2, metavar=("SEED", "KIND"))
    args = p.parse_args()
    if args.child:
        child(int(args.child[0]), args.tls, args.child[1])
        return
    for kind in KINDS:
        tally: collections.Counter = collections.Counter()
        for seed in range(args.cases):
            cmd = [sys.executable, __file__, "--tls", args.tls]
            done = subprocess.run(
                cmd + ["--child", str(seed), kind],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=60,
            )
            lines = done.stdout.strip().splitlines()
            last = lines[-1].split()[0] if lines else "-"
            tally[f"exit {done.returncode}, last step {last}"] += 1
        print(kind, dict(tally), flush=True)


if __name__ == "__main__":
    main()
