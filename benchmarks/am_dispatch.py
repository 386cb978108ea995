"""Per-message cost of active-message dispatch, in one process.

Queues ``--count`` messages on a receiving worker (driving UCX progress
directly, so no handler runs yet), then times one ``dispatch`` of them all:

* ``count``: a handler that only counts (record pop, AmMessage, handler
  call, record back to the pool);
* ``receive_into``: a handler that starts ``receive_into`` of each (plus
  the request).

Both eager (64 B) and forced rendezvous (4 KiB) messages.  Hot caches, one
process: the per-message Python work, not what it costs between real
copies (see RESULTS.md)::

    python benchmarks/am_dispatch.py [--count N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import gpucx
from gpucx._lib import lib
from gpucx.ops.am import dispatch


def measure(count: int) -> dict:
    out = {}
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address, error_handling=False)
        b.connect(a.address, error_handling=False)
        buf = np.zeros(4096, np.uint8)
        for proto, payload in (("eager", buf[:64]), ("rndv", buf)):
            for mode in ("count", "receive_into"):
                got: list = []
                if mode == "count":
                    b.set_am_handler(5, lambda msg: None)
                else:
                    b.set_am_handler(
                        5, lambda msg, got=got: got.append(msg.receive_into(buf))
                    )
                sends = [ab.am_send_nb(5, payload, proto=proto) for _ in range(count)]
                q = b._amq
                while q.tail - q.head < count:
                    lib.ucp_worker_progress(a._h)
                    lib.ucp_worker_progress(b._h)
                t0 = time.perf_counter()
                dispatch(b)
                out[(proto, mode)] = (time.perf_counter() - t0) / count * 1e6
                end = time.monotonic() + 30
                while not all(r.done() for r in sends + got):
                    a.progress()
                    b.progress()
                    if time.monotonic() > end:
                        raise RuntimeError("messages did not complete")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5, help="best of")
    args = ap.parse_args()
    runs = [measure(args.count) for _ in range(args.repeat)]
    print(f"us per message, best of {args.repeat} runs of {args.count}")
    for key in runs[0]:
        print(f"{key[0]:6} {key[1]:13} {min(r[key] for r in runs):6.2f}")


if __name__ == "__main__":
    main()
