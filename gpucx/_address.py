"""Framed worker addresses: the UCX address plus a gpucx trailer.

UCX parses a worker address without knowing its length, trusts its body,
and can crash on a corrupted one.  gpucx therefore appends a fixed-size
trailer to the bytes ``ucp_worker_query`` returns::

    UCX address | magic "GPCX" | version u8 | flags u8 | node key u16 |
    UCX length u32 | pid u32 | pid-namespace inode u64 | start time u64 |
    boot id 16 bytes | crc32 u32

(little-endian; the crc32 covers the UCX part and every trailer field
before it).  UCX ignores the trailing bytes, so a plain UCX program can use
a gpucx address as it is.  :func:`parse` verifies the frame before any byte
reaches UCX; the identity fields let a peer on the same host tell whether
the process behind an address is still alive (see :mod:`gpucx._liveness`).
The node key (once a reserved field, 0 from writers that predate it) is a
16-bit hash of what UCX's shared-memory transports need in common besides
the kernel: the host name and the IPC and mount namespaces.  Processes of
one kernel in different containers (or emulated hosts) share the boot id
and may share the pid namespace, but not these (:func:`same_node`).

The checksum catches corruption, not a hostile peer: a crafted address with
a valid checksum reaches UCX like any other.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from typing import NamedTuple

from .errors import InvalidAddressError

MAGIC = b"GPCX"
VERSION = 1
_FIELDS = struct.Struct("<4sBBHIIQQ16s")
_CRC = struct.Struct("<I")
#: Bytes the trailer adds to a UCX address.
TRAILER_LEN = _FIELDS.size + _CRC.size


class Identity(NamedTuple):
    """Who wrote an address: enough to check its process on this host."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    boot_id: bytes  # 16 bytes, /proc/sys/kernel/random/boot_id
    pidns: int  # inode of /proc/self/ns/pid (0 when unknown)
    node_key: int = 0  # host name, IPC and mount namespaces (0: unknown)


def proc_stat(pid: int | str = "self") -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after
    # the last ')'.  Field 3 (state) is then index 0, field 22 index 19.
    return stat[stat.rfind(b")") + 2 :].split()


def proc_start_time(pid: int | str = "self") -> int | None:
    """Start time of ``pid`` in clock ticks after boot, or None if gone."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[19])


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _node_key() -> int:
    """16 bits (never 0) of the host name and the IPC and mount namespace
    inodes: what sets apart processes of one kernel in different
    containers."""
    parts = [os.uname().nodename]
    for ns in ("ipc", "mnt"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    key = zlib.crc32("/".join(parts).encode())
    return ((key >> 16) ^ key) & 0xFFFF or 1


_boot = _boot_id()
_ns = _pidns()
_node = _node_key()
_self: Identity | None = None
_self_pid = 0


def own_identity() -> Identity:
    """This process's identity (recomputed after a fork)."""
    global _self, _self_pid
    pid = os.getpid()
    if _self is None or _self_pid != pid:
        _self = Identity(pid, proc_start_time("self") or 0, _boot, _ns, _node)
        _self_pid = pid
    return _self


def frame(ucx: bytes) -> bytes:
    """Append this process's trailer to the UCX address ``ucx``."""
    me = own_identity()
    head = ucx + _FIELDS.pack(
        MAGIC,
        VERSION,
        0,
        me.node_key,
        len(ucx),
        me.pid,
        me.pidns,
        me.start_time,
        me.boot_id,
    )
    return head + _CRC.pack(zlib.crc32(head))


def is_local(ident: Identity) -> bool:
    """True when ``ident`` names a process of this host and pid namespace."""
    return ident.boot_id == _boot and ident.pidns == _ns and _boot != bytes(16)


def same_node(ident: Identity) -> bool:
    """True when ``ident`` names a process of this host and pid namespace
    (:func:`is_local`) that also shares this process's host name and IPC
    and mount namespaces, as far as its node key tells (a writer that did
    not send one is taken to share them)."""
    return is_local(ident) and ident.node_key in (0, _node)


def parse(blob: bytes) -> tuple[bytes, Identity]:
    """Split a framed address into the UCX part and the writer's identity.

    Raises
    ------
    gpucx.InvalidAddressError
        When the trailer is missing, of another format version, or does not
        match the bytes (a length or checksum mismatch).
    """
    n = len(blob)
    if n <= TRAILER_LEN:
        raise InvalidAddressError(
            f"malformed worker address: {n} bytes is too short for a gpucx "
            f"address (the trailer alone has {TRAILER_LEN})"
        )
    t = n - TRAILER_LEN
    magic, version, _flags, node, ucx_len, pid, pidns, start, boot = (
        _FIELDS.unpack_from(blob, t)
    )
    if magic != MAGIC:
        raise InvalidAddressError(
            "not a gpucx worker address (no gpucx trailer): it is corrupted, or "
            "a raw UCX address from a non-gpucx program; for the latter use "
            "connect(address, raw=True)"
        )
    if version != VERSION:
        raise InvalidAddressError(
            f"malformed worker address: trailer format version {version}, "
            f"this gpucx reads version {VERSION}"
        )
    if ucx_len != t:
        raise InvalidAddressError(
            f"malformed worker address: the trailer says the UCX part has "
            f"{ucx_len} bytes, the blob holds {t} (truncated or extended)"
        )
    (crc,) = _CRC.unpack_from(blob, n - _CRC.size)
    if zlib.crc32(memoryview(blob)[: n - _CRC.size]) != crc:
        raise InvalidAddressError(
            "malformed worker address: checksum mismatch (the bytes were "
            "corrupted on the way)"
        )
    return blob[:t], Identity(pid, start, boot, pidns, node)
