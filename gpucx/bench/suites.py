"""The measurements ``gpucx bench`` runs, one class per test name.

Names follow ``ucx_perftest`` so figures can be compared.  Latency tests
report one-way latency (half a round trip, as ``ucx_perftest`` does) except
``fadd_lat``, whose figure is the whole fetch-and-add (it is a round trip by
nature).  Bandwidth tests report bytes moved per second and the average time
per message.

``tag_lat`` and ``tag_bw`` run their timing loops in C
(``gpucx/_csrc/bench.c``): one Python->C crossing per measured point.  With
``--async`` they use the public non-blocking API (``send_nb``/``recv_nb``
and :class:`~gpucx.Request`) instead, which measures what a Python program
using those calls gets.  The other tests drive the public API of their area
(AM, stream, RMA, atomics, arrays) from Python.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy

from .._internal import am_recv_registration, engine, handle, park, rkey_handle
from .._lib import ffi, lib
from ..mem.buffer import acquire
from ..ops import rma as _rma
from ..request import INPROGRESS, raise_status
from .errors import BenchSetupError
from .memory import MEMORY_KINDS, alloc
from .session import ACK_TAG, DATA_TAG, BadControlMessage, quote, reply_field
from .sizes import MAX_SIZE

__all__ = [
    "TESTS",
    "DEFAULT_TESTS",
    "Params",
    "Bench",
    "MAX_ITERS",
    "MAX_WINDOW",
    "APIS",
    "API_PATHS",
    "PREPARED_TESTS",
]

#: Most iterations (and warm-up iterations) of one point.
MAX_ITERS = 1 << 32
#: Largest ``window`` (a C loop allocates one completion slot per message).
MAX_WINDOW = 1 << 16
#: Longest per-point ``timeout`` in seconds.
MAX_TIMEOUT = 1e6
#: The paths ``gpucx bench --api`` measures (see Params.api), and the tests
#: that have a prepared-list path.
APIS = ("c", "python", "prepared")
PREPARED_TESTS = ("put_bw", "get_bw", "am_bw")
API_PATHS = {
    "c": "C loop (gpucx/_csrc/bench.c): the transport's speed",
    "python": "Python API, one Request per message",
    "prepared": "prepared transfer lists and AM batches "
    "(ep.prepare_put/prepare_get/prepare_am), one C call per list",
}

#: Active-message id the AM tests use.
AM_ID = 7

_perf_ns = time.perf_counter_ns


@dataclasses.dataclass
class Params:
    """One measured point, as both sides see it."""

    test: str
    size: int
    iters: int
    warmup: int
    window: int = 32
    client_mem: str = "host"
    server_mem: str = "host"
    use_async: bool = False
    timeout: float = 120.0
    #: Which path is measured: "c" (loops in C), "python" (the Request API,
    #: one call per message) or "prepared" (put_bw/get_bw/am_bw through
    #: prepared lists, ``ep.prepare_put``/``prepare_get``/``prepare_am``).
    #: ``use_async`` is True unless "c".
    api: str = "c"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> Params:
        """The point a control message describes, every field checked.

        Raises
        ------
        ValueError
            Naming the field: not an object, an unknown or missing field, a
            value of the wrong type or out of range (size up to 16 GiB,
            iters and warmup up to 2**32, window up to 65536, a finite
            timeout up to 1e6 s, a known test and memory kind).
        """
        if not isinstance(d, dict):
            raise ValueError(f"params must be an object, not {quote(d)}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in fields)
        if unknown:
            raise ValueError(f"params: unknown field(s) {quote(unknown)}")
        missing = [
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and name not in d
        ]
        if missing:
            raise ValueError(f"params: missing field(s) {missing}")
        test = d["test"]
        if not isinstance(test, str) or test not in TESTS:
            raise ValueError(f"params: unknown test {quote(test)}")
        _count(d, "size", 0, MAX_SIZE)
        _count(d, "iters", 1, MAX_ITERS)
        _count(d, "warmup", 0, MAX_ITERS)
        _count(d, "window", 1, MAX_WINDOW)
        for name in ("client_mem", "server_mem"):
            if name in d and d[name] not in MEMORY_KINDS:
                raise ValueError(
                    f"params: bad --memory kind {quote(d[name])} for {name}: "
                    "use host, ucx, reg or cuda"
                )
        if "use_async" in d and not isinstance(d["use_async"], bool):
            raise ValueError(
                f"params: use_async must be true or false, not {quote(d['use_async'])}"
            )
        if "api" in d and d["api"] not in APIS:
            raise ValueError(
                f"params: api must be one of {', '.join(APIS)}, not {quote(d['api'])}"
            )
        if "timeout" in d:
            t = d["timeout"]
            if (
                not isinstance(t, (int, float))
                or isinstance(t, bool)
                or not 0 < t <= MAX_TIMEOUT
            ):
                raise ValueError(
                    f"params: timeout must be a number in (0, {MAX_TIMEOUT:g}], "
                    f"not {quote(t)}"
                )
        return cls(**d)


def _count(d: dict, name: str, low: int, high: int) -> None:
    if name not in d:
        return
    v = d[name]
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise ValueError(
            f"params: {name} must be an int in [{low}, {high}], not {quote(v)}"
        )


def lat_figures(size: int, one_way_ns) -> dict:
    """Figures of a latency test from per-iteration one-way times (ns)."""
    a = numpy.asarray(one_way_ns, dtype=numpy.float64)
    avg = float(a.mean())
    return {
        "latency_us": float(numpy.median(a)) / 1e3,
        "latency_p99_us": float(numpy.percentile(a, 99)) / 1e3,
        "latency_avg_us": avg / 1e3,
        "bandwidth_gbs": size / avg if avg > 0 else 0.0,
        "msg_rate": 1e9 / avg if avg > 0 else 0.0,
        "elapsed_s": float(a.sum()) / 1e9,
    }


def bw_figures(size: int, iters: int, elapsed_ns: int) -> dict:
    """Figures of a bandwidth test: ``iters`` messages of ``size`` bytes."""
    elapsed_ns = max(int(elapsed_ns), 1)
    per = elapsed_ns / max(iters, 1)
    return {
        "latency_us": None,
        "latency_p99_us": None,
        "latency_avg_us": per / 1e3,
        "bandwidth_gbs": size * iters / elapsed_ns,
        "msg_rate": iters * 1e9 / elapsed_ns,
        "elapsed_s": elapsed_ns / 1e9,
    }


class Bench:
    """One test at one size; the same class runs on both sides.

    The client calls :meth:`run` after the server answered :meth:`prepare`
    (whose dict it gets as ``extra``); the server then runs :meth:`serve`.
    """

    name = ""
    kind = "bw"  # "lat" or "bw"
    #: The matching ucx_perftest test, or None.
    perftest: str | None = None
    #: Only these sizes make sense (atomics), or None.
    fixed_sizes: tuple[int, ...] | None = None
    #: What the latency figure means (for the table's notes).
    latency_note = "one-way (half a round trip)"
    #: The API the test always measures, whatever ``--api`` says (None:
    #: the one ``--api`` names).
    fixed_api: str | None = None
    #: Context features the serving side needs for this test
    #: (``gpucx bench --server`` enables only those of the tests it serves).
    features: frozenset[str] = frozenset({"tag"})
    #: The send and receive buffers of the ping-pong tests (c_pingpong).
    sbuf: Any
    rbuf: Any
    #: The operation whose UCX protocol the result names (a key of
    #: gpucx.protocols.OPERATIONS), or None.
    protocol_op: str | None = None
    #: A protocol learnt while measuring (an RMA probe), else None.
    probed: Any = None

    def __init__(self, sess, params: Params, server: bool = False):
        self.s = sess
        self.p = params
        self.server = server
        self.mem = params.server_mem if server else params.client_mem
        self.timeout_ns = int(params.timeout * 1e9)

    # server side
    def prepare(self) -> dict:
        return {}

    def serve(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        pass

    # client side
    def run(self, extra: dict) -> dict:
        raise NotImplementedError

    def protocol(self):
        """The protocol UCX used on the client's side for this point
        (gpucx.protocols.Protocol), or None if UCX does not tell; asked
        after :meth:`run`, once UCX has selected it."""
        if self.probed is not None or self.protocol_op is None:
            return self.probed
        # UCX's memory types: "ucx" and "reg" are host memory too.
        memory = tuple(
            "cuda" if m == "cuda" else "host"
            for m in (self.p.client_mem, self.p.server_mem)
        )
        return self.s.ep.protocol(self.protocol_op, self.p.size, memory)

    # helpers
    def buffer(self, fill: int = 0):
        other = self.p.client_mem if self.server else self.p.server_mem
        return alloc(
            self.mem, self.p.size, self.s.device, fill, self.s.ctx, other == "cuda"
        )

    def c_pingpong(self, fn, head: tuple, tail: tuple, rtt) -> None:
        """One run of a C ping-pong loop (``gpucx_bench_*_pingpong``):
        ``fn(worker, ep, *head, sbuf, smt, rbuf, rmt, nbytes, *tail,
        timeout_ns, slots, rtt_ns, elapsed)`` on this side's ``sbuf`` and
        ``rbuf``; round trips into ``rtt`` (a uint64 array) unless None.
        Raises the loop's error."""
        sp, n, smt, skeep = acquire(self.sbuf, False)
        rp, _, rmt, rkeep = acquire(self.rbuf, True)
        out = ffi.new("uint64_t *")
        rtt_p = ffi.NULL if rtt is None else ffi.cast("uint64_t *", rtt.ctypes.data)
        slots = c_slots(2)
        w, ep = handle(self.s.worker), handle(self.s.ep)
        st = fn(
            w, ep, *head, sp, smt, rp, rmt, n, *tail, self.timeout_ns, slots, rtt_p, out
        )
        raise_after_loop(
            self.s, st, slots, 2, (skeep, rkeep, rtt), f"bench {self.name}"
        )

    def c_acked_stream(self, fn, head: tuple, tail: tuple, buf, receiving: bool) -> int:
        """One run of a C bandwidth loop that ends with the receiver's
        acknowledgement (``gpucx_bench_tag_stream``, ``gpucx_bench_am_stream``):
        ``fn(worker, ep, *head, ptr, nbytes, mt, *tail, window, timeout_ns,
        slots, ack, elapsed)`` on ``buf``; returns the ns it took."""
        ptr, nbytes, mt, keep = acquire(buf, receiving)
        out = ffi.new("uint64_t *")
        nslots = self.p.window + 1
        slots = c_slots(nslots)
        ack = ffi.new("uint64_t *")
        w, ep = handle(self.s.worker), handle(self.s.ep)
        st = fn(
            w,
            ep,
            *head,
            ptr,
            nbytes,
            mt,
            *tail,
            self.p.window,
            self.timeout_ns,
            slots,
            ack,
            out,
        )
        raise_after_loop(self.s, st, slots, nslots, (keep, ack), f"bench {self.name}")
        return out[0]

    def run_prepared(self, prepare, entry, n: int, finish) -> int:
        """``n`` operations as prepared lists of ``window`` entries
        (``prepare([entry] * k)``: ``ep.prepare_put``, ``prepare_get``,
        ``prepare_am``): one C call runs a list, two lists in flight at a
        time, then ``finish()`` (a flush, the receiver's acknowledgement).
        Returns the ns from the first run to the end of ``finish``."""
        t = self.p.timeout
        window = max(1, self.p.window)
        full, rest = divmod(n, window)
        lists = [prepare([entry] * window)] if full else []
        tail = prepare([entry] * rest) if rest else None
        try:
            runs = lists * full + ([tail] if tail is not None else [])
            t0 = _perf_ns()
            prev = None
            for xfer in runs:
                req = xfer.run_nb()
                if prev is not None:
                    prev.wait(t)
                prev = req
            if prev is not None:
                prev.wait(t)
            finish()
            return _perf_ns() - t0
        finally:
            for xfer in [*lists, tail]:
                if xfer is not None:
                    xfer.close()

    def ack_send(self) -> None:
        self.s.ep.send(numpy.zeros(1, numpy.uint64), tag=ACK_TAG)

    def ack_recv(self) -> None:
        self.s.worker.recv(
            numpy.zeros(1, numpy.uint64), tag=ACK_TAG, timeout=self.p.timeout
        )

    def bw_run(self, phase) -> dict:
        """The client of a bandwidth test: ``phase(n)`` sends n messages and
        returns the ns they took; a warm-up phase, then the measured one."""
        phase(self.p.warmup)
        return bw_figures(self.p.size, self.p.iters, phase(self.p.iters))

    def serve_phases(self, one) -> None:
        """The server of a bandwidth test: ``one()`` per message of the
        warm-up phase, then of the measured one, each acknowledged.  (The
        client's timed loops stay written out: a call through a callable
        per message would be part of what they measure.)"""
        for n in (self.p.warmup, self.p.iters):
            for _ in range(n):
                one()
            self.ack_send()


def spin_wait(sess, req, timeout: float):
    """``req.wait(timeout)``, busy-polling the worker all the while.

    ``Request.wait`` spins for ``GPUCX_SPIN_US`` and then sleeps on the
    worker's event fd; a receiving side that sleeps makes the sender's
    shared-memory transport signal it and wait for it to wake.
    ``ucx_perftest``'s receiver polls without sleeping, so the bench's
    receivers do too.  The deadline and the endpoint's health are checked
    every 1000 polls: a failed endpoint raises its error (posted receives
    belong to the worker and would not fail), the deadline ends in
    ``req.wait``, which raises.

    Written out rather than through the engine's ``wait_for(poll=True)``: it is
    on the measured path of the Python API's receivers, and ``req.done()``
    progresses itself, so each poll is one progress call, not two.
    """
    end = time.monotonic() + timeout
    ep = sess.ep
    while True:
        for _ in range(1000):
            if req.done():
                return req.wait(timeout)
        err = ep.error
        if err is not None:
            raise err
        if time.monotonic() > end:
            return req.wait(max(end - time.monotonic(), 0.0))


def c_slots(n: int):
    """Zeroed completion slots for a C timing loop."""
    return ffi.new("gpucx_slot_t[]", n)


def raise_after_loop(sess, st: int, slots, n: int, keep, what: str) -> None:
    """After a C loop: raise its error, parking the slots UCX still holds.

    A rendezvous send to a peer that stopped answering cannot be canceled:
    its slot (and the buffers) are parked on the worker, which settles them
    when the endpoint and the worker close.
    """
    if st == lib.UCS_OK:
        return
    w = sess.worker
    for i in range(n):
        if slots[i].status == INPROGRESS:
            park(w, slots + i, (slots, keep))
            sess.tainted = True
    raise_status(st, what, sess.ep)


# -- tag ---------------------------------------------------------------------


class TagLat(Bench):
    protocol_op = "tag"
    name = "tag_lat"
    kind = "lat"
    perftest = "tag_lat"

    def _alloc(self):
        self.sbuf = self.buffer(1)
        self.rbuf = self.buffer()

    def prepare(self) -> dict:
        self._alloc()
        return {}

    def _c_loop(self, initiator: int, iters: int, rtt) -> None:
        self.c_pingpong(
            lib.gpucx_bench_tag_pingpong, (initiator,), (DATA_TAG, iters), rtt
        )

    def _py_loop(self, initiator: bool, iters: int, rtt) -> None:
        w, ep = self.s.worker, self.s.ep
        t = self.p.timeout
        for i in range(iters):
            t0 = _perf_ns()
            r = w.recv_nb(self.rbuf, tag=DATA_TAG)
            if not initiator:
                r.wait(t)
            ep.send_nb(self.sbuf, tag=DATA_TAG).wait(t)
            if initiator:
                r.wait(t)
                if rtt is not None:
                    rtt[i] = _perf_ns() - t0

    def _loop(self, initiator, iters, rtt):
        if self.p.use_async:
            self._py_loop(bool(initiator), iters, rtt)
        else:
            self._c_loop(initiator, iters, rtt)

    def serve(self) -> None:
        self._loop(0, self.p.warmup, None)
        self._loop(0, self.p.iters, None)

    def run(self, extra: dict) -> dict:
        self._alloc()
        rtt = numpy.zeros(self.p.iters, numpy.uint64)
        self._loop(1, self.p.warmup, None)
        self._loop(1, self.p.iters, rtt)
        return lat_figures(self.p.size, rtt / 2)


class TagBw(Bench):
    protocol_op = "tag"
    name = "tag_bw"
    kind = "bw"
    perftest = "tag_bw"
    latency_note = "time per message"

    def prepare(self) -> dict:
        self.buf = self.buffer()
        return {}

    def _c_loop(self, send: int, iters: int) -> int:
        return self.c_acked_stream(
            lib.gpucx_bench_tag_stream,
            (send,),
            (DATA_TAG, ACK_TAG, iters),
            self.buf,
            not send,
        )

    def _py_loop(self, send: bool, iters: int) -> int:
        w, ep, t = self.s.worker, self.s.ep, self.p.timeout
        window = max(1, self.p.window)
        t0 = _perf_ns()
        if send:
            ack = w.recv_nb(numpy.zeros(1, numpy.uint64), tag=ACK_TAG)
        reqs: list = []
        for _ in range(iters):
            if len(reqs) >= window:
                reqs.pop(0).wait(t)
            if send:
                reqs.append(ep.send_nb(self.buf, tag=DATA_TAG))
            else:
                reqs.append(w.recv_nb(self.buf, tag=DATA_TAG))
        for r in reqs:
            r.wait(t)
        if send:
            ack.wait(t)
        else:
            self.ack_send()
        return _perf_ns() - t0

    def _loop(self, send, iters) -> int:
        if self.p.use_async:
            return self._py_loop(bool(send), iters)
        return self._c_loop(send, iters)

    def serve(self) -> None:
        self._loop(0, self.p.warmup)
        self._loop(0, self.p.iters)

    def run(self, extra: dict) -> dict:
        self.buf = self.buffer(1)
        return self.bw_run(lambda n: self._loop(1, n))


# -- active messages ------------------------------------------------------------


class _AmBase(Bench):
    features = frozenset({"tag", "am"})
    protocol_op = "am"

    def _by_handler(self) -> bool:
        """Whether this side receives through a handler and ``receive_into``
        (device memory, and ``--api python``: the public API's per-message
        receive) rather than posted receives matched in gpucx's UCX callback
        (``--api c`` and ``prepared``)."""
        return self.mem == "cuda" or self.p.api == "python"

    def _inbox(self):
        self.inbox: collections.deque = collections.deque()
        self.s.worker.set_am_handler(AM_ID, self.inbox.append)

    def _take(self):
        # Busy-polls like ucx_perftest's receiver (see spin_wait).
        what = f"bench {self.name}: no active message"
        wait = engine(self.s.worker).wait_for
        wait(lambda: self.inbox, self.p.timeout, what, poll=True)
        msg = self.inbox.popleft()
        if msg.is_rndv:
            msg.receive_into(self.rbuf).wait(self.p.timeout)
        return msg

    def cleanup(self) -> None:
        try:
            self.s.worker.set_am_handler(AM_ID, None)
        except Exception:  # cleanup after a failed test: the worker may be
            pass  # closed already, and the test's own error is the one to report


class AmLat(_AmBase):
    name = "am_lat"
    kind = "lat"
    perftest = "ucp_am_lat"

    def prepare(self) -> dict:
        self.sbuf, self.rbuf = self.buffer(1), self.buffer()
        self._setup()
        return {}

    def _setup(self) -> None:
        if not self._by_handler():
            # Made before the client may send: without a handler, a message
            # that finds no posted receive is kept for the next one.
            self.reg = am_recv_registration(self.s.worker, AM_ID)
        else:
            self._inbox()

    def _c_loop(self, initiator: int, iters: int, rtt) -> None:
        self.c_pingpong(
            lib.gpucx_bench_am_pingpong, (self.reg, AM_ID, initiator), (iters,), rtt
        )

    def serve(self) -> None:
        if not self._by_handler():
            self._c_loop(0, self.p.warmup, None)
            self._c_loop(0, self.p.iters, None)
            return
        ep = self.s.ep
        for _ in range(self.p.warmup + self.p.iters):
            self._take()
            ep.am_send(AM_ID, self.sbuf)

    def run(self, extra: dict) -> dict:
        self.sbuf, self.rbuf = self.buffer(1), self.buffer()
        self._setup()
        rtt = numpy.zeros(self.p.iters, numpy.uint64)
        if not self._by_handler():
            self._c_loop(1, self.p.warmup, None)
            self._c_loop(1, self.p.iters, rtt)
            return lat_figures(self.p.size, rtt / 2)
        ep = self.s.ep
        try:
            for i in range(self.p.warmup + self.p.iters):
                t0 = _perf_ns()
                ep.am_send(AM_ID, self.sbuf)
                self._take()
                if i >= self.p.warmup:
                    rtt[i - self.p.warmup] = _perf_ns() - t0
        finally:
            self.cleanup()
        return lat_figures(self.p.size, rtt / 2)


class AmBw(_AmBase):
    name = "am_bw"
    kind = "bw"
    perftest = "ucp_am_bw"
    latency_note = "time per message"

    def _by_handler(self) -> bool:
        """Only ``--api python`` receives through the handler: posted
        receives take device memory too (a rendezvous payload zero copy, an
        eager one unpacked by UCX), so the C loop's receiver runs no Python
        per message whatever the memory."""
        return self.p.api == "python"

    def prepare(self) -> dict:
        self.rbuf = self.buffer()
        self.posted: list = []
        if not self._by_handler():
            # Receives posted ahead (worker.am_recv_many_nb: one call, one
            # request per phase), matched in the UCX callback: no Python per
            # message, as ucx_perftest receives in its callback.  Posted
            # before the client may send.
            self.posted = self._post(self.p.warmup)
        else:
            self._handle_in()
        return {}

    def _handle_in(self) -> None:
        """The handler of the receiving side (``--api python``, as a
        program receives): every payload is received into the buffer with
        ``receive_into``, posted in the handler as ``ucx_perftest``'s
        handler posts its receive; ``_serve_handler`` waits for them in
        order.  Set before the client may send."""
        pending: collections.deque = collections.deque()
        self.pending, self.arrived = pending, 0
        rbuf = self.rbuf

        def handler(msg) -> None:
            self.arrived += 1
            pending.append(msg.receive_into(rbuf))

        self.s.worker.set_am_handler(AM_ID, handler)

    def _post(self, n: int) -> list:
        return [self.s.worker.am_recv_many_nb(AM_ID, [self.rbuf] * n)] if n else []

    def _serve_handler(self) -> None:
        """Each phase's messages through the handler (``_handle_in``):
        ``Request.wait`` on the oldest receive, which runs the handler as
        the next messages arrive (their receives start while this one
        completes), a busy-polled ``progress()`` while none is pending."""
        worker, t, pending = self.s.worker, self.p.timeout, self.pending
        what = f"bench {self.name}: no active message"
        for n in (self.p.warmup, self.p.iters):
            while self.arrived < n or pending:
                if pending:
                    pending.popleft().wait(t)
                else:
                    engine(worker).wait_for(
                        lambda: pending or self.arrived >= n,  # noqa: B023
                        t,
                        what,
                        poll=True,
                    )
            # Less this phase's count, not zero: the next phase's first
            # messages may arrive while the acknowledgement is sent.
            self.arrived -= n
            self.ack_send()

    def serve(self) -> None:
        if self._by_handler():
            self._serve_handler()
            return
        for nxt in (self.p.iters, 0):
            for req in self.posted:
                spin_wait(self.s, req, self.p.timeout)
            self.posted = self._post(nxt)  # before the ack lets the client go
            self.ack_send()

    def cleanup(self) -> None:
        for req in getattr(self, "posted", ()):  # a failed run: withdraw them
            req.cancel()
        self.posted = []
        super().cleanup()

    def _c_phase(self, n: int) -> int:
        """``n`` messages from the C loop, acknowledged by the receiver."""
        return self.c_acked_stream(
            lib.gpucx_bench_am_stream, (AM_ID,), (ACK_TAG, n), self.sbuf, False
        )

    def _prepared_phase(self, n: int) -> int:
        """``n`` messages as ``ep.prepare_am`` batches (``run_prepared``)."""
        ep = self.s.ep
        return self.run_prepared(
            lambda bufs: ep.prepare_am(AM_ID, bufs), self.sbuf, n, self.ack_recv
        )

    def _phase(self, n: int) -> int:
        if self.p.api == "prepared":
            return self._prepared_phase(n)
        if not self.p.use_async:
            return self._c_phase(n)
        ep, t, window = self.s.ep, self.p.timeout, max(1, self.p.window)
        t0 = _perf_ns()
        reqs: list = []
        for _ in range(n):
            if len(reqs) >= window:
                reqs.pop(0).wait(t)
            reqs.append(ep.am_send_nb(AM_ID, self.sbuf))
        for r in reqs:
            r.wait(t)
        self.ack_recv()
        return _perf_ns() - t0

    def run(self, extra: dict) -> dict:
        self.sbuf = self.buffer(1)
        return self.bw_run(self._phase)


# -- stream -----------------------------------------------------------------------


class StreamBw(Bench):
    features = frozenset({"tag", "stream"})
    protocol_op = "stream"
    name = "stream_bw"
    kind = "bw"
    perftest = "stream_bw"
    latency_note = "time per message"

    def prepare(self) -> dict:
        self.rbuf = self.buffer()
        return {}

    def serve(self) -> None:
        ep, t = self.s.ep, self.p.timeout
        self.serve_phases(lambda: ep.stream_recv(self.rbuf, timeout=t))

    def _phase(self, n: int) -> int:
        ep = self.s.ep
        t0 = _perf_ns()
        for _ in range(n):
            ep.stream_send(self.sbuf)
        self.ack_recv()
        return _perf_ns() - t0

    def run(self, extra: dict) -> dict:
        self.sbuf = self.buffer(1)
        return self.bw_run(self._phase)


# -- RMA and atomics ------------------------------------------------------------


class _RmaBase(Bench):
    features = frozenset({"tag", "rma"})
    #: Whether the server busy-polls while the client runs (see serve()).
    serve_spin = False

    def prepare(self) -> dict:
        self.target = self.buffer()
        self.region = self.s.ctx.register(self.target)
        return {
            "remote": self.region.remote().to_bytes().hex(),
            "address": int(self.region.address),
        }

    def serve(self) -> None:
        # One-sided: the server only progresses until the client is done.
        msg = self.s.recv_ctrl(self.p.timeout, spin=self.serve_spin)
        if msg.get("op") != "fin":
            raise BenchSetupError(f"unexpected control message {quote(msg)}")

    def cleanup(self) -> None:
        region = getattr(self, "region", None)
        if region is not None and hasattr(region, "close"):
            region.close()

    def run(self, extra: dict) -> dict:
        token = reply_field(extra, "remote", str)
        try:
            rmem = self.s.ep.unpack(bytes.fromhex(token))
        except ValueError as exc:
            raise BadControlMessage(
                f"the peer's region token is malformed ({exc})"
            ) from None
        try:
            figures = self.measure(rmem)
            self.probed = self._probe(rmem)
            return figures
        finally:
            self.s.send_ctrl({"op": "fin"})
            if hasattr(rmem, "close"):
                rmem.close()

    def measure(self, rmem) -> dict:
        raise NotImplementedError

    def _probe(self, rmem):
        """One more put or get, after the measurement, that asks UCX which
        protocol it took (gpucx.ops.rma.probe: put and get are not in
        the endpoint's tables unless UCX's PROTO_INFO is on)."""
        if self.protocol_op not in ("put", "get"):
            return None
        buf = self.buffer(1)
        # The C loops post to UCX directly, never on gpucx's own path: their
        # rows report what UCX does.
        return _rma.probe(
            self.s.ep,
            self.protocol_op,
            buf,
            rmem,
            timeout=self.p.timeout,
            ucx=not self.p.use_async,  # the test _RmaBw._phase makes
        )


class _RmaBw(_RmaBase):
    kind = "bw"
    latency_note = "time per message"
    op = ""
    get = 0

    def _c_phase(self, rmem, rkey, n: int) -> int:
        ptr, nbytes, mt, keep = acquire(self.local, bool(self.get))
        out = ffi.new("uint64_t *")
        nslots = self.p.window + 1
        slots = c_slots(nslots)
        st = lib.gpucx_bench_rma_stream(
            handle(self.s.worker),
            handle(self.s.ep),
            self.get,
            ptr,
            nbytes,
            mt,
            self.remote_addr,
            rkey,
            n,
            self.p.window,
            self.timeout_ns,
            slots,
            out,
        )
        raise_after_loop(self.s, st, slots, nslots, (keep, rmem), f"bench {self.name}")
        return out[0]

    def run(self, extra: dict) -> dict:
        addr = reply_field(extra, "address", int)
        if not 0 <= addr < 1 << 64:
            raise BadControlMessage(f"the peer's region address {addr} is not 64-bit")
        self.remote_addr = addr
        return super().run(extra)

    def _prepared_phase(self, rmem, n: int) -> int:
        """``n`` puts or gets as prepared transfer lists (``run_prepared``),
        then an endpoint flush."""
        ep = self.s.ep
        return self.run_prepared(
            ep.prepare_get if self.get else ep.prepare_put,
            (self.local, rmem, 0),
            n,
            lambda: ep.flush(timeout=self.p.timeout),
        )

    def _phase(self, rmem, n: int) -> int:
        if self.p.api == "prepared":
            return self._prepared_phase(rmem, n)
        rkey = None if self.p.use_async else rkey_handle(rmem)
        if rkey is not None:
            return self._c_phase(rmem, rkey, n)
        ep, t, window = self.s.ep, self.p.timeout, max(1, self.p.window)
        post = getattr(ep, self.op)
        t0 = _perf_ns()
        reqs: list = []
        for _ in range(n):
            if len(reqs) >= window:
                reqs.pop(0).wait(t)
            reqs.append(post(self.local, rmem))
        for r in reqs:
            r.wait(t)
        ep.flush(timeout=t)
        return _perf_ns() - t0

    def measure(self, rmem) -> dict:
        self.local = self.buffer(1)
        return self.bw_run(lambda n: self._phase(rmem, n))


class PutBw(_RmaBw):
    protocol_op = "put"
    name = "put_bw"
    perftest = "ucp_put_bw"
    op = "put_nb"


class GetBw(_RmaBw):
    protocol_op = "get"
    name = "get_bw"
    perftest = "ucp_get"
    op = "get_nb"
    get = 1
    # Over shared memory with peer error handling UCX emulates gets with
    # messages the target answers: the server busy-polls, as ucx_perftest's
    # does.  Puts into memory from ctx.allocate are plain copies into the
    # mapped segment there; a spinning server would only take CPU from the
    # client, so put_bw's server sleeps on the event fd between checks.
    serve_spin = True


class PutLat(_RmaBase):
    protocol_op = "put"
    name = "put_lat"
    kind = "lat"
    perftest = "ucp_put_lat"
    latency_note = "half of put + endpoint flush (one round trip)"

    def measure(self, rmem) -> dict:
        ep, t = self.s.ep, self.p.timeout
        src = self.buffer(1)
        rtt = numpy.zeros(self.p.iters, numpy.float64)
        for i in range(self.p.warmup + self.p.iters):
            t0 = _perf_ns()
            ep.put(src, rmem)
            ep.flush(timeout=t)
            if i >= self.p.warmup:
                rtt[i - self.p.warmup] = _perf_ns() - t0
        return lat_figures(self.p.size, rtt / 2)


class FaddLat(_RmaBase):
    protocol_op = "atomic_fetch"
    name = "fadd_lat"
    kind = "lat"
    perftest = "ucp_fadd"
    fixed_sizes = (8,)
    latency_note = "whole fetch-and-add (a round trip)"
    # "am": on endpoints with peer error handling gpucx runs atomics over
    # its own active messages (gpucx.ops.atomic).
    features = frozenset({"tag", "rma", "amo", "am"})

    def measure(self, rmem) -> dict:
        ep = self.s.ep
        ops = numpy.zeros(self.p.iters, numpy.float64)
        for i in range(self.p.warmup + self.p.iters):
            t0 = _perf_ns()
            ep.fetch_add(rmem, 1, nbytes=8)
            if i >= self.p.warmup:
                ops[i - self.p.warmup] = _perf_ns() - t0
        return lat_figures(8, ops)


# -- arrays ------------------------------------------------------------------------


#: Receives ``array_bw``'s server keeps posted (at most ``--window``): enough
#: for the next arrays' transfers to run while one is taken.  Deeper costs
#: more than it gives: with 32 posted, 1 MiB host arrays took 2-7x longer
#: each than with 2 or 4 or with blocking ``recv_array`` (32 transfers and
#: 32 fresh arrays at once; two processes over shared memory, 2-core VM).
ARRAY_READ_AHEAD = 4


class ArrayBw(Bench):
    """``send_array_nb`` with ``--window`` arrays in flight against
    ``recv_array_nb`` with up to :data:`ARRAY_READ_AHEAD` receives posted
    (read-ahead: the next arrays arrive while one is taken): the Python API
    both ways (there is no C loop).  A server with ``--memory cuda``
    receives into device memory (CuPy) whatever the client sends: host
    arrays then take the receiver-side staging path (docs/gpu.md)."""

    features = frozenset({"tag", "am"})
    protocol_op = "am"
    name = "array_bw"
    kind = "bw"
    perftest = None
    fixed_api = "python"
    latency_note = "time per array"

    def serve(self) -> None:
        ep, t = self.s.ep, self.p.timeout
        window = max(1, min(self.p.window, ARRAY_READ_AHEAD))
        allocator = self._device_allocator() if self.mem == "cuda" else None
        for n in (self.p.warmup, self.p.iters):
            reqs: collections.deque = collections.deque()
            posted = 0
            for _ in range(n):
                while posted < n and len(reqs) < window:
                    reqs.append(ep.recv_array_nb(allocator))
                    posted += 1
                spin_wait(self.s, reqs.popleft(), t)
            self.ack_send()

    def _device_allocator(self):
        """Device memory on the bench's device for every array (CuPy)."""
        import cupy

        device = cupy.cuda.Device(self.s.device)

        def allocate(nbytes: int, memory_type: int):
            with device:
                return cupy.empty(nbytes, cupy.uint8)

        return allocate

    def _phase(self, n: int) -> int:
        ep, t, arr = self.s.ep, self.p.timeout, self.arr
        window = max(1, self.p.window)
        reqs: collections.deque = collections.deque()
        t0 = _perf_ns()
        for _ in range(n):
            if len(reqs) >= window:
                reqs.popleft().wait(t)
            reqs.append(ep.send_array_nb(arr))
        for r in reqs:
            r.wait(t)
        self.ack_recv()
        return _perf_ns() - t0

    def run(self, extra: dict) -> dict:
        self.arr = self.buffer(1)
        return self.bw_run(self._phase)


TESTS: dict[str, type[Bench]] = {
    cls.name: cls
    for cls in (
        TagLat,
        TagBw,
        AmLat,
        AmBw,
        StreamBw,
        PutLat,
        PutBw,
        GetBw,
        FaddLat,
        ArrayBw,
    )
}

#: What plain ``gpucx bench`` runs.
DEFAULT_TESTS = ("tag_lat", "tag_bw")


def server_features(tests) -> frozenset[str]:
    """The context features a server needs to serve ``tests`` and no more."""
    out: frozenset[str] = frozenset({"tag"})
    for name in tests:
        out |= TESTS[name].features
    return out
