"""Buffers for the benchmark: host memory (a NumPy array, the same
registered with the context, or memory mapped by UCX as ``ucx_perftest``
uses) or CUDA (CuPy) memory."""

from __future__ import annotations

import numpy

from .errors import BenchSetupError  # defined there; importable here too

__all__ = ["MEMORY_KINDS", "BenchSetupError", "parse_memory", "cuda_problem", "alloc"]

#: ``host``: NumPy arrays (huge pages from 4 MiB on, where the kernel
#: allows); ``ucx``: host memory mapped by UCX (``Context.allocate``), the
#: kind ``ucx_perftest`` uses; ``reg``: a NumPy array registered with the
#: context (``Context.register``; where CUDA is initialised in the process,
#: UCX's ``cuda_copy`` pins it with ``cuMemHostRegister``); ``cuda``: CuPy
#: arrays.
MEMORY_KINDS = ("host", "ucx", "reg", "cuda")

#: Regions behind ``ucx`` buffers: NumPy views do not keep a region alive,
#: so they are held here (dropped once their context closed).
_MAPPED: list = []


def parse_memory(text: str) -> tuple[str, str]:
    """``"host"`` -> (host, host); ``"host:cuda"`` -> (client, server) kinds.

    Raises
    ------
    BenchSetupError
        For a kind other than ``host``, ``ucx``, ``reg`` or ``cuda``, or more
        than two.
    """
    parts = [p.strip().lower() for p in text.split(":")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in MEMORY_KINDS for p in parts):
        raise BenchSetupError(
            f"bad --memory {text!r}: use host, ucx, reg, cuda, or CLIENT:SERVER "
            "such as host:cuda"
        )
    return parts[0], parts[1]


def cuda_problem(device: int = 0) -> str | None:
    """Why CUDA buffers cannot be made or moved here, or None when they can."""
    import gpucx

    with gpucx.Context() as ctx:
        problem = ctx.cuda_problem
    if problem is not None:
        return f"--memory cuda: gpucx.UnsupportedError: {problem}"
    try:
        import cupy
    except Exception:  # missing, or broken on import (no driver): no CuPy
        return "--memory cuda needs CuPy (pip install 'gpucx[cuda12]') and a GPU"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"--memory cuda: no usable CUDA GPU here ({exc})".replace("\n", " ")
    if count < 1:
        return "--memory cuda: no CUDA GPU found"
    if not 0 <= device < count:
        return f"--device {device}: this host has {count} CUDA GPU(s)"
    return None


def _cuda_current(ctx, device: int) -> None:
    """Make ``device``'s CUDA context current in this thread where this host
    can move CUDA memory: UCX's ``cuda_copy`` pins the host memory mapped or
    registered afterwards only then."""
    if ctx.cuda_available and cuda_problem(device) is None:
        import cupy

        cupy.cuda.Device(device).use()
        cupy.empty(1, cupy.uint8)


def alloc(
    kind: str, nbytes: int, device: int = 0, fill: int = 0, ctx=None, gpu_peer=False
):
    """A contiguous ``uint8`` array of ``nbytes`` in ``kind`` memory.

    For ``ucx`` memory, ``ctx`` (a :class:`gpucx.Context`) maps it; for
    ``reg`` memory it registers a NumPy array, with ``device``'s CUDA context
    initialised first when this host can move CUDA memory (so that UCX pins
    it); either region stays until the context closes.  ``gpu_peer``: the
    other side's memory is CUDA memory; ``ucx`` memory is then mapped with
    the CUDA context current too, as ``ucx_perftest`` maps its host memory
    in a process that initialised CUDA for the other buffer (UCX pins it:
    host-to-GPU tag runs at the bus's speed rather than about 1 GB/s).

    Raises
    ------
    BenchSetupError
        If CUDA is asked for and unavailable, or ``ucx`` memory without
        ``ctx``.
    """
    if kind not in MEMORY_KINDS:
        raise BenchSetupError(f"bad --memory kind {kind!r}: use host, ucx, reg or cuda")
    if kind == "host":
        arr = numpy.empty(max(nbytes, 1), numpy.uint8)[:nbytes]
        arr.fill(fill)
        return arr
    if kind in ("ucx", "reg"):
        if ctx is None:
            raise BenchSetupError(f"--memory {kind}: no gpucx.Context to map it with")
        if kind == "ucx":
            if gpu_peer:
                _cuda_current(ctx, device)
            region = ctx.allocate(max(nbytes, 1))
            arr = region.as_array(numpy.uint8)[:nbytes]
        else:
            _cuda_current(ctx, device)
            arr = numpy.empty(max(nbytes, 1), numpy.uint8)
            region = ctx.register(arr)
            arr = arr[:nbytes]
        _MAPPED[:] = [r for r in _MAPPED if not r.closed]
        _MAPPED.append(region)  # unmapped when ctx closes, not when collected
        arr.fill(fill)
        return arr
    problem = cuda_problem(device)
    if problem:
        raise BenchSetupError(problem)
    import cupy

    with cupy.cuda.Device(device):
        arr = cupy.full(nbytes, fill, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
    return arr
