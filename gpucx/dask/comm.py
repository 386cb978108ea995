"""The ``gpucx://`` comm: Backend, Connector, Listener and Comm for Dask.

Wire format: :mod:`gpucx.dask._framing`; handshake and tags:
:mod:`gpucx.dask._runtime` and ``docs/dask.md``.

Failure detection: a task awaits :meth:`gpucx.aio.Endpoint.wait_closed`
of the connection endpoint and of the data endpoint (when there is one),
which returns as soon as the endpoint fails (UCX's error callback: a TCP
or connection-manager reset at once; a peer on this host that dies is
caught by gpucx's liveness check of the data endpoint, a
``mode="same-host"`` endpoint).  It then cancels the comm's posted
receives, so every pending and later ``read`` raises ``CommClosedError``
(tag receives are worker-wide and would not fail by themselves), and
closes the data endpoint (gpucx fails, parks or closes it as its state
asks).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import weakref

import numpy as np
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import (
    BaseListener,
    Comm,
    CommClosedError,
    Connector,
    FatalCommClosedError,
)
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.utils import ensure_ip, get_ip

import gpucx
from gpucx.mem import as_buffer
from gpucx.mem.memtype import MemoryType

from . import _framing as fr
from . import _runtime as rt

logger = logging.getLogger("gpucx.dask")

PREFIX = "gpucx://"
_HOST_TYPES = (bytes, bytearray, memoryview)
_DEVICE_TYPES = frozenset({MemoryType.CUDA, MemoryType.CUDA_MANAGED})


def _refuse_encryption(connection_args: dict) -> None:
    import dask.config

    if (
        connection_args.get("ssl_context") is not None
        or connection_args.get("require_encryption")
        or dask.config.get("distributed.comm.require-encryption", False)
    ):
        raise FatalCommClosedError(
            "gpucx:// does not encrypt: it cannot serve a TLS security "
            "configuration or distributed.comm.require-encryption; use tls:// "
            "or turn encryption off"
        )


#: What a failed read or write turns into ``CommClosedError``: the
#: connection's failures (gpucx's errors, a peer that broke the wire format,
#: socket errors).  Anything else (KeyboardInterrupt, SystemExit, a bug,
#: a missing device allocator) aborts the comm and propagates as it is, as
#: with ``tcp://``: Dask retries a lost connection, not a Ctrl-C.
_CONNECTION_LOST = (gpucx.UCXError, fr.FramingError, OSError)


def _check_family(host: str, what: str) -> None:
    """Refuse an address of the family UCX's TCP transport is not set for,
    before UCX sees it (nothing is sent or bound).

    UCX 1.22's TCP transport serves the first family of its ``TCP_AF_PRIO``
    (``inet,inet6`` by default): an IPv6 connection then corrupts the heap
    (``uct_tcp_ep_set_dest_addr``, reached when a connection is accepted)
    and the process aborts; with ``inet6`` first, IPv6 works and IPv4
    connections hang.  So one process speaks one family.
    """
    v6 = ":" in host
    if v6 == rt.ipv6_mode():
        return
    if v6:
        raise FatalCommClosedError(
            f"gpucx:// {what} [{host}]: an IPv6 address needs UCX's TCP "
            "transport set to IPv6 (distributed-gpucx.environment: "
            "{tcp-af-prio: inet6}, or UCX_TCP_AF_PRIO=inet6), which then serves "
            "IPv6 only; with its default UCX crashes on IPv6 connections"
        )
    raise FatalCommClosedError(
        f"gpucx:// {what} {host}: UCX's TCP transport is set to IPv6 "
        "(tcp-af-prio inet6), which serves no IPv4 address; use an IPv6 address"
    )


def _lost(comm, exc: BaseException, what: str) -> BaseException:
    """The exception a failed ``read``/``write`` raises (the comm is aborted
    already): ``CommClosedError`` for a lost connection, else ``exc``."""
    if isinstance(exc, (asyncio.CancelledError, CommClosedError)):
        return exc
    if isinstance(exc, _CONNECTION_LOST):
        return CommClosedError(f"{comm}: {what} failed: {exc!r}")
    return exc


def _kind(frame) -> tuple[int, int]:
    """(nbytes, kind) of an outgoing frame."""
    if type(frame) in _HOST_TYPES:
        return (frame.nbytes if type(frame) is memoryview else len(frame)), fr.HOST
    buf = as_buffer(frame)
    kind = fr.CUDA if buf.memory_type in _DEVICE_TYPES else fr.HOST
    return buf.nbytes, kind


def _sync_device(frame) -> None:
    """Wait for the allocation of a device receive buffer (stream-ordered
    allocators) before UCX writes into it."""
    try:
        import cupy
    except ImportError:
        return
    if isinstance(frame, cupy.ndarray):
        cupy.cuda.get_current_stream().synchronize()


class GpucxComm(Comm):
    """One Dask connection over a gpucx endpoint."""

    def __init__(
        self,
        lw: rt.LoopWorker,
        ep,
        rtag: int,
        stag: int,
        peer_cap: int,
        local_addr: str,
        peer_addr: str,
        settings: rt.Settings,
        deserialize: bool = True,
        data_ep=None,
    ):
        super().__init__(deserialize=deserialize)
        self._lw = lw
        self._ep = ep
        # Messages go over the data endpoint of a peer on this host (a
        # mode="same-host" endpoint, rt.data_endpoint), else over the
        # connection's own endpoint.  Both are watched for failure.
        self._dep = data_ep if data_ep is not None else ep
        self._w = lw.w
        self._rtag = rtag
        self._stag = stag
        self._peer_cap = peer_cap
        self._settings = settings
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._ctrl = np.empty(settings.ctrl_cap, "u1")
        self._cache = rt.receive_cache(settings)
        self._closed = False
        self._broken: str | None = None
        self._recvs: set = set()
        self._released = False
        self._dep_closed = False  # the data endpoint was handed to its close
        self._failed = asyncio.get_running_loop().create_future()
        self._close_sent = False
        self._peer_closed = False
        # The watch tasks hold the comm weakly: a comm dropped without
        # close() is collected, and closed (``__del__``).
        ref = weakref.ref(self)
        self._watches = [asyncio.ensure_future(_watch_endpoint(ref, ep))]
        if self._dep is not ep:
            self._watches.append(asyncio.ensure_future(_watch_endpoint(ref, self._dep)))

    def __del__(self) -> None:
        # As tcp:// does with a dangling stream: warn, and close it.
        if getattr(self, "_closed", True):
            return
        lw = self._lw
        try:
            logger.warning("Closing dangling comm %r", self)
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is lw.loop:
                self.abort()
            elif not lw.loop.is_closed():
                # Collected in another thread: abort on the comm's own loop.
                lw.loop.call_soon_threadsafe(self.abort)
        except Exception:  # interpreter exit, or the loop closed meanwhile:
            pass  # the loop's worker closes the endpoints with itself

    # -- failure detection ----------------------------------------------------

    def _endpoint_closed(self, err) -> None:
        """The connection or data endpoint failed (``err``) or was closed
        (None)."""
        if err is None or self._closed or self._broken is not None:
            return
        self._peer_failed(f"peer failed: {err}")

    def _peer_failed(self, reason: str) -> None:
        if self._closed or self._broken is not None:
            return
        self._broken = reason
        if not self._failed.done():
            self._failed.set_result(reason)
        for req in list(self._recvs):
            req.cancel()
        # gpucx fails the data endpoint's operations if the peer died, or
        # closes it once they are done if it lives on (it closed its end).
        self._close_data_endpoint()
        self._lw.aw.driver.kick()

    def _close_data_endpoint(self) -> None:
        dep = self._dep
        if dep is not None and dep is not self._ep and not self._dep_closed:
            self._dep_closed = True
            dep.close()

    def endpoint_failed(self, ep, err) -> None:
        """Endpoint ``ep`` failed (or closed) with ``err``
        (:func:`_watch_endpoint`): the comm breaks if it is still this
        comm's connection or data endpoint."""
        if ep is self._ep or ep is self._dep:
            self._endpoint_closed(err)

    def _check_peer(self) -> None:
        """Before posting frames over the data endpoint: raise
        ``CommClosedError`` if the peer process is gone
        (``Endpoint.check_peer``).  A frame still in a dead peer's memory
        cannot be fetched, and a rendezvous send to it would stay with UCX
        (see ``Worker.stranded_bytes``).  A comm that broke otherwise goes
        on: what had fully arrived is still delivered."""
        dep = self._dep
        if dep is self._ep:
            return
        if not self._dep_closed:
            try:
                dep.check_peer()
            except gpucx.UCXError as exc:
                self._peer_failed(f"peer failed: {exc}")
                raise CommClosedError(f"{self}: {self._broken}") from None
        elif dep.error is not None:  # closed, then its peer was found dead
            raise CommClosedError(f"{self}: {self._broken}")

    async def _await_frame(self, req) -> None:
        """Await a frame receive, racing the peer's failure: a receive that
        already matched a dead peer's message over the data endpoint (no
        peer error handling) cannot be canceled in UCX and would not end."""
        if self._dep is self._ep or req.done():
            await req
            return
        task = asyncio.ensure_future(_await(req))
        done, _ = await asyncio.wait(
            {task, self._failed}, return_when=asyncio.FIRST_COMPLETED
        )
        if task not in done:
            task.cancel()
            raise CommClosedError(f"{self}: {self._broken}")
        task.result()

    async def _recv(self, buf):
        req = self._w.recv_nb(buf, self._rtag)
        # After a peer failure, what arrived before it is still delivered.
        if self._broken is not None and not req.done():
            req.cancel()
            raise CommClosedError(f"{self}: {self._broken}")
        self._recvs.add(req)
        try:
            return await req
        finally:
            self._recvs.discard(req)

    # -- Comm API ---------------------------------------------------------------

    async def read(self, deserializers=None):
        """Read one message; ``CommClosedError`` once the comm is closed,
        the peer closed or failed, or the peer broke the wire format."""
        if self._closed:
            raise CommClosedError(f"{self} is closed")
        s = self._settings
        try:
            info = await self._recv(self._ctrl)
            ctl = fr.parse(self._ctrl, info.nbytes, s.limits)
            if ctl.flags & fr.F_CLOSE:
                self._peer_closed = True
                self.abort()
                raise CommClosedError(f"{self}: connection closed by the peer")
            sizes, kinds = ctl.sizes, ctl.kinds
            if ctl.flags & fr.F_TABLE:
                table = np.empty(fr.table_bytes(ctl.nframes), "u1")
                got = await self._recv(table)
                if got.nbytes != table.nbytes:
                    raise fr.FramingError("frame table of the wrong size")
                sizes, kinds = fr.parse_table(
                    table, 0, ctl.nframes, ctl.total, s.limits, False
                )
            frames: list = []
            reqs = []
            off = ctl.inline_at
            ctrl = self._ctrl
            alloc = None
            w = self._w
            cache = self._cache
            trim = False
            for size, kind in zip(sizes, kinds, strict=True):
                if kind == fr.CUDA:
                    if alloc is None:
                        alloc = rt.device_allocator(s.device_allocator)
                    buf = alloc(size)
                    if size:
                        _sync_device(buf)
                elif kind == fr.INLINE:
                    buf = np.empty(size, "u1")
                    buf[:] = ctrl[off : off + size]
                    off += size
                    buf = buf.data
                else:
                    buf = cache.get(size)
                    if size >= cache.min_bytes:
                        trim = True
                if size and kind != fr.INLINE:
                    if not reqs:
                        self._check_peer()
                    reqs.append(w.recv_nb(buf, self._rtag))
                frames.append(buf)
            if trim:
                cache.schedule_trim(self._lw.loop)
            if reqs:
                self._recvs.update(reqs)
                if self._broken is not None:
                    for r in reqs:
                        r.cancel()
                try:
                    for r in reqs:
                        await self._await_frame(r)
                finally:
                    self._recvs.difference_update(reqs)
        except BaseException as exc:
            self.abort()
            err = _lost(self, exc, "read")
            if err is exc:
                raise
            raise err from exc
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            self.abort()
            raise CommClosedError(f"{self}: aborted stream on truncated data")

    async def write(self, msg, serializers=None, on_error="message") -> int:
        """Write one message; return its payload bytes.  Aborts the comm
        (and raises ``CommClosedError``) when the send fails or is cancelled."""
        if self._closed or self._broken is not None:
            raise CommClosedError(f"{self} is closed: {self._broken or 'locally'}")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
        )
        try:
            return await self._send_frames(frames)
        except BaseException as exc:
            self.abort()
            err = _lost(self, exc, "write")
            if err is exc:
                raise
            raise err from exc

    async def _send_frames(self, frames) -> int:
        if self._closed or self._broken is not None:
            raise CommClosedError(f"{self} is closed: {self._broken or 'locally'}")
        s = self._settings
        n = len(frames)
        sizes = []
        kinds = []
        for f in frames:
            size, kind = _kind(f)
            sizes.append(size)
            kinds.append(kind)
        total = sum(sizes)
        table_len = fr.HEADER.size + fr.ENTRY.size * n
        separate_table = table_len > self._peer_cap
        inline = []
        if not separate_table:
            room = min(s.inline_threshold, self._peer_cap - table_len)
            for i in range(n):
                size = sizes[i]
                if kinds[i] == fr.HOST and 0 < size <= room:
                    kinds[i] = fr.INLINE
                    inline.append(frames[i])
                    room -= size
        ep = self._dep
        tag = self._stag
        if ep is not self._ep and len(inline) < n:
            self._check_peer()  # a rendezvous send to a dead peer would stay
        reqs = []
        if separate_table:
            table = fr.pack_table(sizes, kinds)
            reqs.append(ep.send_nb(fr.pack_header(fr.F_TABLE, n, total), tag))
            reqs.append(ep.send_nb(table, tag))
        else:
            ctrl = fr.pack_header(0, n, total) + fr.pack_table(sizes, kinds)
            if inline:
                # One contiguous message: a copy of a few KiB costs less than
                # UCX's IOV path.
                ctrl = b"".join([ctrl, *inline])
            reqs.append(ep.send_nb(ctrl, tag))
        for f, size, kind in zip(frames, sizes, kinds, strict=True):
            if size and kind != fr.INLINE:
                reqs.append(ep.send_nb(f, tag))
        for r in reqs:
            await r
        return total

    async def close(self) -> None:
        """Send CLOSE, flush (bounded by ``close-timeout``), close."""
        if self._closed:
            return
        self._closed = True
        for req in list(self._recvs):  # a read in flight ends closed
            req.cancel()
        try:
            if self._drain():
                self._peer_closed = True  # nothing to tell the peer
            elif self._broken is None and not self._ep.endpoint.closed:
                req = self._dep.send_nb(fr.close_message(), self._stag)
                await asyncio.wait_for(self._dep.aflush(), self._settings.close_timeout)
                await req
                self._close_sent = True
        except (gpucx.UCXError, asyncio.TimeoutError):
            # The CLOSE could not go out or be flushed within close-timeout
            # (the peer went away, the endpoint failed): the teardown
            # below closes all the same.
            pass
        finally:
            self._teardown()

    def _drain(self) -> bool:
        """Take what waits on our tag in UCX's unexpected queue (nobody will
        read it); True when the peer's CLOSE was among it."""
        saw_close = False
        for _ in range(64):
            try:
                req = self._w.recv_nb(self._ctrl, self._rtag)
            except Exception:  # the worker is gone already
                return saw_close
            if not req.done():
                req.cancel()
                break
            if req.exception() is None:
                nbytes = req.result().nbytes
                if nbytes == fr.HEADER.size and bytes(self._ctrl[:nbytes]) == (
                    fr.close_message()
                ):
                    saw_close = True
        return saw_close

    def _send_close(self) -> None:
        """Post a CLOSE control message (abort), unless the peer is gone or
        closed, or one went out already."""
        if self._broken is not None or self._peer_closed or self._close_sent:
            return
        try:
            req = self._dep.send_nb(fr.close_message(), self._stag)
            if req.done() and req.exception() is None:
                self._close_sent = True
        except gpucx.UCXError:  # the endpoint went away: nobody to tell
            pass

    def abort(self) -> None:
        """Close at once, without waiting (safe from ``finally`` blocks)."""
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        for watch in self._watches:
            if not watch.done():
                watch.cancel()
        for req in list(self._recvs):
            req.cancel()
        ep = self._ep
        if ep is not None:
            if self._drain():
                self._peer_closed = True
            self._send_close()
            self._close_data_endpoint()
            self._ep = None
            self._dep = None
            try:
                ep.close(force=True)
            except Exception:  # already gone with its worker
                pass
            self._lw.forget(ep.endpoint)
        if not self._released:
            self._released = True
            try:
                self._lw.aw.driver.kick()
            except Exception:  # the loop or the worker closed: nothing to wake
                pass
            rt.release(self._lw)

    def closed(self) -> bool:
        """True once closed here, or once the peer failed."""
        return self._closed or self._broken is not None

    @property
    def local_address(self) -> str:
        """``gpucx://host:port`` of this side (from ``ucp_ep_query``)."""
        return self._local_addr

    @property
    def peer_address(self) -> str:
        """``gpucx://host:port`` of the peer (as dialled, or from
        ``ucp_ep_query`` on the listener side)."""
        return self._peer_addr

    @property
    def same_host(self) -> bool:
        """Whether both ends have the same host address."""
        return super().same_host

    @property
    def extra_info(self) -> dict:
        """Nothing beyond the addresses (no TLS)."""
        return {}


async def _watch_endpoint(ref, ep) -> None:
    """Tell the comm behind weak reference ``ref`` when its connection
    endpoint ``ep`` fails."""
    try:
        err = await ep.wait_closed()
    except asyncio.CancelledError:
        return
    comm = ref()
    if comm is not None:
        comm.endpoint_failed(ep, err)


def _addr(pair) -> str:
    if pair is None:
        return ""
    return PREFIX + unparse_host_port(*pair)


async def _first(task: asyncio.Future, ep, timeout: float, what: str):
    """Await ``task``, failing early when endpoint ``ep`` fails: the peer
    went away mid-handshake."""
    watch = asyncio.ensure_future(ep.wait_closed())
    try:
        done, _ = await asyncio.wait(
            {task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        if not watch.done():
            watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if watch in done:
        raise CommClosedError(f"{what}: peer went away ({watch.result()})")
    raise CommClosedError(f"{what}: no answer within {timeout} s")


async def _await(req):
    return await req


class GpucxConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **connection_args):
        """Connect to ``host:port`` and run the gpucx handshake; an
        unreachable peer raises ``CommClosedError`` (an ``OSError``)."""
        _refuse_encryption(connection_args)
        s = rt.settings()
        host, port = parse_host_port(address)
        ip = ensure_ip(host)
        _check_family(ip, "cannot connect to")
        lw = rt.acquire(s)
        ep = None
        ok = False
        try:
            try:
                ep = await asyncio.wait_for(
                    lw.aw.aconnect((ip, port)), s.connect_timeout
                )
            except asyncio.TimeoutError:
                raise CommClosedError(
                    f"gpucx connect to {address} timed out after {s.connect_timeout} s"
                ) from None
            rtag, stag = rt.new_tag(), rt.new_tag()
            pid, start, boot, ns = rt.identity()
            hello = rt.HELLO.pack(
                rt.HELLO_MAGIC,
                rt.PROTOCOL_VERSION,
                stag,
                rtag,
                pid,
                start,
                boot,
                ns,
                s.ctrl_cap,
            ) + (lw.w.address if s.data_endpoints else b"")
            await ep.am_send_nb(rt.HELLO_AM_ID, hello, reply=True)
            welcome = bytearray(rt.WELCOME.size + rt.ADDRESS_MAX)
            task = asyncio.ensure_future(lw.aw.arecv(welcome, tag=rtag | rt.CH_WELCOME))
            info = await _first(
                task, ep, s.connect_timeout, f"gpucx handshake with {address}"
            )
            # The listener's identity (fields 2-5) is not used any more: the
            # data endpoint's comes with its worker address.
            magic, version, *_, peer_cap = rt.WELCOME.unpack_from(welcome)
            if (
                info.nbytes < rt.WELCOME.size
                or magic != rt.WELCOME_MAGIC
                or version != rt.PROTOCOL_VERSION
            ):
                raise FatalCommClosedError(
                    f"{address} did not answer the gpucx:// handshake (version "
                    f"{version}; this gpucx speaks {rt.PROTOCOL_VERSION})"
                )
            peer_address = bytes(welcome[rt.WELCOME.size : info.nbytes])
            dep = rt.data_endpoint(lw, peer_address) if s.data_endpoints else None
            local = _addr(ep.local_sockaddr)
            comm = GpucxComm(
                lw,
                ep,
                rtag,
                stag,
                peer_cap,
                local,
                PREFIX + address,
                s,
                deserialize,
                dep,
            )
            ok = True
            return comm
        except gpucx.UCXError as exc:
            raise CommClosedError(f"gpucx connect to {address}: {exc}") from exc
        finally:
            if not ok:
                if ep is not None:
                    ep.close(force=True)
                rt.release(lw)


class GpucxListener(BaseListener):
    prefix = PREFIX
    comm_class = GpucxComm
    encrypted = False

    def __init__(
        self,
        address: str,
        comm_handler,
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        **connection_args,
    ):
        super().__init__()
        _refuse_encryption(connection_args)
        ip, self.port = parse_host_port(address, default_port=0)
        # An empty host listens on every interface and says so (0.0.0.0),
        # as tcp:// does.
        self.ip = ip or ("::" if rt.ipv6_mode() else "0.0.0.0")
        _check_family(self.ip, "cannot listen on")
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.default_host = default_host
        self._lw: rt.LoopWorker | None = None
        self._lst: gpucx.aio.Listener | None = None
        self._accept_task: asyncio.Task | None = None
        self._handshakes: set[asyncio.Task] = set()
        self._stopped = False
        self._bound_port = self.port

    async def start(self) -> None:
        """Listen and start accepting."""
        s = rt.settings()
        self._settings = s
        lw = rt.acquire(s)
        try:
            self._lst = _listen(lw, self.ip, self.port)
        except BaseException:
            rt.release(lw)
            raise
        self._bound_port = self._lst.port  # reported after stop() too
        self._lw = lw
        self._accept_task = asyncio.ensure_future(self._accept_loop())

    async def _accept_loop(self) -> None:
        lw = self._lw
        while lw is not None and not self._stopped:
            try:
                ep = await lw.aw.aaccept(self._lst)
            except asyncio.CancelledError:
                return
            except Exception as exc:
                if not self._stopped:
                    logger.debug("gpucx accept failed: %r", exc)
                return
            if self._stopped:  # accepted as stop() ran: not served
                ep.close(force=True)
                return
            task = asyncio.ensure_future(self._serve(ep))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _serve(self, ep) -> None:
        lw = self._lw
        if lw is None:  # stopped meanwhile
            ep.close(force=True)
            return
        s = self._settings
        lw.refs += 1
        comm = None
        dep = None
        try:
            hello = await asyncio.wait_for(lw.hello_for(ep.endpoint), s.connect_timeout)
            n = rt.HELLO.size
            ok_len = n <= len(hello) <= n + rt.ADDRESS_MAX
            # The client's identity (fields 4-7) is not used any more: the
            # data endpoint's comes with its worker address.
            magic, version, rtag, stag, *_, peer_cap = (
                rt.HELLO.unpack_from(hello) if ok_len else (b"",) * 9
            )
            if (
                magic != rt.HELLO_MAGIC
                or version != rt.PROTOCOL_VERSION
                or rtag & ~((1 << 56) - 1 - 0xFF) != rt.TAG_PREFIX
                or stag & ~((1 << 56) - 1 - 0xFF) != rt.TAG_PREFIX
                or peer_cap < fr.HEADER.size + fr.ENTRY.size
            ):
                raise fr.FramingError("malformed gpucx:// HELLO")
            me = rt.identity()
            dep = rt.data_endpoint(lw, hello[n:]) if s.data_endpoints else None
            welcome = rt.WELCOME.pack(
                rt.WELCOME_MAGIC, rt.PROTOCOL_VERSION, *me, s.ctrl_cap
            ) + (lw.w.address if dep is not None else b"")
            await ep.asend(welcome, stag | rt.CH_WELCOME)
            comm = GpucxComm(
                lw,
                ep,
                rtag,
                stag,
                peer_cap,
                _addr(ep.local_sockaddr),
                _addr(ep.remote_sockaddr),
                s,
                self.deserialize,
                dep,
            )
            lw.refs += 1  # the comm's own reference
        except BaseException as exc:
            if dep is not None:
                dep.close()
            lw.forget(ep.endpoint)
            try:
                ep.close(force=True)
            except Exception:  # already gone with its worker
                pass
            if not isinstance(exc, asyncio.CancelledError):
                logger.debug("gpucx handshake failed: %r", exc)
            return
        finally:
            rt.release(lw)
        comm.allow_offload = self.allow_offload
        # From here on the comm is Dask's: stop() leaves it alone (as
        # tcp:// does; Server aborts the comms still in Dask's handshake
        # with abort_handshaking_comms()).
        self._handshakes.discard(asyncio.current_task())  # type: ignore[arg-type]
        try:
            if self._stopped:
                # Stopped before the comm was ours to hand out (as tcp://
                # closes a stream accepted after stop()).
                raise CommClosedError("listener stopped")
            await self.on_connection(comm)
        except CommClosedError:
            logger.debug("connection closed during the Dask handshake")
            comm.abort()
            return
        except BaseException:
            comm.abort()
            raise
        await self.comm_handler(comm)

    def stop(self) -> None:
        """Stop accepting; drop connections still in the gpucx handshake.
        Established comms (and those in Dask's handshake) stay open."""
        if self._stopped:
            return
        self._stopped = True
        if self._accept_task is not None and not self._accept_task.done():
            self._accept_task.cancel()
        for task in list(self._handshakes):
            task.cancel()
        lst, self._lst = self._lst, None
        if lst is not None:
            lst.close()
        lw, self._lw = self._lw, None
        if lw is not None:
            rt.release(lw)

    def get_host_port(self):
        """``(host, port)`` listened on."""
        if self._lst is None and self._stopped:
            raise ValueError("listener is stopped")
        return self.ip, self._port

    @property
    def _port(self):
        return self._lst.port if self._lst is not None else self._bound_port

    @property
    def listen_address(self) -> str:
        """The address listened on (maybe a wildcard host)."""
        return self.prefix + unparse_host_port(self.ip, self._port)

    @property
    def contact_address(self) -> str:
        """An address peers can connect to."""
        host = ensure_concrete_host(self.ip, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, self._port)


def _listen(lw: rt.LoopWorker, host: str, port: int):
    """``lw.aw.listen(port, host)``; a port in use raises ``OSError`` with
    ``EADDRINUSE`` (port ranges skip it), without UCX's own log line about
    the failed ``bind``."""
    if port and rt.port_in_use(host, port):
        raise OSError(
            errno.EADDRINUSE, f"gpucx:// cannot listen on {host}:{port}: in use"
        )
    try:
        return lw.aw.listen(port, host)
    except gpucx.UCXError as exc:
        if exc.status_name == "UCS_ERR_BUSY":
            raise OSError(
                errno.EADDRINUSE, f"gpucx:// cannot listen on {host}:{port}: {exc}"
            ) from exc
        raise


class GpucxBackend(Backend):
    """The ``gpucx`` scheme (entry point ``distributed.comm.backends``)."""

    def get_connector(self):
        return GpucxConnector()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        return GpucxListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc):
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc):
        return parse_host_port(loc)

    def resolve_address(self, loc):
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc):
        host, port = parse_host_port(loc)
        host = ensure_ip(host)
        _check_family(host, "cannot reach")
        return unparse_host_port(get_ip(host), None)
