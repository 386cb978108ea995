"""UCX status codes and the exceptions they become.

One table (``_STATUS_TO_CLASS``) maps every ``ucs_status_t`` to an exception
class; :func:`check` is the one function that turns a status into an
exception.  Every error keeps ``.status`` and ``.status_name``.
"""

from __future__ import annotations

import builtins
import inspect
import os
import types

from ._lib import ffi, lib

__all__ = [
    "UCXError",
    "ClosedError",
    "CanceledError",
    "MessageTruncatedError",
    "PeerError",
    "TimeoutError",
    "UnsupportedError",
    "InvalidAddressError",
    "AlreadyReceivedError",
    "DroppedMessagesWarning",
    "SlowPathWarning",
    "check",
    "status_name",
    "error_for",
    "peer_error_for",
    "peer_gone",
    "ep_create_error",
    "note_deadline",
]


class UCXError(Exception):
    """A UCX operation failed.

    Attributes
    ----------
    status : int or None
        The ``ucs_status_t`` value (``None`` for errors gpucx raises itself
        without a UCX status, such as use after close).
    status_name : str
        The symbolic name, e.g. ``"UCS_ERR_CANCELED"`` (``""`` when ``status``
        is ``None``).
    released : bool or None
        For an operation given up (a deadline passed, the peer died, the
        wait was interrupted): True when the operation's buffers are the
        caller's again as the error is raised (UCX withdrew the operation,
        or gpucx force-closed its endpoint: ``on_timeout="release"``), False
        when UCX still holds them (parked until UCX lets go of them; do not
        modify them).  None for every other error.  docs/reliability.md,
        "Deadlines and the buffer".
    """

    #: See the class doc; set by :func:`note_deadline`.
    released: bool | None = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        self.status_name = status_name(status) if status is not None else ""


class ClosedError(UCXError):
    """The object (or its parent) was closed, or belongs to the parent of a
    forked child process."""


class AlreadyReceivedError(RuntimeError):
    """The payload of a message was already received (a second
    ``receive_into``, ``.data`` after it, or a probed message received
    twice)."""


class DroppedMessagesWarning(RuntimeWarning):
    """A worker dropped messages from peers at one of its queue caps
    (``Worker.stats()`` counts them; docs/reliability.md, "Bounded
    queues").  Raised once, then at most once a minute per worker."""


class SlowPathWarning(UserWarning):
    """An operation took a protocol gpucx knows to be slow (software
    emulation of RMA, CUDA data staged through host shared memory; rules in
    :mod:`gpucx.protocols`).  Raised once per endpoint configuration,
    operation, memory types and protocol (docs/gpu.md, "Which path does a
    transfer take?")."""


class CanceledError(UCXError):
    """The request was canceled (``UCS_ERR_CANCELED``)."""


class MessageTruncatedError(UCXError):
    """The receive buffer was smaller than the message.

    Attributes
    ----------
    buffer_size : int or None
        Bytes the receive buffer holds.
    message_size : int or None
        Bytes the sender sent, when UCX reports it.
    """

    buffer_size: int | None = None
    message_size: int | None = None


class PeerError(UCXError, ConnectionError):
    """The peer died, reset the connection, or cannot be reached."""


class TimeoutError(UCXError, builtins.TimeoutError):
    """A deadline passed (a ``timeout=`` argument, or ``UCS_ERR_TIMED_OUT``)."""


class UnsupportedError(UCXError):
    """This UCX build, transport set or machine cannot do what was asked."""


class InvalidAddressError(UCXError, ValueError):
    """A worker address or socket address is malformed or unusable."""


def status_name(status: int) -> str:
    """Return the symbolic name of a ``ucs_status_t`` value."""
    return ffi.string(lib.gpucx_status_name(status)).decode()


def _build_table() -> dict[int, type[UCXError]]:
    table: dict[int, type[UCXError]] = {
        lib.UCS_ERR_CANCELED: CanceledError,
        lib.UCS_ERR_MESSAGE_TRUNCATED: MessageTruncatedError,
        lib.UCS_ERR_TIMED_OUT: TimeoutError,
        lib.UCS_ERR_UNSUPPORTED: UnsupportedError,
        lib.UCS_ERR_NOT_IMPLEMENTED: UnsupportedError,
        lib.UCS_ERR_INVALID_ADDR: InvalidAddressError,
        lib.UCS_ERR_UNREACHABLE: PeerError,
        lib.UCS_ERR_CONNECTION_RESET: PeerError,
        lib.UCS_ERR_NOT_CONNECTED: PeerError,
        lib.UCS_ERR_REJECTED: PeerError,
        lib.UCS_ERR_ENDPOINT_TIMEOUT: PeerError,
        lib.UCS_ERR_IO_ERROR: PeerError,
    }
    for st in range(lib.UCS_ERR_LAST_LINK_FAILURE, lib.UCS_ERR_FIRST_LINK_FAILURE + 1):
        table[st] = PeerError
    for st in range(
        lib.UCS_ERR_LAST_ENDPOINT_FAILURE, lib.UCS_ERR_FIRST_ENDPOINT_FAILURE + 1
    ):
        table[st] = PeerError
    return table


_STATUS_TO_CLASS = _build_table()


def error_for(status: int, what: str) -> UCXError:
    """Build (not raise) the exception for a failed ``status``."""
    cls = _STATUS_TO_CLASS.get(status, UCXError)
    reason = ffi.string(lib.ucs_status_string(status)).decode()
    return cls(f"{what}: {reason}", status)


def peer_error_for(status: int, what: str) -> UCXError:
    """Build the exception for an endpoint that UCX reported as failed.

    Whatever status the error callback carried (connection reset, a
    vanished shared-memory segment, an I/O error...), the cause is on the
    peer's side: it is reported as :class:`PeerError` with that status.
    """
    reason = ffi.string(lib.ucs_status_string(status)).decode()
    cls = _STATUS_TO_CLASS.get(status)
    if cls is None or not issubclass(cls, PeerError):
        cls = PeerError
    return cls(f"{what}: {reason}", status)


def peer_gone(what: str, reason: str, status: int | None = None) -> PeerError:
    """Build the :class:`PeerError` for a peer gpucx itself found dead.

    ``reason`` says how it was found (e.g. the peer process exited);
    ``status`` defaults to ``UCS_ERR_CONNECTION_RESET``.
    """
    if status is None:
        status = lib.UCS_ERR_CONNECTION_RESET
    return PeerError(f"{what}: {reason}", status)


def note_deadline(exc: BaseException, released: bool, detail: str) -> None:
    """Say on ``exc`` (the error of an operation given up) what became of
    the operation's buffers: ``released`` (:attr:`UCXError.released`) and
    ``detail`` appended to the message.  An exception that is no
    :class:`UCXError` (``KeyboardInterrupt``) gets ``detail`` as a note."""
    text = ("released: " if released else "still parked: ") + detail
    if isinstance(exc, UCXError):
        exc.released = released
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]} ({text})",) + exc.args[1:]
    else:
        exc.add_note(f"gpucx: {text}")


def ep_create_error(status: int, peer: str, by_address: bool) -> UCXError | None:
    """The exception for a failed ``ucp_ep_create`` (``None`` on ``UCS_OK``).

    ``by_address`` is true when the peer was named by a worker address blob:
    then an invalid or unreachable address means the blob itself is
    malformed, or names no transport this worker can use (nothing was sent
    yet).
    """
    if status == 0:
        return None
    if by_address and status in (
        lib.UCS_ERR_INVALID_ADDR,
        lib.UCS_ERR_INVALID_PARAM,
        lib.UCS_ERR_UNREACHABLE,
    ):
        return InvalidAddressError(
            f"ucp_ep_create: unusable worker address ({status_name(status)}): "
            "malformed, or no transport in it is reachable from here",
            status,
        )
    if status == lib.UCS_ERR_INVALID_ADDR:
        return InvalidAddressError(f"ucp_ep_create: cannot resolve {peer}", status)
    return error_for(status, f"ucp_ep_create({peer})")


def check(status: int, what: str) -> None:
    """Raise the exception for ``status`` unless it is ``UCS_OK``.

    Parameters
    ----------
    status : int
        A ``ucs_status_t`` value.
    what : str
        The operation, used as the message prefix.

    Raises
    ------
    UCXError
        Or the subclass the status maps to, when ``status`` is not ``UCS_OK``.
    """
    if status != 0:
        raise error_for(status, what)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def stacklevel_outside() -> int:
    """The ``stacklevel`` of the first frame outside gpucx, for a warning
    issued by the function that calls this one (a call may come through
    several of gpucx's frames: a worker's close, a context manager, a
    request's wait)."""
    here = inspect.currentframe()
    f: types.FrameType | None = here.f_back if here is not None else None
    level = 1
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    return level
