"""Remote atomics (``ucp_atomic_op_nbx``) on 4- and 8-byte words.

Values are unsigned ``nbytes * 8``-bit integers; negative operands are taken
in two's complement (``atomic_add(k, -1)`` decrements).  Fetched values are
returned unsigned.  The remote address must be aligned to ``nbytes``.

Every operation takes ``stream=`` as put/get do: the atomic is posted only
once the work queued on that CUDA stream before the call has finished (the
worker progresses meanwhile).  The local operand and result are host
memory, so the stream orders the atomic and nothing else.
"""

from __future__ import annotations

from .._handle import raise_closed
from .._lib import ffi, lib
from ..errors import UnsupportedError
from ..mem import cuda as _cuda
from ..mem.remote import RemoteKey
from ..request import INPROGRESS, SPIN_NS, Request, block, raise_status

__all__ = [
    "atomic_add",
    "atomic_and",
    "atomic_or",
    "atomic_xor",
    "fetch_add",
    "fetch_and",
    "fetch_or",
    "fetch_xor",
    "swap",
    "compare_swap",
]

_ADD = lib.GPUCX_AMO_ADD
_AND = lib.GPUCX_AMO_AND
_OR = lib.GPUCX_AMO_OR
_XOR = lib.GPUCX_AMO_XOR
_SWAP = lib.GPUCX_AMO_SWAP
_CSWAP = lib.GPUCX_AMO_CSWAP
_HOST = int(lib.UCS_MEMORY_TYPE_HOST)  # atomics' local operands are host words


def _word(value, nbytes: int, what: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be an int, not {type(value).__name__}")
    bits = nbytes * 8
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise ValueError(
            f"{what}: {name}={value} does not fit in {nbytes} bytes "
            f"([-2**{bits - 1}, 2**{bits}))"
        )
    return value & ((1 << bits) - 1)


def _prepare(ep, rkey, offset, nbytes, what):
    h = ep._h
    if h is None:
        raise_closed(ep)
    if not isinstance(rkey, RemoteKey):
        raise TypeError(
            f"expected a RemoteKey from Endpoint.unpack(), not {type(rkey).__name__}"
        )
    if nbytes not in (4, 8):
        raise ValueError(f"{what}: nbytes must be 4 or 8, not {nbytes!r}")
    raddr = rkey._target(ep, offset, nbytes, what, True)
    if raddr % nbytes:
        raise ValueError(
            f"{what}: offset={offset} gives remote address {raddr:#x}, not "
            f"aligned to {nbytes} bytes"
        )
    return h, raddr


def _run(
    ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream, timeout=None
):
    h, raddr = _prepare(ep, rkey, offset, nbytes, what)
    operand = _word(value, nbytes, what, "value")
    other = 0 if swap_value is None else _word(swap_value, nbytes, what, "new")
    w = ep._w
    if stream is not None:
        # Host operands: nothing is made current, prepare() only waits.
        _cuda.prepare(w, 0, _HOST, stream, what)
    amo = ffi.new("gpucx_amo_t *")
    st = lib.gpucx_atomic_wait(
        w._h, h, op, fetch, operand, other, nbytes, raddr, rkey._h, amo, SPIN_NS
    )
    if st:
        if st == INPROGRESS:
            # UCX cannot cancel an atomic: a timeout parks it, uncanceled.
            st = block(w, ffi.addressof(amo, "slot"), timeout, (amo, rkey), None, False)
        if st == lib.UCS_ERR_CANCELED:
            raise UnsupportedError(
                f"{what}: UCX found no atomic protocol to this peer (UCX "
                ">= 1.19 offers none on endpoints with peer error handling: "
                "connect with error_handling=False)",
                st,
            )
        if st:
            raise_status(st, what, ep)
    return lib.gpucx_amo_result(amo, nbytes) if fetch else None


def _run_nb(ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream):
    h, raddr = _prepare(ep, rkey, offset, nbytes, what)
    operand = _word(value, nbytes, what, "value")
    other = 0 if swap_value is None else _word(swap_value, nbytes, what, "new")
    if stream is not None:
        _cuda.prepare(ep._w, 0, _HOST, stream, what)
    amo = ffi.new("gpucx_amo_t *")
    lib.gpucx_atomic(h, op, fetch, operand, other, nbytes, raddr, rkey._h, amo)
    if fetch:

        def finish(req, amo=amo, nbytes=nbytes):
            return lib.gpucx_amo_result(amo, nbytes)

    else:
        finish = None
    return _AtomicRequest(
        ep._w, ffi.addressof(amo, "slot"), (amo, rkey), what, finish, ep
    )


class _AtomicRequest(Request):
    """An atomic's request: UCX cannot cancel it, so neither ``cancel()`` nor
    a ``wait`` timeout asks it to (a timeout leaves it running)."""

    __slots__ = ()
    _cancelable = False


_STREAM = """
        ``stream`` (a CUDA stream object or raw handle, optional): the
        atomic is posted only once the work queued on it before the call
        finished.
"""

_TIMEOUT = """
        ``timeout`` (seconds, optional): how long to wait at most; a
        ``gpucx.TimeoutError`` then (the operation may still take effect at
        the peer).
"""

_RAISES = """
        Raises
        ------
        ValueError
            ``offset`` outside the remote region or not aligned to
            ``nbytes``, ``nbytes`` not 4 or 8, a value that does not fit,
            a read-only region, or a key of another endpoint.
        TypeError
            If ``rkey`` is not a RemoteKey or a value is not an int, or for
            a bad ``stream``.
        gpucx.UnsupportedError
            (blocking form) UCX has no atomic protocol to this peer, e.g.
            on an endpoint with peer error handling (the ``_nb`` form
            fails with ``CanceledError``); or a ``stream`` without a CUDA
            driver.
        gpucx.PeerError
            If the peer died or is unreachable.
        gpucx.ClosedError
            If the endpoint or the key is closed.
"""


def _make(name, op, fetch, doc):
    def blocking(
        ep, rkey, value, offset: int = 0, nbytes: int = 8, *, stream=None, timeout=None
    ):
        return _run(
            ep, rkey, op, fetch, value, None, offset, nbytes, name, stream, timeout
        )

    def nonblocking(
        ep, rkey, value, offset: int = 0, nbytes: int = 8, *, stream=None
    ) -> Request:
        return _run_nb(ep, rkey, op, fetch, value, None, offset, nbytes, name, stream)

    ret = "the old value (unsigned)" if fetch else "None"
    blocking.__name__ = blocking.__qualname__ = name
    blocking.__doc__ = f"""{doc} Blocking; returns {ret}.
{_STREAM}{_TIMEOUT}{_RAISES}"""
    nonblocking.__name__ = nonblocking.__qualname__ = name + "_nb"
    nonblocking.__doc__ = f"""{doc} Returns a Request whose ``wait()`` gives
        {ret}.
{_STREAM}{_RAISES}"""
    return blocking, nonblocking


atomic_add, atomic_add_nb = _make("atomic_add", _ADD, 0, "Remote ``*p += value``.")
atomic_and, atomic_and_nb = _make("atomic_and", _AND, 0, "Remote ``*p &= value``.")
atomic_or, atomic_or_nb = _make("atomic_or", _OR, 0, "Remote ``*p |= value``.")
atomic_xor, atomic_xor_nb = _make("atomic_xor", _XOR, 0, "Remote ``*p ^= value``.")
fetch_add, fetch_add_nb = _make("fetch_add", _ADD, 1, "Remote ``*p += value``.")
fetch_and, fetch_and_nb = _make("fetch_and", _AND, 1, "Remote ``*p &= value``.")
fetch_or, fetch_or_nb = _make("fetch_or", _OR, 1, "Remote ``*p |= value``.")
fetch_xor, fetch_xor_nb = _make("fetch_xor", _XOR, 1, "Remote ``*p ^= value``.")
swap, swap_nb = _make("swap", _SWAP, 1, "Remote ``*p = value``.")


def compare_swap(
    ep,
    rkey,
    expected,
    new,
    offset: int = 0,
    nbytes: int = 8,
    *,
    stream=None,
    timeout=None,
):
    """Remote ``if *p == expected: *p = new``.  Blocking; returns the old
    value (unsigned): the swap happened iff it equals ``expected``.

    ``stream`` (a CUDA stream object or raw handle, optional): the atomic is
    posted only once the work queued on it before the call finished.
    ``timeout`` (seconds, optional): how long to wait at most.

    Raises
    ------
    gpucx.TimeoutError
        When ``timeout`` seconds pass first (the swap may still take effect at
        the peer).
    ValueError
        ``offset`` outside the remote region or not aligned to ``nbytes``,
        ``nbytes`` not 4 or 8, a value that does not fit, a read-only
        region, or a key of another endpoint.
    TypeError
        If ``rkey`` is not a RemoteKey or a value is not an int, or for a
        bad ``stream``.
    gpucx.UnsupportedError
        UCX has no atomic protocol to this peer, e.g. on an endpoint with
        peer error handling; or a ``stream`` without a CUDA driver.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.ClosedError
        If the endpoint or the key is closed.
    """
    return _run(
        ep,
        rkey,
        _CSWAP,
        1,
        expected,
        new,
        offset,
        nbytes,
        "compare_swap",
        stream,
        timeout,
    )


def compare_swap_nb(
    ep, rkey, expected, new, offset: int = 0, nbytes: int = 8, *, stream=None
):
    """Start a :func:`compare_swap`; ``wait()`` returns the old value.

    Raises
    ------
    ValueError, TypeError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`compare_swap`, before anything is posted.
    """
    return _run_nb(
        ep, rkey, _CSWAP, 1, expected, new, offset, nbytes, "compare_swap", stream
    )


__all__ += [n + "_nb" for n in list(__all__)]
