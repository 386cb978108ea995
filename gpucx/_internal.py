"""The internal interface between gpucx's layers (not public API).

Core objects (``Context``, ``Worker``, ``Endpoint``, ``RemoteKey``,
``MemoryRegion``, ``Request``) keep their UCX handles and bookkeeping in
private attributes that belong to the module defining them.  Code in another
layer that needs one of them (the benchmark package ``gpucx.bench``, which
runs its timing loops in C on the core's handles; ``gpucx.aio``, which
waits through a worker's engine; the memory layer,
which asks its endpoint's engine what is still in flight) goes through the
functions here: each crossing has a name, a docstring and one place to
change, and ``tests/test_layout.py`` checks that ``gpucx.bench`` touches no
private attribute of a core object except through this module.

This module imports only ``_lib`` (it reaches the rest through the objects
it is given), so every layer from ``gpucx.mem`` up may use it
(docs/layout.md, "Layers").
"""

from __future__ import annotations

from typing import Any

from ._lib import ffi

__all__ = [
    "engine",
    "handle",
    "amo_exports",
    "rkey_handle",
    "park",
    "am_recv_registration",
    "abandon",
    "defer_to_closing",
]


def engine(obj: Any) -> Any:
    """The progress engine (:class:`gpucx._engine.Engine`) of a Worker, or
    of an Endpoint's worker: progress, waits, slots and the operations in
    flight, for the layers above the core."""
    return obj._engine


def handle(obj: Any) -> Any:
    """The UCX handle of a core object (``ucp_worker_h`` of a Worker,
    ``ucp_ep_h`` of an Endpoint, ``ucp_context_h`` of a Context,
    ``ucp_rkey_h`` of a RemoteKey), or ``None`` once it is closed.

    For C loops that take the handle directly (``gpucx/_csrc/bench.c``);
    the caller checks ``None`` (or has checked the object is open)."""
    return obj._h


def amo_exports(ctx: Any) -> Any:
    """The ``gpucx_amo_exports_t *`` of a Context: the regions exported for
    gpucx's emulated atomics, which a region adds itself to when its key is
    packed (``gpucx.mem.region``) and a worker serves from
    (``gpucx.ops.atomic``)."""
    return ctx._amo_exports


def rkey_handle(rmem: Any) -> Any:
    """The ``ucp_rkey_h`` of a RemoteKey, or ``None`` for any other object
    (a stand-in without a UCX key): callers then take the Python path."""
    h = getattr(rmem, "_h", None)
    try:
        return h if ffi.typeof(h) is ffi.typeof("ucp_rkey_h") else None
    except TypeError:
        return None


def park(worker: Any, slot: Any, keep: Any) -> None:
    """Leave a completion slot that UCX still holds (and ``keep``, what it
    writes into) with the worker's engine, which frees it once UCX lets go
    (or the worker closes)."""
    worker._engine.park(slot, keep)


def am_recv_registration(worker: Any, am_id: int) -> Any:
    """The ``gpucx_am_reg_t *`` that receives posted for ``am_id`` on
    ``worker`` go through (``Worker.am_recv_nb``'s; made on first use), for
    C loops that post receives themselves (``gpucx_bench_am_pingpong``).
    Without a handler for the id, a message that finds no posted receive
    is kept for the next one."""
    return worker._am_recv_registration(am_id)


def abandon(obj: Any, reason: str) -> None:
    """Forget the UCX handles of ``obj`` and its children without calling
    UCX (a forked child, or a benchmark that left UCX holding operations
    it cannot cancel); later use raises ``ClosedError`` naming ``reason``."""
    obj._abandon(reason)


def defer_to_closing(ep: Any, rkey: Any) -> bool:
    """Hand the ``ucp_rkey_h`` ``rkey`` to its endpoint when the endpoint is
    closing: it completes or cancels its operations first, then destroys
    the key.  False (nothing taken) when the endpoint is not closing."""
    if not ep._closing:
        return False
    ep._late_rkeys.append(rkey)
    return True
