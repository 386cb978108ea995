"""Peer programs for the gpucx:// Dask comm tests (spawned processes)."""

from __future__ import annotations

import asyncio


def comm_server(tls, ch, mode):
    """Listen on gpucx://; tell the port; then, per ``mode``:

    - ``"silent"``: accept one comm and never answer (the test kills us);
    - ``"stream"``: start writing 64 MiB messages forever (killed mid-way);
    - ``"burst-close"``: write 20 messages (small and 2 MiB), close the comm
      and live on;
    - ``"write-pending"``: start writing one 64 MiB message and wait (the
      test reads it or kills us).
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
            if mode == "write-pending":
                big = np.ones(64 << 20, "u1")
                asyncio.ensure_future(comm.write({"x": to_serialize(big)}))
            if mode == "burst-close":
                for i in range(20):
                    x = np.full(2 << 20 if i % 2 else 10, i, "u1")
                    await comm.write({"i": i, "x": to_serialize(x)})
                await comm.close()
            await asyncio.sleep(3600)

        async with listen("gpucx://127.0.0.1:0", handle) as lst:
            ch.put(("address", lst.contact_address))
            await accepted.wait()
            ch.put(("accepted", None))
            await asyncio.sleep(3600)

    with dask.config.set({"distributed-gpucx.tls": tls}):
        asyncio.run(main())


#: Sizes the fake device allocator was asked for (test double for CuPy/RMM).
FAKE_DEVICE_CALLS: list = []


def fake_device_buffer(nbytes):
    """A device-allocator stand-in for a missing GPU: host memory posing as
    CUDA memory through ``__cuda_array_interface__`` (tests/fakegpu.py)."""
    import numpy as np

    from fakegpu import FakeCudaArrayV3

    FAKE_DEVICE_CALLS.append(nbytes)
    return FakeCudaArrayV3(np.empty(nbytes, "u1"))
