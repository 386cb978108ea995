"""Peer programs for the asyncio tests (run in spawned processes)."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np

import gpucx
import gpucx.aio


def aio_echo_server(ch, n):
    async def main():
        with gpucx.Context(config={"TLS": "tcp"}) as ctx:
            async with gpucx.aio.Worker(ctx) as w:
                w.listen(host="127.0.0.1")
                ch.put(w._listeners[0].port)
                ep = await w.aaccept(timeout=30)
                for i in range(n):
                    buf = np.empty(1024, np.int64)
                    await w.arecv(buf, tag=i)
                    await ep.asend(buf * 2, tag=i)
                await asyncio.to_thread(ch.get)

    asyncio.run(main())


def aio_die_after_connect(ch):
    async def main():
        ctx = gpucx.Context(config={"TLS": "tcp"})
        w = gpucx.aio.Worker(ctx)
        w.listen(host="127.0.0.1")
        ch.put(w._listeners[0].port)
        ep = await w.aaccept(timeout=30)  # keep it: a dropped endpoint closes
        # Wait without blocking the loop: the connection still needs progress.
        await asyncio.to_thread(ch.get)
        os.kill(os.getpid(), signal.SIGKILL)
        del ep

    asyncio.run(main())


def aio_peer_to_kill(tls, via, ch):
    """Hand out a worker address (or a listener port), take a message from
    the test, then wait to be killed while progressing."""
    from conftest import transport_config

    async def main():
        ctx = gpucx.Context(config=transport_config(tls, listener=via == "listener"))
        w = gpucx.aio.Worker(ctx)
        if via == "listener":
            w.listen(host="127.0.0.1")
            ch.put(w._listeners[0].port)
            eps = [await w.aaccept(timeout=30)]  # kept until the end
        else:
            ch.put(w.address)
            eps = []
        await w.arecv(bytearray(5), tag=7)
        await asyncio.to_thread(ch.get)
        os.kill(os.getpid(), signal.SIGKILL)
        del eps

    asyncio.run(main())
