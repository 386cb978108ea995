"""Peer programs of the GPU suite (tests/test_cuda.py), run in spawned
children.  CuPy is imported inside each function, so that this module
imports on machines without it."""

from __future__ import annotations

import gpucx


def pattern(cupy, nbytes: int, seed: int = 0):
    """Deterministic bytes on the current device: (i * 7 + seed) % 251."""
    i = cupy.arange(nbytes, dtype=cupy.uint64)
    return ((i * 7 + seed) % 251).astype(cupy.uint8)


def cuda_echo(cfg, ch, sizes, device):
    """Receive each size into a CuPy buffer by tag, check it, echo it back."""
    import cupy

    with cupy.cuda.Device(device), gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        ch.put(w.address)
        ep = w.connect(ch.get())
        bad = []
        for k, n in enumerate(sizes):
            buf = cupy.zeros(n, cupy.uint8)
            info = w.recv(buf, tag=k, timeout=60)
            want = pattern(cupy, n, k)
            if info.nbytes != n or not bool((buf == want).all()):
                bad.append((n, int((buf != want).sum())))
            ep.send(buf, tag=k | 1 << 32)
        ch.put(("checked", bad, ep.transports))
        ch.get()


def array_echo(cfg, ch, count, device):
    """recv_array ``count`` arrays (CUDA data -> CuPy), send each back."""
    import cupy

    with cupy.cuda.Device(device), gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        ch.put(w.address)
        ep = w.connect(ch.get())
        kinds = []
        for _ in range(count):
            arr = ep.recv_array(timeout=60)
            kinds.append((type(arr).__module__.split(".")[0], arr.device.id))
            ep.send_array(arr)
        ch.put(("kinds", kinds))
        ch.get()


def cuda_region_owner(cfg, ch, nbytes, device):
    """Allocate a CUDA region, fill it, publish its key; after the peer's
    put-with-notify, report the region's bytes (as host bytes)."""
    import cupy

    with cupy.cuda.Device(device), gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        region = ctx.allocate(nbytes, gpucx.MemoryType.CUDA, device=device)
        view = region.as_array()
        view[:] = pattern(cupy, nbytes, 3)
        cupy.cuda.runtime.deviceSynchronize()
        ch.put((w.address, region.remote().to_bytes(), type(view).__module__))
        ep = w.connect(ch.get())
        notes = []
        while not notes:
            notes = w.notifications(timeout=60)
        ch.put(("region", notes[0][1], cupy.asnumpy(view).tobytes()))
        ch.get()
        del ep


def cuda_am_posted(cfg, ch, sizes, device):
    """Posted AM receives into CuPy buffers: one group for ``sizes`` (posted
    before the peer sends), then a single receive posted after an eager
    message was kept.  Reports the sizes and the mismatching byte counts."""
    import time

    import cupy

    with cupy.cuda.Device(device), gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        ch.put(w.address)
        w.connect(ch.get())
        bufs = [cupy.zeros(n, cupy.uint8) for n in sizes]
        req = w.am_recv_many_nb(40, bufs)
        ch.put("posted")
        got = req.wait(60)
        bad = [
            int((b != pattern(cupy, n, k)).sum())
            for k, (b, n) in enumerate(zip(bufs, sizes, strict=True))
        ]
        ch.put(("group", got, bad))
        assert ch.get() == "sent"
        t_end = time.monotonic() + 0.5
        while time.monotonic() < t_end:  # the message arrives and is kept
            w.progress()
        kept = cupy.zeros(100, cupy.uint8)
        n = w.am_recv(40, kept, timeout=60)
        ch.put(("kept", n, int((kept != pattern(cupy, 100, 9)).sum())))
        ch.get()


def cuda_ipc_owner(cfg, ch, nbytes, device):
    """Allocate and fill a CUDA region, publish its token, then wait on the
    channel without progressing the worker (gpucx's own CUDA IPC path is
    one-sided); on "read" report the region's bytes, then say goodbye."""
    import cupy

    with cupy.cuda.Device(device), gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        region = ctx.allocate(nbytes, gpucx.MemoryType.CUDA, device=device)
        view = region.as_array()
        view[:] = pattern(cupy, nbytes, 3)
        cupy.cuda.runtime.deviceSynchronize()
        ch.put((w.address, region.remote().to_bytes()))
        assert ch.get() == "read"  # no progress meanwhile
        ch.put(cupy.asnumpy(view).tobytes())
        assert ch.get() == "bye"
        region.close()
