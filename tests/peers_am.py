"""Peer programs for the two-process AM, stream and array tests."""

from __future__ import annotations

import contextlib

import numpy as np

import gpucx

from conftest import transport_config

#: AM ids of the echo protocol: the client sends to ECHO, the peer answers
#: to BACK with the same header and payload.
ECHO, BACK = 1, 2


def _connect(w, q, via_listener):
    if via_listener:
        lst = w.listen(host="127.0.0.1")
        q.put(("port", lst.port))
        return lst.accept(timeout=30)
    q.put(("address", w.address))
    return w.connect(q.get())


def am_echo_peer(tls, q, via_listener):
    """Echo active messages (through their reply endpoint), stream bytes and
    arrays back to the client, on command, until told "bye"."""
    with gpucx.Context(config=transport_config(tls, via_listener)) as ctx:
        w = ctx.create_worker()
        ep = _connect(w, q, via_listener)
        inbox = []
        # The handler only queues: receiving and replying happen below,
        # outside the handler (handlers do not nest progress).
        w.set_am_handler(ECHO, inbox.append)
        conn = q._conn
        while True:
            w.progress()
            while inbox:
                msg = inbox.pop(0)
                buf = np.empty(msg.nbytes, np.uint8)
                msg.receive_into(buf).wait(60)
                proto = "rndv" if msg.is_rndv else None
                msg.reply_ep.am_send(BACK, buf, header=msg.header, proto=proto)
            if not conn.poll(0):
                continue
            cmd, arg = q.get()
            if cmd == "stream":
                buf = np.empty(arg, np.uint8)
                ep.stream_recv(buf, timeout=60)
                ep.stream_send(buf)
            elif cmd == "arrays":
                for _ in range(arg):
                    ep.send_array(ep.recv_array(timeout=60))
            elif cmd == "bye":
                q.put(("done", ep.transports))
                q.get()
                return


def array_sender_peer(tls, q, sends):
    """Send one array of ``nbytes`` per ``(nbytes, proto)`` in ``sends`` to
    the client, in order, then report what each blocking send returned
    ("ok" or the exception) and wait for "bye"."""
    with gpucx.Context(config=transport_config(tls, True)) as ctx:
        w = ctx.create_worker()
        lst = w.listen(host="127.0.0.1")
        q.put(("port", lst.port))
        ep = lst.accept(timeout=30)
        seen = []
        for i, (nbytes, proto) in enumerate(sends):
            arr = np.full(nbytes, i, np.uint8)
            try:
                ep.send_array(arr, proto=proto)
                seen.append("ok")
            except gpucx.UCXError as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
        q.put(("sent", seen))
        assert q.get(60) == "bye"


def nested_reply_peer(tls, q):
    """Send an AM that asks for a reply, wait for the reply, then send a tag
    message: the client receives it with a blocking recv whose wait runs the
    AM handler, which replies with a blocking send of its own."""
    import time

    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        q.put(w.address)
        ep = w.connect(q.get())
        got = []
        w.set_am_handler(4, got.append)
        time.sleep(0.2)  # the client is asleep in its blocking recv by now
        ep.am_send(3, b"ping", reply=True)
        end = time.monotonic() + 30
        while not got:
            w.progress()
            assert time.monotonic() < end, "no reply"
        assert bytes(got[0].data) == b"pong"
        time.sleep(0.2)
        ep.send(np.arange(4096, dtype=np.uint8), tag=7)
        assert q.get() == "bye"
        ep.close()


def am_burst_peer(tls, q, sizes):
    """Send one active message (id 11) per size in ``sizes``, byte value
    ``i % 251 + 1`` for the i-th, then wait for "bye"."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        q.put(w.address)
        ep = w.connect(q.get())
        assert q.get() == "go"
        reqs = [
            ep.am_send_nb(11, np.full(n, i % 251 + 1, np.uint8))
            for i, n in enumerate(sizes)
        ]
        for r in reqs:
            r.wait(60)
        assert q.get() == "bye"
        ep.close()


@contextlib.contextmanager
def burst_receiver(tls, sizes):
    """A worker here, connected to an :func:`am_burst_peer` process that
    sends ``sizes``: yields ``(worker, endpoint, channel)``; put "go" on the
    channel to start the burst.  On exit the peer is told "bye" and joined.
    """
    from conftest import channel_pair, join_ok, spawn

    q, theirs = channel_pair()
    child = spawn(am_burst_peer, tls, theirs, sizes)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)
            yield w, ep, q
            q.put("bye")
            ep.close()
    finally:
        join_ok(child, 60)
