"""Listeners: accept connections on a socket address."""

from __future__ import annotations

from ._handle import Handle, raise_closed
from ._internal import engine, handle
from ._lib import ffi, lib
from .errors import check

__all__ = ["Listener"]


class Listener(Handle):
    """Accepts peers that connect to ``(host, port)`` (``ucp_listener_create``).

    Connection requests are queued by a C callback during progress;
    :meth:`accept` turns the oldest into an :class:`~gpucx.Endpoint`.
    """

    def __init__(self, worker, host: str, port: int):
        worker_h = handle(worker)
        if worker_h is None:
            raise_closed(worker)
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be in 0..65535, not {port!r}")
        self._init_handle()
        state = ffi.new("gpucx_listener_state_t *")
        check(
            lib.gpucx_listener_create(worker_h, host.encode(), port, state),
            f"ucp_listener_create({host}:{port})",
        )
        self._state = state
        self._h = state.listener
        self._w = worker
        self.host = host
        self.port = lib.gpucx_listener_port(self._h)
        worker._adopt(self)

    def __repr__(self) -> str:
        state = "closed" if self._h is None else f"{self.host}:{self.port}"
        return f"<gpucx.Listener {state}>"

    def accept(self, timeout: float | None = None, *, error_handling: bool = True):
        """Wait for the next peer and return its :class:`~gpucx.Endpoint`.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None waits forever.
        error_handling : bool
            Peer error-handling mode for the new endpoint (default on).  UCX
            (>= 1.19) offers no atomic operations on endpoints with it;
            gpucx then runs atomics over its own active messages
            (``error_handling=False`` gives UCX's atomics).

        Raises
        ------
        gpucx.TimeoutError
            When no peer connects within ``timeout`` seconds.
        gpucx.ClosedError
            If the listener is closed.
        """
        what = f"no connection on {self.host}:{self.port}"
        accept = self._try_accept
        return engine(self._w).wait_for(lambda: accept(error_handling), timeout, what)

    def _try_accept(self, error_handling: bool = True):
        """The endpoint of the oldest queued connection request, or None."""
        from .endpoint import Endpoint

        if self._h is None:
            raise_closed(self)
        req = lib.gpucx_listener_pop(self._state)
        if req == ffi.NULL:
            return None
        peer = f"peer of {self.host}:{self.port}"
        return Endpoint._accept(self._w, req, peer, error_handling)

    def _queued(self) -> bool:
        """Whether a connection request waits (no call into C)."""
        st = self._state
        return self._h is None or st.head != st.tail

    def _release(self) -> None:
        lib.gpucx_listener_drain(self._state)
        lib.ucp_listener_destroy(self._h)


def poll_accept(listener: Listener, error_handling: bool = True):
    """The endpoint of ``listener``'s oldest queued connection request, or
    None when none is queued (what an event-loop driver asks after each
    progress pass; nothing is called in C when the queue is empty).

    Raises
    ------
    gpucx.ClosedError
        If the listener is closed.
    """
    if not listener._queued():
        return None
    return listener._try_accept(error_handling)
