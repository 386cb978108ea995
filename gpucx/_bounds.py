"""Bounded queues: what a peer can make a worker hold, and what was dropped.

Four queues fill with what peers send, without the application asking:

``am_kept``
    Active messages kept (in C) for the next posted receive of an id that
    has posted receives and no handler (all ids of a worker together).
``am_queue``
    Active messages waiting (in C) for their Python handler: a worker
    progressed only by a ``ProgressThread`` or by C wait loops.
``notify``
    Put-with-notify notifications not yet taken (in C; anyone may send to
    the reserved id).
``arrays``
    ``send_array`` messages waiting for ``recv_array`` (Python, one queue
    per sender; the caps apply to all senders together, so that peers
    connecting again and again cannot multiply them).

Each has a count cap and a byte cap (``GPUCX_*`` context options, see
:data:`CAPS`).  Bytes are what a message holds here: its header and eager
payload (a rendezvous payload stays at the sender).  A message that would
pass a cap is dropped: eager data goes back to UCX, a rendezvous payload
is never fetched (UCX releases its descriptor and the sender completes).
The C queues count drops in C (no Python per message); a worker raises
one :class:`~gpucx.DroppedMessagesWarning` at the first drop and at most
one per :data:`WARN_INTERVAL_S` after that.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

from ._lib import ffi, lib
from .errors import DroppedMessagesWarning

__all__ = ["QueueStats", "CAPS", "stats", "WARN_INTERVAL_S"]

#: Seconds between two drop warnings of one worker.
WARN_INTERVAL_S = 60.0

#: Queue name -> (count option, byte option), without the ``GPUCX_`` prefix.
CAPS = {
    "am_kept": ("AM_KEPT_MAX_COUNT", "AM_KEPT_MAX_BYTES"),
    "am_queue": ("AM_QUEUE_MAX_COUNT", "AM_QUEUE_MAX_BYTES"),
    "notify": ("NOTIFY_MAX_COUNT", "NOTIFY_MAX_BYTES"),
    "arrays": ("ARRAY_QUEUE_MAX_COUNT", "ARRAY_QUEUE_MAX_BYTES"),
}

_NO_CAP = (1 << 64) - 1  # SIZE_MAX: what C stores for "no cap" (option 0)


@dataclass(frozen=True)
class QueueStats:
    """Counters of one bounded queue (:meth:`Worker.stats`).

    ``count``/``bytes``: held now; ``max_count``/``max_bytes``: the caps
    (0: none); ``dropped``/``dropped_bytes``: dropped at a cap (or for
    lack of memory) since the worker was created.
    """

    count: int
    bytes: int
    max_count: int
    max_bytes: int
    dropped: int
    dropped_bytes: int


def caps(context, queue: str) -> tuple[int, int]:
    """The (count, bytes) caps of ``queue`` for a context's workers."""
    count, nbytes = CAPS[queue]
    options = context.options
    return int(options[count]), int(options[nbytes])


def _from_c(q) -> QueueStats:
    mc, mb = q.max_count, q.max_bytes
    return QueueStats(
        q.count,
        q.bytes,
        0 if mc == _NO_CAP else mc,
        0 if mb == _NO_CAP else mb,
        q.dropped,
        q.dropped_bytes,
    )


class ArrayQueueStats:
    """The Python-side counters of the array queues (all senders)."""

    __slots__ = ("count", "bytes", "dropped", "dropped_bytes", "max_count", "max_bytes")

    def __init__(self, max_count: int, max_bytes: int):
        self.count = self.bytes = self.dropped = self.dropped_bytes = 0
        self.max_count = max_count
        self.max_bytes = max_bytes

    def snapshot(self) -> QueueStats:
        return QueueStats(
            self.count,
            self.bytes,
            self.max_count,
            self.max_bytes,
            self.dropped,
            self.dropped_bytes,
        )


def stats(e) -> dict[str, QueueStats]:
    """Per-queue counters of the worker whose engine is ``e`` (see
    :class:`QueueStats`)."""
    kept = ffi.new("gpucx_qstat_t *")
    queue = ffi.new("gpucx_qstat_t *")
    notify = ffi.new("gpucx_qstat_t *")
    lib.gpucx_am_stats(e.amq, kept, queue)
    lib.gpucx_notify_stats(e.notify_q, notify)
    return {
        "am_kept": _from_c(kept),
        "am_queue": _from_c(queue),
        "notify": _from_c(notify),
        "arrays": e.am.array_stats.snapshot(),
    }


def dropped(e) -> None:
    """Messages were dropped since the last look: warn, rate-limited.

    Called (with the worker's engine) when the C drop counter moved (the
    engine's ``on_drops`` hook: its progress and waits compare it) or the
    array queue dropped one.
    """
    am = e.am
    e.amq.drops_seen = e.amq.drops
    now = time.monotonic()
    if now < am.warn_at:
        return
    am.warn_at = now + WARN_INTERVAL_S
    full = []
    for name, s in stats(e).items():
        if s.dropped:
            count_opt, bytes_opt = CAPS[name]
            full.append(
                f"{name}: {s.dropped} dropped (caps GPUCX_{count_opt}={s.max_count}, "
                f"GPUCX_{bytes_opt}={s.max_bytes}; 0 = none)"
            )
    warnings.warn(
        "gpucx: this worker dropped messages from peers that would have passed "
        "its queue caps -- " + "; ".join(full) + ". Counters: Worker.stats(); "
        f"this warning repeats at most every {WARN_INTERVAL_S:.0f} s.",
        DroppedMessagesWarning,
        stacklevel=3,
    )
