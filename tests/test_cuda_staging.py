"""GPU suite (marker ``cuda``): receiver-side staging of host arrays into
device memory, and posted array receives, on a real GPU with CuPy.

Skipped without an NVIDIA GPU and CuPy (conftest); on a GPU machine it runs
as is (``python -m pytest -q -m cuda tests/test_cuda_staging.py``).  The
sender is a plain host process sending NumPy arrays; the receiver's
allocator returns CuPy memory, so the arrays take the staging path
(gpucx.ops._staging).  The same logic without a GPU: tests/test_staging.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpucx

from conftest import channel_pair, join_ok, spawn

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

CUDA_TLS = {
    "default": None,
    "ipc": {"TLS": "cuda_copy,cuda_ipc,sm,self,tcp"},
    "tcp-staged": {"TLS": "tcp,cuda_copy,self"},
}
SIZES = [8, 5000, 1 << 16, 1 << 20, 64 << 20]


@pytest.fixture(scope="module")
def cupy():
    import cupy

    return cupy


@pytest.fixture(params=sorted(CUDA_TLS))
def cuda_cfg(request):
    return CUDA_TLS[request.param]


def host_pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 7 + seed) % 251).astype(np.uint8)


def _host_sender(cfg, chan, sizes) -> None:
    """A host process: send NumPy arrays (pageable memory), wait for bye."""
    with gpucx.Context(config=cfg) as ctx:
        w = ctx.create_worker()
        chan.put(w.address)
        ep = w.connect(chan.get(60))
        for i, n in enumerate(sizes):
            ep.send_array(host_pattern(n, i), timeout=120)
        while chan.get(120) != "bye":
            pass


def _receive(cupy, cfg, sizes, *, window=0, stream=None, staging=None):
    """Receive ``sizes`` from a host sender into CuPy memory; return the
    arrays (as host bytes) and the pool's figures."""
    q, theirs = channel_pair()
    child = spawn(_host_sender, cfg, theirs, sizes)
    config = dict(cfg or {})
    if staging is not None:
        config["GPUCX_STAGING_BYTES"] = staging
    try:
        with gpucx.Context(config=config) as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)

            def allocator(nbytes, memory_type):
                assert memory_type == gpucx.MemoryType.HOST
                return cupy.full(nbytes, 0xEE, cupy.uint8)

            got = []
            if window:
                posted = [ep.recv_array_nb(allocator, stream=stream) for _ in sizes]
                got = [r.wait(120) for r in posted]
            else:
                for _ in sizes:
                    got.append(ep.recv_array(120, allocator, stream=stream))
            out = [cupy.asnumpy(g) for g in got]
            pool = w._engine.am.staging
            figures = None if pool is None else (pool.allocs, pool.lent, pool.total)
            q.put("bye")
    finally:
        join_ok(child, 120)
    return out, figures


def test_staging_host_arrays_into_cupy(cupy, cuda_cfg):
    out, (allocs, lent, total) = _receive(cupy, cuda_cfg, SIZES)
    for i, (n, a) in enumerate(zip(SIZES, out, strict=True)):
        assert a.tobytes() == host_pattern(n, i).tobytes(), f"array {i} ({n} B)"
    assert lent == 0
    # Growing sizes: one buffer per new size class, never more than the cap.
    assert allocs <= len(SIZES) and total <= 256 << 20


def test_staging_posted_receives_into_cupy(cupy, cuda_cfg):
    sizes = [1 << 20] * 8 + [5000] * 8
    out, (allocs, lent, _total) = _receive(cupy, cuda_cfg, sizes, window=True)
    for i, (n, a) in enumerate(zip(sizes, out, strict=True)):
        assert a.tobytes() == host_pattern(n, i).tobytes(), f"array {i}"
    assert lent == 0 and allocs <= len(sizes)


def test_staging_off_is_ucx_direct_and_correct(cupy):
    cfg = CUDA_TLS["ipc"]
    out, figures = _receive(cupy, cfg, SIZES[:4], staging=0)
    for i, (n, a) in enumerate(zip(SIZES[:4], out, strict=True)):
        assert a.tobytes() == host_pattern(n, i).tobytes()
    assert figures is not None and figures[0] == 0  # no buffer made


def test_staging_with_a_stream_is_visible_to_its_kernels(cupy):
    s = cupy.cuda.Stream(non_blocking=True)
    n = 1 << 22
    q, theirs = channel_pair()
    child = spawn(_host_sender, None, theirs, [n])
    try:
        with gpucx.Context() as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)
            with s:
                dst = cupy.zeros(n, cupy.uint8)
                dst += 1  # queued on s: the copy must come after it
            out = ep.recv_array(120, lambda nbytes, mt: dst[:nbytes], stream=s)
            with s:
                total = int(out.astype(cupy.uint64).sum())
            q.put("bye")
    finally:
        join_ok(child, 120)
    assert total == int(host_pattern(n, 0).astype(np.uint64).sum())


def test_staging_pool_freed_at_close(cupy):
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab, ba = a.connect(b.address), b.connect(a.address)
        req = ba.recv_array_nb(lambda n, mt: cupy.empty(n, cupy.uint8))
        send = ab.send_array_nb(host_pattern(1 << 20, 3))
        while not (req.done() and send.done()):
            a.progress()
        assert (
            cupy.asnumpy(req.result()).tobytes() == host_pattern(1 << 20, 3).tobytes()
        )
        pool = b._engine.am.staging
        assert pool.allocs == 1 and pool.total == 1 << 20
        b.close()
        assert pool.closed and pool.total == 0
