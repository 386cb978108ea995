"""Remote atomics on 4- and 8-byte words.

On endpoints without peer error handling they are ``ucp_atomic_op_nbx``.
On endpoints with it (gpucx's default), where UCX (>= 1.19) has no atomic
protocol, gpucx runs them over its own active messages (reserved ids
``0xFF20``/``0xFF21``): the target's C handler checks the request against
the regions its context exported (writable host memory, in bounds,
aligned, ``"amo"`` feature), applies it with ``__atomic`` builtins and
replies with the old value; see :func:`emulated` and docs/rma.md.

Values are unsigned ``nbytes * 8``-bit integers; negative operands are taken
in two's complement (``atomic_add(k, -1)`` decrements).  Fetched values are
returned unsigned.  The remote address must be aligned to ``nbytes``.

Every operation takes ``stream=`` as put/get do: the atomic is posted only
once the work queued on that CUDA stream before the call has finished (the
worker progresses meanwhile).  The local operand and result are host
memory, so the stream orders the atomic and nothing else.
"""

from __future__ import annotations

from .._engine import INPROGRESS
from .._handle import raise_closed
from .._internal import amo_exports
from .._lib import ffi, lib
from ..errors import UCXError, UnsupportedError, error_for, status_name
from ..mem import cuda as _cuda
from ..mem.memtype import HOST_INT as _HOST  # atomics' local operands are host words
from ..mem.remote import RemoteKey
from ..request import Request, raise_status

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


def worker_init(e) -> None:
    """Install the C handlers of gpucx's emulated atomics on a new worker's
    engine (contexts with the ``"am"`` feature): the target side, which
    serves the regions its context exported, and the initiator side, which
    completes requests with the target's reply."""
    e.amo_ok = False
    ctx = e.context
    if "am" in ctx.features:
        st = lib.gpucx_amo_worker_init(e.state, amo_exports(ctx))
        if st != lib.UCS_OK:
            raise_status(st, "ucp_worker_set_am_recv_handler(atomics)")
        e.amo_ok = True


def emulated(ep) -> bool:
    """Whether atomics on ``ep`` run over gpucx's active messages.

    The rule: an endpoint with peer error handling (gpucx's default) gets
    gpucx's emulation, one without gets ``ucp_atomic_op_nbx``.  UCX (>= 1.19)
    selects no atomic protocol on endpoints with peer error handling, and
    finding that out by posting one fails the whole endpoint (UCX reports an
    endpoint timeout), so gpucx does not probe.
    """
    return ep._peer_mode


#: What a target's refusal of an emulated atomic means (its status).
_REFUSED = {
    lib.UCS_ERR_NO_ELEM: "the target has no exported writable region with this "
    "key's address and size (closed, read-only, or never exported)",
    lib.UCS_ERR_OUT_OF_RANGE: "the word is outside the target's region",
    lib.UCS_ERR_INVALID_PARAM: "the target refused the request (alignment, "
    "size or operation)",
    lib.UCS_ERR_UNSUPPORTED: "the target does not serve atomics (its context "
    'lacks the "amo" feature) or the region is not host memory',
}


def _fail(st, what, ep, emulate):
    if emulate and st == lib.UCS_ERR_UNSUPPORTED and not ep._engine.amo_ok:
        raise UnsupportedError(
            f"{what}: atomics on an endpoint with peer error handling run over "
            'active messages: this context needs the "am" feature (or connect '
            "with error_handling=False)",
            st,
        )
    if emulate and st in _REFUSED and ep._state.error == lib.UCS_OK:
        exc = error_for(st, what)
        exc.args = (f"{what}: {_REFUSED[st]} ({status_name(st)})",)
        raise exc
    raise_status(st, what, ep)


class _AmoRequest(Request):
    """A Request whose refusal by the target reads as such."""

    __slots__ = ("_emulate", "_cancelable")

    def __init__(self, emulate: bool, *args):
        self._emulate = emulate
        # UCX cannot cancel its own atomics (it aborts the process when asked
        # to); gpucx's emulated ones cancel like any request.
        self._cancelable = emulate
        super().__init__(*args)

    def _complete(self) -> None:
        st = self._slot.status
        super()._complete()
        if self._state == 2 and self._emulate and st in _REFUSED:
            try:
                _fail(st, self._what, self._ep, True)
            except UCXError as exc:
                self._value = exc


def _post_args(ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream):
    """What the blocking and non-blocking forms both pass to C: the engine,
    whether gpucx emulates the atomic, its record, and the argument tuple
    of ``gpucx_atomic``/``gpucx_atomic_wait`` (less the spin)."""
    h, raddr = _prepare(ep, rkey, offset, nbytes, what)
    operand = _word(value, nbytes, what, "value")
    other = 0 if swap_value is None else _word(swap_value, nbytes, what, "new")
    e = ep._engine
    if stream is not None:
        # Host operands: nothing is made current, ready() only waits.
        _cuda.door(e, 0, _HOST, stream, what).ready()
    emulate = ep._peer_mode
    amo = ffi.new("gpucx_amo_t *")
    args = (
        e.state,
        h,
        emulate,
        op,
        fetch,
        operand,
        other,
        nbytes,
        raddr,
        rkey._h,
        rkey._base,
        rkey._size,
        amo,
    )
    return e, emulate, amo, args


def _run(
    ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream, timeout=None
):
    e, emulate, amo, args = _post_args(
        ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream
    )
    st = lib.gpucx_atomic_wait(*args, e.spin_ns)
    if st:
        if st == INPROGRESS:
            # UCX cannot cancel its own atomics (it aborts the process when
            # asked to): a timeout parks them, uncanceled.  gpucx's emulated
            # ones are canceled like any request.
            slot = ffi.addressof(amo, "slot")
            st = e.block(slot, timeout, amo, ep, emulate, rkey)
        if st:
            _fail(st, what, ep, emulate)
    return lib.gpucx_amo_result(amo, nbytes) if fetch else None


def _run_nb(ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream):
    e, emulate, amo, args = _post_args(
        ep, rkey, op, fetch, value, swap_value, offset, nbytes, what, stream
    )
    st = lib.gpucx_atomic(*args)
    if emulate and st == lib.UCS_ERR_UNSUPPORTED and not e.amo_ok:
        _fail(st, what, ep, True)  # nothing was posted
    if fetch:

        def finish(req, amo=amo, nbytes=nbytes):
            return lib.gpucx_amo_result(amo, nbytes)

    else:
        finish = None
    slot = ffi.addressof(amo, "slot")
    return _AmoRequest(emulate, e, slot, amo, what, finish, ep, None, rkey)


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
            An endpoint with peer error handling (gpucx emulates the atomic)
            on a context without the ``"am"`` feature, a target without the
            ``"amo"`` feature or a device-memory region; or a ``stream``
            without a CUDA driver.
        gpucx.UCXError
            The target refused an emulated atomic (region not exported,
            read-only or closed, out of bounds, misaligned).
        gpucx.CanceledError
            The endpoint was closed while the atomic waited.
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
        As for :func:`fetch_add`: no ``"am"`` feature for an emulated
        atomic, a target without ``"amo"``; or a ``stream`` without a CUDA
        driver.
    gpucx.UCXError
        The target refused an emulated atomic.
    gpucx.CanceledError
        The endpoint was closed while the atomic waited.
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
