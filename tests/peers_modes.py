"""Peer programs for tests/test_endpoint_modes.py (endpoint modes)."""

from __future__ import annotations

import numpy as np

import gpucx


def receiver_peer(chan, config=None):
    """A worker that sends its address, then receives on command:
    ``("recv", nbytes, tag)`` posts a receive of ``nbytes`` on ``tag`` and
    answers ``("got", nbytes)`` once it completed; ``"bye"`` ends.  It
    progresses all the while (UCX's shared-memory and CMA paths need the
    receiver to)."""
    with gpucx.Context(config=config) as ctx:
        w = ctx.create_worker()
        chan.put(w.address)
        reqs = []
        while True:
            w.progress()
            for req, n in list(reqs):
                if req.done():
                    reqs.remove((req, n))
                    chan.put(("got", req.result().nbytes))
            if not chan.poll(0.001):
                continue
            cmd = chan.get()
            if cmd == "bye":
                return
            _, nbytes, tag = cmd
            reqs.append((w.recv_nb(np.empty(nbytes, "u1"), tag), nbytes))
