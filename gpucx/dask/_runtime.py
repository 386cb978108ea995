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
import socket
import struct
import warnings
from typing import Any, NamedTuple

import dask.config
from dask.utils import parse_bytes, parse_timedelta

import gpucx
import gpucx.aio

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
    # What sends given up on data endpoints (mode="same-host") may hold
    # before the worker refuses new ones (Worker.stranded_bytes).
    out["GPUCX_MAX_STRANDED_BYTES"] = parse_bytes(cfg["max-stranded-bytes"])
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
        self.ctx = context()
        self.aw = gpucx.aio.Worker(self.ctx, progress=progress, spin_us=spin_us)
        self.w = self.aw.worker
        self.refs = 0
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

    def close(self) -> None:
        self._early.clear()
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


def data_endpoint(lw: LoopWorker, address: bytes):
    """The data endpoint to a peer on this host whose gpucx worker address
    the handshake carried: ``worker.connect(address, mode="same-host")``
    (no UCX peer error handling, so large frames may take single-copy
    ``cma``; gpucx watches the peer process, fails what is pending when it
    dies, closes the endpoint once idle and counts what dead peers strand;
    docs/guide.md, "Endpoint modes").  None when there is no address, or
    when gpucx refuses the mode (the peer runs elsewhere, or given-up sends
    hold ``max-stranded-bytes`` already: then one warning): the comm then
    sends over its connection's endpoint."""
    if not address:
        return None
    try:
        ep = lw.w.connect(bytes(address), mode="same-host")
    except gpucx.UnsupportedError as exc:
        cap = lw.ctx.max_stranded_bytes
        if cap and lw.w.stranded_bytes >= cap and not lw.stranded_warned:
            lw.stranded_warned = True
            logger.warning(
                "gpucx: sends cut short by dead peers hold %d bytes on data "
                "endpoints (distributed-gpucx.max-stranded-bytes=%d): new comms "
                "to peers on this host send over their connection's endpoint "
                "(no cma) until UCX lets go of them or this event loop's comms "
                "are all closed",
                lw.w.stranded_bytes,
                cap,
            )
        else:
            logger.debug("gpucx: no data endpoint: %s", exc)
        return None
    except gpucx.UCXError as exc:  # not a gpucx address, or the peer is gone
        logger.debug("gpucx: no data endpoint: %s", exc)
        return None
    return gpucx.aio.Endpoint(ep, lw.aw.driver)
