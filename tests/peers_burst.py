"""Sender processes for the burst test."""

from __future__ import annotations

import numpy as np

import gpucx

WINDOW = 64


def burst_sender(ch, sender_id, count):
    """Send ``count`` messages (sender id, sequence) with tag = sender id,
    non-blocking with a window of outstanding requests."""
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(ch.get())
        pending = []
        for seq in range(count):
            msg = np.array([sender_id, seq] + [seq * 7 + sender_id] * 14, np.int64)
            pending.append(ep.send_nb(msg, tag=sender_id))
            if len(pending) >= WINDOW:
                pending.pop(0).wait(30)
        for r in pending:
            r.wait(30)
        ep.flush(timeout=30)
        ch.put("sent")
        ch.get()  # stay until the receiver has everything
