"""Peer programs for the two-process tests of the bench C loops."""

from __future__ import annotations

import numpy as np

import gpucx
from gpucx._lib import ffi, lib
from gpucx.bench.session import ACK_TAG, DATA_TAG

from conftest import transport_config


def c_loop_peer(tls, q, test, size, iters, window):
    """Run the responder half of ``test`` ("stream" or "pingpong") with the C
    loops; report the status and the first bytes received."""
    with gpucx.Context(config=transport_config(tls)) as ctx:
        w = ctx.create_worker()
        q.put(w.address)
        ep = w.connect(q.get())
        buf = np.zeros(size, np.uint8)
        out = ffi.new("uint64_t *")
        ptr = ffi.from_buffer(buf)
        mt = int(gpucx.MemoryType.HOST)
        slots = ffi.new("gpucx_slot_t[]", window + 1)
        ack = ffi.new("uint64_t *")
        if test == "stream":
            st = lib.gpucx_bench_tag_stream(
                w._h,
                ep._h,
                0,
                ptr,
                size,
                mt,
                DATA_TAG,
                ACK_TAG,
                iters,
                window,
                30 * 10**9,
                slots,
                ack,
                out,
            )
        else:
            sbuf = np.full(size, 7, np.uint8)
            st = lib.gpucx_bench_tag_pingpong(
                w._h,
                ep._h,
                0,
                ffi.from_buffer(sbuf),
                mt,
                ptr,
                mt,
                size,
                DATA_TAG,
                iters,
                30 * 10**9,
                slots,
                ffi.NULL,
                out,
            )
        q.put((st, bytes(buf[:16]), out[0]))
        q.get()
