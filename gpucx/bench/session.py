"""A connected benchmark pair: control messages and peer setup.

Both sides of ``gpucx bench`` talk over UCX itself: control messages are
small JSON documents sent as tag messages with :data:`CTRL_TAG`, benchmark
data uses :data:`DATA_TAG` and acknowledgements :data:`ACK_TAG`.  The peer is
either a child process on this host (worker addresses exchanged over its
stdin/stdout, so the transports are exactly the ones asked for) or a
``gpucx bench --server`` on another host (reached through its Listener).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import gpucx

from .._internal import abandon, engine
from .._lib import lib
from .errors import BenchSetupError

__all__ = [
    "Session",
    "CTRL_TAG",
    "DATA_TAG",
    "ACK_TAG",
    "context_config",
    "PeerGone",
    "BadControlMessage",
    "parse_ctrl",
    "reply_field",
    "quote",
]

CTRL_TAG = 0x67707563_00000001
DATA_TAG = 0x67707563_00000002
ACK_TAG = 0x67707563_00000003

#: Largest control message.
_CTRL_MAX = 1 << 16


def context_config(tls: str | None, listener: bool = False) -> dict | None:
    """The Context config for ``--tls`` (None = UCX's choice).  Listener
    connections need ``tcp`` for UCX's connection manager; data still moves
    over the other transports named."""
    if not tls:
        return None
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if listener and not any(n in ("tcp", "all") for n in names):
        names.append("tcp")
    return {"TLS": ",".join(names)}


class PeerGone(Exception):
    """The peer process or host went away."""


class BadControlMessage(PeerGone):
    """The peer sent a control message the protocol does not allow: larger
    than 64 KiB, not UTF-8 JSON, not a JSON object, or a field missing or of
    the wrong type.  A peer that breaks the protocol is treated as gone:
    the bench fails with this message (the serving side answers it with an
    error instead and keeps serving)."""


#: How much of a bad value an error message quotes.
_QUOTE = 80


def quote(value: object) -> str:
    """``repr(value)``, cut to a readable length for error messages."""
    text = repr(value)
    return text if len(text) <= _QUOTE else text[: _QUOTE - 3] + "..."


def parse_ctrl(data: bytes | bytearray | memoryview) -> dict:
    """Decode one received control message.

    A pure function over the peer's bytes: at most :data:`_CTRL_MAX` of them
    are decoded, so a hostile message costs bounded memory and time.

    Raises
    ------
    BadControlMessage
        For more than 64 KiB, bytes that are not UTF-8 JSON (or nest too
        deep for the decoder), or a document that is not a JSON object.
    """
    if len(data) > _CTRL_MAX:
        raise BadControlMessage(
            f"control message of {len(data)} bytes (at most {_CTRL_MAX})"
        )
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadControlMessage(f"control message is not UTF-8 ({exc})") from None
    except RecursionError:
        raise BadControlMessage("control message nests too deep") from None
    except ValueError as exc:
        raise BadControlMessage(f"control message is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BadControlMessage(
            f"control message is a JSON {type(obj).__name__}, not an object"
        )
    return obj


def reply_field(msg: dict, name: str, kind: type | tuple[type, ...]):
    """``msg[name]``, checked to be an instance of ``kind`` (never a bool
    where an int is asked for).

    Raises
    ------
    BadControlMessage
        Naming the field, when it is missing or of another type.
    """
    if name not in msg:
        raise BadControlMessage(f"control message without {name!r}: {quote(msg)}")
    value = msg[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        want = (
            kind.__name__
            if isinstance(kind, type)
            else "/".join(k.__name__ for k in kind)
        )
        raise BadControlMessage(
            f"control message field {name!r} is {quote(value)}, not a {want}"
        )
    return value


class Session:
    """One side of a connected benchmark pair."""

    def __init__(
        self,
        ctx,
        worker,
        ep,
        *,
        role: str,
        device: int = 0,
        timeout: float = 120.0,
        parent_pid: int | None = None,
        proc: subprocess.Popen | None = None,
    ):
        self.ctx = ctx
        self.worker = worker
        self.ep = ep
        self.role = role
        self.device = device
        self.timeout = timeout
        self._parent_pid = parent_pid
        # The peer process this session started (a local run), or None.
        self._proc = proc
        #: Set once the peer acknowledged ``quit``: it then exits by itself.
        self.finished = False
        #: Set when a failed C loop left operations UCX would not cancel
        #: (rendezvous sends to a peer that gave up): tearing the worker
        #: down under them can crash inside UCX, so close() abandons the
        #: UCX handles instead (the memory stays with the process).
        self.tainted = False

    # -- control messages ----------------------------------------------------

    def send_ctrl(self, obj: dict) -> None:
        """Send one control message (JSON) to the peer."""
        data = json.dumps(obj).encode()
        if len(data) > _CTRL_MAX:
            raise ValueError("control message too large")
        self.ep.send(data, tag=CTRL_TAG)

    def recv_ctrl(self, timeout: float | None = None, *, spin: bool = False) -> dict:
        """Wait for the peer's next control message.

        The receive is posted once and the worker sleeps on its event fd
        between checks of the deadline and of the peer's health, so a
        message is never lost to a cancel.  With ``spin`` it busy-polls
        instead (checking every ``POLL_STRIDE`` progress calls), as
        ``ucx_perftest``'s server does: the side serving one-sided
        operations UCX emulates (RMA over shared memory with peer error
        handling) must progress them at once.

        Raises
        ------
        PeerGone
            When the endpoint failed or (child peer) the parent process died.
        BadControlMessage
            When the message is not a JSON object of at most 64 KiB (see
            :func:`parse_ctrl`); it is consumed, the next one can follow.
        gpucx.TimeoutError
            When ``timeout`` seconds pass first.
        """
        w = self.worker
        buf = bytearray(_CTRL_MAX)
        req = w.recv_nb(buf, tag=CTRL_TAG)

        def healthy() -> None:
            err = self.ep.error
            if err is not None:
                why = f"the peer went away ({err})"
            elif self._parent_pid is not None and os.getppid() != self._parent_pid:
                why = "the benchmark client exited"
            elif self._proc is not None and self._proc.poll() is not None:
                why = f"the peer process exited with code {self._proc.returncode}"
            else:
                return
            req.cancel()
            raise PeerGone(why)

        if not engine(w).wait_for(req.done, timeout, None, healthy, poll=spin):
            req.cancel()
            w.progress()
            raise gpucx.TimeoutError(
                f"timed out: the peer sent nothing for {timeout} s",
                lib.UCS_ERR_TIMED_OUT,
            )
        try:
            info = req.result()
        except gpucx.MessageTruncatedError as exc:
            size = exc.message_size
            what = f"{size} bytes" if size else f"more than {_CTRL_MAX} bytes"
            raise BadControlMessage(
                f"control message of {what} (at most {_CTRL_MAX})"
            ) from None
        return parse_ctrl(memoryview(buf)[: info.nbytes])

    def call(self, obj: dict, timeout: float | None = None) -> dict:
        """Send a control message and return the peer's answer."""
        self.send_ctrl(obj)
        return self.recv_ctrl(self.timeout if timeout is None else timeout)

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Close the endpoint, worker and context (and reap a child peer)."""
        try:
            if self.tainted:
                abandon(self.ctx, "abandoned after a failed benchmark")
            elif self.ep is not None and not self.ep.closed:
                self.ep.close(force=True)
        finally:
            if not self.tainted:
                self.ctx.close()
            proc = self._proc
            if proc is not None:
                try:
                    if not self.finished:
                        proc.kill()
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
                for f in (proc.stdin, proc.stdout):
                    if f is not None:
                        f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- client side ----------------------------------------------------------------


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    out = proc.stdout
    assert out is not None  # Popen(stdout=PIPE)
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerGone(f"the local peer process said nothing for {timeout} s")
        ready, _, _ = select.select([out], [], [], left)
        if ready:
            chunk = os.read(out.fileno(), 1)
            if not chunk:
                raise PeerGone(
                    f"the local peer process exited early (code {proc.wait()})"
                )
            line += chunk
    return line.decode().strip()


def spawn_local(
    tls: str | None, error_handling: bool, device: int, timeout: float
) -> Session:
    """Start a peer process on this host and connect to it."""
    cmd = [
        sys.executable,
        "-m",
        "gpucx.bench.peer",
        "--parent-pid",
        str(os.getpid()),
        "--device",
        str(device),
    ]
    if tls:
        cmd += ["--tls", tls]
    if not error_handling:
        cmd.append("--no-error-handling")
    # The peer does no linear algebra: without a thread pool, NumPy's
    # OpenBLAS does not spin a core for its first 50-100 ms, which on a small
    # host overlaps the first point's warm-up.
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    ctx = None
    try:
        line = _readline(proc, 60.0)
        if not line.startswith("ADDRESS "):
            raise PeerGone(f"unexpected line from the local peer: {line!r}")
        peer_address = bytes.fromhex(line.split()[1])
        ctx = gpucx.Context(config=context_config(tls))
        w = ctx.create_worker()
        stdin = proc.stdin
        assert stdin is not None  # Popen(stdin=PIPE)
        stdin.write(f"ADDRESS {w.address.hex()}\n".encode())
        stdin.flush()
        ep = w.connect(peer_address, error_handling=error_handling)
    except BaseException:
        if ctx is not None:
            ctx.close()
        proc.kill()
        proc.wait()
        raise
    return Session(ctx, w, ep, role="client", device=device, timeout=timeout, proc=proc)


def connect_remote(
    hostport: str, tls: str | None, error_handling: bool, device: int, timeout: float
) -> Session:
    """Connect to ``gpucx bench --server`` at ``HOST:PORT``.

    Raises
    ------
    BenchSetupError
        For a malformed ``HOST:PORT``.
    """
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BenchSetupError(f"bad --client {hostport!r}: use HOST:PORT")
    ctx = gpucx.Context(config=context_config(tls, listener=True))
    try:
        w = ctx.create_worker()
        ep = w.connect((host.strip("[]"), int(port)), error_handling=error_handling)
        s = Session(ctx, w, ep, role="client", device=device, timeout=timeout)
        s.send_ctrl({"op": "hello"})
        s.recv_ctrl(timeout=min(timeout, 30.0))
    except BaseException:
        ctx.close()
        raise
    return s
