"""Peer programs for the gpucx:// Dask comm tests (spawned processes)."""

from __future__ import annotations

import asyncio
import time


def comm_server(tls, ch, mode):
    """Listen on gpucx://; tell the port; then, per ``mode``:

    - ``"silent"``: accept one comm and never answer (the test kills us);
    - ``"stream"``: start writing 64 MiB messages forever (killed mid-way).
    """
    import dask.config
    import numpy as np
    from distributed.comm import listen
    from distributed.protocol import to_serialize

    async def main():
        accepted = asyncio.Event()

        async def handle(comm):
            accepted.set()
            if mode == "stream":
                big = np.ones(64 << 20, "u1")
                while True:
                    await comm.write({"x": to_serialize(big)})
            await asyncio.sleep(3600)

        async with listen("gpucx://127.0.0.1:0", handle) as lst:
            ch.put(("address", lst.contact_address))
            await accepted.wait()
            ch.put(("accepted", None))
            await asyncio.sleep(3600)

    with dask.config.set({"distributed-gpucx.tls": tls}):
        asyncio.run(main())


def sleeper():
    time.sleep(3600)
