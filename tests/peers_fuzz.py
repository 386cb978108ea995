"""Peer programs for the fuzz tests: a hostile sender of array messages."""

from __future__ import annotations

import numpy as np

import gpucx
from gpucx.ops import am as _am

from conftest import transport_config


def hostile_array_peer(tls, chan, messages):
    """Connect to the test's worker, send each ``(header, nbytes, proto)`` as
    a raw message on the arrays AM id, then one well-formed array; wait for
    "done"."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        ep = w.connect(chan.get(30))
        chan.put(w.address)
        for header, nbytes, proto in messages:
            req = _am._send_nb(
                ep, _am.ARRAY_AM_ID, bytes(nbytes), header, _am.send_flags(True, proto)
            )
            req.wait(30)
        ep.send_array(np.arange(1000, dtype=np.float64))
        assert chan.get(60) == "done"
        ep.close()


def rma_owner_peer(tls, features, chan):
    """A worker of a context with ``features`` and an unexported array:
    send our address and the array's address, progress until asked, then
    report the sum of the array's first 64 bytes."""
    feats = None if features is None else set(features)
    with gpucx.Context(features=feats, config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        secret = np.zeros(4096, np.uint8)
        chan.put((w.address, secret.ctypes.data))
        while not chan._conn.poll(0):
            w.progress()
        assert chan.get(1) == "report"
        chan.put(int(secret[:64].sum()))
        assert chan.get(60) == "done"
