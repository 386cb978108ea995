"""The awaitable faces of gpucx.aio: :class:`Worker`, and the
:class:`Endpoint` and :class:`Listener` objects it hands out.  Each wraps a
blocking-API object and delegates its public attributes to it."""

from __future__ import annotations

import asyncio
from operator import attrgetter
from typing import TYPE_CHECKING

from .._handle import raise_closed
from .._internal import engine as _engine_of
from .._internal import handle as _handle
from .._lib import lib
from ..errors import TimeoutError as GpucxTimeoutError
from ..ops.tag import TAG_MASK_FULL
from ._driver import _MODES, _Driver, _driver, flush

if TYPE_CHECKING:
    # What mypy sees: each face has every attribute of the object it wraps
    # (the delegation below), with its signature.  At run time the faces
    # derive from object; they are not instances of the core classes.
    from ..endpoint import Endpoint as _EndpointBase
    from ..listener import Listener as _ListenerBase
    from ..worker import Worker as _WorkerBase
else:
    _EndpointBase = _ListenerBase = _WorkerBase = object


class Endpoint(_EndpointBase):
    """Async face of a :class:`gpucx.Endpoint` (every sync attribute is
    there too)."""

    __slots__ = ("_ep", "_drv")

    def __init__(self, ep, driver: _Driver):
        self._ep = ep
        self._drv = driver

    def __repr__(self) -> str:
        return f"<gpucx.aio.Endpoint {self._ep!r}>"

    @property
    def endpoint(self):
        """The underlying blocking-API :class:`gpucx.Endpoint`."""
        return self._ep

    @property
    def on_timeout(self) -> str:
        """:attr:`gpucx.Endpoint.on_timeout`, settable here too: with
        ``"release"`` a canceled await of an operation on this endpoint
        (``asyncio.wait_for``, ``task.cancel()``) force-closes the endpoint
        when UCX cannot withdraw the operation, before the cancellation
        propagates (docs/reliability.md, "Deadlines and the buffer")."""
        return self._ep.on_timeout

    @on_timeout.setter
    def on_timeout(self, mode: str | None) -> None:
        self._ep.on_timeout = mode

    async def asend(
        self, buf, tag: int = 0, sync: bool = False, *, stream=None
    ) -> None:
        """``ep.send`` as a coroutine (``stream``: see docs/gpu.md)."""
        req = self._ep.send_nb(buf, tag, sync, stream=stream)
        return await self._drv.wait(req)

    async def aflush(self) -> None:
        """Wait until every operation on this endpoint completed remotely."""
        ep = self._ep
        h = _handle(ep)
        if h is None:
            raise_closed(ep)
        await flush(self._drv, lib.gpucx_ep_flush, h, ep)

    async def wait_closed(self):
        """Wait until the endpoint fails or is closed; return why.

        Resolves as soon as UCX reports the endpoint's failure (a TCP
        reset, a broken connection-manager link, keepalive), gpucx's
        liveness check finds the peer process on this host dead (the way
        a dead shared-memory peer is noticed; ``GPUCX_PEER_CHECK_INTERVAL``),
        or the endpoint or its worker is closed here.  The worker needs no
        other pending operation for that: while something awaits this, the
        driver keeps checking.

        Returns
        -------
        gpucx.UCXError or None
            The endpoint's error (:attr:`gpucx.Endpoint.error`, e.g. a
            :class:`~gpucx.PeerError`), or None when it was closed here
            without one.  Nothing is raised, so several tasks may await it.
            Cancelling one awaiting task does not affect the others.
        """
        return await self._drv.wait_closed(self._ep)

    def close(self, *, force: bool = False, timeout: float | None = None) -> None:
        """Close the endpoint (see :meth:`gpucx.Endpoint.close`)."""
        self._ep.close(force=force, timeout=timeout)
        self._drv.resolve_closers()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Listener(_ListenerBase):
    """Async face of a :class:`gpucx.Listener` (from :meth:`Worker.listen`):
    its peers come as async :class:`Endpoint` objects.  Every other
    attribute is the blocking listener's."""

    __slots__ = ("_lst", "_aw")

    def __init__(self, listener, worker: Worker):
        self._lst = listener
        self._aw = worker

    def __repr__(self) -> str:
        return f"<gpucx.aio.Listener {self._lst!r}>"

    @property
    def listener(self):
        """The underlying blocking-API :class:`gpucx.Listener`."""
        return self._lst

    def accept(
        self, timeout: float | None = None, *, error_handling: bool = True
    ) -> Endpoint:
        """:meth:`gpucx.Listener.accept` (blocking), returning the async
        :class:`Endpoint`."""
        ep = self._lst.accept(timeout, error_handling=error_handling)
        return Endpoint(ep, self._aw.driver)

    async def aaccept(
        self, timeout: float | None = None, *, error_handling: bool = True
    ) -> Endpoint:
        """Wait for the next peer on this listener (see
        :meth:`Worker.aaccept`)."""
        return await self._aw.aaccept(self._lst, timeout, error_handling=error_handling)

    # The blocking listener's close takes a timeout this one never did.
    def close(self) -> None:  # type: ignore[override]
        """Close the listener."""
        self._lst.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._lst.close()


class Worker(_WorkerBase):
    """A :class:`gpucx.Worker` driven by the running asyncio loop.

    Parameters
    ----------
    context : gpucx.Context
    thread_mode : str
        As for :meth:`gpucx.Context.create_worker`.
    progress : {"event", "poll"}
        ``"event"`` (default) sleeps on the worker's fd between events;
        ``"poll"`` progresses on every loop iteration while requests are
        outstanding (lower latency, one busy core meanwhile).
    spin_us : float, optional
        How long an await busy-polls (in C, blocking the loop) before it
        parks on a future: 50 us in ``"event"`` mode, 200 us in ``"poll"``
        mode by default, 0 to never spin.  The spin adapts: one that ends
        without the completion halves the next, down to none (with a
        full-length probe every 32 awaits); one that sees it restores the
        full length.

    Raises
    ------
    ValueError
        For an unknown ``progress`` mode or a negative ``spin_us``.
    RuntimeError
        When no event loop is running.
    """

    def __init__(
        self,
        context,
        thread_mode: str = "single",
        progress: str = "event",
        spin_us: float | None = None,
    ):
        if progress not in _MODES:
            raise ValueError(f"progress must be one of {_MODES}, not {progress!r}")
        if spin_us is not None and not spin_us >= 0:
            raise ValueError(f"spin_us must be >= 0, not {spin_us!r}")
        self._worker = context.create_worker(thread_mode)
        spin = None if spin_us is None else int(spin_us * 1000)
        self._drv = _driver(_engine_of(self._worker), progress, spin)
        self._listeners: list = []

    def __repr__(self) -> str:
        return f"<gpucx.aio.Worker {self._worker!r}>"

    @property
    def worker(self):
        """The underlying blocking-API :class:`gpucx.Worker`."""
        return self._worker

    @property
    def driver(self) -> _Driver:
        """The event-loop driver of this worker (gpucx.aio's own: what its
        :class:`Endpoint` and :class:`Listener` faces and gpucx.dask's comms
        await through)."""
        return self._drv

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, timeout: float | None = None) -> None:
        """Close the worker (its endpoints and listeners first; see
        :meth:`gpucx.Worker.close`)."""
        self._drv.detach()
        self._worker.close(timeout=timeout)

    # -- connections ----------------------------------------------------------

    def listen(self, port: int = 0, host: str = "0.0.0.0"):
        """Start listening; :meth:`aaccept` (or the listener's ``accept``
        and ``aaccept``) returns the peers as :class:`Endpoint` objects."""
        lst = self._worker.listen(port, host)
        self._listeners.append(lst)
        return Listener(lst, self)

    def connect(
        self,
        address,
        *,
        error_handling: bool | None = None,
        raw: bool = False,
        mode: str | None = None,
    ) -> Endpoint:
        """:meth:`gpucx.Worker.connect`, returning the async
        :class:`Endpoint` (returns at once; :meth:`aconnect` waits for a
        ``(host, port)`` connection to be up).  ``mode="same-host"``: the
        endpoint mode of the guide's "Endpoint modes"."""
        ep = self._worker.connect(
            address, error_handling=error_handling, raw=raw, mode=mode
        )
        return Endpoint(ep, self._drv)

    async def aaccept(
        self,
        listener=None,
        timeout: float | None = None,
        *,
        error_handling: bool = True,
    ) -> Endpoint:
        """Wait for the next peer on ``listener`` (default: the only one).

        Raises
        ------
        ValueError
            If no listener was started, or several and none was named.
        gpucx.TimeoutError
            When ``timeout`` passes first.
        """
        if isinstance(listener, Listener):
            listener = listener.listener
        if listener is None:
            live = [lst for lst in self._listeners if not lst.closed]
            if len(live) != 1:
                raise ValueError(
                    "call listen() first (or name the listener to accept on)"
                )
            listener = live[0]
        coro = self._drv.accept(listener, error_handling)
        try:
            ep = await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            raise GpucxTimeoutError(
                f"no connection on port {listener.port} within {timeout} s",
                lib.UCS_ERR_TIMED_OUT,
            ) from None
        return Endpoint(ep, self._drv)

    async def aconnect(
        self,
        address,
        *,
        error_handling: bool | None = None,
        raw: bool = False,
        mode: str | None = None,
    ) -> Endpoint:
        """Connect to a peer (see :meth:`gpucx.Worker.connect`).

        For a ``(host, port)`` address the coroutine waits until the
        connection is established, so an unreachable peer raises
        :class:`~gpucx.PeerError` here.
        """
        ep = self.connect(address, error_handling=error_handling, raw=raw, mode=mode)
        if isinstance(address, tuple):
            try:
                await ep.aflush()
            except BaseException:
                ep.close(force=True)
                raise
        return ep

    # -- tag matching ---------------------------------------------------------

    async def arecv(
        self, buf, tag: int = 0, tag_mask: int = TAG_MASK_FULL, *, stream=None
    ):
        """``worker.recv`` as a coroutine; returns :class:`gpucx.RecvInfo`
        (``stream``: see docs/gpu.md)."""
        req = self._worker.recv_nb(buf, tag, tag_mask, stream=stream)
        return await self._drv.wait(req)

    async def aflush(self) -> None:
        """Wait until every operation of this worker completed remotely."""
        w = self._worker
        h = _handle(w)
        if h is None:
            raise_closed(w)
        await flush(self._drv, lib.gpucx_worker_flush, h)


def _delegate(face: type, core: type, to: str, per_instance: tuple[str, ...]) -> None:
    """Give ``face`` a read-only property for each public attribute of
    ``core`` that ``face`` does not define itself: the core class's
    methods, properties and constants, and ``per_instance`` (the public
    attributes its ``__init__`` sets).  Each reads the attribute of the
    wrapped object (``face.<to>``), one C call (``attrgetter``); it
    replaced a ``__getattr__`` that mypy could not see through and that
    every delegated access paid for after a failed lookup."""
    names = {n for n in dir(core) if not n.startswith("_")} | set(per_instance)
    for name in sorted(names):
        if not hasattr(face, name):
            prop = property(attrgetter(f"{to}.{name}"), doc=f"``{to}.{name}``")
            setattr(face, name, prop)


def _install() -> None:
    from ..endpoint import Endpoint as CoreEndpoint
    from ..listener import Listener as CoreListener
    from ..worker import Worker as CoreWorker

    _delegate(Endpoint, CoreEndpoint, "_ep", ("peer",))
    _delegate(Listener, CoreListener, "_lst", ("host", "port"))
    _delegate(Worker, CoreWorker, "_worker", ("thread_mode",))


_install()
