"""Peer programs run in spawned child processes by the two-process tests."""

from __future__ import annotations

import os
import signal

import numpy as np

import gpucx

from conftest import transport_config


def echo_server(tls, q, n_messages, via_listener):
    """Receive ``n_messages`` (tag i) and echo each back with tag i | 1<<32."""
    with gpucx.Context(config=transport_config(tls, via_listener)) as ctx:
        w = ctx.create_worker()
        if via_listener:
            lst = w.listen(host="127.0.0.1")
            q.put(("port", lst.port))
            ep = lst.accept(timeout=30)
        else:
            q.put(("address", w.address))
            ep = w.connect(q.get())
        for i in range(n_messages):
            probe = None
            while probe is None:
                probe = w.probe(tag=i)
            buf = np.empty(probe.nbytes, np.uint8)
            w.recv(buf, tag=i, timeout=30)
            ep.send(buf, tag=i | 1 << 32)
        # Every echo was received by the client before it asks for "done", so
        # no flush is needed (a flush here would wait for the client, which
        # is blocked on the queue, not progressing its worker).
        q.put(("done", ep.transports))
        q.get()  # wait for the client to finish before closing


def die_before_receiving(q):
    """Connect back, then die without receiving anything."""
    ctx = gpucx.Context()
    w = ctx.create_worker()
    q.put(w.address)
    ep = w.connect(q.get())
    ep.send(b"ready", tag=1)
    q.get()
    os.kill(os.getpid(), signal.SIGKILL)


def connect_then_die(tls, chan, progress=False):
    """Connect back, then die when told, without answering; with
    ``progress``, progress meanwhile (messages arrive, none is received)."""
    ctx = gpucx.Context(config=transport_config(tls))
    w = ctx.create_worker()
    chan.put(w.address)
    w.connect(chan.get())
    while progress and not chan.poll(0.001):
        w.progress()
    chan.get()
    os.kill(os.getpid(), signal.SIGKILL)
