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
once where pidfds exist: the worker keeps its watched peers' pidfds in an
epoll set (``worker._pfd``) that blocking waits sleep on beside the UCX
event fd (``gpucx_worker_sleep``) and the asyncio driver puts on its loop;
either looks at the peers as soon as one becomes readable.
A peer is dead when its stat file is gone, its state is zombie or dead (a
SIGKILLed child not yet reaped is a zombie), or the pid now belongs to a
process started later.

A dead peer's endpoint gets a :class:`~gpucx.PeerError` and is force-closed
in UCX, so UCX fails every operation outstanding on it.
"""

from __future__ import annotations

import os
import select
import time
from contextlib import suppress

from ._address import proc_stat
from ._lib import ffi, lib
from .errors import peer_gone

# Read from UCX here rather than imported from gpucx.request: the request
# layer sits above this one (it runs these checks from its waits), and an
# import back up would close a circle (docs/layout.md, "Layers").
INPROGRESS = lib.UCS_INPROGRESS

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


def peer_alive(ep) -> bool:
    """False when ``ep``'s peer is a process of this host that died."""
    peer = ep._w._watched.get(ep)
    return peer is None or _alive(ep._w, ep, peer)


def _alive(worker, ep, peer) -> bool:
    """Whether watched ``ep``'s peer process lives.  A ``select`` of its
    pidfd (opened by :func:`watch`, kept until :func:`unwatch`) says
    "alive" for about a microsecond; any other answer, and a peer without a
    pidfd, is settled by a read of ``/proc/<pid>/stat`` (on a ``"multi"``
    worker another thread may have just closed the fd)."""
    fd = worker._pidfds.get(ep, -1)
    if fd >= 0:
        try:
            if not select.select((fd,), (), (), 0)[0]:
                return True
        except (OSError, ValueError):
            pass
    return proc_alive(*peer)


def _keep_pidfd(worker, ep, peer) -> int:
    """Open ``ep``'s peer's pidfd, keep it until :func:`unwatch` and add it
    to the worker's epoll set of them, which blocking waits sleep on
    (created with the first one: ``worker._pfd``).  Returns the fd, or -1
    (no pidfd; kept as such, so /proc answers from then on)."""
    new = open_pidfd(*peer)
    fd = worker._pidfds.setdefault(ep, new)  # another thread may have been first
    if fd != new:
        if new >= 0:
            os.close(new)
        return fd
    if fd >= 0:
        pset = worker._pset
        if pset is None:
            pset = worker._pset = select.epoll()
            worker._pfd = pset.fileno()
        with suppress(OSError, ValueError):  # unwatched meanwhile, or closing
            pset.register(fd, select.EPOLLIN)
    return fd


def unwatch(worker, ep) -> None:
    """Stop checking ``ep``'s peer (closed, or found dead)."""
    worker._watched.pop(ep, None)
    fd = worker._pidfds.pop(ep, -1)
    if fd >= 0:
        if worker._pset is not None:
            with suppress(OSError, ValueError):
                worker._pset.unregister(fd)
        os.close(fd)


def unwatch_all(worker) -> None:
    """Stop checking every peer (the worker closes)."""
    for ep in list(worker._pidfds):
        unwatch(worker, ep)
    worker._watched.clear()
    pset, worker._pset = worker._pset, None
    worker._pfd = -1
    if pset is not None:
        pset.close()


def watch(worker, ep, pid: int, start_time: int) -> None:
    """Check ``ep``'s peer process (``pid``, ``start_time``) from now on;
    its pidfd goes into the set blocking waits sleep on."""
    if worker._peer_interval > 0:
        worker._watched[ep] = (pid, start_time)
        if ep not in worker._pidfds:
            _keep_pidfd(worker, ep, (pid, start_time))


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


def check(worker, now: float | None = None, force: bool = False) -> None:
    """Check the worker's local peers if the interval has passed, or now
    (``force``: a blocking wait's sleep was woken by a peer's pidfd)."""
    if now is None:
        now = time.monotonic()
    if now < worker._peer_check_at and not force:
        return
    worker._peer_check_at = now + worker._peer_interval
    watched = worker._watched
    for ep in list(watched):
        if ep._h is None or ep._state.error != lib.UCS_OK:
            unwatch(worker, ep)
        else:
            check_peer(worker, ep)
    # A pidfd opened for an endpoint another thread unwatched meanwhile
    # (watch racing a death found on a "multi" worker) would wake every
    # sleep once its peer exits.
    for ep in [e for e in worker._pidfds if e not in watched]:
        unwatch(worker, ep)
    sweep_parked(worker)


def check_peer(worker, ep) -> bool:
    """Look at ``ep``'s peer now, whatever the interval: if it is a process
    of this host that died, fail ``ep`` (:func:`peer_died`) and return True."""
    peer = worker._watched.get(ep)
    if peer is None or _alive(worker, ep, peer):
        return False
    unwatch(worker, ep)
    peer_died(worker, ep, f"peer process {peer[0]} died")
    return True


def peer_died(worker, ep, reason: str) -> None:
    """Mark ``ep`` failed with ``reason`` and close it in UCX.

    With peer error handling the UCX endpoint is force-closed, which fails
    every operation still outstanding on it.  Without it a force close is
    undefined behaviour in UCX; in ``"multi"`` thread mode another thread
    may be posting on the endpoint right now.  In those cases the UCX
    endpoint is left to the worker's destruction.  Either way, a tracked
    request UCX still holds is parked (its buffers stay alive until UCX lets
    go) and fails with PeerError, and blocking waits on the endpoint raise
    PeerError (``request.block``).
    """
    ep._state.error = lib.UCS_ERR_CONNECTION_RESET
    ep._error_reason = reason
    ep._closed_reason = reason
    h = ep._h
    ep._h = None  # later operations raise PeerError (see _handle.raise_closed)
    parent = ep._parent  # the bookkeeping close() does for a closed child
    if parent is not None:
        parent._live -= 1
    force = ep._peer_mode and not worker._multi
    if force:
        pending = [r for r in worker._pending if r._slot.status == INPROGRESS]
        slot = ffi.new("gpucx_slot_t *")
        if lib.gpucx_ep_close(h, 1, slot) == INPROGRESS:
            worker._park(slot, None)
        else:
            lib.gpucx_slot_release(slot)
        lib.ucp_worker_progress(worker._h)
        # Operations gpucx cannot tie to an endpoint (a tag receive already
        # matched to the dead peer's rendezvous send) come back canceled by
        # the force close, within a few progress calls: that is the peer's
        # death (see Request._complete).
        until = time.monotonic() + SUSPECT_S
        for req in pending:
            if req._ep is None:
                worker._suspects[req] = (reason, until)
    # Atomics gpucx emulates over active messages wait for a reply UCX knows
    # nothing of: they fail with the peer's death now.
    lib.gpucx_amo_ep_closed(worker._state, h, ep._state.error)
    for req in [r for r in worker._pending if r._ep is ep]:
        if req._slot.status != INPROGRESS:
            req._complete()
        else:
            worker._park(req._slot, req._keep)
            req._fail(peer_gone(req._what, reason, ep._state.error))
    # The endpoint's children (unpacked remote keys) must go before the UCX
    # endpoint and worker do; a later close() of the endpoint finds no UCX
    # handle and would not reach them.
    if force:
        ep._close_children()
    else:  # the UCX endpoint lives on: close them with the worker
        worker._on_close.append(lambda: _close_keys(worker, ep))


def _close_keys(worker, ep) -> None:
    """Close a dead peer's remote keys within the closing worker's deadline."""
    ep._deadline = worker._deadline
    ep._close_children()


def free_parked_keys(worker, closing: bool = False) -> None:
    """Free the remote keys closed while parked operations held them
    (``worker._parked_keys``) whose operations UCX has let go of.  With
    ``closing`` (the worker's close, before ``ucp_worker_destroy``) every
    entry goes: one UCX still uses is left to the worker's destruction,
    never freed under UCX."""
    keys = worker._parked_keys
    left = []
    for rkey_h, slots in keys:
        if all(s.status != INPROGRESS for s in slots):
            lib.gpucx_rkey_destroy(rkey_h)
        elif not closing:
            left.append((rkey_h, slots))
    keys[:] = left


def sweep_parked(worker) -> None:
    """Free parked slots UCX has let go of (their buffers go with them), and
    the remote keys closed while such operations held them, once UCX let
    go of every one (before their slots are released)."""
    if worker._parked_keys:
        free_parked_keys(worker)
    parked = worker._parked
    if parked and any(s.status != INPROGRESS for s, _ in parked):
        keep = []
        for slot, k in parked:
            if slot.status == INPROGRESS:
                keep.append((slot, k))
            else:
                lib.gpucx_slot_release(slot)
        parked[:] = keep
