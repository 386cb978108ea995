"""asyncio integration: awaitable requests and event-driven progress.

A thin driver over the loop-agnostic core.  One :class:`_Driver` per
(worker, event loop) watches the worker's event fd (``ucp_worker_get_efd``)
with ``loop.add_reader``.  On every wake it progresses the worker until idle,
resolves the futures of finished requests from their C completion records,
and re-arms (``ucp_worker_arm``); when arming answers BUSY (events arrived
meanwhile) it progresses again, because the fd is edge-triggered and would
not fire twice.  An idle worker costs no CPU.

``progress="poll"`` trades CPU for latency: while requests are outstanding
the driver progresses on every loop iteration (``call_soon``); with nothing
outstanding it sleeps on the fd like the event mode.

The loop's reader callback holds only a weak reference to the driver, and
closing (or dropping) a worker removes its reader, so nothing leaks.

Every ``*_nb`` :class:`~gpucx.Request` is awaitable (``await req``): that is
how any operation is awaited.  :class:`Worker` adds the coroutines
``aaccept``, ``aconnect``, ``arecv`` and ``aflush``; the :class:`Endpoint`
objects it hands out (from ``connect``, ``aconnect``, ``accept`` and
``aaccept``) add ``asend``, ``aflush`` and ``wait_closed`` (the endpoint
failed or closed).  Every other operation is there in
its blocking and ``_nb`` forms (await the ``_nb`` request).
"""

from __future__ import annotations

from .._names import rehome
from ._driver import _SPIN_PROBE_EVERY, wait_request
from ._faces import Endpoint, Listener, Worker
from ._thread import ProgressThread

__all__ = ["Worker", "Endpoint", "Listener", "ProgressThread", "wait_request"]
# The public classes read as gpucx.aio's (repr, pickling, docs), as they
# did before the split.
rehome(__name__, Worker, Endpoint, Listener, ProgressThread)
# Read by tests/test_aio.py (the adaptive spin's probe period).
_SPIN_PROBE_EVERY = _SPIN_PROBE_EVERY
