"""Liveness of peers on this host, checked by gpucx itself.

UCX reports a dead peer over TCP at once, but over shared memory (UCX 1.22,
sysv/posix with MM_ERROR_HANDLING) it never does: operations on such an
endpoint wait forever.  When a framed worker address (:mod:`gpucx._address`)
says the peer runs on this host, gpucx records its pid and start time and
looks at it now and then — never on the hot path, only between wait
slices, from the asyncio driver's timer and every few hundred
``Worker.progress()`` calls — at most once per interval: a ``select`` of the
peer's pidfd (Linux 5.3 and up, about a microsecond), else a read of
``/proc/<pid>/stat`` (tens of microseconds).  A peer's exit is also seen at
once where pidfds exist: the worker's engine keeps its watched peers'
pidfds in an epoll set (``engine.pfd``) that blocking waits sleep on beside the UCX
event fd (``gpucx_worker_sleep``) and the asyncio driver puts on its loop;
either looks at the peers as soon as one becomes readable.
A peer is dead when its stat file is gone, its state is zombie or dead (a
SIGKILLed child not yet reaped is a zombie), or the pid now belongs to a
process started later.

A dead peer's endpoint gets a :class:`~gpucx.PeerError` and is force-closed
in UCX, so UCX fails every operation outstanding on it: the endpoint says
how when it is watched (``on_death``, see :meth:`gpucx._engine.Engine.watch`).

Every function here takes the worker's engine (:mod:`gpucx._engine`), whose
methods are the way other layers reach them.
"""

from __future__ import annotations

import os
import select
import time
from contextlib import suppress

from ._address import proc_stat
from ._lib import lib

#: How long after a peer's death a canceled request that gpucx could not
#: tie to an endpoint is taken to have been canceled by the death.
SUSPECT_S = 1.0
#: ``Worker.progress()`` calls between two looks at the clock.
PROGRESS_STRIDE = 256


def proc_alive(pid: int, start_time: int) -> bool:
    """True while process ``pid`` started at ``start_time`` is alive."""
    fields = proc_stat(pid)
    if not fields or fields[0] in (b"Z", b"X", b"x"):
        return False
    return int(fields[19]) == start_time


def peer_alive(engine, ep) -> bool:
    """False when ``ep``'s peer is a process of this host that died."""
    peer = engine.watched.get(ep)
    return peer is None or _alive(engine, ep, peer)


def _alive(engine, ep, peer) -> bool:
    """Whether watched ``ep``'s peer process lives.  A ``select`` of its
    pidfd (opened by :func:`watch`, kept until :func:`unwatch`) says
    "alive" for about a microsecond; any other answer, and a peer without a
    pidfd, is settled by a read of ``/proc/<pid>/stat`` (on a ``"multi"``
    worker another thread may have just closed the fd)."""
    fd = engine.pidfds.get(ep, -1)
    if fd >= 0:
        try:
            if not select.select((fd,), (), (), 0)[0]:
                return True
        except (OSError, ValueError):
            pass
    return proc_alive(peer[0], peer[1])


def keep_pidfd(engine, ep, pid: int, start_time: int) -> int:
    """Open ``ep``'s peer's pidfd, keep it until :func:`unwatch` and add it
    to the engine's epoll set of them, which blocking waits sleep on
    (created with the first one: ``engine.pfd``).  Returns the fd, or -1
    (no pidfd; kept as such, so /proc answers from then on)."""
    new = open_pidfd(pid, start_time)
    fd = engine.pidfds.setdefault(ep, new)  # another thread may have been first
    if fd != new:
        if new >= 0:
            os.close(new)
        return fd
    if fd >= 0:
        pset = engine.pset
        if pset is None:
            pset = engine.pset = select.epoll()
            engine.pfd = pset.fileno()
        with suppress(OSError, ValueError):  # unwatched meanwhile, or closing
            pset.register(fd, select.EPOLLIN)
    return fd


def unwatch(engine, ep) -> None:
    """Stop checking ``ep``'s peer (closed, or found dead)."""
    engine.watched.pop(ep, None)
    fd = engine.pidfds.pop(ep, -1)
    if fd >= 0:
        if engine.pset is not None:
            with suppress(OSError, ValueError):
                engine.pset.unregister(fd)
        os.close(fd)


def unwatch_all(engine) -> None:
    """Stop checking every peer (the worker closes)."""
    for ep in list(engine.pidfds):
        unwatch(engine, ep)
    engine.watched.clear()
    pset, engine.pset = engine.pset, None
    engine.pfd = -1
    if pset is not None:
        pset.close()


def watch(engine, ep, pid: int, start_time: int, ep_state, on_death) -> None:
    """Check ``ep``'s peer process (``pid``, ``start_time``) from now on;
    its pidfd goes into the set blocking waits sleep on.  ``ep_state``:
    the endpoint's C state (an endpoint UCX failed already is not looked
    at); ``on_death(reason)``: what fails the endpoint when its peer died."""
    if engine.peer_interval > 0:
        engine.watched[ep] = (pid, start_time, ep_state, on_death)
        if ep not in engine.pidfds:
            keep_pidfd(engine, ep, pid, start_time)


def open_pidfd(pid: int, start_time: int) -> int:
    """A pidfd of process ``pid`` started at ``start_time`` (readable once
    it exits), or -1: no pidfds here (Linux before 5.3, a sandbox), or the
    process is gone.  The caller closes it."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1
    # The pidfd names whichever process had the pid when it was opened: ours
    # if the pid still has our peer's start time now.
    if proc_alive(pid, start_time):
        return fd
    os.close(fd)
    return -1


def check(engine, now: float | None = None, force: bool = False) -> None:
    """Check the engine's local peers if the interval has passed, or now
    (``force``: a blocking wait's sleep was woken by a peer's pidfd)."""
    if now is None:
        now = time.monotonic()
    if now < engine.peer_check_at and not force:
        return
    engine.peer_check_at = now + engine.peer_interval
    watched = engine.watched
    ok = lib.UCS_OK
    for ep, peer in list(watched.items()):
        if ep.closed or peer[2].error != ok:
            unwatch(engine, ep)
        else:
            check_peer(engine, ep)
    # A pidfd opened for an endpoint another thread unwatched meanwhile
    # (watch racing a death found on a "multi" worker) would wake every
    # sleep once its peer exits.
    for ep in [e for e in engine.pidfds if e not in watched]:
        unwatch(engine, ep)
    engine.sweep_parked()


def check_peer(engine, ep) -> bool:
    """Look at ``ep``'s peer now, whatever the interval: if it is a process
    of this host that died, fail ``ep`` (its ``on_death``) and return True."""
    peer = engine.watched.get(ep)
    if peer is None or _alive(engine, ep, peer):
        return False
    unwatch(engine, ep)
    peer[3](f"peer process {peer[0]} died")
    return True
