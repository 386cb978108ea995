"""Peer programs for the two-host tests (tests/test_hosts.py).

Run as ``python peers_hosts.py ROLE ARGS...`` on an emulated host (see
tests/hosts.py).  They speak to the test over stdin/stdout, one JSON value
a line (bytes as ``{"b": hex}``): a multiprocessing queue does not cross
network namespaces.  UCX's own log lines go to stdout, so the protocol gets
a private copy of fd 1 and fd 1 is pointed at stderr.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

_out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # before UCX loads: its log lines go to fd 1
# A peer that hangs prints where and exits, well inside the test's timeout.
faulthandler.dump_traceback_later(
    int(os.environ.get("GPUCX_PEER_DEADLINE", "45")), exit=True
)

import numpy as np  # noqa: E402
from hosts import decode, encode  # noqa: E402

import gpucx  # noqa: E402

TIMEOUT = 30
MIB = 1 << 20
AM_ID = 5


def put(obj) -> None:
    _out.write(json.dumps(encode(obj)) + "\n")
    _out.flush()


def get():
    line = sys.stdin.readline()
    if not line:
        sys.exit(3)  # the test is gone
    return decode(json.loads(line))


def payload(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def owner(how: str, host: str) -> None:
    """The side that is reached: listens on ``host`` (``how`` = "listener")
    or publishes its worker address ("address"); offers a registered region;
    answers every kind of transfer the user side starts."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        data = np.zeros(MIB, np.uint8)
        region = ctx.register(data)
        am_buf = np.zeros(MIB, np.uint8)
        am_req = w.am_recv_nb(AM_ID, am_buf)  # posted before the peer sends
        if how == "listener":
            lst = w.listen(host=host, port=0)
            put(["port", lst.port, region.remote().to_bytes()])
            ep = lst.accept(timeout=TIMEOUT)
        else:
            put(["address", w.address, region.remote().to_bytes()])
            ep = w.connect(get())
        # tag: eager and rendezvous sizes, echoed back
        for i, n in enumerate((64, MIB)):
            buf = np.empty(n, np.uint8)
            info = w.recv(buf, tag=10 + i, timeout=TIMEOUT)
            assert info.nbytes == n and np.array_equal(buf, payload(n, i))
            ep.send(buf, tag=20 + i, timeout=TIMEOUT)
        # AM (rendezvous size)
        assert am_req.wait(TIMEOUT) == MIB
        assert np.array_equal(am_buf, payload(MIB, 7))
        # RMA: the user put into `data`, then says so; the owner writes a
        # pattern for the user's get and progresses until the user is done
        note = np.empty(1, np.uint8)
        w.recv(note, tag=30, timeout=TIMEOUT)
        assert np.array_equal(data[4096 : 4096 + 65536], payload(65536, 3))
        data[: 2 * 65536] = payload(2 * 65536, 4)
        ep.send(note, tag=31, timeout=TIMEOUT)
        # arrays both ways
        arr = ep.recv_array(timeout=TIMEOUT)
        assert arr.dtype == np.float32 and arr.shape == (300, 500), (
            arr.dtype,
            arr.shape,
        )
        ep.send_array(arr * 2, timeout=TIMEOUT)
        w.recv(note, tag=40, timeout=TIMEOUT)  # the user has everything
        put(["done", ep.transports, ep.remote_sockaddr])
        get()  # wait for the test before closing


def user(how: str, host: str) -> None:
    """The side that connects (by ``(host, port)`` or by worker address)
    and drives every transfer."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        _, where, token = get()
        if how == "listener":
            ep = w.connect((host, where))
        else:
            ep = w.connect(where)
            put(w.address)
        for i, n in enumerate((64, MIB)):
            ep.send(payload(n, i), tag=10 + i, timeout=TIMEOUT)
            back = np.empty(n, np.uint8)
            w.recv(back, tag=20 + i, timeout=TIMEOUT)
            assert np.array_equal(back, payload(n, i))
        ep.am_send(AM_ID, payload(MIB, 7), timeout=TIMEOUT)
        key = ep.unpack(token)
        ep.put(payload(65536, 3), key, offset=4096, timeout=TIMEOUT)
        ep.flush(timeout=TIMEOUT)
        note = np.zeros(1, np.uint8)
        ep.send(note, tag=30, timeout=TIMEOUT)
        w.recv(note, tag=31, timeout=TIMEOUT)
        out = np.empty(2 * 65536, np.uint8)
        ep.get(out, key, offset=0, timeout=TIMEOUT)
        assert np.array_equal(out, payload(2 * 65536, 4))
        arr = np.arange(300 * 500, dtype=np.float32).reshape(300, 500)
        ep.send_array(arr, timeout=TIMEOUT)
        back = ep.recv_array(timeout=TIMEOUT)
        assert np.array_equal(back, arr * 2)
        ep.send(note, tag=40, timeout=TIMEOUT)
        put(["done", ep.transports, ep.local_sockaddr])
        get()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
