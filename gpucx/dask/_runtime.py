"""Per-process context, per-event-loop worker, and configuration.

One :class:`gpucx.Context` per process (made on the first connect or
listen, remade in a forked child) with the ``tag`` and ``am`` features
only: a Dask peer gets no remote memory access.  One :mod:`gpucx.aio`
worker per running event loop, driven by the loop itself (no thread),
counted by the comms and listeners that use it and closed with the last.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
import select
import socket
import struct
import warnings
from typing import Any, NamedTuple

import dask.config
from dask.utils import parse_bytes, parse_timedelta

import gpucx
import gpucx.aio
from gpucx import _internal
from gpucx._internal import engine
from gpucx.request import in_flight

from ._buffers import ReceiveCache
from ._framing import ENTRY, HEADER, Limits

logger = logging.getLogger("gpucx.dask")

#: The active-message id a client's HELLO travels on (the only AM the comm
#: uses; the listener side learns the client's endpoint from it).
HELLO_AM_ID = 0xFE5D
#: Top byte of every tag the comm uses (the rest is random per connection).
TAG_PREFIX = 0xD5 << 56
#: Low byte of a tag: the channel.  The WELCOME has a channel of its own:
#: it travels over the connection's endpoint while the listener's first
#: messages may take the data endpoint, and UCX orders messages only within
#: one endpoint.
CH_DATA = 0
CH_WELCOME = 1
#: Mask of the top byte: every comm message (``new_tag``).
TAG_PREFIX_MASK = 0xFF << 56
#: Unexpected comm messages taken before a worker closes: at most this many,
#: into a buffer this big (a longer one is truncated, and gone all the same).
_DRAIN_MAX = 4096
_DRAIN_BUF = 64 * 1024
#: Frames whose table fits in the control buffer (more: a TABLE message).
CTRL_TABLE_MAX = 4096
#: Early HELLOs kept for endpoints whose handshake task has not asked yet.
_EARLY_MAX = 1024

#: HELLO (client -> listener, AM): magic, version, client->server tag,
#: server->client tag, client identity (pid, start time, boot id, pid ns),
#: client's control buffer size.
HELLO = struct.Struct("<4sB3xQQIQ16sQI")
HELLO_MAGIC = b"GXDH"
#: A HELLO or WELCOME may end with the sender's gpucx worker address (at
#: most this many bytes): the peer on the same host then opens a data
#: endpoint to it (see ``data_endpoint``).
ADDRESS_MAX = 4096
#: WELCOME (listener -> client, tag server->client | CH_WELCOME): magic, version,
#: listener identity, listener's control buffer size.
WELCOME = struct.Struct("<4sB3xIQ16sQI")
WELCOME_MAGIC = b"GXDW"
#: 2: no sentinel send any more (failures come from the endpoint itself);
#: the WELCOME on its own channel.
PROTOCOL_VERSION = 2


class Settings(NamedTuple):
    connect_timeout: float
    close_timeout: float
    inline_threshold: int
    progress: str
    device_allocator: str
    limits: Limits
    ctrl_cap: int
    data_endpoints: bool
    receive_cache: int
    receive_cache_min: int
    receive_cache_ttl: float
    spin_us: float
    max_stranded: int


def _load_defaults() -> dict[str, Any]:
    import yaml

    path = os.path.join(os.path.dirname(__file__), "gpucx-dask.yaml")
    with open(path) as f:
        defaults = yaml.safe_load(f)
    dask.config.update_defaults(defaults)
    return defaults["distributed-gpucx"]


DEFAULTS = _load_defaults()


def _config() -> dict[str, Any]:
    """``distributed-gpucx.*`` over the shipped defaults (a test harness may
    have replaced Dask's whole config)."""
    return {**DEFAULTS, **(dask.config.get("distributed-gpucx", default=None) or {})}


def settings() -> Settings:
    """The comm settings from Dask's config (``distributed-gpucx.*``).

    Raises
    ------
    ValueError
        For a value of the wrong kind (a negative timeout, an unknown
        progress mode...).
    """
    cfg = _config()
    ct = parse_timedelta(cfg["connect-timeout"], "s")
    cl = parse_timedelta(cfg["close-timeout"], "s")
    inline = parse_bytes(cfg["inline-threshold"])
    cache = parse_bytes(cfg["receive-cache"])
    cache_min = parse_bytes(cfg["receive-cache-min-frame"])
    ttl = parse_timedelta(cfg["receive-cache-ttl"], "s")
    spin = parse_timedelta(cfg["spin"], "s")
    stranded = parse_bytes(cfg["max-stranded-bytes"])
    if (
        ct is None
        or ct <= 0
        or cl is None
        or cl < 0
        or inline < 0
        or cache < 0
        or cache_min < 0
        or ttl is None
        or ttl <= 0
        or spin is None
        or spin < 0
        or stranded < 0
    ):
        raise ValueError(
            "distributed-gpucx: connect-timeout and receive-cache-ttl must be "
            "> 0, close-timeout, inline-threshold, receive-cache, "
            "receive-cache-min-frame, spin and max-stranded-bytes >= 0"
        )
    if cfg["progress"] not in ("event", "poll"):
        raise ValueError(
            f"distributed-gpucx.progress must be event or poll, not {cfg['progress']!r}"
        )
    if cfg["progress"] == "poll":
        # Poll mode progressed on every loop iteration while anything was
        # pending, and a comm always has its next read posted: a busy core
        # per idle process.  The adaptive spin gives the latency instead.
        warnings.warn(
            "distributed-gpucx.progress: poll was removed (it kept a core busy "
            "while idle); event progress is used (see distributed-gpucx.spin)",
            FutureWarning,
            stacklevel=2,
        )
    limits = Limits(
        int(cfg["max-frames"]),
        parse_bytes(cfg["max-frame-size"]),
        parse_bytes(cfg["max-message-size"]),
    )
    # The control buffer holds the header, a table of up to CTRL_TABLE_MAX
    # frames and the inline bytes; longer tables travel as their own message.
    ctrl_cap = HEADER.size + CTRL_TABLE_MAX * ENTRY.size + inline
    return Settings(
        ct,
        cl,
        inline,
        "event",
        cfg["device-allocator"],
        limits,
        ctrl_cap,
        bool(cfg["same-host-data-endpoints"]),
        cache,
        cache_min,
        ttl,
        round(spin * 1e6, 3),
        stranded,
    )


def context_config() -> dict[str, Any]:
    """``gpucx.Context(config=...)`` from ``distributed-gpucx.*``."""
    cfg = _config()
    out: dict[str, Any] = {}
    for key, value in (cfg.get("environment") or {}).items():
        name = str(key).upper().replace("-", "_")
        if name.startswith("UCX_"):
            name = name[4:]
        out[name] = value
    if cfg.get("tls") is not None:
        out["TLS"] = cfg["tls"]
    for name in list(out):
        if f"UCX_{name}" in os.environ:
            del out[name]  # the environment wins (as documented)
    if not {"UCX_TCP_CM_REUSEADDR", "UCX_CM_REUSEADDR"} & set(os.environ):
        # Listen again at once on a port whose previous listener's
        # connections are in TIME_WAIT (a restarted scheduler), as tcp://
        # does with SO_REUSEADDR.
        out.setdefault("CM_REUSEADDR", "y")
    out["GPUCX_PEER_CHECK_INTERVAL"] = float(cfg["peer-check-interval"])
    timeout = cfg.get("peer-timeout")
    if timeout is not None:
        # None: GPUCX_PEER_TIMEOUT from the environment, else gpucx's default.
        try:
            seconds = parse_timedelta(timeout, "s")
        except (TypeError, ValueError):
            seconds = None
        if seconds is None or seconds < 0:
            raise ValueError(
                "distributed-gpucx.peer-timeout must be a duration >= 0 or "
                f"null, not {timeout!r}"
            )
        out["GPUCX_PEER_TIMEOUT"] = float(seconds)
    return out


def ipv6_mode() -> bool:
    """Whether UCX's TCP transport is set to IPv6 first (``TCP_AF_PRIO``
    from the environment or ``distributed-gpucx.environment``): then comms
    take IPv6 addresses only, else IPv4 only (see ``comm._check_family``)."""
    prio: Any = os.environ.get("UCX_TCP_AF_PRIO")
    if prio is None:
        prio = context_config().get("TCP_AF_PRIO")
    if isinstance(prio, (list, tuple)):
        prio = ",".join(map(str, prio))
    return bool(prio) and str(prio).split(",")[0].strip().lower() == "inet6"


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` is taken by a listener (bound with the address
    reuse UCX's connection manager is given: a port in TIME_WAIT is free).
    Asked before UCX tries, so a busy port costs no UCX error line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


_contexts: dict = {}  # (pid, config) -> gpucx.Context
#: loop -> its LoopWorker.  Not a WeakKeyDictionary: the worker's driver
#: holds the loop, so a weak key would never drop.  An entry goes when its
#: last user releases it, when the loop shuts down (``_loop_end``), or, for
#: a loop closed without shutting down, on the next ``acquire``.
_workers: dict = {}


def context() -> gpucx.Context:
    """This process's comm context for the current configuration (made on
    first use; a forked child makes its own)."""
    cfg = context_config()
    key = (os.getpid(), repr(sorted(cfg.items())))
    ctx = _contexts.get(key)
    if ctx is None or ctx.closed:
        for k in [k for k in _contexts if k[0] != key[0]]:
            del _contexts[k]  # a parent's, after a fork: not ours to use
        ctx = _contexts[key] = gpucx.Context(features={"tag", "am"}, config=cfg)
    return ctx


class LoopWorker:
    """The gpucx worker of one event loop, shared by its comms and listeners."""

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: str, spin_us: float):
        self.loop = loop
        self.aw = gpucx.aio.Worker(context(), progress=progress, spin_us=spin_us)
        self.w = self.aw.worker
        self.refs = 0
        self.parked: list = []  # data endpoints closed once idle
        self.stranded: list = []  # (request, nbytes) of operations given up
        self.stranded_warned = False
        self._early: dict = {}  # Endpoint -> HELLO bytes
        self._waiting: dict = {}  # Endpoint -> Future
        self.end: Any = None  # the _loop_end generator
        self.w.set_am_handler(HELLO_AM_ID, self._on_hello)

    def _on_hello(self, msg) -> None:
        ep = msg.reply_ep
        if ep is None or msg.is_rndv:
            return
        data = bytes(msg.data)
        fut = self._waiting.pop(ep, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(data)
        elif len(self._early) < _EARLY_MAX:
            self._early[ep] = data

    async def hello_for(self, ep) -> bytes:
        """The HELLO the client behind accepted endpoint ``ep`` sends."""
        data = self._early.pop(ep, None)
        if data is not None:
            return data
        fut = self.loop.create_future()
        self._waiting[ep] = fut
        try:
            return await fut
        finally:
            self._waiting.pop(ep, None)

    def forget(self, ep) -> None:
        self._early.pop(ep, None)
        fut = self._waiting.pop(ep, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def strand(self, req, nbytes: int) -> None:
        """A comm gave up on ``req`` (``nbytes``): count it as stranded
        while UCX still holds it (see :func:`data_endpoints_allowed`)."""
        if in_flight(req):
            self.stranded.append((req, nbytes))

    def stranded_bytes(self) -> int:
        """Bytes of given-up operations UCX has not let go of yet."""
        self.stranded = [(r, n) for r, n in self.stranded if in_flight(r)]
        return sum(n for _, n in self.stranded)

    def close(self) -> None:
        self._early.clear()
        self.stranded.clear()
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self._waiting.clear()
        end, self.end = self.end, None
        if end is not None:
            # Finish the loop-end generator (its finally has nothing left to
            # do), so nothing is left for the loop to finalize.  It awaits
            # nothing: one step ends it.
            try:
                end.aclose().send(None)
            except (StopIteration, RuntimeError):
                pass
        if not self.w.closed:
            self._drain()
            self.aw.close(timeout=1.0)

    def _drain(self) -> None:
        """Take the comm messages left in UCX's unexpected queue (a peer's
        CLOSE that came after its comm was torn down here): UCX would warn
        about each when the worker is destroyed."""
        w = self.w
        buf = bytearray(_DRAIN_BUF)
        for _ in range(3):
            w.progress()
        for _ in range(_DRAIN_MAX):
            try:
                req = w.recv_nb(buf, TAG_PREFIX, TAG_PREFIX_MASK)
            except Exception:  # the worker is going away already
                return
            if not req.done():
                req.cancel()
                w.progress()
                return
            req.exception()  # truncated or not, it is gone from the queue


_cache: list = []  # [(pid, cap, min, ttl), ReceiveCache]


def receive_cache(s: Settings) -> ReceiveCache:
    """This process's cache of large host receive buffers for settings ``s``
    (a forked child or another configuration gets a new one)."""
    key = (os.getpid(), s.receive_cache, s.receive_cache_min, s.receive_cache_ttl)
    if _cache and _cache[0] == key:
        return _cache[1]
    if _cache:
        _cache[1].clear()
    cache = ReceiveCache(s.receive_cache, s.receive_cache_min, s.receive_cache_ttl)
    _cache[:] = [key, cache]
    return cache


async def _loop_end(lw: LoopWorker):
    """An async generator parked for the life of ``lw``'s loop: the loop's
    ``shutdown_asyncgens()`` (``asyncio.run`` and Dask's loop runners call it
    before closing the loop) closes it, and with it the worker that comms
    and listeners left open (their endpoints first)."""
    try:
        yield
    finally:
        if lw.end is not None:  # not closed by lw.close() itself
            lw.end = None
            _drop(lw)


def _drop(lw: LoopWorker) -> None:
    if _workers.get(lw.loop) is lw:
        del _workers[lw.loop]
    lw.close()
    if not _workers and _cache:
        _cache[1].clear()  # no comm left: give the memory back


def _sweep_closed_loops() -> None:
    """Close the workers of loops that were closed without shutting down."""
    for loop, lw in list(_workers.items()):
        if loop.is_closed():
            _drop(lw)


def acquire(s: Settings) -> LoopWorker:
    """The running loop's worker, with one more user."""
    loop = asyncio.get_running_loop()
    lw = _workers.get(loop)
    if lw is None or lw.w.closed:
        _sweep_closed_loops()
        lw = LoopWorker(loop, s.progress, s.spin_us)
        _workers[loop] = lw
        # Start the generator here, in the loop's thread, so the loop's
        # first-iteration hook registers it for shutdown_asyncgens().
        gen = _loop_end(lw)
        try:
            gen.asend(None).send(None)
        except StopIteration:
            pass
        lw.end = gen
    lw.refs += 1
    return lw


def release(lw: LoopWorker) -> None:
    """One user fewer; the last closes the worker."""
    lw.refs -= 1
    if lw.refs <= 0:
        _drop(lw)


def identity() -> tuple[int, int, bytes, int]:
    from gpucx._address import own_identity

    me = own_identity()
    return me.pid, me.start_time, me.boot_id, me.pidns


def watch_peer(lw: LoopWorker, ep, pid: int, start: int, boot: bytes, ns: int) -> None:
    """Check the peer process's liveness when it runs on this host."""
    from gpucx._address import Identity, is_local

    if pid != os.getpid() and is_local(Identity(pid, start, boot, ns)):
        _internal.watch_peer(ep.endpoint, pid, start)


def new_tag() -> int:
    """A random connection tag (reserved top byte, channel byte 0)."""
    return TAG_PREFIX | (int.from_bytes(os.urandom(6), "little") << 8)


def device_allocator(name: str):
    """The callable ``nbytes -> CUDA array`` for ``device-allocator``.

    Raises
    ------
    RuntimeError
        When the named library is not installed.
    """
    if name in ("auto", "cupy"):
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            return lambda n: cupy.empty((n,), dtype="u1")
        if name == "cupy":
            raise RuntimeError(
                "the peer sent CUDA frames and device-allocator is cupy, "
                "but CuPy is not installed"
            )
    if name in ("auto", "rmm"):
        try:
            import rmm
        except ImportError:
            raise RuntimeError(
                "the peer sent CUDA frames: install cupy or rmm to receive "
                "them (distributed-gpucx.device-allocator)"
            ) from None
        return lambda n: rmm.DeviceBuffer(size=n)
    mod, _, attr = name.rpartition(".")
    if not mod:
        raise RuntimeError(f"distributed-gpucx.device-allocator: unknown {name!r}")
    return getattr(importlib.import_module(mod), attr)


def data_endpoints_allowed(lw: LoopWorker, s: Settings) -> bool:
    """Whether a new comm of ``lw`` may use a data endpoint.

    A rendezvous send on a data endpoint (no peer error handling) that the
    peer had not fetched when it died is never released by UCX, which
    cancels no send and refuses to force-close such an endpoint: only the
    worker's destruction frees its buffer.  Comms post nothing to a peer
    they know is dead, but a death while a frame is on its way still
    strands its send.  Once ``max-stranded-bytes`` are held so, new comms
    use their connection's endpoint only (UCX cleans those up); the memory
    comes back when the loop's last comm closes the worker.
    """
    if not s.data_endpoints:
        return False
    if not s.max_stranded or lw.stranded_bytes() < s.max_stranded:
        return True
    if not lw.stranded_warned:
        lw.stranded_warned = True
        logger.warning(
            "gpucx: %d bytes of operations cut short by dead peers are held "
            "on data endpoints (distributed-gpucx.max-stranded-bytes=%d): new "
            "comms to peers on this host use their connection's endpoint "
            "(no cma) until this event loop's comms are all closed",
            lw.stranded_bytes(),
            s.max_stranded,
        )
    return False


class PeerProcess:
    """A peer process on this host: is it alive, at the cost of a
    ``poll`` of its pidfd (Linux 5.3 and up; ``fd`` is -1 without one, and
    after ``close``), else of a read of ``/proc/<pid>/stat``."""

    __slots__ = ("pid", "start", "fd", "_poll", "_dead")

    def __init__(self, pid: int, start: int):
        from gpucx._liveness import open_pidfd

        self.pid = pid
        self.start = start
        self._poll = None
        self._dead = False
        # -1: no pidfds here, or the process is gone (alive() asks /proc).
        self.fd = open_pidfd(pid, start)
        if self.fd >= 0:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._poll is not None:
            self._dead = bool(self._poll.poll(0))
        else:
            from gpucx._liveness import proc_alive

            self._dead = not proc_alive(self.pid, self.start)
        return not self._dead

    def close(self) -> None:
        if self.fd >= 0:
            self._poll = None
            os.close(self.fd)
            self.fd = -1


def data_endpoint(lw: LoopWorker, address: bytes, pid, start, boot, ns):
    """An endpoint for a peer on this host, made from its worker address
    without peer error handling, so UCX may move large frames with
    single-copy ``cma`` (error-handling endpoints leave shared memory only
    its copy-through-FIFO path).  Its failures are caught by gpucx's
    liveness check of the peer process (the address is framed) and by the
    connection endpoint's ``wait_closed``.  None for a peer elsewhere, or
    when the address is not a gpucx worker address.
    """
    from gpucx._address import Identity, is_local

    if not address or not is_local(Identity(pid, start, boot, ns)):
        return None
    try:
        ep = lw.w.connect(bytes(address), error_handling=False)
    except gpucx.UCXError:
        return None
    return gpucx.aio.Endpoint(ep, lw.aw.driver)


def close_data_endpoint(lw: LoopWorker, dep) -> None:
    """Close a data endpoint once nothing is pending on it.

    Without peer error handling a force close is not allowed while the peer
    may still act on our operations (it could read a rendezvous buffer we
    gave up; UCX would not handle the error on its side).  An endpoint with
    operations pending is parked and closed by a later sweep (or with the
    worker); an endpoint whose peer died was failed by gpucx already.
    """
    lw.parked.append(dep.endpoint)
    sweep_parked(lw)


def sweep_parked(lw: LoopWorker) -> None:
    """Flush-close the parked data endpoints that have nothing pending."""
    if not lw.parked or lw.w.closed:
        return
    busy = engine(lw.w).busy_endpoints()
    keep = []
    for ep in lw.parked:
        if ep.closed:
            continue
        if ep in busy:
            keep.append(ep)
            continue
        try:
            ep.close(timeout=0.5)
        except Exception:
            pass
    lw.parked = keep
