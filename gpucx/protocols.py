"""Which protocol UCX selected for a transfer, and whether it is a slow one.

UCX's "protocols v2" choose, per endpoint configuration, operation, memory
types and message size, how a transfer moves ("eager short", "rendezvous
zero-copy", "software emulation", ...) and over which transport.  This
module reads UCX's own reports of those choices; it never guesses:

* ``ucp_ep_print_info`` (source ``"ucp_ep_print_info"``): the tables of the
  operations without a remote key (tag, active message, stream sends) that
  the endpoint's configuration has selected so far.  Always available.
* ``ucp_worker_print_info`` (``"ucp_worker_print_info"``): the tables of the
  remote-key operations (put, get, atomics, rendezvous data send/fetch).
  UCX prints these only where its ``PROTO_INFO`` option enables them
  (``Context(config={"PROTO_INFO": "y"})`` or ``UCX_PROTO_INFO=y``), and
  then also writes every table to its log as it is made.
* ``ucp_request_query`` (``"ucp_request_query"``): the protocol of one
  request still in flight, for its exact length (:meth:`Request.protocol`,
  :func:`gpucx.ops.rma.probe`).  Needs no option.

A selection exists only once an operation of that kind, with those memory
types, was posted on an endpoint of the same configuration: before that
:func:`protocol` returns None.

The tables are those ``UCX_PROTO_INFO=y`` prints; :func:`parse_tables`
reads them from either report or from a UCX log.

Slow paths (:func:`is_slow`, documented in docs/gpu.md):

1. ``software emulation`` (put/get/atomics carried by active messages, the
   peer's progress moving the data) while CUDA (or other device) memory is
   on either side: every fragment is a synchronous copy to or from the
   device (about 1 GB/s on an H100).  Between host memories it is not slow
   (it ran at 0.9-1.1 of ``ucx_perftest`` over shared memory).
2. A copy protocol (its description says ``copy-in``, ``copy-out`` or
   ``bcopy``) over a host transport (not ``cuda_*``, ``gdr_copy``, ``rc*``,
   ``dc*``, ``ud*``) while CUDA (or other device) memory is on either side,
   for a range reaching past :data:`COPY_SLOW_ABOVE` bytes: the data is
   staged through host bounce buffers piece by piece.

gpucx's own path (:mod:`gpucx.ops.ipc`): a ``put``/``get`` between host
memory and a CUDA region of a process on this host, or a ``get`` of one
into CUDA memory, that gpucx copies itself with the copy engines over CUDA
IPC is reported as a :class:`Protocol` with ``description`` ``"gpucx
cuda_ipc copy"``, ``config`` ``"gpucx/cuda_ipc"`` and ``source``
``"gpucx"`` (:func:`protocol` with the key, :func:`gpucx.ops.rma.probe`,
:attr:`Request.protocol`); it is never slow.  Whether that path takes an
operation is :mod:`gpucx.ops.ipc`'s to say (it registers the question
with :func:`set_own_route`): this module reports on the operations and
imports none of them.

``no data fetch`` and everything else (short, eager, zero-copy, rendezvous
over ``cuda_ipc``, ``cma``, ``knem``, ``rkey_ptr``, RDMA) is not slow.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
import weakref
from typing import Any

from ._handle import raise_closed
from ._internal import handle
from ._lib import ffi, lib
from .errors import SlowPathWarning, UCXError, stacklevel_outside

__all__ = [
    "Protocol",
    "OPERATIONS",
    "COPY_SLOW_ABOVE",
    "parse_tables",
    "parse_request_info",
    "parse_range",
    "is_slow",
    "protocols",
    "protocol",
    "own_path",
    "set_own_route",
    "remember_info",
    "memory_name",
    "SlowPathWarning",
]

#: gpucx's operation names and UCX's descriptions of them: the title of a
#: selection table and the short name in a request's info string.
OPERATIONS = {
    "tag": ("tagged message by ucp_tag_send*", "tag_send"),
    "tag_sync": ("synchronous tagged message by ucp_tag_send_sync*", "tag_send_sync"),
    "am": ("active message by ucp_am_send*", "am_send"),
    "am_reply": ("active message by ucp_am_send* with reply flag", "am_send_reply"),
    "stream": ("stream message by ucp_stream_send*", "stream"),
    "put": ("remote memory write by ucp_put*", "put"),
    "get": ("remote memory read by ucp_get*", "get"),
    "atomic_post": ("posted atomic by ucp_atomic_op*", "amo_post"),
    "atomic_fetch": ("fetching atomic by ucp_atomic_op*", "amo_fetch"),
    "atomic_cswap": ("atomic compare-and-swap by ucp_atomic_op*", "amo_cswap"),
    "rndv_send": ("rendezvous data send", "rndv_send"),
    "rndv_fetch": ("rendezvous data fetch", "rndv_recv"),
    "rndv_drop": ("rendezvous data drop", "rndv_recv_drop"),
}
# Longest first: "active message ... with reply flag" before "active message".
_BY_TITLE = sorted(
    ((title, op) for op, (title, _) in OPERATIONS.items()), key=lambda t: -len(t[0])
)
_BY_NAME = sorted(
    ((name, op) for op, (_, name) in OPERATIONS.items()), key=lambda t: -len(t[0])
)

#: A copy protocol with device memory on a side is slow for a range that
#: reaches past this many bytes (rule 2 of the module doc).
COPY_SLOW_ABOVE = 64 * 1024

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = r"(?:\d+[KMGTP]?|inf)"
_RANGE_RE = re.compile(rf"^(?:(\d+)\s+)?({_SIZE})(?:\.\.({_SIZE}))?$")
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s?")
_CFG_RE = re.compile(r"\bcfg#\d+\b")
_TRANSPORT_RE = re.compile(r"[A-Za-z0-9_]+/[A-Za-z0-9_:.\[\]-]+")
_HOST_TL_EXCLUDED = ("cuda", "gdr", "rc", "dc", "ud", "rocm", "ze")
_DEVICE_MEMORY = re.compile(r"\b(cuda|rocm|ze)")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One row of a UCX protocol selection: what UCX does for messages of
    ``start``..``end`` bytes of one operation and pair of memory types."""

    #: gpucx's name of the operation (a key of :data:`OPERATIONS`), or "".
    op: str
    #: UCX's selection parameters: "remote memory read by ucp_get* into
    #: host memory from host" (a table title) or "get into host memory"
    #: (a request's info string).
    operation: str
    #: First message size of the range, in bytes.
    start: int
    #: Last size (inclusive), None for no bound ("inf").
    end: int | None
    #: UCX's protocol description, e.g. "software emulation", without the
    #: "(?) " mark of an estimated row.
    description: str
    #: UCX's configuration column: lanes as "transport/device", "" if none.
    config: str
    #: Slow by the rule of :func:`is_slow`.
    slow: bool
    #: Which UCX report said it (see the module doc).
    source: str
    #: UCX marked the row "(?)": its performance is an estimate.
    estimated: bool = False
    #: The endpoint configuration ("gpucx intra-node cfg#1"), "" if unknown.
    endpoint_config: str = ""
    #: Operation flags UCX shows in parentheses ("fast-completion",
    #: "multi", "frag"), "" for a plain call (gpucx's operations).
    variant: str = ""
    #: Memory type of the local buffer ("host", "cuda", ...), "" if unknown.
    local_memory: str = ""
    #: Memory type on the remote side (remote-key operations), else "".
    remote_memory: str = ""

    @property
    def transports(self) -> tuple[str, ...]:
        """The ``transport/device`` pairs of :attr:`config`."""
        return tuple(_TRANSPORT_RE.findall(self.config))

    @property
    def short(self) -> str:
        """``description`` and ``config`` in one line, e.g.
        ``"software emulation sysv/memory"``."""
        return f"{self.description} {self.config}".strip()

    def covers(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` bytes falls in this row's range."""
        return self.start <= nbytes and (self.end is None or nbytes <= self.end)


def parse_size(text: str) -> int | None:
    """A size as UCX prints it ("8241", "256K", "4M", "inf" -> None)."""
    if text == "inf":
        return None
    unit = text[-1] if text[-1] in _UNITS and not text[-1].isdigit() else ""
    return int(text[: len(text) - len(unit)]) * _UNITS[unit]


def parse_range(text: str) -> tuple[int, int | None]:
    """``(start, end)`` of a range cell: "0", "0..92", "256K..inf".

    Raises
    ------
    ValueError
        If ``text`` is not a UCX size range.
    """
    m = _RANGE_RE.match(text.strip())
    if m is None or m.group(2) == "inf":
        raise ValueError(f"not a UCX size range: {text!r}")
    start = parse_size(m.group(2))
    assert start is not None
    end = start if m.group(3) is None else parse_size(m.group(3))
    return start, end


def _memory_name(text: str) -> str:
    """ "host memory" / "cuda/GPU0" / "cuda/dev[0]" / "cuda" -> "host"/"cuda"."""
    word = text.strip().split(" ")[0].split("/")[0]
    return word.replace("-", "_")


def _split_title(title: str, names) -> tuple[str, str, str, str]:
    """``(op, variant, local, remote)`` of a selection title."""
    found = next(((p, o) for p, o in names if title.startswith(p)), None)
    if found is None:
        return "", "", "", ""
    op, rest = found[1], title[len(found[0]) :]
    variant = ""
    if rest.startswith("("):
        variant, _, rest = rest[1:].partition(")")
    rest = rest.split(", arg in ")[0]
    m = re.match(r"^ (?:from|into|of) (.+?)(?: (?:to|from|with) (.+))?$", rest)
    if m is None:
        return op, variant, "", ""
    return op, variant, _memory_name(m.group(1)), _memory_name(m.group(2) or "")


def is_slow(
    description: str,
    config: str,
    local_memory: str = "",
    remote_memory: str = "",
    end: int | None = None,
) -> bool:
    """Whether a protocol row is a slow path (rules in the module doc).

    ``end`` is the last size of the row (None: no bound)."""
    desc = description.lower()
    if "no data fetch" in desc:
        return False
    device = any(_DEVICE_MEMORY.match(m or "") for m in (local_memory, remote_memory))
    if not device:
        return False
    if "software emulation" in desc:
        return True
    if not any(w in desc for w in ("copy-in", "copy-out", "bcopy")):
        return False
    tls = [t.split("/")[0] for t in _TRANSPORT_RE.findall(config)]
    if not tls or any(t.startswith(_HOST_TL_EXCLUDED) for t in tls):
        return False
    return end is None or end > COPY_SLOW_ABOVE


def _row(op_title, cfg, cells, source) -> Protocol | None:
    rng, desc, config = cells[-3], cells[-2], cells[-1]
    try:
        start, end = parse_range(rng.split()[-1])
    except ValueError:
        return None
    estimated = desc.startswith("(?)")
    if estimated:
        desc = desc[3:].strip()
    op, variant, local, remote = _split_title(op_title, _BY_TITLE)
    return Protocol(
        op=op,
        operation=op_title,
        start=start,
        end=end,
        description=desc,
        config=config,
        slow=is_slow(desc, config, local, remote, end),
        source=source,
        estimated=estimated,
        endpoint_config=cfg,
        variant=variant,
        local_memory=local,
        remote_memory=remote,
    )


def parse_tables(text: str, source: str = "log") -> list[Protocol]:
    """Every row of the selection tables in ``text``.

    ``text``: what ``UCX_PROTO_INFO=y`` logs (lines may start with UCX's
    ``[time] [host:pid:thread]`` prefix), or what ``ucp_ep_print_info`` /
    ``ucp_worker_print_info`` print (lines start with ``# ``).  Both the
    UCX 1.22 layout (two title rows and a "Range | Description | Config"
    header, maybe a "Count" column) and the 1.20/1.21 one (the
    configuration and the operation in one row, no header) are read.
    Tables without rows (selected but empty) add nothing.
    """
    out: list[Protocol] = []
    cfg, title = "", ""
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if line.startswith("#"):
            line = line[1:].strip()
        if not (line.startswith("|") and line.endswith("|")) or len(line) < 2:
            continue
        cells = [c.strip() for c in line[1:-1].split("|")]
        if cells[-3:] == ["Range", "Description", "Config"]:
            continue
        if len(cells) >= 3:
            if title:
                row = _row(title, cfg, cells, source)
                if row is not None:
                    out.append(row)
            continue
        if len(cells) == 2:  # UCX 1.20/1.21: "| cfg | operation |"
            cfg, title = cells
        elif _CFG_RE.search(cells[0]):
            cfg, title = cells[0], ""
        else:
            title = cells[0]
    return out


_INFO_RE = re.compile(r"^\{[^}]*\}\s*(?P<op>.*?) length (?P<n>\d+)(?P<rest>.*)$")
_PERF_RE = re.compile(r"\s+(?:[\d.]+ MB/s [\d.]+ us|- not available)\s*$")
_CONFIG_START = re.compile(r"(?:^|\s)(?=\d+% on |[A-Za-z0-9_]+/\S)")


def parse_request_info(text: str, source: str = "ucp_request_query"):
    """The :class:`Protocol` in a request's info string (what
    ``ucp_request_query`` reports for a send-side request of UCX's
    protocols: "{proto,cb} get into host memory length 65536 software
    emulation sysv/memory 2345.6 MB/s 27.95 us"), or None for another
    string.  Its range is the request's length only; UCX names no remote
    memory type there."""
    m = _INFO_RE.match(text.strip())
    if m is None:
        return None
    rest = _PERF_RE.sub("", m.group("rest")).strip()
    cut = _CONFIG_START.search(rest)
    desc, config = (rest[: cut.start()], rest[cut.start() :]) if cut else (rest, "")
    desc, config = desc.strip(), config.strip()
    n = int(m.group("n"))
    op, variant, local, remote = _split_title(m.group("op"), _BY_NAME)
    return Protocol(
        op=op,
        operation=m.group("op"),
        start=n,
        end=n,
        description=desc,
        config=config,
        slow=is_slow(desc, config, local, remote, n),
        source=source,
        variant=variant,
        local_memory=local,
        remote_memory=remote,
    )


# -- endpoints ----------------------------------------------------------------


def _printed(fn, handle) -> str:
    size = ffi.new("size_t *")
    p = fn(handle, size)
    if p == ffi.NULL:
        raise UCXError("cannot open a memory stream for UCX's report")
    try:
        return ffi.string(p, size[0]).decode(errors="replace")
    finally:
        lib.gpucx_free(p)


#: What request queries taught about each endpoint (weakly, by endpoint).
_learnt_by_ep: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _learnt(ep) -> dict:
    """What request queries taught about ``ep``: {(op, local, length): row}."""
    d = _learnt_by_ep.get(ep)
    if d is None:
        d = _learnt_by_ep[ep] = {}
    return d


def protocols(ep) -> list[Protocol]:
    """Every protocol row UCX reports for ``ep`` so far (see the module doc
    for the sources).

    Raises
    ------
    gpucx.ClosedError
        If the endpoint (or its worker) is closed.
    """
    h = handle(ep)
    wh = handle(ep.worker)
    if h is None or wh is None:
        raise_closed(ep)
    rows = parse_tables(_printed(lib.gpucx_ep_info, h), "ucp_ep_print_info")
    cfgs = {r.endpoint_config for r in rows}
    wrows = parse_tables(_printed(lib.gpucx_worker_info, wh), "ucp_worker_print_info")
    if not cfgs and len({r.endpoint_config for r in wrows}) == 1:
        cfgs = {wrows[0].endpoint_config}  # the only configuration there is
    rows += [r for r in wrows if r.endpoint_config in cfgs]
    rows += list(_learnt(ep).values())
    return rows


def _memory_pair(memory) -> tuple[str, str]:
    if isinstance(memory, str):
        memory = (memory, "")
    local, remote = (list(memory) + ["", ""])[:2]
    return memory_name(local), memory_name(remote)


def memory_name(m) -> str:
    """How a protocol row names a memory type (``"host"``, ``"cuda"``...),
    from a :class:`gpucx.MemoryType`, its int value or a name."""
    if isinstance(m, int) and not isinstance(m, bool):
        from .mem.memtype import MemoryType

        m = MemoryType(m)
    name = getattr(m, "name", m) or ""
    return str(name).lower().replace("-", "_")


def _match(rows, op, nbytes, local, remote, variant):
    best = None
    for r in rows:
        if r.op != op or r.variant != variant or not r.covers(nbytes):
            continue
        if local and r.local_memory and r.local_memory != local:
            continue
        if remote and r.remote_memory and r.remote_memory != remote:
            continue
        # A table row beats a single-length request row; a row naming the
        # remote memory type beats one that does not.
        rank = (r.source != "ucp_request_query", bool(r.remote_memory))
        if best is None or rank > best[0]:
            best = (rank, r)
    return None if best is None else best[1]


def own_path(op: str, ep=None, local: str = "", remote: str = "cuda"):
    """The :class:`Protocol` row of gpucx's own copy-engine path
    (:mod:`gpucx.ops.ipc`) for ``op`` ("put", "get" or a request's name)."""
    name = "get" if op.startswith("get") else "put"
    return Protocol(
        op=name,
        operation=f"{name} by gpucx over CUDA IPC",
        start=0,
        end=None,
        description="gpucx cuda_ipc copy",
        config="gpucx/cuda_ipc",
        slow=False,
        source="gpucx",
        endpoint_config="",
        local_memory=local,
        remote_memory=remote,
    )


def _no_own_route(ep, op: str, local: str, remote: str, rkey) -> bool:
    return False


#: Whether gpucx's own path takes an operation: ``(ep, op, local memory,
#: remote memory, rkey) -> bool``, registered by :mod:`gpucx.ops.ipc` when
#: it is imported (:func:`set_own_route`): this module reports on the
#: operations and imports none of them.
_own_route: Any = _no_own_route


def set_own_route(fn) -> None:
    """Make ``fn(ep, op, local, remote, rkey)`` what :func:`protocol` asks
    whether gpucx's own copy path takes an operation (``gpucx.ops.ipc``
    registers :func:`gpucx.ops.ipc.takes`)."""
    global _own_route
    _own_route = fn


def protocol(
    ep,
    op: str,
    nbytes: int,
    memory=("host", "host"),
    variant: str = "",
    *,
    rkey=None,
):
    """The protocol UCX selected on ``ep`` for ``op`` of ``nbytes`` bytes,
    or None when UCX has not selected one yet (no such operation posted on
    an endpoint of this configuration) or does not report it (remote-key
    operations without ``PROTO_INFO`` nor a queried request).

    A ``put``/``get`` that gpucx's own path takes (see the module doc) gets
    that path's row (:func:`own_path`): for ``rkey`` when given, else when
    a key of ``ep`` to CUDA memory has its CUDA IPC handle open.

    Parameters
    ----------
    op : str
        A key of :data:`OPERATIONS`: "tag", "am", "stream", "put", "get", ...
    nbytes : int
        Message size in bytes.
    memory : (str, str) or str
        Memory types of the local buffer and of the remote side ("host",
        "cuda", a :class:`gpucx.MemoryType`); the remote one matters for
        remote-key operations only.
    variant : str
        UCX's operation flags ("fast-completion", "multi"); "" for the
        plain operations gpucx posts.
    rkey : RemoteKey, optional
        The key of a ``put``/``get``: says whether gpucx's own path takes
        it (its remote memory type is the key's).

    Raises
    ------
    ValueError
        For an unknown ``op`` or a negative ``nbytes``.
    gpucx.ClosedError
        If the endpoint is closed.
    """
    if op not in OPERATIONS:
        raise ValueError(f"unknown operation {op!r}; one of {sorted(OPERATIONS)}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes}")
    local, remote = _memory_pair(memory)
    if rkey is not None:
        remote = memory_name(rkey.memory_type)
    if not variant and _own_route(ep, op, local, remote, rkey):
        if ep.closed:
            raise_closed(ep)
        return own_path(op, ep, local, remote)
    return _match(protocols(ep), op, nbytes, local, remote, variant)


def request_protocol(slot, ep=None, remote_memory: str = ""):
    """The protocol of the UCX request in ``slot`` while it is in flight
    (``ucp_request_query``), else None; remembered on ``ep`` if given."""
    if slot is None:
        return None
    out = ffi.new("char[]", 1024)
    if lib.gpucx_slot_proto_info(slot, out, 1024) != 0:
        return None
    return _remember(ep, parse_request_info(ffi.string(out).decode()), remote_memory)


def remember_info(ep, text: str, remote_memory: str):
    """The :class:`Protocol` a request's info string (``ucp_request_query``)
    describes, remembered on ``ep`` for :func:`protocol`; None for an empty
    or unreadable string."""
    return _remember(ep, parse_request_info(text), remote_memory)


def _remember(ep, row, remote_memory: str):
    if row is None:
        return None
    if remote_memory and not row.remote_memory:
        row = dataclasses.replace(
            row,
            remote_memory=remote_memory,
            slow=is_slow(
                row.description, row.config, row.local_memory, remote_memory, row.end
            ),
        )
    if ep is not None:
        _learnt(ep)[(row.op, row.local_memory, row.remote_memory, row.start)] = row
    return row


# -- the one-time slow-path warning --------------------------------------------

_warned: set = set()


def warn_if_slow(ep, op: str, nbytes: int, memory, row=None):
    """Warn (:class:`gpucx.SlowPathWarning`, once per process for each
    endpoint configuration, operation, memory types and protocol) when the
    protocol UCX selected for ``op`` on ``ep`` is slow.  ``row``: a protocol
    already known (a request's), else looked up.  Never raises for a
    report UCX cannot give."""
    try:
        if row is None:
            row = protocol(ep, op, nbytes, memory)
    except (UCXError, ValueError):
        return None  # no report: nothing to warn about
    if row is None or not row.slow:
        return row
    key = (
        row.endpoint_config,
        row.op,
        row.local_memory,
        row.remote_memory,
        row.description,
        row.config,
    )
    if key in _warned:
        return row
    _warned.add(key)
    where = f"{row.local_memory or '?'}"
    if row.remote_memory:
        where += f" -> {row.remote_memory}"
    rng = f"{row.start}..{'inf' if row.end is None else row.end}"
    warnings.warn(
        SlowPathWarning(
            f"{op} of {nbytes} bytes ({where}) on endpoint {ep.peer}: UCX uses "
            f"{row.short!r} for sizes {rng} ({row.source}), a slow path; see "
            "docs/gpu.md, 'Which path does a transfer take?'"
        ),
        stacklevel=stacklevel_outside(),
    )
    return row


def first_use(ep, op: str, bit: int, nbytes: int, memory, slot=None) -> None:
    """The check of an operation's first use on ``ep`` for one memory
    combination (``bit`` marks it done): the protocol of the request in
    ``slot`` if still in flight, else what the tables say."""
    ep._proto_seen |= 1 << bit
    row = None
    if slot is not None:
        row = request_protocol(slot, ep, _memory_pair(memory)[1])
    warn_if_slow(ep, op, nbytes, memory, row)
