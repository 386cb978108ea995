"""Child program for the view-lifetime tests: a read of freed memory may
crash, so each case runs in its own process and prints "ok" at the end."""

from __future__ import annotations

import gc
import sys

import numpy as np

import gpucx

N = 8 << 20  # large enough that freed memory goes back to the OS


def allocated() -> None:
    ctx = gpucx.Context()
    region = ctx.allocate(N)
    v = region.as_array(np.uint64)
    v[:] = 7
    tail = v[-16:]  # a view of the view
    region.close()
    assert (v == 7).all()  # still mapped: the view holds it
    v[:] = 9
    del v
    gc.collect()
    assert (tail == 9).all()
    ctx.close()  # the cleanup waits for the last view too
    assert ctx._cleanup_deferred
    tail[:] = 3
    assert (tail == 3).all()
    del tail
    gc.collect()
    assert not ctx._cleanup_deferred and ctx._deferred_maps == 0
    print("ok")


def registered() -> None:
    ctx = gpucx.Context()
    obj = np.full(N // 8, 5, np.uint64)
    region = ctx.register(obj)
    v = region.as_array(np.uint64)
    del obj
    region.close()
    ctx.close()
    gc.collect()
    assert (v == 5).all()  # the registered object lives on in the view
    v[:] = 6
    assert (v == 6).all()
    print("ok")


if __name__ == "__main__":
    {"allocated": allocated, "registered": registered}[sys.argv[1]]()
