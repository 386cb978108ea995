"""The Python cost of small tag and active-message calls, in one process.

Two workers of one context (``sm,self``), 8-byte messages: a blocking
``ep.send`` then ``w.recv`` of the message already there; ``recv_nb``,
``send_nb(...).wait()`` and ``wait()`` (the Request path); ``am_send`` then
``progress()`` running the handler.  The best of five loops of 50,000, in
microseconds a pair.  Like ``rma_small_loop.py`` it measures the Python
layer in front of UCX, so compare builds alternated in one session
(``PYTHONPATH=<tree> python benchmarks/tag_small_loop.py``).
"""

from __future__ import annotations

import numpy as np

# The best-of loop both small-loop benchmarks time with (this directory is
# on sys.path when a script of it runs).
from rma_small_loop import best_of

import gpucx


def main(n: int = 50_000, loops: int = 5) -> dict[str, float]:
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)
        src, dst = np.ones(8, np.uint8), np.zeros(8, np.uint8)
        for _ in range(1000):
            ab.send(src, tag=1)
            b.recv(dst, tag=1)
        got: list = []
        b.set_am_handler(3, got.append)

        def blocking() -> None:
            ab.send(src, tag=1)
            b.recv(dst, tag=1)

        def nb() -> None:
            r = b.recv_nb(dst, tag=1)
            ab.send_nb(src, tag=1).wait()
            r.wait()

        def am() -> None:
            ab.am_send(3, src)
            b.progress()
            got.clear()

        calls = (("send+recv", blocking), ("nb+wait", nb), ("am_send+progress", am))
        return best_of(calls, loops, n)


if __name__ == "__main__":
    print(" ".join(f"{k} {v:.3f} us" for k, v in main().items()))
