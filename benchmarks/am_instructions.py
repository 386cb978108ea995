"""A fixed active-message workload for instruction counts.

Wall-clock figures on the development VM swing between fast and slow
periods; instruction counts do not. Run this under callgrind at two counts
and subtract to get the instructions one message costs (sender and
receiver workers in one process, forced rendezvous, handler plus
``receive_into`` plus both waits)::

    valgrind --tool=callgrind --callgrind-out-file=cg.200 \\
        python benchmarks/am_instructions.py 200
    valgrind --tool=callgrind --callgrind-out-file=cg.1200 \\
        python benchmarks/am_instructions.py 1200
    # per message = (total of cg.1200 - total of cg.200) / 1000

``--sends`` measures the sending side's path alone: COUNT rounds of 64
eager 8-byte ``am_send_nb`` into receives posted with one
``am_recv_many_nb`` a round (matched in C; per message = the difference
divided by 64 times the extra rounds).

``--proto eager`` sends the handler's messages eagerly (``receive_into``
then copies in Python instead of starting a rendezvous receive).

``--window W`` streams instead: W messages are sent back to back, the
handler starts ``receive_into`` of each and keeps only the request (as a
streaming receiver does), then both sides wait for the W; COUNT is rounded
up to a multiple of W.  Set ``OPENBLAS_NUM_THREADS=1``: NumPy's idle BLAS
threads otherwise add thousands of instructions a message at random.

To compare two checkouts, run each as ``python -S`` with
``PYTHONPATH=<checkout>:<the venv's site-packages>``: without ``-S`` an
editable install of gpucx takes precedence over ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse

import numpy as np

import gpucx

AM_ID = 7


def run(
    count: int, size: int, window: int = 1, sends: bool = False, proto: str = "rndv"
) -> None:
    with gpucx.Context(config={"TLS": "sm,self"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address, error_handling=False)
        ba = b.connect(a.address, error_handling=False)
        sbuf = np.ones(size, np.uint8)
        rbuf = np.empty(size, np.uint8)
        if sends:
            send_only(b, ab, count)
        elif window > 1:
            stream(a, b, ab, sbuf, rbuf, -(-count // window), window, proto)
        else:
            ping(a, b, ab, sbuf, rbuf, count, proto)
        assert sends or (rbuf[0] == 1 and rbuf[-1] == 1)
        ba.close()
        ab.close()


def ping(a, b, ab, sbuf, rbuf, count: int, proto: str = "rndv") -> None:
    """``count`` messages, one at a time."""
    inbox: list = []
    b.set_am_handler(AM_ID, inbox.append)
    for _ in range(count):
        req = ab.am_send_nb(AM_ID, sbuf, proto=proto)
        while not inbox:
            b.progress()
            a.progress()
        inbox.pop(0).receive_into(rbuf).wait(10)
        req.wait(10)


def send_only(b, ab, rounds: int) -> None:
    """``rounds`` rounds of 64 eager 8-byte sends into posted receives."""
    out = np.ones(8, np.uint8)
    bufs = [np.zeros(8, np.uint8) for _ in range(64)]
    for _ in range(rounds):
        got = b.am_recv_many_nb(AM_ID, bufs)
        sends = [ab.am_send_nb(AM_ID, out) for _ in range(64)]
        got.wait(10)  # a spin in C: no Python loop
        for req in sends:
            req.wait(10)
        assert bufs[-1][0] == 1


def stream(a, b, ab, sbuf, rbuf, rounds: int, window: int, proto: str = "rndv") -> None:
    """``rounds`` rounds of ``window`` messages sent back to back."""
    recvs: list = []
    b.set_am_handler(AM_ID, lambda msg: recvs.append(msg.receive_into(rbuf)))
    for _ in range(rounds):
        sends = [ab.am_send_nb(AM_ID, sbuf, proto=proto) for _ in range(window)]
        while len(recvs) < window:
            b.progress()
            a.progress()
        for req in recvs:
            req.wait(10)
        for req in sends:
            req.wait(10)
        recvs.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("count", type=int, help="messages to send")
    p.add_argument("--size", type=int, default=8192, help="payload bytes")
    p.add_argument(
        "--window", type=int, default=1, help="messages per streamed round (1: ping)"
    )
    p.add_argument(
        "--sends", action="store_true", help="the sending path alone (see above)"
    )
    p.add_argument(
        "--proto",
        choices=("rndv", "eager"),
        default="rndv",
        help="the protocol of the handler's messages (default rndv)",
    )
    args = p.parse_args()
    run(args.count, args.size, args.window, args.sends, args.proto)


if __name__ == "__main__":
    main()
