"""Flooding peers for tests/test_flood.py (run in spawned processes)."""

from __future__ import annotations

import numpy as np

import gpucx
from gpucx._lib import lib
from gpucx.ops import am as _am
from gpucx.ops import rma as _rma

from conftest import transport_config

#: The AM id the receiver uses once with a posted receive, then ignores.
FLOOD_AM_ID = 77
#: The tag of the message sent after the flood.
AFTER_TAG = 99
_WINDOW = 256


def flood(chan, tls, kind, n, size):
    """Send ``n`` messages of ``size`` bytes of ``kind`` ("am", "notify",
    "arrays"), all eagerly, then a tag message; wait for "bye"."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        chan.put(w.address)
        ep = w.connect(chan.get())
        payload = np.ones(size, np.uint8)
        eager = lib.GPUCX_AM_SEND_EAGER
        window = []
        for _ in range(n):
            if kind == "am":
                r = ep.am_send_nb(FLOOD_AM_ID, payload, proto="eager")
            elif kind == "notify":
                # What any peer may send to the reserved notification id.
                r = _am._send_nb(ep, _rma.NOTIFY_AM_ID, payload, b"", eager)
            else:
                r = ep.send_array_nb(payload, proto="eager")
            window.append(r)
            if len(window) == _WINDOW:
                for r in window:
                    r.wait(60)
                window.clear()
        for r in window:
            r.wait(60)
        ep.send(b"after the flood", tag=AFTER_TAG)
        chan.put("flooded")
        assert chan.get(120) == "bye"
