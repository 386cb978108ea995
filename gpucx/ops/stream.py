"""The stream API: an ordered byte stream per endpoint.

``stream_send`` appends bytes to the endpoint's stream; ``stream_recv``
fills a buffer completely from it (``UCP_STREAM_RECV_FLAG_WAITALL``), however
the sender split its sends.  Message boundaries are not kept.
"""

from __future__ import annotations

from .._engine import INPROGRESS, Engine, new_slot
from .._handle import raise_closed
from .._lib import lib
from ..errors import UnsupportedError
from ..mem import cuda as _cuda
from ..mem.buffer import acquire
from ..mem.memtype import HOST_INT as _HOST
from ..request import Request, finish, posted, raise_status

__all__ = ["stream_send", "stream_send_nb", "stream_recv", "stream_recv_nb"]

_SEND = "stream send"
#: What a stream receive is called (its requests' name; an endpoint's close
#: does not wait for them).
RECV = _RECV = "stream recv"


def _open(ep):
    """The endpoint's UCX handle and engine; refuses a closed endpoint and a
    context without the stream feature."""
    h = ep._h
    if h is None:
        raise_closed(ep)
    e = ep._engine
    if "stream" not in e.context.features:
        _no_stream(ep)
    return h, e


def _post(e, ptr, mt: int, stream, what: str, post, take=Engine.slot, keep=None):
    """Take a slot and run ``post(slot)``; return ``(slot, status)``.

    CUDA memory, or a ``stream`` to wait for, goes through the CUDA door
    (``keep``: :func:`acquire`'s keepalive, a deferred producer stream the
    door waits for); the slot is taken inside it, since waiting for the
    stream progresses the worker and a handler run meanwhile may take the
    shared slot.  ``post`` may spin in C (bounded) but never blocks: the
    unbounded wait of a blocking call runs after the door (no device
    context stays pushed while handlers run), as for tag messages.
    """
    if mt == _HOST and stream is None:
        slot = take(e)
        return slot, post(slot)
    with _cuda.door(e, ptr, mt, stream, what, keep):
        slot = take(e)
        return slot, post(slot)


def _no_stream(ep):
    # UCX crashes on stream calls of a context made without the feature.
    raise UnsupportedError(
        'the stream API needs a Context created with the "stream" feature '
        "(features=None enables every feature)"
    )


def stream_send(ep, buf, *, stream=None, timeout=None) -> None:
    """Append ``buf`` to the endpoint's stream; return once it is reusable.

    ``stream``: a CUDA stream (CuPy/Numba/PyTorch object or raw handle)
    whose queued work must finish before the operation is posted.
    ``timeout``: seconds to wait at most (None: no limit).

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass before ``buf`` is reusable.  UCX cannot
        withdraw a send already handed to the transport: it may still reach
        the peer, and gpucx keeps ``buf`` alive (do not modify it) until UCX
        lets go of it, or the endpoint is closed.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send (non-contiguous...).
    gpucx.UnsupportedError
        If the context was created without the ``"stream"`` feature.
    """
    h, e = _open(ep)
    ptr, n, mt, keep = acquire(buf, False, stream, True)
    slot, st = _post(
        e,
        ptr,
        mt,
        stream,
        _SEND,
        lambda s: lib.gpucx_stream_send_wait(e.state, h, ptr, n, mt, s, e.spin_ns),
        keep=keep,
    )
    if st:
        finish(e, slot, st, timeout, _SEND, ep, keep)


def stream_send_nb(ep, buf, *, stream=None) -> Request:
    """Start appending ``buf`` to the endpoint's stream.

    ``stream``: a CUDA stream (CuPy/Numba/PyTorch object or raw handle)
    whose queued work must finish before the operation is posted.

    Returns
    -------
    Request
        ``wait()`` returns None.

    Raises
    ------
    gpucx.ClosedError
        If the endpoint is closed.
    BufferError
        For memory gpucx cannot send.
    gpucx.UnsupportedError
        If the context was created without the ``"stream"`` feature.
    """
    h, e = _open(ep)
    ptr, n, mt, keep = acquire(buf, False, stream, True)
    slot, st = _post(
        e,
        ptr,
        mt,
        stream,
        _SEND,
        lambda s: lib.gpucx_stream_send(h, ptr, n, mt, s),
        keep=keep,
    )
    return posted(e, slot, st, keep, _SEND, ep)


def _fresh_slot(e):
    return new_slot()


def _length(req) -> int:
    return req._slot.length


def stream_recv(ep, buf, timeout: float | None = None, *, stream=None) -> int:
    """Fill all of ``buf`` from the endpoint's stream; return its size.

    ``stream``: a CUDA stream (CuPy/Numba/PyTorch object or raw handle)
    whose queued work must finish before the operation is posted.

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass first (the receive is canceled; bytes
        it already took from the stream are lost).
    gpucx.PeerError
        If the peer died.
    BufferError
        If ``buf`` is read-only or not contiguous.
    gpucx.ClosedError
        If the endpoint is closed.
    gpucx.UnsupportedError
        If the context was created without the ``"stream"`` feature.
    """
    h, e = _open(ep)
    ptr, n, mt, keep = acquire(buf, True, stream, True)
    slot, st = _post(
        e,
        ptr,
        mt,
        stream,
        _RECV,
        lambda s: _recv(e, h, ptr, n, mt, timeout, s),
        keep=keep,
    )
    if st == INPROGRESS:
        st = e.block(slot, timeout, keep)  # past the CUDA door
    if st:
        raise_status(st, _RECV, ep, slot, n)
    return slot.length


def _recv(e, h, ptr, n: int, mt: int, timeout, slot) -> int:
    """Post a stream receive into ``slot`` (spinning in C for it, bounded,
    when there is no ``timeout``); its status."""
    if timeout is None:
        return lib.gpucx_stream_recv_wait(e.state, h, ptr, n, mt, slot, e.spin_ns)
    return lib.gpucx_stream_recv(h, ptr, n, mt, slot)


def stream_recv_nb(ep, buf, *, stream=None) -> Request:
    """Start filling all of ``buf`` from the endpoint's stream.

    ``stream``: a CUDA stream (CuPy/Numba/PyTorch object or raw handle)
    whose queued work must finish before the operation is posted.

    Returns
    -------
    Request
        ``wait()`` returns the number of bytes received (``len(buf)``).

    Raises
    ------
    BufferError
        If ``buf`` is read-only or not contiguous.
    gpucx.ClosedError
        If the endpoint is closed.
    gpucx.UnsupportedError
        If the context was created without the ``"stream"`` feature.
    """
    h, e = _open(ep)
    ptr, n, mt, keep = acquire(buf, True, stream, True)
    slot, _ = _post(
        e,
        ptr,
        mt,
        stream,
        _RECV,
        lambda s: lib.gpucx_stream_recv(h, ptr, n, mt, s),
        _fresh_slot,
        keep,
    )
    return Request(e, slot, keep, _RECV, _length, ep, n)
