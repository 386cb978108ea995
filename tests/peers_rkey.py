"""Child program for the truncated/garbage remote-key tests (UCX may crash
on a damaged key, so each run is its own process)."""

from __future__ import annotations

import random
import sys

import numpy as np

import gpucx


def unpack_damaged(tls: str, kind: str, seed: int) -> None:
    """Unpack damaged keys sealed into valid tokens; print one line per key
    with how UCX took it (``ok`` or the error class)."""
    cfg = {"default": None, "tcp": {"TLS": "tcp"}, "shm": {"TLS": "sm,self"}}[tls]
    ctx = gpucx.Context(config=cfg)
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    region = ctx.register(np.zeros(4096, np.uint8))
    r = region.remote()
    rng = random.Random(seed)
    if kind == "trunc":  # every prefix of the real key
        keys = [r.rkey[:n] for n in range(1, len(r.rkey))]
    else:  # random bytes of random lengths
        keys = [rng.randbytes(rng.randint(1, 64)) for _ in range(40)]
    for k in keys:
        bad = gpucx.RemoteMemory(r.address, r.nbytes, r.memory_type, k)
        try:
            key = ab.unpack(bad.to_bytes())
        except gpucx.UCXError as exc:
            print(len(k), type(exc).__name__, flush=True)
        else:
            print(len(k), "ok", flush=True)
            key.close()
    print("survived", flush=True)


if __name__ == "__main__":
    unpack_damaged(sys.argv[1], sys.argv[2], int(sys.argv[3]))
