"""Active messages (``ucp_am_send_nbx`` / ``ucp_worker_set_am_recv_handler``).

An active message (AM) is an id (0..65535), a small header and a payload.
The receiving worker runs the Python handler set for the id with an
:class:`AmMessage`.

How it runs: the UCX receive callback is C (``gpucx/_csrc/am.c``).  It copies
the header, records data pointer, length, flags and reply endpoint into the
worker's C queue and keeps eager data alive (``UCS_INPROGRESS``).  After
``ucp_worker_progress`` returns, :func:`dispatch` pops the queue and runs the
handlers in arrival order.  Every path that progresses a worker dispatches:
:meth:`Worker.progress`, the waiting loop of blocking calls and
``Request.wait`` (through the engine's ``poll_events``), and ``recv_array``.

Rules:

* An exception raised by a handler propagates to the caller of
  ``progress()`` / ``wait()``; messages after it stay queued and are
  dispatched by the next progress.
* A message whose id has no handler when it is dispatched (the handler was
  cleared with ``set_am_handler(id, None)`` after the message arrived) is
  **dropped with a** :class:`RuntimeWarning` (the first of each id only).
  Messages for ids that never had a handler or a posted receive on the
  worker are dropped by UCX itself.
* Posted receives (:func:`am_recv_nb`) are matched in the UCX callback.  An
  id used with them and without a handler keeps, in C, the messages that
  find no posted receive, for the next receive posted (up to
  ``GPUCX_AM_KEPT_MAX_COUNT`` / ``_BYTES``; past them messages are dropped
  and counted in ``Worker.stats()``, see :mod:`gpucx._bounds`).
* Handlers do not nest: while a handler runs, progress made inside it (a
  blocking reply, say) queues new messages instead of dispatching them.
* Ids ``0xFF00``..``0xFFFF`` are reserved for gpucx itself
  (:data:`RESERVED_AM_IDS`; ``send_array`` uses :data:`ARRAY_AM_ID`).

The package, by concern (issue 36): ``_state`` (ids, the per-worker state,
message records), ``_message`` (:class:`AmMessage`), ``_handlers``
(setting handlers and :func:`dispatch`), ``_send`` (sending) and ``_recv``
(posted receives).  Everything is imported from here, ``gpucx.ops.am``.
"""

from __future__ import annotations

from ..._names import rehome
from ._handlers import dispatch, set_am_handler, set_internal_handler
from ._message import AmMessage
from ._message import _KeptMessage as _KeptMessage
from ._recv import am_recv, am_recv_many, am_recv_many_nb, am_recv_nb, recv_registration
from ._send import _send_nb as _send_nb
from ._send import am_send, am_send_nb, pack_header, send_flags, send_internal_nb
from ._state import _POOL_MAX as _POOL_MAX
from ._state import (
    ARRAY_AM_ID,
    MAX_USER_AM_ID,
    RESERVED_AM_IDS,
    attach,
    check_id,
    detach,
    give_back_unreceived,
)
from ._state import _no_am as _no_am
from ._state import _register as _register

# The message class reads as gpucx.ops.am's (repr, pickling, docs), as it
# did before the split.
rehome(__name__, AmMessage, _KeptMessage)

__all__ = [
    "AmMessage",
    "set_am_handler",
    "am_send",
    "am_send_nb",
    "am_recv",
    "am_recv_nb",
    "am_recv_many",
    "am_recv_many_nb",
    "dispatch",
    "RESERVED_AM_IDS",
    "MAX_USER_AM_ID",
    # For gpucx's own modules (and the heartbeat, arrays, am_batch...).
    "ARRAY_AM_ID",
    "attach",
    "check_id",
    "detach",
    "give_back_unreceived",
    "pack_header",
    "recv_registration",
    "send_flags",
    "send_internal_nb",
    "set_internal_handler",
]
