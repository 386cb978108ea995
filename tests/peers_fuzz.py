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
                ep, _am.ARRAY_AM_ID, bytes(nbytes), header, _am._flags(True, proto)
            )
            req.wait(30)
        ep.send_array(np.arange(1000, dtype=np.float64))
        assert chan.get(60) == "done"
        ep.close()
