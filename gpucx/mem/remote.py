"""Remote memory: the token a region's owner hands out, and the key made
from it on an endpoint.

:class:`RemoteMemory` is a self-describing, immutable token: the address,
size and memory type of a registered region plus its packed UCX remote key.
It travels as bytes in a fixed layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"GXRM"
    4       1     format version (1)
    5       1     memory type (ucs_memory_type_t value)
    6       2     flags (bit 0: read-only; other bits must be 0)
    8       8     address of the first byte in the owner's process
    16      8     nbytes
    24      4     rkey_len: length of the packed UCX remote key (1..65536)
    28      R     packed remote key (ucp_rkey_pack)
    28+R    4     CRC-32 (zlib) of bytes 0 .. 28+R

Format version 2 is version 1 with a CUDA IPC block between the packed
key and the CRC (the CRC covers it); a token is written as version 2 only
when it carries one (a CUDA region whose allocation the driver could
export), so tokens of host regions stay readable by older gpucx::

    28+R    2     block length (108)
    30+R    64    CUipcMemHandle of the allocation holding the region
    94+R    8     offset of the region's first byte in that allocation
    102+R   8     size of the allocation
    110+R   16    owner's boot id (/proc/sys/kernel/random/boot_id)
    126+R   8     owner's pid-namespace inode
    134+R   4     owner's pid
    138+R   4     CRC-32 of bytes 0 .. 138+R

The block lets a peer on the same host (same boot id and pid namespace)
copy to and from the region with the copy engines, without UCX
(gpucx.ops.ipc; docs/rma.md, "gpucx's own path for CUDA regions").

Pickling a :class:`RemoteMemory` goes through the same bytes; nothing but
these fields is ever deserialized.  :meth:`RemoteMemory.from_bytes` rejects
truncated, oversized, foreign, newer or corrupted blobs with a
:class:`ValueError` before UCX sees them.

:class:`RemoteKey` is a token unpacked on one endpoint
(``ucp_ep_rkey_unpack``, from a zero-padded copy of the packed key): what
RMA and atomic calls take.  It bounds-checks every access against the
token, so an honest peer stays inside the bytes exported to it.  These
checks run in the initiator's process: a hostile peer that skips them
reaches whatever UCX lets its key reach (on shared memory and TCP, any
address in the owner's process; see docs/rma.md, "What a peer can
reach").  Only gpucx's emulated atomics are checked at the target.
"""

from __future__ import annotations

import struct
import time
import zlib

from .._handle import Handle, raise_closed, time_left
from .._internal import defer_to_closing, engine, handle
from .._lib import ffi, lib
from ..errors import check
from .memtype import CUDA_TYPES, MemoryType

__all__ = [
    "RemoteMemory",
    "RemoteKey",
    "CudaIpc",
    "MAGIC",
    "FORMAT_VERSION",
    "FORMAT_VERSION_IPC",
]

#: First four bytes of every token.
MAGIC = b"GXRM"
#: The token layout this gpucx writes for a region without a CUDA IPC block
#: (it reads it and :data:`FORMAT_VERSION_IPC`).
FORMAT_VERSION = 1
#: The layout of a token that carries a CUDA IPC block.
FORMAT_VERSION_IPC = 2
#: Largest packed remote key a token may carry.
MAX_RKEY_LEN = 1 << 16

#: Zero bytes after the copy of a packed key that UCX unpacks.
RKEY_PAD = 4096

FLAG_READONLY = 1
_KNOWN_FLAGS = FLAG_READONLY

_HEADER = struct.Struct("<4sBBHQQI")
_CRC = struct.Struct("<I")
_IPC_LEN = struct.Struct("<H")
_IPC = struct.Struct("<64sQQ16sQI")
_MIN_LEN = _HEADER.size + 1 + _CRC.size
_U64 = 1 << 64


class CudaIpc:
    """The CUDA IPC block of a token: what a peer on the owner's host needs
    to map the region's allocation (``cuIpcOpenMemHandle``) and who made it.

    Attributes
    ----------
    handle : bytes
        The 64-byte ``CUipcMemHandle`` of the allocation.
    offset : int
        Offset of the region's first byte in the allocation.
    alloc_size : int
        Size of the allocation in bytes.
    boot_id : bytes
        The owner's boot id (16 bytes).
    pidns : int
        Inode of the owner's pid namespace.
    pid : int
        The owner's process id.

    Raises
    ------
    ValueError
        (constructor) For a handle that is not 64 bytes, a boot id that is
        not 16, or a field outside its range.
    """

    __slots__ = ("handle", "offset", "alloc_size", "boot_id", "pidns", "pid")
    handle: bytes
    offset: int
    alloc_size: int
    boot_id: bytes
    pidns: int
    pid: int

    def __init__(self, handle, offset, alloc_size, boot_id, pidns, pid):
        handle, boot_id = bytes(handle), bytes(boot_id)
        if len(handle) != 64:
            raise ValueError(f"CUDA IPC handle of {len(handle)} bytes, not 64")
        if len(boot_id) != 16:
            raise ValueError(f"boot id of {len(boot_id)} bytes, not 16")
        fields = (int(offset), int(alloc_size), int(pidns), int(pid))
        if not all(0 <= v < _U64 for v in fields[:3]) or not 0 <= fields[3] < 1 << 32:
            raise ValueError(f"CUDA IPC block field out of range: {fields}")
        values = (handle, fields[0], fields[1], boot_id, *fields[2:])
        for name, v in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, v)

    def __setattr__(self, name, value):
        raise AttributeError("CudaIpc is immutable")

    def __repr__(self) -> str:
        return (
            f"<gpucx.mem.remote.CudaIpc pid={self.pid} offset={self.offset} "
            f"alloc_size={self.alloc_size}>"
        )

    def pack(self) -> bytes:
        return _IPC.pack(
            self.handle,
            self.offset,
            self.alloc_size,
            self.boot_id,
            self.pidns,
            self.pid,
        )


class RemoteMemory:
    """What a peer needs to reach a registered region: address, size,
    memory type, read-only flag and the packed UCX remote key.

    Made by :meth:`MemoryRegion.remote` or :meth:`from_bytes`; immutable.

    Attributes
    ----------
    address : int
        Address of the region's first byte in the owner's process.
    nbytes : int
        Size of the region in bytes.
    memory_type : MemoryType
        Where the region lives on the owner's side.
    rkey : bytes
        The packed UCX remote key.
    readonly : bool
        The owner exported the region for reading only: puts and atomics
        are refused.
    ipc : CudaIpc or None
        For a CUDA region: its allocation's CUDA IPC handle and the owner's
        host identity, for gpucx's own same-host path (None when the owner
        could not export one, or for other memory).

    Raises
    ------
    ValueError
        (constructor) For a negative address or size, a region that wraps
        the 64-bit address space, an empty rkey or one over 65536 bytes,
        an unknown memory type, or an ``ipc`` block whose allocation does
        not hold the region.
    """

    __slots__ = ("address", "nbytes", "memory_type", "rkey", "readonly", "ipc")
    address: int
    nbytes: int
    memory_type: MemoryType
    rkey: bytes
    readonly: bool
    ipc: CudaIpc | None

    def __init__(
        self,
        address: int,
        nbytes: int,
        memory_type: MemoryType,
        rkey: bytes,
        readonly: bool = False,
        ipc: CudaIpc | None = None,
    ):
        address = int(address)
        nbytes = int(nbytes)
        rkey = bytes(rkey)
        # The same limits from_bytes enforces: a token made here from a
        # peer's fields must not reach UCX with an impossible region.
        if address < 0 or nbytes < 0 or address + nbytes > _U64:
            raise ValueError(
                f"remote memory: region {address:#x} + {nbytes} bytes is outside "
                "the 64-bit address space"
            )
        if not 0 < len(rkey) <= MAX_RKEY_LEN:
            raise ValueError(
                f"remote memory: rkey length {len(rkey)} outside 1..{MAX_RKEY_LEN}"
            )
        object.__setattr__(self, "address", address)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "memory_type", MemoryType(memory_type))
        object.__setattr__(self, "rkey", rkey)
        object.__setattr__(self, "readonly", bool(readonly))
        if ipc is not None:
            if not isinstance(ipc, CudaIpc):
                raise TypeError(f"ipc must be a CudaIpc, not {type(ipc).__name__}")
            if ipc.offset + nbytes > ipc.alloc_size:
                raise ValueError(
                    f"remote memory: CUDA IPC block: the region ({ipc.offset} + "
                    f"{nbytes} bytes) is outside its allocation of "
                    f"{ipc.alloc_size} bytes"
                )
        object.__setattr__(self, "ipc", ipc)

    def __setattr__(self, name, value):
        raise AttributeError("RemoteMemory is immutable")

    def __repr__(self) -> str:
        ro = ", readonly" if self.readonly else ""
        ipc = ", cuda ipc" if self.ipc is not None else ""
        return (
            f"<gpucx.RemoteMemory address={self.address:#x} nbytes={self.nbytes} "
            f"{self.memory_type.name} rkey={len(self.rkey)} bytes{ro}{ipc}>"
        )

    def __eq__(self, other):
        if not isinstance(other, RemoteMemory):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    def __reduce__(self):
        return (RemoteMemory.from_bytes, (self.to_bytes(),))

    def to_bytes(self) -> bytes:
        """The token in the documented binary layout (see the module doc)."""
        ipc = self.ipc
        head = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION if ipc is None else FORMAT_VERSION_IPC,
            int(self.memory_type),
            FLAG_READONLY if self.readonly else 0,
            self.address,
            self.nbytes,
            len(self.rkey),
        )
        body = head + self.rkey
        if ipc is not None:
            body += _IPC_LEN.pack(_IPC.size) + ipc.pack()
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, blob) -> RemoteMemory:
        """Parse a token made by :meth:`to_bytes`.

        Parameters
        ----------
        blob : bytes-like
            The token.

        Raises
        ------
        TypeError
            If ``blob`` is not bytes-like.
        ValueError
            For a blob that is truncated, oversized, does not start with the
            magic, has another format version, fails its checksum, or
            carries an impossible field (the message says which).
        """
        try:
            data = bytes(memoryview(blob).cast("B"))
        except TypeError:
            raise TypeError(
                f"a remote-memory token is bytes, not {type(blob).__name__}"
            ) from None
        n = len(data)
        if n >= len(MAGIC) and not data.startswith(MAGIC):
            raise ValueError(
                f"not a gpucx remote-memory token: magic {data[:4]!r}, expected "
                f"{MAGIC!r} (Endpoint.unpack takes region.remote() or its "
                "to_bytes(), not the bare UCX key of region.ucx_rkey())"
            )
        if n < _MIN_LEN:
            raise ValueError(
                f"remote-memory token truncated: {n} bytes, at least {_MIN_LEN} "
                "are needed"
            )
        magic, version, mtype, flags, address, nbytes, rlen = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(
                f"not a gpucx remote-memory token: magic {magic!r}, expected "
                f"{MAGIC!r} (Endpoint.unpack takes region.remote() or its "
                "to_bytes(), not the bare UCX key of region.ucx_rkey())"
            )
        if version not in (FORMAT_VERSION, FORMAT_VERSION_IPC):
            raise ValueError(
                f"remote-memory token format version {version}; this gpucx reads "
                f"versions {FORMAT_VERSION} and {FORMAT_VERSION_IPC}"
            )
        if not 0 < rlen <= MAX_RKEY_LEN:
            raise ValueError(
                f"remote-memory token: rkey length {rlen} outside 1..{MAX_RKEY_LEN}"
            )
        ext = 0
        if version == FORMAT_VERSION_IPC:
            ext = _IPC_LEN.size + _IPC.size
        want = _HEADER.size + rlen + ext + _CRC.size
        if n < want:
            raise ValueError(
                f"remote-memory token truncated: {n} bytes, the header says {want}"
            )
        if n > want:
            raise ValueError(
                f"remote-memory token oversized: {n} bytes, the header says {want}"
            )
        body = data[: want - _CRC.size]
        (crc,) = _CRC.unpack_from(data, want - _CRC.size)
        if zlib.crc32(body) != crc:
            raise ValueError("remote-memory token corrupted: checksum mismatch")
        if flags & ~_KNOWN_FLAGS:
            raise ValueError(f"remote-memory token: unknown flags {flags:#x}")
        try:
            memory_type = MemoryType(mtype)
        except ValueError:
            raise ValueError(
                f"remote-memory token: unknown memory type {mtype}"
            ) from None
        if address + nbytes > _U64:
            raise ValueError(
                f"remote-memory token: region {address:#x} + {nbytes} bytes "
                "wraps the address space"
            )
        ipc = None
        if ext:
            at = _HEADER.size + rlen
            (blen,) = _IPC_LEN.unpack_from(data, at)
            if blen != _IPC.size:
                raise ValueError(
                    f"remote-memory token: CUDA IPC block of {blen} bytes, "
                    f"expected {_IPC.size}"
                )
            if memory_type not in CUDA_TYPES:
                raise ValueError(
                    "remote-memory token: a CUDA IPC block on a "
                    f"{memory_type.name} region"
                )
            ipc = CudaIpc(*_IPC.unpack_from(data, at + _IPC_LEN.size))
        return cls(
            address,
            nbytes,
            memory_type,
            data[_HEADER.size : _HEADER.size + rlen],
            bool(flags & FLAG_READONLY),
            ipc,
        )


def as_remote(obj) -> RemoteMemory:
    """A :class:`RemoteMemory`, or a token's bytes parsed into one.

    Raises
    ------
    TypeError, ValueError
        As for :meth:`RemoteMemory.from_bytes`.
    """
    if isinstance(obj, RemoteMemory):
        return obj
    return RemoteMemory.from_bytes(obj)


class RemoteKey(Handle):
    """A :class:`RemoteMemory` unpacked on one endpoint
    (``ucp_ep_rkey_unpack``); made by :meth:`Endpoint.unpack`.

    A child of its endpoint: closing the endpoint closes the key first.
    Closing waits (bounded) for RMA and atomic requests still using it.
    Closing a key whose CUDA IPC handle gpucx opened (gpucx's own path,
    :attr:`cuda_ipc`) first waits for the copies still in flight on it
    (they need no peer: the copy engines finish them), then closes the
    handle.

    Attributes
    ----------
    remote : RemoteMemory
        The token it was unpacked from.
    endpoint : Endpoint
        The endpoint it is bound to; RMA through any other is refused.
    """

    def __init__(self, ep, remote: RemoteMemory, device: int | None = None):
        h = handle(ep)
        if h is None:
            raise_closed(ep)
        out = ffi.new("ucp_rkey_h *")
        # UCX parses a packed key without its length: a truncated or crafted
        # key makes it read past the end.  Hand it a zero-padded copy, as
        # worker addresses get (endpoint.py), so such reads stay in memory
        # gpucx owns and see zeros.
        rkey = remote.rkey
        padded = ffi.new("char[]", len(rkey) + RKEY_PAD)
        ffi.memmove(padded, rkey, len(rkey))
        check(lib.gpucx_rkey_unpack(h, padded, out), "ucp_ep_rkey_unpack")
        self._init_handle()
        self._h = out[0]
        self.remote = remote
        self.endpoint = ep
        # The bounds every access is checked against (read on each op).
        self._base = remote.address
        self._size = remote.nbytes
        self._readonly = remote.readonly
        # Host memory on the owner's side (read on each op): gpucx's own
        # path never serves such a key, and from host memory no protocol
        # to it is a slow path (gpucx.protocols.is_slow), so the host-to-
        # host put/get looks at neither.
        self._host = remote.memory_type == MemoryType.HOST
        #: gpucx's own path (gpucx.mem.ipc): "unopened", the Mapping once
        #: opened, or why the path is not taken.
        self._ipc: object = (
            "unopened" if remote.ipc is not None else "no CUDA IPC handle in the token"
        )
        #: The device whose context opens the handle (None: the current one):
        #: ``Endpoint.unpack(..., device=)``.
        self._ipc_device = device
        ep._adopt(self)

    def __repr__(self) -> str:
        r = self.remote
        state = "closed" if self._h is None else f"{r.address:#x}+{r.nbytes}"
        return f"<gpucx.RemoteKey {state}>"

    @property
    def address(self) -> int:
        """Remote address of the region's first byte."""
        return self.remote.address

    @property
    def nbytes(self) -> int:
        """Size of the remote region in bytes."""
        return self.remote.nbytes

    @property
    def memory_type(self) -> MemoryType:
        """Memory type of the remote region."""
        return self.remote.memory_type

    @property
    def cuda_ipc(self) -> str:
        """State of gpucx's own same-host path for this key (docs/rma.md):
        ``"open"`` (the owner's allocation is mapped here; puts and gets
        from host memory, and gets into CUDA memory, are copy-engine
        copies), ``"unopened"`` (the token carries a CUDA IPC handle, not
        opened yet: it opens at the first put or get that can use it), or
        why the path is not taken (UCX serves every operation)."""
        state = self._ipc
        return state if type(state) is str else "open"

    def _target(self, ep, offset, nbytes: int, what: str, write: bool) -> int:
        """Check an access and return the remote address (before UCX)."""
        if self._h is None:
            raise_closed(self)
        if ep is not self.endpoint:
            raise ValueError(
                f"{what}: this RemoteKey was unpacked on {self.endpoint!r}, not "
                f"{ep!r}; unpack the token on each endpoint"
            )
        if type(offset) is not int:
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise TypeError(
                    f"{what}: offset must be an int, not {type(offset).__name__}"
                )
            offset = int(offset)
        size = self._size
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(
                f"{what}: offset={offset} nbytes={nbytes} is outside the remote "
                f"region of {size} bytes"
            )
        if write and self._readonly:
            raise ValueError(f"{what}: the remote region was exported read-only")
        return self._base + offset

    def _release(self) -> None:
        close = getattr(self._ipc, "close", None)
        if close is not None:
            # gpucx's own copies on the mapping end first (they need no
            # peer), then the handle closes.
            close()
            self._ipc = "closed"
        ep = self.endpoint
        e = engine(ep)
        # The operations that use this key, in flight or given up while UCX
        # held them (each names the keys it uses when it is made).
        pending, parked = e.holding(self)
        if (pending or parked) and e.h is not None:
            if defer_to_closing(ep, self._h):
                return
            end = time.monotonic() + time_left(self._deadline)
            if not e.drain(pending, end):
                # UCX may still read the key: never free it under UCX.
                return
            if not e.drain_slots(parked, end):
                # A timed-out operation UCX still holds: the engine frees
                # the key once UCX let go of it.
                e.park_key(self._h, parked)
                return
        lib.gpucx_rkey_destroy(self._h)
