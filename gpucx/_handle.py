"""Lifetime rules shared by Context, Worker, Endpoint, Listener and regions.

* ``close()`` is explicit, idempotent and closes children first, all within
  one deadline (``CLOSE_TIMEOUT_S``, then a short grace): a close never
  blocks for ever, however many children or dead peers there are;
* every handle is a context manager;
* use after close raises :class:`~gpucx.ClosedError`;
* an unclosed handle warns ``ResourceWarning`` from ``__del__`` and closes,
  within ``DROP_CLOSE_TIMEOUT_S`` (garbage collection may run it anywhere:
  it must not block the program for long);
* at interpreter exit every live context is closed in order;
* in a forked child, handles inherited from the parent are abandoned (never
  touched: the UCX state belongs to the parent) and raise ``ClosedError``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
import warnings
import weakref
from typing import Any

from .errors import ClosedError, peer_gone

_live_roots: weakref.WeakSet[Any] = weakref.WeakSet()
_alive = True
_serials = itertools.count(1)


#: How long closing one object (with everything under it) may wait for
#: outstanding operations and for the peer before it cancels what is left.
CLOSE_TIMEOUT_S = 10.0
#: Extra time a close gives UCX to report cancellations after the deadline.
CLOSE_GRACE_S = 1.0
#: The deadline of the close an unclosed handle makes when it is collected:
#: a flush still delivers what is on its way to a live peer, but a peer
#: that does not progress cannot hold the collecting thread for
#: ``CLOSE_TIMEOUT_S``.
DROP_CLOSE_TIMEOUT_S = 1.0


def time_left(deadline: float | None, floor: float = 0.0) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), at least
    ``floor``."""
    if deadline is None:
        return max(CLOSE_TIMEOUT_S, floor)
    return max(deadline - time.monotonic(), floor)


class Handle:
    """Base of every gpucx object that owns a UCX handle.

    Subclasses set ``self._h`` to the UCX handle (``None`` once closed) and
    implement ``_release()`` to free it; children register with
    ``parent._adopt(child)``.
    """

    _h: Any = None
    _closed_reason: str | None = None
    #: When this close must be over (``time.monotonic()``); set by close()
    #: and handed down to the children, so closing a parent with many
    #: children is bounded as a whole, not per child.
    _deadline: float | None = None
    _pid: int = 0
    _is_worker = False
    _is_endpoint = False
    _parent: Handle | None = None
    #: Children adopted and not yet closed.
    _live = 0
    #: Garbage collection finalized this handle while children were open.
    _deferred = False

    def _init_handle(self) -> None:
        self._children: weakref.WeakSet[Handle] = weakref.WeakSet()
        self._pid = os.getpid()
        self._serial = next(_serials)

    def _adopt(self, child: Handle) -> None:
        self._children.add(child)
        child._parent = self
        self._live += 1

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the parent closed)."""
        return self._h is None

    def _close_children(self) -> None:
        self._close_all(self._children)

    def _close_all(self, children) -> None:
        """Close ``children`` (of this handle or below it) within this
        handle's deadline, newest first: endpoints made from a listener
        close before it."""
        deadline = self._deadline
        for child in sorted(
            list(children), key=lambda c: getattr(c, "_serial", 0), reverse=True
        ):
            child._close_by(deadline)

    def _close_by(self, deadline: float | None) -> None:
        """Close within ``deadline`` (a parent's, handed down; None: this
        handle's own), or sooner if this handle's own deadline is earlier."""
        if deadline is not None and (
            self._deadline is None or self._deadline > deadline
        ):
            self._deadline = deadline
        self.close()

    def _release(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self, *, timeout: float | None = None) -> None:
        """Release the UCX resource (children first).  Safe to call twice.

        Everything under this object closes within one deadline: ``timeout``
        seconds (default ``CLOSE_TIMEOUT_S``, 10 s) for flushing endpoints
        and draining outstanding operations, then what is left is canceled.

        Raises
        ------
        ValueError
            For a negative ``timeout``.
        """
        if timeout is not None:
            if timeout < 0:
                raise ValueError(f"timeout must be >= 0, not {timeout}")
            deadline = time.monotonic() + timeout
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
        if self._h is None:
            return
        if self._deadline is None:
            self._deadline = time.monotonic() + CLOSE_TIMEOUT_S
        try:
            self._close_children()
        finally:
            try:
                self._release()
            finally:
                self._h = None
                if self._closed_reason is None:
                    self._closed_reason = "closed"
                parent = self._parent
                if parent is not None:
                    parent._child_closed()

    def _child_closed(self) -> None:
        """One child adopted here closed: once the last one did, a close
        garbage collection deferred (``__del__``) runs."""
        self._live -= 1
        if self._deferred and self._live == 0:
            self.close(timeout=DROP_CLOSE_TIMEOUT_S)

    def _abandon(self, reason: str) -> None:
        """Forget the UCX handle without calling UCX (forked child)."""
        for child in list(getattr(self, "_children", ())):
            child._abandon(reason)
        self._h = None
        self._closed_reason = reason

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._h is None or not _alive:
            return
        if self._pid != os.getpid():
            return
        warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
        if self._live > 0:
            # Garbage collection finalizes a cycle in no set order and has
            # already emptied the weak set of children: closing now would
            # free UCX state (a context) under children it can no longer
            # see.  The last child to close closes this handle.
            self._deferred = True
            return
        try:
            self.close(timeout=DROP_CLOSE_TIMEOUT_S)
        except Exception:  # a finalizer must not raise: the ResourceWarning
            pass  # above already told the user; Python would only print this one


def raise_closed(obj: Handle) -> None:
    """Raise :class:`ClosedError` describing why ``obj`` cannot be used."""
    name = type(obj).__name__
    reason = getattr(obj, "_error_reason", None)
    if reason is not None:  # gpucx found the peer dead and closed the endpoint
        peer = getattr(obj, "peer", "")
        raise peer_gone(f"{name} {peer}", reason)
    if obj._closed_reason == "forked":
        raise ClosedError(
            f"{name} was created in process {obj._pid} and cannot be used in the "
            f"forked child {os.getpid()}: create a new gpucx.Context in the child"
        )
    raise ClosedError(f"{name} is closed")


def register_root(obj: Handle) -> None:
    _live_roots.add(obj)


def _after_fork_in_child() -> None:
    for root in list(_live_roots):
        root._abandon("forked")


def _at_exit() -> None:
    global _alive
    for root in list(_live_roots):
        try:
            root.close()
        except Exception:  # interpreter exit: a failed close of one root must
            pass  # not keep the others open, and nobody is left to catch it
    _alive = False


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
