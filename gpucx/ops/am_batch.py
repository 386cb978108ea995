"""Prepared batches of active messages (:meth:`Endpoint.prepare_am`).

A batch is a list of payloads checked once; every :meth:`AmBatch.run` or
:meth:`AmBatch.run_nb` sends each of them as one active message with the
same id and header, in list order, with a single call into C and one
request for all of them.  Messages UCX sends inside the call (short and
eager copies: small messages, the usual case) allocate no request and run
no callback, so a run of small messages costs about what UCX's own loop
costs.  The receiving side sees ordinary active messages: handlers
(:meth:`Worker.set_am_handler`) or posted receives
(:meth:`Worker.am_recv_many_nb`) take them as they take ``am_send``'s.
"""

from __future__ import annotations

from .._handle import raise_closed
from .._internal import engine
from .._lib import ffi, lib
from ..errors import UCXError
from ..mem import cuda as _cuda
from ..mem.buffer import acquire
from ..mem.memtype import HOST_INT as _HOST
from ..request import Request
from . import am as _am
from ._prepared import Prepared

__all__ = ["prepare_am", "AmBatch"]

_ITEMS = ffi.typeof("gpucx_am_item_t[]")
_OP = ffi.typeof("gpucx_notify_op_t *")
_WHAT = "am batch"


def prepare_am(
    ep, am_id: int, bufs, header=b"", *, reply: bool = False, proto=None
) -> AmBatch:
    """Prepare a batch of active messages on this endpoint, to send as one
    operation.

    Everything :meth:`am_send` checks -- the id, the header, ``proto``,
    every buffer, CUDA capability -- is checked here, once; each
    :meth:`AmBatch.run` or :meth:`AmBatch.run_nb` then sends every message
    with a single call into C.

    Parameters
    ----------
    am_id : int
        0..0xFEFF, the receiver's handler or posted-receive id.
    bufs : iterable of buffers
        One message per entry (any object :func:`gpucx.mem.as_buffer`
        accepts, may be empty; the same buffer may appear many times).  The
        batch holds them until it is closed; what they contain when it runs
        is what is sent.
    header : bytes-like
        Sent with every message (at most the worker's maximum AM header);
        copied now.
    reply : bool
        Give the receiver an :attr:`AmMessage.reply_ep` with each message.
    proto : None, "eager" or "rndv"
        Force a protocol for every message; None lets UCX choose by size.

    Returns
    -------
    AmBatch

    Raises
    ------
    ValueError
        For a bad id, an unknown ``proto``, an oversized header or an
        empty ``bufs``.
    TypeError
        If ``bufs`` is not an iterable.
    BufferError, gpucx.UnsupportedError
        For a buffer :meth:`am_send` cannot send (the message names the
        entry).
    gpucx.UnsupportedError
        Without the ``"am"`` feature.
    gpucx.ClosedError
        If the endpoint is closed.
    """
    return AmBatch(ep, am_id, bufs, header, reply, proto)


class AmBatch(Prepared):
    """A prepared list of active messages on one endpoint
    (:meth:`Endpoint.prepare_am`).

    :meth:`run_nb` sends every entry, in list order, with one call into C
    and returns one :class:`~gpucx.Request` for all of them; :meth:`run`
    also waits.  A batch can run any number of times, also while earlier
    runs are still in flight (each run has its own completion).  A run is
    done when every message completed locally (its buffer is reusable), as
    for :meth:`Endpoint.am_send_nb`.  A send UCX refuses stops the run: the
    messages after it are not sent and the request fails with that error
    once the ones already sent completed.

    Attributes
    ----------
    endpoint : Endpoint
        The endpoint every message goes through.
    am_id : int
        The active-message id.
    nbytes : int
        Payload bytes one run sends (the sum of the entries' sizes).
    """

    __slots__ = ("am_id", "_header", "_flags")

    def __init__(self, ep, am_id, bufs, header, reply, proto):
        if ep.closed:
            raise_closed(ep)
        _am.check_id(am_id)
        flags = _am.send_flags(reply, proto)
        if header:
            header = bytes(memoryview(header).cast("B"))  # later runs send this
        e = engine(ep)
        hdr, hn = _am.pack_header(e, header)
        try:
            bufs = list(bufs)
        except TypeError:
            raise TypeError(
                f"prepare_am: bufs must be an iterable of buffers, not "
                f"{type(bufs).__name__}"
            ) from None
        if not bufs:
            raise ValueError("prepare_am: bufs is empty (nothing to send)")
        items = ffi.new(_ITEMS, len(bufs))
        keep: list = [hdr]
        total = 0
        cuda_ptr = None
        cuda_mt = _HOST
        seen: dict = {}
        for i, buf in enumerate(bufs):
            try:
                got = seen.get(id(buf))
                if got is None:
                    got = acquire(buf, False, None)
                    if got[2] != _HOST:
                        # Checks that this context can move it.
                        _cuda.door(e, got[0], got[2], None, _WHAT).ready()
                    seen[id(buf)] = got
                    keep.append((buf, got[3]))
            except (TypeError, ValueError, BufferError, UCXError) as exc:
                exc.args = (f"prepare_am: entry {i}: {exc}", *exc.args[1:])
                raise
            ptr, n, mt, _k = got
            if mt != _HOST and cuda_ptr is None:
                cuda_ptr, cuda_mt = ptr, mt
            it = items[i]
            it.buf = ptr
            it.len = n
            it.memory_type = mt
            total += n
        self.endpoint = ep
        self.am_id = am_id
        self.nbytes = total
        self._items = items
        self._count = len(bufs)
        self._keep = keep
        self._header = (hdr, hn)
        self._flags = flags
        self._cuda_ptr = cuda_ptr
        self._cuda_mt = cuda_mt

    def __repr__(self) -> str:
        state = "closed" if self._keep is None else f"{self._count} messages"
        return f"<gpucx.AmBatch id {self.am_id} {state}, {self.nbytes} bytes>"

    def _post(self, stream, spin_ns: int):
        e, h = self._open()
        return self._through_door(e, stream, _WHAT, self._run, e, h, spin_ns)

    def _run(self, e, h, spin_ns: int):
        op = ffi.new(_OP)
        hdr, hn = self._header
        st = lib.gpucx_am_batch_run(
            e.state,
            h,
            self.am_id,
            hdr,
            hn,
            self._items,
            self._count,
            self._flags,
            op,
            spin_ns,
        )
        return st, op

    def run_nb(self, *, stream=None) -> Request:
        """Send every message; return one request for all of them.

        Parameters
        ----------
        stream : stream object or int, optional
            A CUDA stream: the messages are sent only once the work queued
            on it before the call finished.

        Returns
        -------
        Request
            ``wait()`` returns None once every buffer is reusable.

        Raises
        ------
        gpucx.ClosedError
            If the batch or the endpoint is closed.
        gpucx.UnsupportedError
            A ``stream`` without a CUDA driver.
        """
        st, op = self._post(stream, 0)
        return self._request(st, op, (self._keep, self._items, op), _WHAT)

    def run(self, timeout=None, *, stream=None) -> None:
        """Send every message and wait until all completed locally (see
        :meth:`run_nb`).

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first.
        gpucx.PeerError
            If the peer died or is unreachable.
        gpucx.UCXError
            The first error of a message.
        gpucx.ClosedError, gpucx.UnsupportedError
            As for :meth:`run_nb`, before anything is sent.
        """
        st, op = self._post(stream, self._engine.spin_ns)
        self._finish(st, op, (self._keep, self._items, op), _WHAT, timeout)
