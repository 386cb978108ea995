"""Peer programs for the two-process RMA and atomic tests."""

from __future__ import annotations

import numpy as np

import gpucx

from conftest import transport_config


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def serve(w, chan):
    """Progress ``w`` (the target of one-sided operations over TCP needs to)
    until the peer says something on ``chan``; return it."""
    while not chan._conn.poll(0):
        w.progress()
    return chan.get(5)


def owner(tls, chan, nbytes, allocate):
    """Export a region; verify on request, on this side, what peers wrote.

    Commands: ("verify", offset, bytes) -> ("verified", equal),
    ("notified", count, seeds) -> wait for ``count`` notifications, check
    the region equals pattern(seed) when each arrives -> ("notes", [...]),
    ("read", offset, n) -> ("data", bytes), ("bye",).
    """
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        if allocate == "view":
            # Registered memory inside an allocated region: shares its keys.
            whole = ctx.allocate(nbytes + 8192)
            mem = whole.as_array(np.uint8)[4096 : 4096 + nbytes]
            mem[:] = 0
            region = ctx.register(mem)
        elif allocate:
            region = ctx.allocate(nbytes)
            mem = region.as_array(np.uint8)
            mem[:] = 0
        else:
            mem = np.zeros(nbytes, np.uint8)
            region = ctx.register(mem)
        chan.put(("hello", w.address, region.remote().to_bytes()))
        kind, peer_address = chan.get(60)
        ep = w.connect(peer_address)
        while True:
            cmd = serve(w, chan)
            if cmd[0] == "verify":
                _, offset, data = cmd
                got = bytes(mem[offset : offset + len(data)])
                chan.put(("verified", got == data))
            elif cmd[0] == "read":
                _, offset, n = cmd
                chan.put(("data", bytes(mem[offset : offset + n])))
            elif cmd[0] == "notified":
                _, seeds = cmd
                result = []
                for seed in seeds:
                    notes = []
                    while not notes:
                        notes = w.notifications(timeout=30)
                    # The data must be in place when the notification is.
                    (nep, note), *rest = notes
                    assert not rest, notes
                    ok = np.array_equal(mem, pattern(seed, nbytes))
                    result.append((note, ok, nep is ep))
                    chan.put(("ack", seed))
                chan.put(("notes", result))
            elif cmd[0] == "bye":
                break
        ep.close(force=True)
        region.close()


def adder(tls, chan, n_ops, nbytes):
    """Connect to the owner in the main process and fetch_add 1, n_ops times."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        address, blob = chan.get(60)
        ep = w.connect(address, error_handling=False)
        key = ep.unpack(blob)
        olds = []
        for i in range(n_ops):
            if i % 2:
                olds.append(ep.fetch_add(key, 1, nbytes=nbytes))
            else:
                olds.append(ep.fetch_add_nb(key, 1, nbytes=nbytes).wait(30))
        ep.flush()
        chan.put(("done", olds))
        chan.get(60)
        key.close()
        ep.close(force=True)


def adder_default(tls, chan, n_ops, nbytes):
    """As :func:`adder`, on a default endpoint (peer error handling: gpucx
    emulates the atomics): a fifth blocking fetch_add, the rest
    fetch_add_nb in windows of 64."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        address, blob = chan.get(60)
        ep = w.connect(address)
        key = ep.unpack(blob)
        olds = [ep.fetch_add(key, 1, nbytes=nbytes) for _ in range(n_ops // 5)]
        left = n_ops - n_ops // 5
        while left:
            reqs = [
                ep.fetch_add_nb(key, 1, nbytes=nbytes) for _ in range(min(64, left))
            ]
            olds += [r.wait(30) for r in reqs]
            left -= len(reqs)
        chan.put(("done", olds))
        chan.get(60)
        key.close()
        ep.close(force=True)


def idle_owner(tls, chan):
    """Export a counter, then never progress (and wait to be killed)."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        mem = np.zeros(1, np.uint64)
        region = ctx.register(mem)
        chan.put(("hello", w.address, region.remote().to_bytes()))
        chan.get(120)  # killed before anything comes
