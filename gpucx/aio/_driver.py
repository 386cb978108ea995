"""The event-loop driver of gpucx.aio: one :class:`_Driver` per (worker,
event loop) progresses the worker's engine from the loop (see the package
docstring), and :func:`wait_request` is what ``await req`` runs."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from .._engine import new_slot
from .._lib import lib
from ..listener import poll_accept
from ..ops import ipc as _own
from ..request import Request, engine_of, observe, set_awaiter, spin

_MODES = ("event", "poll")
#: How long an await busy-polls in C before it parks on a future, per mode:
#: a reply that comes within this time costs no event-loop iteration.  Idle
#: workers never spin (nothing is awaited).
_SPIN_NS = {"event": 50_000, "poll": 200_000}
#: Adaptive spin: a spin that ends without the completion halves the next
#: one (below 1 us it stops); a spin that sees the completion restores the
#: full length.  Spinning at 0 probes with the full length every this many
#: awaits (a missed probe leaves it at 0).  On a machine with a free core
#: for the peer a reply within the spin saves the wake-up; where the peer
#: needs this core, spinning only delays it, the spins fail and stop.
_SPIN_PROBE_EVERY = 32
#: Progress calls per round, and rounds per wake, before the loop gets a turn.
_BURST = 64
_ROUNDS = 8


class _Driver:
    """Progress of one worker's engine (:mod:`gpucx._engine`) from one
    asyncio loop: everything it does to the worker goes through the
    engine's surface (``h``, ``efd``, ``pfd``, ``poll_events``,
    ``check_peers``...)."""

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        mode: str,
        spin_ns: int | None = None,
    ):
        if mode not in _MODES:
            raise ValueError(f"progress must be one of {_MODES}, not {mode!r}")
        self.engine = engine
        self.loop = loop
        self._mode = mode
        self._spin_ns = _SPIN_NS[mode] if spin_ns is None else int(spin_ns)
        self._spin_cur = self._spin_ns  # the adaptive spin length
        self._spin_skip = 0  # awaits until the next probe (at 0)
        self._waiters: dict[Request, asyncio.Future] = {}
        self._accepts: list = []  # (listener, future, error_handling)
        self._canceled: set[Request] = set()  # canceled, not yet reported
        # Endpoints someone awaits the end of (Endpoint.wait_closed):
        # endpoint -> [future, number of awaiting tasks].  An entry goes when
        # its future resolves or its last awaiting task gives up, so an
        # endpoint nobody waits for is not kept alive.  (A plain dict: it is
        # looked at after every progress pass.)
        self._closers: dict[Any, list] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None  # peer liveness checks
        # The engine's epoll set of its watched local peers' pidfds
        # (engine.pfd, made with the first one), on the loop once made.
        self.pfd = -1
        self._efd = engine.efd
        ref = weakref.ref(self)

        def on_readable() -> None:
            driver = ref()
            if driver is not None:
                driver.run()

        self._on_readable = on_readable
        loop.add_reader(self._efd, on_readable)
        self.attached = True

    def detach(self) -> None:
        """Remove the reader; fail whatever still waits (worker closing)."""
        if not self.attached:
            return
        self.attached = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._drop_pfd()
        try:
            self.loop.remove_reader(self._efd)
        except (RuntimeError, ValueError, OSError):  # loop already closed
            pass
        from ..errors import ClosedError

        if self.loop.is_closed():
            # Nobody can await these any more, and resolving a future of a
            # closed loop raises (its callbacks cannot be scheduled).
            self._waiters.clear()
            self._accepts.clear()
            self._closers.clear()
            return
        for fut in list(self._waiters.values()):
            if not fut.done():
                fut.set_exception(ClosedError("worker closed while awaiting"))
        for _, fut, _ in self._accepts:
            if not fut.done():
                fut.set_exception(ClosedError("worker closed while awaiting"))
        for ep, (fut, _) in list(self._closers.items()):
            if not fut.done():  # closed with its worker
                fut.set_result(ep.error)
        self._waiters.clear()
        self._accepts.clear()
        self._closers.clear()

    # -- the progress engine ------------------------------------------------

    def kick(self) -> None:
        """Progress soon (after posting, a wake may never come otherwise)."""
        if not self._scheduled and self.attached:
            self._scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        """Progress until idle, resolve what finished, re-arm (the fd's
        reader, and ``kick``)."""
        self._scheduled = False
        e = self.engine
        h = e.h
        if h is None or not self.attached:
            self.detach()
            return
        progress = lib.ucp_worker_progress
        for _ in range(_ROUNDS):
            for _ in range(_BURST):
                if not progress(h):
                    break
            e.poll_events()
            self._resolve()
            if self._mode == "poll" and (self._waiters or self._accepts):
                # Latency mode: keep progressing while anything is pending.
                self.kick()
                return
            st = lib.ucp_worker_arm(h)
            if st != lib.UCS_ERR_BUSY:
                return  # armed (or failed: the next post kicks us again)
        # Still busy: give the loop a turn, then carry on.
        self.kick()

    def _arm_timer(self) -> None:
        """Wake up every check interval while something is awaited and the
        worker has peers on this host: a dead shared-memory peer produces no
        event on the fd, only gpucx's liveness check notices it.  Where
        pidfds exist, their exit wakes us at once (see ``_on_peer_exit``).
        The same while endpoints are heard (the heartbeat,
        ``Engine.beat``): a frozen peer produces no event either."""
        e = self.engine
        if e.pfd != self.pfd:
            self._drop_pfd()
            if e.pfd >= 0:
                self.loop.add_reader(e.pfd, self._on_peer_exit)
                self.pfd = e.pfd
        if self._timer is not None or not (
            self._waiters or self._accepts or self._closers
        ):
            return
        delay = e.peer_interval if e.watched and e.peer_interval > 0 else None
        beat = e.beat_interval()
        if beat is not None:
            delay = beat if delay is None else min(delay, beat)
        if delay is not None:
            self._timer = self.loop.call_later(delay, self._on_timer)

    def _drop_pfd(self) -> None:
        """Take the engine's pidfd set off the loop (the worker closes it,
        after this driver detached)."""
        if self.pfd >= 0:
            try:
                self.loop.remove_reader(self.pfd)
            except (RuntimeError, ValueError, OSError):  # loop already closed
                pass
        self.pfd = -1

    def _on_peer_exit(self) -> None:
        """The worker's pidfd set became readable: a watched peer exited.
        Look at the peers now (``/proc`` confirms; the endpoint fails with
        PeerError and its pidfd leaves the set) and resolve what that
        failed."""
        e = self.engine
        if e.h is not None:
            e.check_peers(force=True)
        self.run()

    def _on_timer(self) -> None:
        self._timer = None
        if not self.attached:
            return
        if self.engine.h is not None:
            self.engine.beat()  # before run(): it resolves what that failed
        self.run()
        self._arm_timer()

    def _resolve(self) -> None:
        if self._closers:
            self.resolve_closers()
        if self._canceled:
            # observe() completes a finished request (a settled request's
            # slot may already serve another message).
            for req in [r for r in self._canceled if observe(r)]:
                self._canceled.discard(req)
        if self._waiters:
            for req in [r for r in self._waiters if observe(r)]:
                fut = self._waiters.pop(req)
                if fut.done():  # the awaiting task was canceled
                    continue
                exc = req.exception()
                if exc is None:
                    fut.set_result(req.result())
                else:
                    fut.set_exception(exc)
        if self._accepts:
            for item in list(self._accepts):
                listener, fut, error_handling = item
                if fut.done():
                    self._accepts.remove(item)
                    continue
                try:
                    # None while no connection request is queued.
                    ep = poll_accept(listener, error_handling)
                except Exception as exc:
                    self._accepts.remove(item)
                    fut.set_exception(exc)
                    continue
                if ep is not None:
                    self._accepts.remove(item)
                    fut.set_result(ep)

    def resolve_closers(self) -> None:
        """Resolve the ``wait_closed`` futures of endpoints that failed
        (UCX's error callback or gpucx's liveness check set their error
        status, both seen here after progress) or were closed."""
        if not self._closers:
            return
        done = None
        for ep in self._closers:
            if ep.closed or ep.error is not None:
                if done is None:
                    done = []
                done.append(ep)
        if done:
            for ep in done:
                fut = self._closers.pop(ep)[0]
                if not fut.done():
                    fut.set_result(ep.error)

    async def wait_closed(self, ep):
        """What ``Endpoint.wait_closed`` awaits for core endpoint ``ep``."""
        entry = self._closers.get(ep)
        if entry is None:
            entry = self._closers[ep] = [self.loop.create_future(), 0]
            if ep.closed or ep.error is not None:
                self.resolve_closers()
            else:
                self._arm_timer()
        fut = entry[0]
        entry[1] += 1
        try:
            return await asyncio.shield(fut)
        finally:
            entry[1] -= 1
            if not entry[1] and not fut.done():
                if not self.loop.is_closed():  # else: collected with its loop
                    fut.cancel()  # the last awaiting task gave up
                if self._closers.get(ep) is entry:
                    del self._closers[ep]

    # -- waiting ------------------------------------------------------------

    def _spin_len(self) -> int:
        """Nanoseconds the next await spins (see ``_SPIN_PROBE_EVERY``)."""
        spin = self._spin_cur
        if not spin and self._spin_ns:
            self._spin_skip -= 1
            if self._spin_skip <= 0:
                spin = self._spin_ns  # probe
        return spin

    def _spin_done(self, spin: int, hit: bool) -> None:
        """Adapt to a spin of ``spin`` ns that saw its completion or not."""
        if hit:
            self._spin_cur = self._spin_ns
            return
        # A missed probe (spinning was off) turns it off again at once.
        self._spin_cur = spin // 2 if spin >= 2000 and self._spin_cur else 0
        if not self._spin_cur:
            self._spin_skip = _SPIN_PROBE_EVERY

    def _arm_wake(self) -> None:
        """Make sure the fd wakes us for what comes next.  With this request
        the only one awaited, arm the worker here (the spin just
        progressed it) instead of in a progress pass on the next loop
        iteration: one iteration fewer per await, which is most of a small
        message's cost.  Otherwise (or when events are pending) kick."""
        if (
            self._scheduled
            or len(self._waiters) != 1
            or self._accepts
            or self._canceled
            or self._mode != "event"
        ):
            self.kick()
            return
        e = self.engine
        e.poll_events()
        if self._closers:
            self.resolve_closers()
        if lib.ucp_worker_arm(e.h) == lib.UCS_ERR_BUSY:
            self.kick()

    async def wait(self, req: Request):
        """Await ``req``: the engine's spin first (:meth:`Engine.spin`, the
        due-spin every wait shares), then a future the progress passes
        resolve."""
        if req.done():
            return req.result()
        e = self.engine
        spin_ns = self._spin_len()
        if spin_ns:
            hit = spin(req, spin_ns)
            self._spin_done(spin_ns, hit)
        else:  # one progress call (gpucx_wait polls at least 128 times)
            lib.ucp_worker_progress(e.h)
            hit = observe(req)
        if hit:
            e.poll_events()
            return req.wait(0)
        fut = self.loop.create_future()
        self._waiters[req] = fut
        self._arm_wake()
        self._arm_timer()
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(req, None)
            if req.on_timeout == "release":
                # Give the buffers back before the cancellation goes on:
                # cancel, and if UCX does not withdraw the operation,
                # force-close its endpoint (bounded, synchronous).
                req.give_up("release")
            elif req.cancel():
                # Cancel the UCX operation; the worker stays usable and the
                # request settles (CanceledError) on a later progress.
                self._canceled.add(req)
            self.kick()
            raise

    async def accept(self, listener, error_handling: bool = True):
        """Await the next connection request of ``listener``."""
        ep = poll_accept(listener, error_handling)
        if ep is not None:
            return ep
        fut = self.loop.create_future()
        self._accepts.append((listener, fut, error_handling))
        self.kick()
        return await fut


def _driver(engine, mode: str | None = None, spin_ns: int | None = None) -> _Driver:
    """The driver of a worker's ``engine`` on the running loop (made on
    first use; the engine's ``driver``)."""
    loop = asyncio.get_running_loop()
    drv = engine.driver
    if drv is not None and drv.attached and drv.loop is loop:
        return drv
    if drv is not None:
        drv.detach()
    drv = _Driver(engine, loop, mode or "event", spin_ns)
    engine.driver = drv
    return drv


async def wait_request(req: Request):
    """Await a request from any coroutine (what ``await req`` does)."""
    if observe(req):
        return req.wait(0)
    return await _driver(engine_of(req)).wait(req)


# ``await req`` waits here (gpucx.request knows no event loop).
set_awaiter(wait_request)


async def flush(driver: _Driver, post, handle, ep=None) -> None:
    """Post an endpoint or worker flush and await its completion (after
    gpucx's own copies issued through it, gpucx.ops.ipc, finished)."""
    e = driver.engine
    for req in _own.in_flight(e, ep):
        await req
    slot = new_slot()
    post(handle, slot)
    what = "endpoint flush" if ep is not None else "worker flush"
    await driver.wait(Request(e, slot, None, what, None, ep))
