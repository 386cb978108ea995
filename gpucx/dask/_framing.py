"""Wire format of the ``gpucx://`` Dask comm, version 1 (pure Python).

Every ``Comm.write`` sends one **control message** on the connection's tag,
then one tag message per frame that is not inline, in frame order::

    header  <4sBBHIQ  magic b"GXDK", version 1, flags, reserved 0,
                      frame count, total payload bytes
    table   count x <QB  frame size, kind (0 host, 1 host inline, 2 cuda)
    inline  the inline frames' bytes, back to back, in frame order

Flags: bit 0 CLOSE (the writer closed the comm; no frames), bit 1 TABLE
(the table did not fit in the peer's control buffer and follows as its own
message; no frame is inline then).  Empty frames are described but never
sent.  :func:`parse` checks everything a peer sends (magic, version, flags,
counts, sizes, kinds, the total and the caps) before the reader allocates
anything.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

MAGIC = b"GXDK"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQ")
ENTRY = struct.Struct("<QB")

F_CLOSE = 1
F_TABLE = 2
_KNOWN_FLAGS = F_CLOSE | F_TABLE

HOST = 0
INLINE = 1
CUDA = 2
KINDS = (HOST, INLINE, CUDA)


class FramingError(ValueError):
    """A control message that breaks the wire format or the caps."""


class Limits(NamedTuple):
    """What a reader accepts from its peer."""

    max_frames: int
    max_frame_bytes: int
    max_total_bytes: int


class Control(NamedTuple):
    """A parsed control message (``sizes``/``kinds`` empty for TABLE)."""

    flags: int
    nframes: int
    total: int
    sizes: tuple[int, ...]
    kinds: tuple[int, ...]
    inline_at: int  # offset of the first inline byte in the message


def pack_header(flags: int, nframes: int, total: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, flags, 0, nframes, total)


def pack_table(sizes, kinds) -> bytes:
    return b"".join(ENTRY.pack(s, k) for s, k in zip(sizes, kinds, strict=True))


def close_message() -> bytes:
    return pack_header(F_CLOSE, 0, 0)


def parse_header(buf, nbytes: int, limits: Limits) -> tuple[int, int, int]:
    """Check a control message's fixed header: (flags, nframes, total).

    Raises
    ------
    FramingError
        For a short message, a wrong magic, another version, unknown flags,
        or counts past the caps.
    """
    if nbytes < HEADER.size:
        raise FramingError(f"control message of {nbytes} bytes is too short")
    magic, version, flags, reserved, nframes, total = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FramingError("not a gpucx:// control message (bad magic)")
    if version != VERSION:
        raise FramingError(
            f"wire format version {version}; this gpucx speaks {VERSION}"
        )
    if flags & ~_KNOWN_FLAGS or reserved:
        raise FramingError(f"unknown control flags {flags:#x}/{reserved:#x}")
    if flags & F_CLOSE and (nframes or total or flags != F_CLOSE):
        raise FramingError("a CLOSE control message carries no frames")
    if nframes > limits.max_frames:
        raise FramingError(f"{nframes} frames exceed the cap of {limits.max_frames}")
    if total > limits.max_total_bytes:
        raise FramingError(
            f"message of {total} bytes exceeds the cap of {limits.max_total_bytes}"
        )
    return flags, nframes, total


def parse_table(
    buf, start: int, nframes: int, total: int, limits: Limits, inline_ok: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check a frame table: (sizes, kinds).

    Raises
    ------
    FramingError
        For an unknown kind, a frame past the cap, sizes that do not add up
        to ``total``, or an inline frame where none may be.
    """
    sizes = []
    kinds = []
    s = 0
    unpack = ENTRY.unpack_from
    for i in range(nframes):
        size, kind = unpack(buf, start + i * ENTRY.size)
        if kind not in KINDS:
            raise FramingError(f"frame {i}: unknown kind {kind}")
        if kind == INLINE and not inline_ok:
            raise FramingError(f"frame {i}: inline frame in a separate table")
        if size > limits.max_frame_bytes:
            raise FramingError(
                f"frame {i} of {size} bytes exceeds the cap of {limits.max_frame_bytes}"
            )
        s += size
        if s > total:
            raise FramingError("frame sizes exceed the announced total")
        sizes.append(size)
        kinds.append(kind)
    if s != total:
        raise FramingError(f"frame sizes add up to {s}, the header says {total}")
    return tuple(sizes), tuple(kinds)


def parse(buf, nbytes: int, limits: Limits) -> Control:
    """Parse and check one control message of ``nbytes`` bytes in ``buf``.

    For a TABLE message the table is not in ``buf``: ``sizes``/``kinds``
    come back empty and the reader receives ``nframes * ENTRY.size`` bytes
    next and calls :func:`parse_table` (see :func:`table_bytes`).

    Raises
    ------
    FramingError
        For anything that breaks the format (see :func:`parse_header` and
        :func:`parse_table`) and inline bytes that do not match the table.
    """
    flags, nframes, total = parse_header(buf, nbytes, limits)
    if flags & F_TABLE:
        if nbytes != HEADER.size:
            raise FramingError("a TABLE control message carries only the header")
        return Control(flags, nframes, total, (), (), HEADER.size)
    end = HEADER.size + nframes * ENTRY.size
    if nbytes < end:
        raise FramingError(
            f"control message of {nbytes} bytes is too short for {nframes} frames"
        )
    sizes, kinds = parse_table(buf, HEADER.size, nframes, total, limits, True)
    inline = sum(s for s, k in zip(sizes, kinds, strict=True) if k == INLINE)
    if nbytes - end != inline:
        raise FramingError(
            f"{nbytes - end} inline bytes follow the table, it announces {inline}"
        )
    return Control(flags, nframes, total, sizes, kinds, end)


def table_bytes(nframes: int) -> int:
    """Size of the separate table message of a TABLE control message."""
    return nframes * ENTRY.size
