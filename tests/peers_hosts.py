"""Peer programs for the tests across emulated hosts (tests/test_hosts.py,
tests/test_hosts_dask.py, tests/test_hosts_flood.py).

Run as ``python peers_hosts.py ROLE ARGS...`` on an emulated host (see
tests/hosts.py).  They speak to the test over stdin/stdout, one JSON value
a line (bytes as ``{"b": hex}``): a multiprocessing queue does not cross
network namespaces.  UCX's own log lines go to stdout, so the protocol gets
a private copy of fd 1 and fd 1 is pointed at stderr.
"""

from __future__ import annotations

import faulthandler
import os
import select
import sys
import time

from hosts import child_channel

# Before UCX loads: its log lines go to fd 1.
put, get = child_channel()
# A peer that hangs prints where and exits, well inside the test's timeout.
faulthandler.dump_traceback_later(
    int(os.environ.get("GPUCX_PEER_DEADLINE", "45")), exit=True
)

import numpy as np  # noqa: E402

import gpucx  # noqa: E402

TIMEOUT = 30
MIB = 1 << 20
AM_ID = 5


def payload(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def owner(how: str, host: str) -> None:
    """The side that is reached: listens on ``host`` (``how`` = "listener")
    or publishes its worker address ("address"); offers a registered region;
    answers every kind of transfer the user side starts."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        data = np.zeros(MIB, np.uint8)
        region = ctx.register(data)
        am_buf = np.zeros(MIB, np.uint8)
        am_req = w.am_recv_nb(AM_ID, am_buf)  # posted before the peer sends
        if how == "listener":
            lst = w.listen(host=host, port=0)
            put(["port", lst.port, region.remote().to_bytes()])
            ep = lst.accept(timeout=TIMEOUT)
        else:
            put(["address", w.address, region.remote().to_bytes()])
            ep = w.connect(get())
        # tag: eager and rendezvous sizes, echoed back
        for i, n in enumerate((64, MIB)):
            buf = np.empty(n, np.uint8)
            info = w.recv(buf, tag=10 + i, timeout=TIMEOUT)
            assert info.nbytes == n and np.array_equal(buf, payload(n, i))
            ep.send(buf, tag=20 + i, timeout=TIMEOUT)
        # AM (rendezvous size)
        assert am_req.wait(TIMEOUT) == MIB
        assert np.array_equal(am_buf, payload(MIB, 7))
        # RMA: the user put into `data`, then says so; the owner writes a
        # pattern for the user's get and progresses until the user is done
        note = np.empty(1, np.uint8)
        w.recv(note, tag=30, timeout=TIMEOUT)
        assert np.array_equal(data[4096 : 4096 + 65536], payload(65536, 3))
        data[: 2 * 65536] = payload(2 * 65536, 4)
        ep.send(note, tag=31, timeout=TIMEOUT)
        # arrays both ways
        arr = ep.recv_array(timeout=TIMEOUT)
        assert arr.dtype == np.float32 and arr.shape == (300, 500), (
            arr.dtype,
            arr.shape,
        )
        ep.send_array(arr * 2, timeout=TIMEOUT)
        w.recv(note, tag=40, timeout=TIMEOUT)  # the user has everything
        put(["done", ep.transports, ep.remote_sockaddr])
        get()  # wait for the test before closing


def user(how: str, host: str) -> None:
    """The side that connects (by ``(host, port)`` or by worker address)
    and drives every transfer."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        _, where, token = get()
        if how == "listener":
            ep = w.connect((host, where))
        else:
            ep = w.connect(where)
            put(w.address)
        for i, n in enumerate((64, MIB)):
            ep.send(payload(n, i), tag=10 + i, timeout=TIMEOUT)
            back = np.empty(n, np.uint8)
            w.recv(back, tag=20 + i, timeout=TIMEOUT)
            assert np.array_equal(back, payload(n, i))
        ep.am_send(AM_ID, payload(MIB, 7), timeout=TIMEOUT)
        key = ep.unpack(token)
        ep.put(payload(65536, 3), key, offset=4096, timeout=TIMEOUT)
        ep.flush(timeout=TIMEOUT)
        note = np.zeros(1, np.uint8)
        ep.send(note, tag=30, timeout=TIMEOUT)
        w.recv(note, tag=31, timeout=TIMEOUT)
        out = np.empty(2 * 65536, np.uint8)
        ep.get(out, key, offset=0, timeout=TIMEOUT)
        assert np.array_equal(out, payload(2 * 65536, 4))
        arr = np.arange(300 * 500, dtype=np.float32).reshape(300, 500)
        ep.send_array(arr, timeout=TIMEOUT)
        back = ep.recv_array(timeout=TIMEOUT)
        assert np.array_equal(back, arr * 2)
        ep.send(note, tag=40, timeout=TIMEOUT)
        put(["done", ep.transports, ep.local_sockaddr])
        get()


def fd_count(w) -> int:
    """Open file descriptors once ``w`` has progressed a while (UCX lets go
    of a closed endpoint's sockets from progress): the fewest seen over its
    last 0.2 s, since UCX's own thread opens and closes descriptors of its
    own now and then."""
    start = time.monotonic()
    counts = []
    while time.monotonic() < start + 0.5:
        w.progress()
        time.sleep(0.001)
        if time.monotonic() > start + 0.3:
            counts.append(len(os.listdir("/proc/self/fd")))
    return min(counts)


def _connect_or_accept(w, side: str, lst, where):
    if side == "a":
        return lst.accept(timeout=TIMEOUT)
    return w.connect(where)


def _round_trip(w, ep, side: str) -> None:
    """One small tag message each way (proves the connection works)."""
    out = payload(4096, 9)
    back = np.empty_like(out)
    req = w.recv_nb(back, tag=60)
    ep.send(out, tag=60, timeout=TIMEOUT)
    req.wait(TIMEOUT)
    assert np.array_equal(back, out)


def _outcome(req, since: float, ep=None):
    """How a pending request ended: (exception class names, seconds after
    ``since``); ``ep``: the endpoint of a receive (Request.wait's)."""
    try:
        req.wait(TIMEOUT, ep=ep)
        names = ["ok"]
    except gpucx.UCXError as exc:
        names = [
            c.__name__ for c in type(exc).__mro__ if c.__module__ == "gpucx.errors"
        ]
        names.append(str(exc))
    return [names, time.monotonic() - since]


def pending(side: str, host: str, nbytes: str, ops: str = "all") -> None:
    """One side of a connection that loses its peer (the test cuts the link
    or freezes the other side) with operations pending on it.

    Side "a" listens on ``host``, side "b" connects to it (the port comes
    from the test).  A first connection makes one round trip and closes
    ("closed"; the test answers once both sides did): the file descriptors
    counted then are the baseline.  On a second connection each side
    posts, towards the other (``ops`` "all"): a tag receive matched by the
    other's rendezvous send and that send (``nbytes`` each), a put and a
    get on the other's region and a rendezvous active message; or only the
    send (``ops`` "send") or only the receive ("recv", the side that has
    nothing to send then); then says "posted".  Told "cut" with a
    monotonic time, it waits for every request and reports how each ended
    and when, tries a blocking send on the failed endpoint and closes it.
    Told "again", it connects a third time (the test has mended the link),
    makes a round trip, closes ("closed" again), and reports the
    descriptors against the baseline.
    """
    n = int(nbytes)
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        w.set_am_handler(AM_ID, lambda msg: None)  # the other side's AM
        lst = where = None
        if side == "a":
            lst = w.listen(host=host, port=0)
            put(["port", lst.port])
        else:
            where = (host, get())
        ep = _connect_or_accept(w, side, lst, where)
        _round_trip(w, ep, side)
        ep.close(timeout=TIMEOUT)
        # Counted once both sides closed (UCX lets go of a connection's
        # socket when the other side has closed it too).
        put(["closed"])
        get()
        baseline = fd_count(w)
        ep = _connect_or_accept(w, side, lst, where)
        rma = np.zeros(8 * MIB, np.uint8)
        region = ctx.register(rma)
        token = np.frombuffer(region.remote().to_bytes(), np.uint8)
        theirs = np.zeros(4096, np.uint8)
        req = w.recv_nb(theirs, tag=50)
        ep.send(token, tag=50, timeout=TIMEOUT)
        info = req.wait(TIMEOUT)
        key = ep.unpack(theirs[: info.nbytes].tobytes())
        inbox = np.zeros(n, np.uint8)
        outbox = np.ones(n, np.uint8)
        reqs = {}
        if ops in ("all", "recv"):
            reqs["tag recv (matched)"] = w.recv_nb(inbox, tag=1)
        if ops in ("all", "send"):
            reqs["tag send (rendezvous)"] = ep.send_nb(outbox, tag=1)
        # The rendezvous sends reach the other side and match while the
        # link is idle, before their payloads fill it.
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            w.progress()
        if ops == "all":
            reqs["put"] = ep.put_nb(np.ones(4 * MIB, np.uint8), key)
            reqs["get"] = ep.get_nb(np.empty(4 * MIB, np.uint8), key, offset=4 * MIB)
            reqs["am send (rendezvous)"] = ep.am_send_nb(
                AM_ID, np.ones(4 * MIB, np.uint8), proto="rndv"
            )
        put(["posted", ctx.tuned])
        # Progress until the test speaks (it cuts the link meanwhile).
        while not select.select([sys.stdin], [], [], 0.001)[0]:
            w.progress()
        _, since = get()
        ended = {name: _outcome(r, since) for name, r in reqs.items()}
        t = time.monotonic()
        try:
            ep.send(payload(64, 1), tag=2, timeout=TIMEOUT)
            later = ["ok"]
        except gpucx.UCXError as exc:
            later = [type(exc).__name__, str(exc)]
        later_s = time.monotonic() - t
        key.close()
        ep.close(timeout=TIMEOUT)
        put(["ended", ended, later, later_s])
        if get() != "again":
            return
        ep = _connect_or_accept(w, side, lst, where)
        _round_trip(w, ep, side)
        ep.close(timeout=TIMEOUT)
        region.close()
        put(["closed"])
        get()
        put(["fds", baseline, fd_count(w)])
        get()


def unanswered(side: str, host: str, seconds: str) -> None:
    """A rendezvous send to a peer that takes nothing while frozen.

    Side "a" listens and sends 8 MiB (tag 7) once connected, progressing
    1 s (the heartbeat's first ping, after 0.2 T, is answered) before it
    says "posted";
    side "b" connects and progresses until the test speaks (it is frozen
    meanwhile).  Told "watch" with a monotonic time, side "a" progresses
    for at most ``seconds`` and reports whether the send ended, how
    (:func:`_outcome`) and the endpoint's error.  Told "receive" (thawed),
    side "b" receives the send with its endpoint and reports how that
    ended: the abort notice of "a" fails it at once.
    """
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        if side == "a":
            lst = w.listen(host=host, port=0)
            put(["port", lst.port])
            ep = lst.accept(timeout=TIMEOUT)
            _round_trip(w, ep, side)
            req = ep.send_nb(payload(8 * MIB, 5), tag=7)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                w.progress()
            put(["posted", ctx.tuned])
            _, since = get()
            end = since + float(seconds)
            while time.monotonic() < end and not req.done():
                w.progress()
                time.sleep(0.001)
            done = req.done()
            put(["watched", done, _outcome(req, since) if done else None])
        else:
            ep = w.connect((host, get()))
            _round_trip(w, ep, side)
            put(["connected"])
            while not select.select([sys.stdin], [], [], 0.001)[0]:
                w.progress()
            assert get() == "receive"
            buf = np.empty(8 * MIB, np.uint8)
            t = time.monotonic()
            put(["received", _outcome(w.recv_nb(buf, tag=7), t, ep)])
        get()


# -- Dask across hosts (tests/test_hosts_dask.py) -----------------------------


def _serve_until_told(make) -> None:
    """Run ``await make()`` (a Dask server, as an async context manager's
    object) in an event loop, say ``["address", its address]``, and close it
    once the test writes a line."""
    import asyncio

    async def main():
        async with await make() as server:
            put(["address", server.address])
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())


def dask_scheduler(scheme: str, host: str) -> None:
    """A ``distributed.Scheduler`` listening on ``scheme://host:0``."""
    from distributed import Scheduler

    async def make():
        return Scheduler(host=host, port=0, protocol=scheme, dashboard=False)

    _serve_until_told(make)


def dask_worker(scheduler: str, interface: str = "") -> None:
    """A ``distributed.Worker`` of ``scheduler`` given no host, as ``dask
    worker SCHEDULER`` starts one (Dask picks what it listens on and the
    address it gives out), or given ``interface`` (``--interface``)."""
    from distributed import Worker

    async def make():
        return Worker(
            scheduler,
            nthreads=1,
            dashboard=False,
            memory_limit=0,
            interface=interface or None,
        )

    _serve_until_told(make)


def comms_seen(dask_worker) -> list:
    """Every comm this Dask server holds (the scheduler's batched stream,
    pooled and incoming comms): ``[local, peer, same_host, data endpoint
    (gpucx:// only), transport names (gpucx:// only)]`` each."""
    comms = set(dask_worker._comms)  # comms accepted and being handled
    for pooled in (dask_worker.rpc.available, dask_worker.rpc.occupied):
        for group in pooled.values():
            comms |= set(group)
    streams = [getattr(dask_worker, "batched_stream", None)]
    streams += getattr(dask_worker, "stream_comms", {}).values()  # a scheduler's
    for stream in streams:
        if stream is not None and stream.comm is not None:
            comms.add(stream.comm)
    return [_comm_seen(c) for c in comms if not c.closed()]


def _comm_seen(c) -> list:
    """``[local, peer, same_host, transports]`` of a Dask comm; for
    ``gpucx://``, the transport names of the connection's endpoint and,
    where the comm has one, of its same-host data endpoint (None when it
    has none)."""
    transports = None
    if type(c).__name__ == "GpucxComm":
        transports = [sorted({name for name, _ in c._ep.transports}), None]
        if c._dep is not c._ep:
            transports[1] = sorted({name for name, _ in c._dep.transports})
    return [c.local_address, c.peer_address, c.same_host, transports]


def _fetched_from(dask_worker) -> list:
    """Who this worker fetched data from, and how many bytes (Dask's own
    ``transfer_incoming_log``)."""
    return [[d["who"], d["total"]] for d in dask_worker.transfer_incoming_log]


def dask_client(scheduler: str) -> None:
    """Connect to ``scheduler`` and wait for two workers; make an 8 MiB
    array and a small one on each worker and have a task on the other one
    take it (``workers=[...]``, ``allow_other_workers=False``: Dask fetches
    it worker to worker); then report the workers' addresses, what each
    fetched from where, and every comm of each worker."""
    from distributed import Client

    with Client(scheduler, timeout=30) as c:
        c.wait_for_workers(2, timeout=30)
        wa, wb = sorted(c.scheduler_info()["workers"])
        sums = []
        for src, dst in ((wa, wb), (wb, wa)):
            for n in (1000, 8 * MIB):
                x = c.submit(payload, n, 5, workers=[src], pure=False)
                y = c.submit(
                    np.sum, x, workers=[dst], allow_other_workers=False, pure=False
                )
                sums.append(int(y.result(timeout=30)) == int(payload(n, 5).sum()))
                del x, y
        put(
            [
                "done",
                [wa, wb],
                sums,
                c.run(_fetched_from),
                c.run(comms_seen),
                c.run_on_scheduler(comms_seen),
                comms_seen_client(c),
            ]
        )
        get()


def comms_seen_client(client) -> list:
    """The client's comm to the scheduler, as :func:`comms_seen` says it."""
    return [_comm_seen(client.scheduler_comm.comm)]


def dask_comm(side: str, scheme: str, host: str, timeout: str) -> None:
    """One end of a ``distributed.comm`` connection that the test cuts.

    Side "a" listens on ``host`` and says ``["address", ...]``; side "b"
    connects to the address the test gives it.  "a" writes one message,
    "b" reads it; then each posts a read that nothing will answer and says
    "ready".  The reads end when the comm learns that the other host is
    gone: each side then says ``["ended", exception name, monotonic
    time]``.  ``timeout`` (seconds) is ``distributed-gpucx.peer-timeout``
    for ``gpucx://`` and ``distributed.comm.timeouts.tcp`` for ``tcp://``.
    """
    import asyncio

    import dask.config
    from distributed.comm import connect, listen

    async def pending_read(comm) -> None:
        put(["ready"])
        try:
            await asyncio.wait_for(comm.read(), TIMEOUT)
            name = "read"
        except Exception as exc:  # what ended it is the report
            name = type(exc).__name__
        put(["ended", name, time.monotonic()])

    async def main():
        if side == "b":
            comm = await connect(get(), timeout=TIMEOUT)
            assert await comm.read() == "hello"
            await pending_read(comm)
            return
        accepted: asyncio.Queue = asyncio.Queue()

        async def handle(comm):
            await accepted.put(comm)
            await asyncio.sleep(3600)  # the comm stays open

        async with listen(f"{scheme}://{host}:0", handle) as lst:
            put(["address", lst.contact_address])
            comm = await accepted.get()
            await comm.write("hello")
            await pending_read(comm)

    cfg = {
        "distributed-gpucx.peer-timeout": f"{timeout}s",
        "distributed.comm.timeouts.tcp": f"{timeout}s",
    }
    with dask.config.set(cfg):
        asyncio.run(main())
    get()  # the test has everything


# -- a hostile flood across the link (tests/test_hosts_flood.py) --------------


class _Chan:
    """The ``chan`` of the one-host flood and fuzz peers (tests/peers_flood.py,
    tests/peers_fuzz.py), over this program's stdin/stdout."""

    def put(self, obj) -> None:
        put(obj)

    def get(self, timeout: float | None = None):
        return get()  # a hang ends at GPUCX_PEER_DEADLINE


def flooder(kind: str, n: str, size: str) -> None:
    """``peers_flood.flood`` from this host: ``n`` eager messages of ``size``
    bytes of ``kind`` to the survivor, then a tag message."""
    from peers_flood import flood

    flood(_Chan(), "default", kind, int(n), int(size))


def hostile_arrays() -> None:
    """``peers_fuzz.hostile_array_peer`` from this host: the messages (header,
    payload size, protocol) come from the test."""
    from peers_fuzz import hostile_array_peer

    chan = _Chan()
    messages = get()
    hostile_array_peer("default", chan, messages)


def rss() -> int:
    """This process's resident memory in bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def survivor(n: str, size: str, hostile: str) -> None:
    """The receiver of a flood from one host while another host sends it
    malformed array messages.

    Takes the first flood message with a posted AM receive, as an
    application would, then only progresses (the rest are unexpected, kept
    up to the caps and dropped beyond).  Meanwhile it receives ``hostile``
    malformed array messages and a good array from the other peer with
    ``recv_array``.  Once the test says the flood is over, receives the
    flooder's tag message and reports its resident memory growth, the AM
    queue's counters, the warnings, and how each array message ended.
    """
    import dataclasses
    import warnings

    from peers_flood import AFTER_TAG, FLOOD_AM_ID

    n_msgs, nbytes = int(n), int(size)
    with (
        gpucx.Context() as ctx,
        warnings.catch_warnings(record=True) as rec,
    ):
        warnings.simplefilter("always")
        w = ctx.create_worker()
        first = np.zeros(nbytes, np.uint8)
        req = w.am_recv_nb(FLOOD_AM_ID, first)
        put(["address", w.address])
        flood_ep = w.connect(get())  # the flooder's address
        arrays_ep = w.connect(get())  # the hostile peer's
        req.wait(TIMEOUT)
        base = peak = rss()
        arrays = []
        for _ in range(int(hostile)):
            try:
                arrays_ep.recv_array(timeout=TIMEOUT)
                arrays.append("received")
            except ValueError as exc:
                arrays.append(str(exc))
            peak = max(peak, rss())
        good = arrays_ep.recv_array(timeout=TIMEOUT)
        good_ok = bool(np.array_equal(good, np.arange(1000, dtype=np.float64)))
        left = n_msgs - 1
        flooded = False
        while True:
            for _ in range(200):
                w.progress()
            s = w.stats()["am_kept"]
            peak = max(peak, rss())
            if not flooded and select.select([sys.stdin], [], [], 0)[0]:
                flooded = get() == "flooded"
            if flooded and s.count + s.dropped >= left:
                break
        buf = bytearray(64)
        info = w.recv(buf, tag=AFTER_TAG, timeout=TIMEOUT)
        after = bytes(buf[: info.nbytes]).decode()
        drops = [
            str(r.message)
            for r in rec
            if issubclass(r.category, gpucx.DroppedMessagesWarning)
        ]
        put(
            [
                "done",
                peak - base,
                dataclasses.asdict(w.stats()["am_kept"]),
                drops,
                arrays,
                good_ok,
                after,
                [flood_ep.transports, arrays_ep.transports],
            ]
        )
        get()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
