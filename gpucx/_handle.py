"""Lifetime rules shared by Context, Worker, Endpoint, Listener and regions.

* ``close()`` is explicit, idempotent and closes children first;
* every handle is a context manager;
* use after close raises :class:`~gpucx.ClosedError`;
* an unclosed handle warns ``ResourceWarning`` from ``__del__`` and closes;
* at interpreter exit every live context is closed in order;
* in a forked child, handles inherited from the parent are abandoned (never
  touched: the UCX state belongs to the parent) and raise ``ClosedError``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import warnings
import weakref
from typing import Any

from ._lib import lib
from .errors import ClosedError, PeerError

_live_roots: weakref.WeakSet[Any] = weakref.WeakSet()
_alive = True
_serials = itertools.count(1)


class Handle:
    """Base of every gpucx object that owns a UCX handle.

    Subclasses set ``self._h`` to the UCX handle (``None`` once closed) and
    implement ``_release()`` to free it; children register with
    ``parent._adopt(child)``.
    """

    _h: Any = None
    _closed_reason: str | None = None
    _pid: int = 0
    _is_worker = False

    def _init_handle(self) -> None:
        self._children: weakref.WeakSet[Handle] = weakref.WeakSet()
        self._pid = os.getpid()
        self._serial = next(_serials)

    def _adopt(self, child: Handle) -> None:
        self._children.add(child)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the parent closed)."""
        return self._h is None

    def _close_children(self) -> None:
        # Newest first: endpoints made from a listener close before it.
        for child in sorted(
            list(self._children), key=lambda c: getattr(c, "_serial", 0), reverse=True
        ):
            child.close()

    def _release(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release the UCX resource (children first).  Safe to call twice."""
        if self._h is None:
            return
        try:
            self._close_children()
        finally:
            try:
                self._release()
            finally:
                self._h = None
                if self._closed_reason is None:
                    self._closed_reason = "closed"

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
        try:
            self.close()
        except Exception:
            pass


def raise_closed(obj: Handle) -> None:
    """Raise :class:`ClosedError` describing why ``obj`` cannot be used."""
    name = type(obj).__name__
    reason = getattr(obj, "_error_reason", None)
    if reason is not None:  # gpucx found the peer dead and closed the endpoint
        peer = getattr(obj, "peer", "")
        raise PeerError(f"{name} {peer}: {reason}", lib.UCS_ERR_CONNECTION_RESET)
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
        except Exception:
            pass
    _alive = False


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
