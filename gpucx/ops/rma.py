"""One-sided operations: remote keys, put/get, put-with-notify.

Three completion levels:

* **local** -- a put's request is done (or blocking ``put`` returned): the
  source buffer may be reused; the data may still be in flight.  A get is
  done when the data is in the local buffer.
* **remote** -- after :meth:`Endpoint.flush` (or :meth:`Worker.flush`)
  returns, every put issued before it is visible in the target memory.
* **notified** -- ``put(..., notify=b"...")`` issues the put, an endpoint
  flush and, once the flush completed, a small active message on the
  reserved id ``0xFFFF``; the owner's :meth:`Worker.notifications` yields
  ``(endpoint, notify)`` only after the data is in place.  (The flush is the
  fence: ``ucp_worker_fence`` in UCX's default fence mode blocks until the
  peer progresses, which a non-blocking call must not do.)

Every call checks ``offset``/``nbytes`` against the remote token before UCX
sees anything.
"""

from __future__ import annotations

from .. import protocols as _protocols
from .._engine import INPROGRESS, new_slot
from .._handle import raise_closed
from .._internal import engine
from .._lib import ffi, lib
from ..errors import UCXError, UnsupportedError
from ..mem import cuda as _cuda
from ..mem.buffer import acquire
from ..mem.ipc import UNOPENED as _UNOPENED
from ..mem.memtype import CUDA_TYPES
from ..mem.memtype import HOST_INT as _HOST
from ..mem.remote import RemoteKey, as_remote
from ..request import Request, finish, posted, raise_status
from . import ipc as _own
from ._prepared import Prepared

__all__ = [
    "unpack",
    "put",
    "put_nb",
    "get",
    "get_nb",
    "prepare_put",
    "prepare_get",
    "probe",
    "probe_nb",
    "Transfer",
    "notifications",
    "NOTIFY_AM_ID",
    "NOTIFY_MAX",
]

#: Active-message id gpucx reserves for put-with-notify (top of the range).
NOTIFY_AM_ID = lib.GPUCX_NOTIFY_ID
#: Largest ``notify`` payload in bytes.
NOTIFY_MAX = lib.GPUCX_NOTIFY_MAX_LEN

_PUT = "put"
_GET = "get"


def unpack(ep, remote, *, device: int | None = None) -> RemoteKey:
    """Unpack a remote-memory token on this endpoint (``ucp_ep_rkey_unpack``).

    Parameters
    ----------
    remote : RemoteMemory or bytes-like
        The owner's :meth:`MemoryRegion.remote` token or its ``to_bytes()``.
    device : int, optional
        For a CUDA key: the CUDA device whose (primary) context is current
        while UCX unpacks it -- a CUDA IPC handle opens in that context.
        None: the calling thread's current device.  Checked for every key
        (an int >= 0, below the device count when a driver is present), but
        used only for CUDA keys.

    Returns
    -------
    RemoteKey
        A child of this endpoint (closed with it).

    Raises
    ------
    ValueError
        For a malformed token blob (see :meth:`RemoteMemory.from_bytes`),
        or a ``device`` < 0 or not below the number of CUDA devices.
    TypeError
        If ``remote`` is neither a token nor bytes-like, or ``device`` is
        not an int.
    gpucx.UnsupportedError
        ``device`` given for a CUDA key without a CUDA driver here.
    gpucx.UCXError
        If UCX cannot unpack the key.
    gpucx.ClosedError
        If the endpoint is closed.
    """
    if ep._h is None:
        raise_closed(ep)
    rem = as_remote(remote)
    cuda_key = rem.memory_type in CUDA_TYPES
    # The driver loads on first use: only when a device matters.
    drv = _cuda.driver() if cuda_key or device is not None else None
    if device is not None:
        _check_device(device, drv, cuda_key)
    # Unpacking a CUDA key may open a CUDA IPC handle, in the current
    # context: have one current (device=, else the thread's device; a
    # progress thread may have none).  Without a local driver the key can
    # still serve RDMA.
    if cuda_key and drv is not None:
        with _cuda.device_context(device=device):
            key = RemoteKey(ep, rem, device)
    else:
        key = RemoteKey(ep, rem, device)
    # gpucx's own path opens the key's CUDA IPC handle (if any) in this
    # device's context (``device``, which the key keeps), at the first put
    # or get that uses it.
    return key


def _check_device(device, drv, cuda_key: bool) -> None:
    if not isinstance(device, int) or isinstance(device, bool):
        raise TypeError(f"unpack: device must be an int, not {type(device).__name__}")
    if device < 0:
        raise ValueError(f"unpack: device must be >= 0, not {device}")
    if drv is None:
        if cuda_key:
            raise UnsupportedError(
                f"unpack: device={device} for a CUDA key needs {_cuda.driver_problem()}"
            )
        return
    count = drv.device_count()
    if device >= count:
        raise ValueError(
            f"unpack: device={device}: this host has {count} CUDA device(s)"
        )


def _key(rkey) -> RemoteKey:
    if not isinstance(rkey, RemoteKey):
        raise TypeError(
            f"expected a RemoteKey from Endpoint.unpack(), not {type(rkey).__name__}"
        )
    return rkey


def put(
    ep, buf, rkey, offset: int = 0, *, notify=None, timeout=None, stream=None
) -> None:
    """Write ``buf`` into the remote region at byte ``offset``; return once
    ``buf`` may be reused (local completion, see the module doc).

    Parameters
    ----------
    buf : buffer
        Any object :func:`gpucx.mem.as_buffer` accepts, host or device.
    rkey : RemoteKey
        From :meth:`Endpoint.unpack` on this endpoint.
    offset : int
        Byte offset into the remote region.
    notify : bytes-like, optional
        Also tell the owner, after the data is in place (a flush, then an
        active message the owner reads with :meth:`Worker.notifications`).
    timeout : float, optional
        Seconds to wait at most.
    stream : stream object or int, optional
        A CUDA stream (CuPy/Numba/PyTorch object or raw handle): the put is
        posted only once the work queued on it before the call finished.
        The same holds for ``stream=`` of :func:`get` and the ``_nb`` forms.

    Raises
    ------
    gpucx.UnsupportedError
        For CUDA memory on a context that cannot move it, or a ``stream``
        without a CUDA driver.
    ValueError
        If ``offset``/``nbytes`` fall outside the remote region (naming
        them), the key belongs to another endpoint, the region is
        read-only, or ``notify`` is longer than ``NOTIFY_MAX``.
    TypeError
        If ``rkey`` is not a RemoteKey.
    gpucx.UnsupportedError
        ``notify`` on a context without the ``"am"`` feature.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.TimeoutError
        When ``timeout`` passes first: the put is parked with ``buf``, or
        released (:attr:`Endpoint.on_timeout` ``"release"``: the endpoint
        force-closed, ``buf`` yours again); the error's ``released`` says
        which (docs/reliability.md, "Deadlines and the buffer").  The same
        holds for :func:`get`.
    gpucx.ClosedError
        If the endpoint or the key is closed.
    """
    if notify is not None:
        put_nb(ep, buf, rkey, offset, notify=notify, stream=stream).wait(timeout)
        return
    _post_wait(ep, lib.gpucx_put_wait, buf, rkey, offset, stream, timeout, _PUT, False)


def put_nb(ep, buf, rkey, offset: int = 0, *, notify=None, stream=None) -> Request:
    """Start a put (see :func:`put`).

    Returns
    -------
    Request
        Done at local completion (with ``notify``: once the put completed
        remotely and the notification was sent); ``wait()`` returns None.

    Raises
    ------
    ValueError, TypeError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`put`, before anything is posted.
    """
    if notify is None:
        return _post_nb(ep, lib.gpucx_put, buf, rkey, offset, stream, _PUT, False)
    h, ptr, n, mt, keep, raddr = _checked(ep, buf, rkey, offset, stream, _PUT)
    e = ep._engine
    note = _notify_bytes(notify, e)
    if not rkey._host and (type(rkey._ipc) is not str or rkey._ipc == _UNOPENED):
        m = _own.route(ep, rkey, mt, ptr, False)
        if m is not None:
            return _own.post(
                ep, m, rkey, ptr, n, raddr, False, stream, keep, "put with notify", note
            )
    op = ffi.new("gpucx_notify_op_t *")
    if mt == _HOST and stream is None:
        lib.gpucx_put_notify(h, ptr, n, raddr, rkey._h, mt, note, len(note), op)
    else:
        with _cuda.door(e, ptr, mt, stream, _PUT):
            lib.gpucx_put_notify(h, ptr, n, raddr, rkey._h, mt, note, len(note), op)
    slot = ffi.addressof(op, "slot")
    return Request(e, slot, (keep, op, note), "put with notify", None, ep, None, rkey)


def get(ep, buf, rkey, offset: int = 0, *, timeout=None, stream=None) -> None:
    """Read ``len(buf)`` bytes of the remote region at ``offset`` into
    ``buf``; return when they are there.

    Raises
    ------
    ValueError
        If ``offset``/``nbytes`` fall outside the remote region (naming
        them), or the key belongs to another endpoint.
    BufferError
        If ``buf`` is read-only or not contiguous.
    TypeError
        If ``rkey`` is not a RemoteKey.
    gpucx.PeerError
        If the peer died or is unreachable.
    gpucx.TimeoutError
        When ``timeout`` passes first.
    gpucx.ClosedError
        If the endpoint or the key is closed.
    """
    _post_wait(ep, lib.gpucx_get_wait, buf, rkey, offset, stream, timeout, _GET, True)


def _checked(ep, buf, rkey, offset, stream, what: str):
    """The checks of a put or a get, before UCX sees anything: the endpoint
    handle, the local buffer (written by a get) and the remote address
    inside the key's region: ``(h, ptr, n, mt, keep, raddr)``.  (The put
    with notify; _post_wait and _post_nb write these checks out.)"""
    h = ep._h
    if h is None:
        raise_closed(ep)
    is_get = what == _GET
    ptr, n, mt, keep = acquire(buf, is_get, stream)
    raddr = _key(rkey)._target(ep, offset, n, what, not is_get)
    return h, ptr, n, mt, keep, raddr


def _post_wait(
    ep, post, buf, rkey, offset, stream, timeout, what: str, is_get: bool
) -> None:
    """Post a put or a get and wait for it (``post``: ``gpucx_put_wait`` or
    ``gpucx_get_wait``): the shared body of :func:`put` and :func:`get`."""
    # The checks of _checked, written out here and in _post_nb: one Python
    # call per put or get (a call more costs a few percent of a small one).
    h = ep._h
    if h is None:
        raise_closed(ep)
    ptr, n, mt, keep = acquire(buf, is_get, stream, True)
    raddr = _key(rkey)._target(ep, offset, n, what, not is_get)
    e = ep._engine
    if not rkey._host and (type(rkey._ipc) is not str or rkey._ipc == _UNOPENED):
        # gpucx's own same-host path (gpucx.ops.ipc), when it applies.
        m = _own.route(ep, rkey, mt, ptr, is_get)
        if m is not None:
            req = _own.post(ep, m, rkey, ptr, n, raddr, is_get, stream, keep, what)
            # A CUDA IPC copy: no endpoint close stops it (CopyRequest.wait).
            req.wait(timeout)
            return
    if mt == _HOST and stream is None:
        slot = e.sslot or new_slot()  # Engine.slot(), inlined (a call less)
        st = post(e.state, h, ptr, n, raddr, rkey._h, mt, slot, e.spin_ns)
    else:
        with _cuda.door(e, ptr, mt, stream, what, keep):
            slot = e.slot()
            st = post(e.state, h, ptr, n, raddr, rkey._h, mt, slot, e.spin_ns)
    if (mt != _HOST or not rkey._host) and not (
        ep._proto_seen >> (mt * 2 + is_get)
    ) & 1:
        _check_protocol(
            ep, what, mt, is_get, n, rkey, slot if st == INPROGRESS else None
        )
    if st:
        finish(e, slot, st, timeout, what, ep, keep, rkey)


def get_nb(ep, buf, rkey, offset: int = 0, *, stream=None) -> Request:
    """Start a get (see :func:`get`).

    Returns
    -------
    Request
        Done when the data is in ``buf``; ``wait()`` returns None.

    Raises
    ------
    ValueError, BufferError, TypeError, gpucx.ClosedError
        As for :func:`get`, before anything is posted.
    """
    return _post_nb(ep, lib.gpucx_get, buf, rkey, offset, stream, _GET, True)


def _post_nb(ep, post, buf, rkey, offset, stream, what: str, is_get: bool) -> Request:
    """Post a put or a get (``post``: ``gpucx_put`` or ``gpucx_get``) and
    return its request: the shared body of :func:`put_nb` and :func:`get_nb`."""
    h = ep._h
    if h is None:
        raise_closed(ep)
    ptr, n, mt, keep = acquire(buf, is_get, stream, True)
    raddr = _key(rkey)._target(ep, offset, n, what, not is_get)
    e = ep._engine
    if not rkey._host and (type(rkey._ipc) is not str or rkey._ipc == _UNOPENED):
        m = _own.route(ep, rkey, mt, ptr, is_get)
        if m is not None:
            return _own.post(ep, m, rkey, ptr, n, raddr, is_get, stream, keep, what)
    if mt == _HOST and stream is None:
        slot = e.slot()
        st = post(h, ptr, n, raddr, rkey._h, mt, slot)
    else:
        with _cuda.door(e, ptr, mt, stream, what, keep):
            slot = e.slot()
            st = post(h, ptr, n, raddr, rkey._h, mt, slot)
    req = posted(e, slot, st, keep, what, ep, rkey)
    if (mt != _HOST or not rkey._host) and not (
        ep._proto_seen >> (mt * 2 + is_get)
    ) & 1:
        _check_protocol(
            ep, what, mt, is_get, n, rkey, slot if st == INPROGRESS else None
        )
    return req


def _check_protocol(ep, what, mt, is_get, n, rkey, slot) -> None:
    """Once per endpoint, operation and local memory type: warn if UCX put
    this put or get on a slow path (gpucx.protocols; the request in
    ``slot`` if still in flight, else UCX's tables)."""
    _protocols.first_use(ep, what, mt * 2 + is_get, n, (mt, rkey.memory_type), slot)


# -- which protocol UCX takes ------------------------------------------------


def probe_nb(ep, op: str, buf, rkey, offset: int = 0, *, ucx: bool = False):
    """Start one put (``op="put"``: ``buf`` into the remote region) or get
    (``"get"``: the region into ``buf``) and return ``(request, protocol)``:
    the :class:`~gpucx.protocols.Protocol` UCX selected for it
    (``ucp_request_query`` on a request posted with
    ``UCP_OP_ATTR_FLAG_NO_IMM_CMPL``, so that UCX reports even an operation
    it could finish at once), None if UCX gave no info string.  The answer
    is also remembered for :func:`gpucx.protocols.protocol`.  Where gpucx's
    own path takes the operation, it is posted there and its row returned;
    ``ucx=True`` posts it to UCX all the same (the row of what code posting
    to UCX directly, such as the bench's C loops, gets).

    This moves data like :meth:`Endpoint.put_nb` / :meth:`Endpoint.get_nb`.

    Raises
    ------
    ValueError
        For another ``op``, and as :meth:`Endpoint.put` / :meth:`Endpoint.get`.
    gpucx.ClosedError
        If the endpoint is closed.
    """
    if op not in (_PUT, _GET):
        raise ValueError(f"probe: op must be 'put' or 'get', not {op!r}")
    is_get = op == _GET
    h, ptr, n, mt, keep, raddr = _checked(ep, buf, rkey, offset, None, op)
    e = ep._engine
    remote = _protocols.memory_name(rkey.memory_type)
    m = None if ucx else _own.route(ep, rkey, mt, ptr, is_get)
    if m is not None:  # gpucx's own path: no UCX request to query
        own = _own.post(ep, m, rkey, ptr, n, raddr, is_get, None, keep, op)
        local = _protocols.memory_name(mt)
        return own, _protocols.own_path(op, ep, local, remote)
    slot = new_slot()
    out = ffi.new("char[]", 1024)
    args = (h, is_get, ptr, n, raddr, rkey._h, mt, slot, out, 1024)
    if mt == _HOST:
        st = lib.gpucx_rma_probe(*args)
    else:
        with _cuda.door(e, ptr, mt, None, op):
            st = lib.gpucx_rma_probe(*args)
    req = posted(e, slot, st, keep, op, ep, rkey)
    return req, _protocols.remember_info(ep, ffi.string(out).decode(), remote)


def probe(ep, op: str, buf, rkey, offset: int = 0, *, timeout=None, ucx=False):
    """:func:`probe_nb`, waited for (the peer must progress meanwhile, as
    for any get); returns the protocol.

    Raises
    ------
    ValueError, gpucx.ClosedError
        As :func:`probe_nb`.
    gpucx.PeerError, gpucx.TimeoutError
        As :meth:`Endpoint.put` / :meth:`Endpoint.get`.
    """
    req, row = probe_nb(ep, op, buf, rkey, offset, ucx=ucx)
    req.wait(timeout)
    return row


# -- prepared transfers --------------------------------------------------------

_ITEMS = ffi.typeof("gpucx_xfer_item_t[]")
_OP = ffi.typeof("gpucx_notify_op_t *")


def prepare_put(ep, entries) -> Transfer:
    """Prepare a list of puts on this endpoint, to run as one operation.

    Everything a put checks -- buffers, remote keys, bounds, read-only
    regions, CUDA capability -- is checked here, once; each
    :meth:`Transfer.run` or :meth:`Transfer.run_nb` then posts every put
    with a single call into C.  The counterpart of NIXL's prepared
    transfer lists.

    Parameters
    ----------
    entries : iterable of (buf, rkey, offset)
        Each writes the whole of ``buf`` (any object
        :func:`gpucx.mem.as_buffer` accepts) into the remote region of
        ``rkey`` (a :class:`~gpucx.RemoteKey` unpacked on this endpoint;
        entries may use different keys) at byte ``offset``.  The transfer
        holds the buffers until it is closed; what they contain when it
        runs is what is sent.

    Returns
    -------
    Transfer

    Raises
    ------
    TypeError
        If an entry is not a ``(buf, rkey, offset)`` triple, a key is not a
        RemoteKey or an offset not an int.
    ValueError
        If an entry falls outside its remote region (naming the entry, its
        offset and size), the key belongs to another endpoint, or the
        region was exported read-only.
    BufferError, gpucx.UnsupportedError
        For a buffer a put cannot read (see :func:`put`).
    gpucx.ClosedError
        If the endpoint or a key is closed.
    """
    return Transfer(ep, entries, False)


def prepare_get(ep, entries) -> Transfer:
    """Prepare a list of gets on this endpoint, to run as one operation.

    As :func:`prepare_put`, in the other direction: each ``(buf, rkey,
    offset)`` entry reads ``len(buf)`` bytes of the remote region at
    ``offset`` into ``buf``, which must be writable.

    Raises
    ------
    TypeError, ValueError, gpucx.UnsupportedError, gpucx.ClosedError
        As for :func:`prepare_put` (a read-only remote region is fine).
    BufferError
        If a buffer is read-only or not contiguous.
    """
    return Transfer(ep, entries, True)


class Transfer(Prepared):
    """A prepared list of puts or gets on one endpoint
    (:meth:`Endpoint.prepare_put` / :meth:`Endpoint.prepare_get`).

    :meth:`run_nb` posts every entry, in list order, with one call into C and
    returns one :class:`~gpucx.Request` for all of them; :meth:`run` also
    waits.  A transfer can run any number of times, also while earlier runs
    are still in flight (each run has its own completion).  Completion has
    the levels of single puts and gets (see the module doc): a run is done
    when every entry completed locally; ``notify=`` adds a flush and a
    notification the owner reads with :meth:`Worker.notifications` once
    every entry's data is in place (for gets: once every entry was read).

    Entries are not ordered against each other at the target; two entries
    writing the same remote bytes leave either's data there.  A post UCX
    refuses stops the run: the entries after it are not posted and the
    request fails with that error once the ones already posted completed.

    Attributes
    ----------
    endpoint : Endpoint
        The endpoint every entry goes through.
    kind : str
        ``"put"`` or ``"get"``.
    nbytes : int
        Bytes one run moves (the sum of the entries' sizes).
    """

    __slots__ = ("kind", "_keys", "_is_get")

    def __init__(self, ep, entries, is_get: bool):
        if ep._h is None:
            raise_closed(ep)
        what = _GET if is_get else _PUT
        try:
            entries = list(entries)
        except TypeError:
            raise TypeError(
                f"prepare_{what}: entries must be an iterable of (buf, rkey, "
                f"offset), not {type(entries).__name__}"
            ) from None
        e = ep._engine
        items = ffi.new(_ITEMS, max(len(entries), 1))
        keep: list = []
        keys: list = []
        total = 0
        cuda_ptr = None
        cuda_mt = _HOST
        for i, entry in enumerate(entries):
            try:
                ptr, n, mt, k, rkey, raddr = _entry(ep, e, what, is_get, entry)
            except (TypeError, ValueError, BufferError, UCXError) as exc:
                # Same exception, named after the entry.
                exc.args = (f"prepare_{what}: entry {i}: {exc}", *exc.args[1:])
                raise
            if mt != _HOST and cuda_ptr is None:
                cuda_ptr, cuda_mt = ptr, mt
            it = items[i]
            it.buf = ptr
            it.len = n
            it.raddr = raddr
            it.rkey = rkey._h
            it.memory_type = mt
            keep.append(k)
            if not any(key is rkey for key in keys):
                keys.append(rkey)
            total += n
        self.endpoint = ep
        self.kind = what
        self.nbytes = total
        self._items = items
        self._count = len(entries)
        self._keep = keep
        self._keys = tuple(keys)
        self._is_get = int(is_get)
        self._cuda_ptr = cuda_ptr
        self._cuda_mt = cuda_mt

    def __repr__(self) -> str:
        state = "closed" if self._keep is None else f"{self._count} entries"
        return f"<gpucx.Transfer {self.kind} {state}, {self.nbytes} bytes>"

    def close(self) -> None:
        """Let go of the buffers and keys.  Runs still in flight keep what
        they use until they complete.  Safe to call twice."""
        super().close()
        self._keys = ()

    def _post(self, notify, stream, spin_ns: int):
        """Check what may have closed, post every entry (and progress up to
        ``spin_ns``); returns ``(status, op, notify bytes)``."""
        e, h = self._open()
        for key in self._keys:
            if key.closed:
                raise_closed(key)
        note = ffi.NULL if notify is None else _notify_bytes(notify, e)
        return self._through_door(
            e, stream, self.kind, self._run, e, h, notify, note, spin_ns
        )

    def _run(self, e, h, notify, note, spin_ns: int):
        op = ffi.new(_OP)
        st = lib.gpucx_xfer_run(
            e.state,
            h,
            self._is_get,
            self._items,
            self._count,
            notify is not None,
            note,
            0 if notify is None else len(note),
            op,
            spin_ns,
        )
        return st, op, note

    def run_nb(self, *, notify=None, stream=None) -> Request:
        """Post every entry; return one request for all of them.

        Parameters
        ----------
        notify : bytes-like, optional
            Once every entry completed, flush the endpoint and send this to
            the owner (see :func:`put`); the request is done when the
            notification was sent.
        stream : stream object or int, optional
            A CUDA stream: the entries are posted only once the work queued
            on it before the call finished.

        Returns
        -------
        Request
            ``wait()`` returns None.

        Raises
        ------
        gpucx.ClosedError
            If the transfer, the endpoint or one of its keys is closed.
        ValueError
            ``notify`` longer than ``NOTIFY_MAX``.
        gpucx.UnsupportedError
            ``notify`` without the ``"am"`` feature, or a ``stream`` without
            a CUDA driver.
        """
        st, op, note = self._post(notify, stream, 0)
        keep = (self._keep, op, note)
        return self._request(st, op, keep, f"{self.kind} transfer", self._keys)

    def run(self, timeout=None, *, notify=None, stream=None) -> None:
        """Post every entry and wait until all completed (see :meth:`run_nb`).

        Raises
        ------
        gpucx.TimeoutError
            When ``timeout`` seconds pass first.
        gpucx.PeerError
            If the peer died or is unreachable.
        gpucx.UCXError
            The first error of an entry.
        gpucx.ClosedError, ValueError, gpucx.UnsupportedError
            As for :meth:`run_nb`, before anything is posted.
        """
        st, op, note = self._post(notify, stream, self._engine.spin_ns)
        keep = (self._keep, op, note)
        self._finish(st, op, keep, f"{self.kind} transfer", timeout, self._keys)


def _entry(ep, e, what: str, is_get: bool, entry):
    """Check one ``(buf, rkey, offset)`` entry of a transfer."""
    if type(entry) is not tuple or len(entry) != 3:
        raise TypeError(f"must be a (buf, rkey, offset) tuple, not {entry!r:.80}")
    buf, rkey, offset = entry
    ptr, n, mt, keep = acquire(buf, is_get, None)
    raddr = _key(rkey)._target(ep, offset, n, what, not is_get)
    if mt != _HOST:
        # Checks that this context can move it (UnsupportedError).
        _cuda.door(e, ptr, mt, None, what).ready()
    return ptr, n, mt, keep, rkey, raddr


def _notify_bytes(notify, e) -> bytes:
    note = bytes(memoryview(notify).cast("B"))
    if len(note) > NOTIFY_MAX:
        raise ValueError(
            f"notify is {len(note)} bytes; at most {NOTIFY_MAX} are allowed"
        )
    if "am" not in e.context.features:
        raise UnsupportedError("put with notify needs the 'am' feature in the Context")
    return note


# -- the owner's side of put-with-notify --------------------------------------


def worker_init(e) -> None:
    """Install the C handler for notifications on a new worker's engine."""
    from .._bounds import caps

    q = ffi.new("gpucx_notify_q_t *")
    count, nbytes = caps(e.context, "notify")
    lib.gpucx_notify_setup(q, count, nbytes, ffi.addressof(e.amq, "drops"))
    e.notify_q = q
    if "am" in e.context.features:
        st = lib.gpucx_notify_init(e.h, q)
        if st != lib.UCS_OK:
            raise_status(st, "ucp_worker_set_am_recv_handler(notify)")


def worker_release(e) -> None:
    """Free queued notifications (the worker is being destroyed)."""
    if e.notify_q is not None:
        lib.gpucx_notify_clear(e.notify_q)


def notifications(worker, timeout: float | None = None) -> list:
    """Notifications received from ``put(..., notify=...)`` so far.

    Progresses the worker, then returns every queued notification, oldest
    first, as ``(endpoint, notify_bytes)`` pairs (each one after its own
    put's data; put-with-notify calls outstanding at the same time may
    notify in any order); ``endpoint`` is the
    :class:`~gpucx.Endpoint` of this worker connected to the sender, or
    None if this side holds none.  A notification is only queued after the
    data of its put is in place.

    Parameters
    ----------
    timeout : float, optional
        None (default): do not wait, return what is there (maybe ``[]``).
        A number: wait up to that many seconds for at least one
        notification; ``[]`` if none came.

    Raises
    ------
    gpucx.ClosedError
        If the worker is closed.
    """
    e = engine(worker)
    h = e.h
    if h is None:
        raise_closed(worker)
    q = e.notify_q
    if timeout is None or timeout <= 0:
        lib.ucp_worker_progress(h)
    elif not lib.gpucx_notify_wait(h, q, e.spin_ns):
        # Spun in C for the worker's GPUCX_SPIN_US first (the fast path: one
        # crossing, no Python per progress call), then sleep in slices.
        e.poll_events()
        e.wait_for(lambda: q.stat.count, timeout)
    out = []
    item = _pop_notification(e)
    while item is not None:
        out.append(item)
        item = _pop_notification(e)
    return out


def _pop_notification(e):
    """The oldest queued ``(endpoint, notify_bytes)``, or None."""
    n = lib.gpucx_notify_pop(e.notify_q)
    if n == ffi.NULL:
        return None
    try:
        return (e.own_endpoint(n.ep), bytes(ffi.buffer(n.data, n.length)))
    finally:
        lib.gpucx_free(n)


def set_notify_handler(worker, handler) -> None:
    """Run ``handler(endpoint, notify_bytes)`` for each put-with-notify
    notification, instead of queueing it for :meth:`notifications`.

    Handlers run in Python after progress returns (``progress()``, blocking
    waits, the asyncio driver), one notification at a time in arrival order;
    an exception in the handler reaches the caller of ``progress()`` or
    ``wait()`` and the notifications after it stay queued.  ``None`` removes
    the handler: notifications queue again for :meth:`notifications`.

    Raises
    ------
    TypeError
        If ``handler`` is neither callable nor None.
    gpucx.ClosedError
        If the worker is closed.
    """
    e = engine(worker)
    if e.h is None:
        raise_closed(worker)
    if handler is not None and not callable(handler):
        raise TypeError(f"handler must be callable or None, not {handler!r}")
    e.notify_handler = handler
    # Progress looks at the queue in C only while a handler is set.
    lib.gpucx_progress_watch(
        e.state,
        e.amq,
        ffi.NULL if handler is None else ffi.addressof(e.notify_q, "stat"),
    )


def dispatch_notifications(e) -> None:
    """Hand queued notifications to the worker's notify handler (the
    engine's ``on_notify`` hook)."""
    handler = e.notify_handler
    while handler is not None and e.h is not None:
        item = _pop_notification(e)
        if item is None:
            return
        handler(*item)
        handler = e.notify_handler
