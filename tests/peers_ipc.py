"""Peer programs for gpucx's own same-host path (tests/test_cuda_ipc_rma.py).

Test doubles only: the CUDA driver is tests/fakecuda/libcuda_fake.c, whose
"device" allocations are POSIX shared-memory objects that its IPC handles
name, so another process's cuIpcOpenMemHandle maps the same bytes.  UCX
here cannot map CUDA memory: the owner registers the allocation with UCX
as host memory (what UCX serves when gpucx falls back) and relabels the
region CUDA, so that its token carries a CUDA IPC handle.
"""

from __future__ import annotations

import ctypes

import numpy as np

import gpucx
from gpucx.mem import cuda as gcuda

from conftest import transport_config

#: Bytes before the region in the owner's allocation (the token's offset).
LEAD = 4096


def fake_driver(lib_path: str):
    """Load the fake libcuda as gpucx's driver, device 0's context current."""
    drv = gcuda.Driver.load(lib_path)
    drv._lib.fake_reset()
    gcuda.set_driver(drv)
    drv.set_current(drv.primary_context(0))
    return drv


def device_array(drv, nbytes: int):
    """``(address, NumPy view)`` of a fresh fake device allocation."""
    base = drv.mem_alloc(nbytes)
    mem = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(base))
    return base, mem


def cuda_region(ctx, drv, nbytes: int):
    """A region of ``nbytes`` at LEAD in a fake device allocation, relabelled
    CUDA (see the module doc): ``(region, view)``."""
    _base, mem = device_array(drv, nbytes + LEAD + 64)
    mem[:] = 0
    view = mem[LEAD : LEAD + nbytes]
    region = ctx.register(view)
    region.memory_type = gpucx.MemoryType.CUDA
    return region, view


def owner(lib_path, chan, nbytes, tls="shm"):
    """Export a CUDA region; answer commands.

    Between commands it progresses its worker, except after ("hold",):
    then it blocks on the channel without progressing until the next
    command (one-sided operations must complete meanwhile).

    Commands: ("read", offset, n) -> ("data", bytes); ("write", offset,
    bytes) -> ("written",); ("notes", count) -> ("notes", [(notify,
    region bytes when it arrived)]); ("hold",); ("bye",).
    """
    drv = fake_driver(lib_path)
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        region, mem = cuda_region(ctx, drv, nbytes)
        chan.put(("hello", w.address, region.remote().to_bytes()))
        hold = False
        while True:
            if not hold:
                while not chan.poll(0):
                    w.progress()
            cmd = chan.get(60)
            hold = False
            if cmd[0] == "read":
                _, offset, n = cmd
                chan.put(("data", bytes(mem[offset : offset + n])))
            elif cmd[0] == "write":
                _, offset, data = cmd
                mem[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
                chan.put(("written",))
            elif cmd[0] == "notes":
                _, count = cmd
                seen: list = []
                while len(seen) < count:
                    for _ep, note in w.notifications(timeout=30):
                        seen.append((note, bytes(mem)))
                chan.put(("notes", seen))
            elif cmd[0] == "hold":
                hold = True
            elif cmd[0] == "bye":
                break
        region.close()
