"""A fixed 8-byte tag workload for instruction counts.

The blocking calls of the public API, ``ep.send`` then ``worker.recv``, both
ways between two workers in one process (the path of
``benchmarks/bench_tag.py``'s ping-pong, without a second process whose
spinning would add a varying count).  Run it under callgrind at two counts
and subtract: the difference over the extra round trips is what one costs,
free of the VM's fast and slow periods::

    valgrind --tool=callgrind --callgrind-out-file=cg.1000 \\
        python benchmarks/tag_instructions.py 1000
    valgrind --tool=callgrind --callgrind-out-file=cg.3000 \\
        python benchmarks/tag_instructions.py 3000
    # per round trip = (total of cg.3000 - total of cg.1000) / 2000

Set ``OPENBLAS_NUM_THREADS=1`` (see ``am_instructions.py``).
"""

from __future__ import annotations

import argparse

import numpy as np

import gpucx


def run(count: int) -> None:
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab, ba = a.connect(b.address), b.connect(a.address)
        out, back = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
        for _ in range(count):
            # Eager over shared memory: each send completes before the
            # other worker's receive looks for it.
            ab.send(out, tag=1)
            b.recv(back, tag=1)
            ba.send(back, tag=2)
            a.recv(out, tag=2)
        assert (out == np.arange(8)).all()
        ab.close()
        ba.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("count", type=int, help="round trips")
    run(p.parse_args().count)


if __name__ == "__main__":
    main()
