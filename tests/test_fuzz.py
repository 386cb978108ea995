"""Fuzzing of what arrives from outside: remote-memory tokens, the keys
unpacked from them, ``send_array`` headers and put-with-notify messages.

Each test runs twice: a sample in the default run and >= 10,000 cases under
``-m fuzz`` (see ``tests/fuzzing.py``).  Worker-address bytes are fuzzed in
the fault suite.
"""

from __future__ import annotations

import math
import struct
import threading
import time
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gpucx
from gpucx.mem.remote import MAGIC, MAX_RKEY_LEN, RemoteMemory
from gpucx.ops import am as _am
from gpucx.ops import arrays as _arrays
from gpucx.ops import rma as _rma

from conftest import Pair, channel_pair, join_ok, spawn
from fuzzing import fuzzed, run

pytestmark = pytest.mark.timeout(900)

U64 = (1 << 64) - 1
_HEAD = struct.Struct("<4sBBHQQI")


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.fixture
def host():
    """Two connected workers over the default transports, and a region of
    4096 bytes exported from worker b's side."""
    ctx = gpucx.Context()
    pair = Pair(ctx)
    arr = np.zeros(4096, np.uint8)
    region = ctx.register(arr)
    yield pair, arr, region.remote()
    ctx.close()


# -- RemoteMemory.from_bytes --------------------------------------------------


def _token_cases(good: bytes, rkey: bytes):
    """(kind, blob): garbage, corrupted, cut, extended, or a re-sealed token
    with forged header fields around the real packed key."""
    n = len(good)
    garbage = st.tuples(st.just("garbage"), st.binary(max_size=300))
    flips = st.lists(
        st.tuples(st.integers(0, n - 1), st.integers(1, 255)), min_size=1, max_size=8
    )

    def corrupt(fl):
        b = bytearray(good)
        for pos, x in fl:
            b[pos] ^= x
        return bytes(b)

    # Flips that cancel out (same byte, same mask twice) give the token back.
    corrupted = st.tuples(st.just("corrupted"), flips.map(corrupt)).filter(
        lambda c: c[1] != good
    )
    cut = st.tuples(st.just("cut"), st.integers(0, n - 1).map(lambda k: good[:k]))
    extended = st.tuples(
        st.just("extended"), st.binary(min_size=1, max_size=64).map(lambda t: good + t)
    )
    u64 = st.one_of(st.integers(0, 1 << 16), st.integers(0, U64))
    forged = st.tuples(
        st.just("forged"),
        st.builds(
            lambda magic, ver, mt, fl, addr, nb, rlen, extra: _seal(
                _HEAD.pack(magic, ver, mt, fl, addr, nb, rlen) + rkey + extra
            ),
            st.one_of(st.just(MAGIC), st.binary(min_size=4, max_size=4)),
            st.one_of(st.just(1), st.integers(0, 255)),
            st.integers(0, 255),
            st.one_of(st.just(0), st.integers(0, 0xFFFF)),
            u64,
            u64,
            st.one_of(st.just(len(rkey)), st.integers(0, (1 << 32) - 1)),
            st.one_of(st.just(b""), st.binary(max_size=16)),
        ),
    )
    return st.one_of(garbage, corrupted, cut, extended, forged)


@fuzzed
def test_fuzz_from_bytes(host, profile):
    _, _, remote = host
    good = remote.to_bytes()

    def body(case):
        kind, blob = case
        try:
            r = RemoteMemory.from_bytes(blob)
        except ValueError as exc:
            assert "remote-memory token" in str(exc)
            return
        # Only a sealed blob of the right layout may parse.
        assert kind in ("forged", "garbage"), kind
        assert r.to_bytes() == blob
        assert 0 < len(r.rkey) <= MAX_RKEY_LEN
        assert r.address + r.nbytes <= 1 << 64
        assert RemoteMemory.from_bytes(r.to_bytes()) == r

    run("RemoteMemory.from_bytes", profile, _token_cases(good, remote.rkey), body)


@fuzzed
def test_fuzz_remote_memory_constructor(profile):
    cases = st.tuples(
        st.integers(-(1 << 65), 1 << 65),
        st.integers(-(1 << 65), 1 << 65),
        st.integers(-2, 300),
        st.binary(max_size=80),
    )

    def body(case):
        address, nbytes, mtype, rkey = case
        try:
            r = RemoteMemory(address, nbytes, mtype, rkey)
        except ValueError:
            ok = (
                address >= 0
                and nbytes >= 0
                and address + nbytes <= 1 << 64
                and 0 < len(rkey) <= MAX_RKEY_LEN
            )
            if ok:  # then only the memory type can be wrong
                with pytest.raises(ValueError):
                    gpucx.MemoryType(mtype)
            return
        assert RemoteMemory.from_bytes(r.to_bytes()) == r

    run("RemoteMemory()", profile, cases, body)


# -- keys unpacked from forged tokens -----------------------------------------


def _access_cases(nbytes_max: int):
    off = st.one_of(
        st.integers(-(1 << 64), 1 << 65), st.integers(-8, nbytes_max + 8), st.just(0)
    )
    return st.tuples(
        st.one_of(st.just("real"), st.integers(0, U64)),  # address
        st.one_of(st.integers(0, nbytes_max), st.integers(0, U64)),  # nbytes
        st.booleans(),  # readonly
        st.sampled_from(["put", "get", "atomic"]),
        off,
        st.integers(0, 512),  # access size
    )


@fuzzed
def test_fuzz_unpacked_key_bounds(host, profile):
    """A token carrying the real packed key and forged fields unpacks; every
    access outside the region it advertises is refused before UCX, and an
    access inside the real region works."""
    pair, arr, remote = host

    def body(case):
        address, nbytes, readonly, op, offset, size = case
        real = address == "real"
        if real:
            address = remote.address
        if address + nbytes > 1 << 64:
            nbytes = (1 << 64) - address
        token = RemoteMemory(address, nbytes, remote.memory_type, remote.rkey, readonly)
        key = pair.ab.unpack(token.to_bytes())
        try:
            if op == "atomic":
                size = 8
            inside = offset >= 0 and offset + size <= nbytes
            writes = op != "get"
            aligned = op != "atomic" or (address + offset) % 8 == 0
            if not inside or (writes and readonly) or not aligned:
                with pytest.raises(ValueError):
                    _access(pair, key, op, offset, size)
            elif real and offset + size <= remote.nbytes and op != "atomic":
                _access(pair, key, op, offset, size)
            # Forged addresses inside their forged bounds are not touched:
            # UCX would follow them (see docs/rma.md).  Atomics in bounds are
            # tested in test_atomic (they need an endpoint without peer error
            # handling on UCX >= 1.19).
        finally:
            key.close()

    run("unpacked RemoteKey bounds", profile, _access_cases(8192), body)


def _on_a(pair, fn):
    """Run a blocking call on worker a in a thread while this thread
    progresses worker b (the target of emulated RMA); return its result."""
    out: list = []

    def call():
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised below
            out.append(exc)

    t = threading.Thread(target=call)
    t.start()
    end = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < end:
        pair.b.progress()
    t.join(5)
    assert not t.is_alive() and len(out) == 1
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _access(pair, key, op, offset, size):
    buf = np.zeros(size, np.uint8)
    if op == "put":
        pair.drive(pair.ab.put_nb(buf, key, offset))
    elif op == "get":
        pair.drive(pair.ab.get_nb(buf, key, offset))
    else:
        pair.ab.atomic_add(key, 1, offset)


def test_forged_token_reaches_what_the_transport_lets_it(host):
    """Pins what docs/rma.md says: over shared memory, CMA and TCP, UCX does
    not bound a key to the region it was packed for, so a token forged with
    another address reaches that address in the owner.  gpucx's bounds
    checks protect honest callers only."""
    pair, arr, remote = host
    other = np.zeros(64, np.uint8)  # never registered
    forged = RemoteMemory(other.ctypes.data, 64, remote.memory_type, remote.rkey)
    key = pair.ab.unpack(forged)
    pair.drive(pair.ab.put_nb(np.full(64, 7, np.uint8), key, 0))
    _on_a(pair, lambda: pair.ab.flush(timeout=10))
    assert other.tolist() == [7] * 64
    assert not arr.any()
    key.close()


# -- send_array headers -------------------------------------------------------

_VALID_DTYPES = [b"<f8", b"|b1", b"<c16", b">i4", b"|u1", b"<M8[ns]", b"<U5", b"|S3"]
_HOSTILE_DTYPES = [
    b"O",
    b"|O8",
    b"<i4,<f8",
    b"(2,3)<f8",
    b"[('a','<i4')]",
    b"|V0",
    b"|S0",
    b"<U0",
    b"<U999999999",
    b"<M8[zz]",
    b"float64",
    b"",
    b"<f8\x00",
    b"\xff\xfe",
]


def _header_cases():
    """(header, nbytes): well-formed, lying and broken array headers."""
    dim = st.one_of(st.integers(0, 8), st.integers(0, U64), st.just(1 << 63))
    dtype = st.one_of(
        st.sampled_from(_VALID_DTYPES + _HOSTILE_DTYPES),
        st.from_regex(rb"\A[<>|=]?[a-zA-Z][0-9]{0,12}\Z"),
        st.binary(max_size=40),
    )

    @st.composite
    def header(draw):
        shape = draw(st.lists(dim, max_size=70))
        dt = draw(dtype)
        magic = draw(st.one_of(st.just(b"GXAR"), st.binary(min_size=4, max_size=4)))
        version = draw(st.one_of(st.just(1), st.integers(0, 255)))
        memtype = draw(st.one_of(st.just(0), st.integers(0, 255)))
        ndim = draw(st.one_of(st.just(len(shape) % 256), st.integers(0, 255)))
        dtlen = draw(st.one_of(st.just(len(dt) % 256), st.integers(0, 255)))
        raw = (
            struct.pack("<4sBBBBB", magic, version, memtype, 0x3C, ndim, dtlen)
            + dt
            + b"".join(struct.pack("<Q", d) for d in shape)
        )
        cut = draw(st.one_of(st.just(len(raw)), st.integers(0, len(raw))))
        raw = raw[:cut] + draw(st.one_of(st.just(b""), st.binary(max_size=8)))
        items = math.prod(shape)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                itemsize = np.dtype(dt.decode("ascii")).itemsize
        except Exception:
            itemsize = 8
        nbytes = draw(
            st.one_of(
                st.just(items * itemsize),
                st.integers(0, 1 << 20),
                st.integers(0, U64),
            )
        )
        return raw, nbytes

    return header()


def _check_parsed(header, nbytes):
    """Parse; on success the result must describe exactly ``nbytes``."""
    try:
        dt, shape, memtype = _arrays.parse_header(header, nbytes)
    except ValueError:
        return False
    assert dt.kind in "biufcmMSUV" and not dt.hasobject and dt.fields is None
    assert dt.itemsize > 0 and len(shape) <= 64
    assert math.prod(shape) * dt.itemsize == nbytes
    gpucx.MemoryType(memtype)
    if nbytes <= 1 << 16:  # and the receiver can build that array
        out = _arrays._as_array(bytearray(nbytes), dt, shape, memtype, nbytes)
        assert out.shape == shape and out.dtype == dt
    return True


@fuzzed
def test_fuzz_array_header_parser(profile):
    """Hostile headers are refused with ValueError without allocating what
    they claim (< 64 KiB traced per parse), and whatever parses is
    consistent and builds its array."""

    def body(case):
        header, nbytes = case
        tracemalloc.start()
        try:
            _arrays.parse_header(header, nbytes)
        except ValueError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 64 * 1024, peak
        _check_parsed(header, nbytes)

    run("send_array header parser", profile, _header_cases(), body)


@fuzzed
def test_fuzz_array_header_round_trip(profile):
    """Every header ``send_array`` writes parses back to its dtype and shape."""
    dtypes = st.one_of(
        hnp.boolean_dtypes(),
        hnp.integer_dtypes(),
        hnp.unsigned_integer_dtypes(),
        hnp.floating_dtypes(),
        hnp.complex_number_dtypes(),
        hnp.datetime64_dtypes(),
        hnp.timedelta64_dtypes(),
        hnp.byte_string_dtypes(min_len=1),
        hnp.unicode_string_dtypes(min_len=1),
    )
    cases = st.tuples(dtypes, hnp.array_shapes(min_dims=0, max_dims=8, min_side=0))

    def body(case):
        dt, shape = case
        nbytes = math.prod(shape) * dt.itemsize
        got = _arrays.parse_header(_arrays._pack(dt.str, shape, 0), nbytes)
        assert got == (dt, shape, 0)

    run("send_array header round trip", profile, cases, body)


@pytest.mark.parametrize(
    "header, nbytes, match",
    [
        (_arrays._pack("<f8", (1 << 40,), 0), 8, "carries 8 bytes"),
        (_arrays._pack("<f8", (1 << 63, 1 << 63, 4), 0), 8, "too big"),
        (_arrays._pack("<f8", (2, 2), 0), 40, "carries 40 bytes"),
        (_arrays._pack("<f8", (1 << 63, 0), 0), 0, "too big"),
        (_arrays._pack("|u1", (1 << 62, 4, 0), 0), 0, "too big"),
        (_arrays._pack("O", (2,), 0), 16, "not a plain dtype"),
        (_arrays._pack("|O8", (2,), 0), 16, "not a plain dtype"),
        (_arrays._pack("<i4,<f8", (1,), 0), 12, "not a plain dtype"),
        (_arrays._pack("(2,)<f8", (1,), 0), 16, "not a plain dtype"),
        (_arrays._pack("|S0", (4,), 0), 0, "no size"),
        (_arrays._pack("<M8[zz]", (1,), 0), 8, "M8"),
        (_arrays._pack("<f8", (1,), 77), 8, "memory type 77"),
        (_arrays._pack("<f8", (1,), 0)[:-3], 8, "length"),
        (b"GXAR\x01\x00\x3c\x41\x03<f8" + b"\0" * 8 * 65, 0, "65 dimensions"),
        (b"GXAR\x02" + _arrays._pack("<f8", (1,), 0)[5:], 8, "version 2"),
        (b"GXA", 0, "too short"),
    ],
    ids=[
        "huge-shape",
        "shape-product-overflow",
        "byte-count-mismatch",
        "huge-dim-beside-zero",
        "huge-product-beside-zero",
        "object",
        "object-with-size",
        "structured",
        "subarray",
        "zero-itemsize",
        "unknown-datetime-unit",
        "unknown-memory-type",
        "truncated-shape",
        "too-many-dims",
        "wrong-version",
        "truncated-fixed-part",
    ],
)
def test_array_header_refused(header, nbytes, match):
    with pytest.raises(ValueError, match=match):
        _arrays.parse_header(header, nbytes)


# -- hostile array messages over a real endpoint ------------------------------


def _hostile_send(ep, header, payload, proto):
    """What a hostile peer does: a raw AM on the arrays id, reply endpoint
    set, any header and payload."""
    return _am._send_nb(
        ep, _am.ARRAY_AM_ID, payload, header, _am.send_flags(True, proto)
    )


def _host_buffer(nbytes, memory_type):
    return bytearray(nbytes)


def _recv_one(pair, header, payload, proto):
    """Send from a thread driving worker a, receive here on worker b; return
    the array, or the exception recv_array raised."""
    errors: list = []

    def send():
        try:
            req = _hostile_send(pair.ab, header, payload, proto)
            end = time.monotonic() + 20
            while not req.done() and time.monotonic() < end:
                pair.a.progress()
            req.result()
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    try:
        try:
            # A host allocator: headers may name any memory type, and which
            # types the default allocator serves depends on the machine.
            got = pair.ba.recv_array(timeout=20, allocator=_host_buffer)
        except ValueError as exc:
            got = exc
    finally:
        t.join(30)
    assert not t.is_alive(), "the sender hung"
    assert not errors, errors
    return got


def _message_cases():
    good = np.arange(6, dtype="<i4").reshape(2, 3)
    payload = st.one_of(
        st.just(good.tobytes()),
        st.binary(max_size=64),
        st.integers(0, 200_000).map(lambda n: bytes(n)),
    )
    return st.tuples(
        _header_cases().map(lambda c: c[0]),
        payload,
        st.sampled_from([None, "eager", "rndv"]),
    )


@fuzzed
def test_fuzz_hostile_array_messages(profile):
    """Hostile array messages over UCX: each refused or received whole, and
    the receiver keeps working for a well-formed array afterwards."""
    ctx = gpucx.Context()
    pair = Pair(ctx)
    good = np.arange(6, dtype="<i4").reshape(2, 3)
    sent = {"n": 0}

    def body(case):
        header, payload, proto = case
        if len(header) > 8000:  # UCX's header limit: the sender refuses
            header = header[:8000]
        valid = _check_parsed(header, len(payload))
        got = _recv_one(pair, header, payload, proto)
        if valid:
            assert isinstance(got, np.ndarray) and got.nbytes == len(payload)
            assert got.tobytes() == payload
        else:
            assert isinstance(got, ValueError) and "malformed" in str(got)
        sent["n"] += 1
        if sent["n"] % 25 == 0:
            out = _recv_one(pair, _arrays._pack("<i4", (2, 3), 0), good.tobytes(), None)
            assert np.array_equal(out, good)

    try:
        run("hostile array messages (UCX)", profile, _message_cases(), body)
        out = _recv_one(pair, _arrays._pack("<i4", (2, 3), 0), good.tobytes(), None)
        assert np.array_equal(out, good)
        assert not pair.b._engine.am.arrays
    finally:
        ctx.close()


_HOSTILE = [
    (_arrays._pack("<f8", (1 << 40,), 0), 8, None),
    (_arrays._pack("<f8", (1 << 62, 8), 0), 8, None),
    (_arrays._pack("<f8", (1,), 0), 4, None),
    (_arrays._pack("<f8", (10,), 0), 100_000, "rndv"),
    (_arrays._pack("O", (2,), 0), 16, None),
    (_arrays._pack("<i4,<f8", (1,), 0), 12, "eager"),
    (_arrays._pack("<f8", (1,), 99), 8, None),
    (b"GXAR\x07" + _arrays._pack("<f8", (1,), 0)[5:], 8, None),
    (_arrays._pack("<f8", (4,), 0)[:-5], 32, None),
    (b"", 8, None),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
def test_hostile_array_peer_process(tls_name):
    """A hostile peer process sends malformed array messages then a good
    one: each is refused, the good one arrives."""
    from peers_fuzz import hostile_array_peer

    ours, theirs = channel_pair()
    proc = spawn(hostile_array_peer, tls_name, theirs, _HOSTILE)
    try:
        from conftest import transport_config

        with gpucx.Context(config=transport_config(tls_name)) as ctx:
            w = ctx.create_worker()
            ours.put(w.address)
            ep = w.connect(ours.get(30))
            for _ in _HOSTILE:
                with pytest.raises(ValueError, match="malformed"):
                    ep.recv_array(timeout=30)
            out = ep.recv_array(timeout=30)
            assert np.array_equal(out, np.arange(1000, dtype=np.float64))
            ours.put("done")
            ep.close()
    finally:
        join_ok(proc, 60)


# -- put-with-notify messages -------------------------------------------------


@fuzzed
def test_fuzz_notify_messages(profile):
    """Anything on the notify id is queued as opaque bytes (eager) or dropped
    (rendezvous, counted and warned about once); the worker keeps working."""
    warnings.simplefilter("ignore", gpucx.DroppedMessagesWarning)
    ctx = gpucx.Context()
    pair = Pair(ctx)
    cases = st.tuples(
        st.binary(max_size=300),
        st.one_of(st.binary(max_size=2000), st.integers(0, 100_000).map(bytes)),
        st.sampled_from(["eager", "rndv"]),
    )

    def body(case):
        header, payload, proto = case
        req = _am._send_nb(
            pair.ab, _rma.NOTIFY_AM_ID, payload, header, _am.send_flags(True, proto)
        )
        pair.drive(req)
        got = []
        end = time.monotonic() + 10
        while proto == "eager" and not got and time.monotonic() < end:
            pair.a.progress()
            got = pair.b.notifications()
        if proto == "eager":
            assert len(got) == 1 and got[0][1] == payload
        else:
            pair.a.progress()
            assert pair.b.notifications() == []

    try:
        run("notify messages", profile, cases, body)
    finally:
        ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls_name", ["tcp", "shm"])
@pytest.mark.parametrize("features", [None, ("tag", "am")], ids=["rma", "no-rma"])
def test_key_packed_by_the_attacker(tls_name, features):
    """Pins docs/rma.md: a peer that packed a key of its own memory and
    forged a token with an address in the owner writes there when the
    owner's context has the "rma" feature (UCX does not bound the key on
    these transports), and cannot when the owner left "rma" out."""
    from conftest import transport_config
    from peers_fuzz import rma_owner_peer

    ours, theirs = channel_pair()
    proc = spawn(rma_owner_peer, tls_name, features, theirs)
    try:
        addr, target = ours.get(30)
        with gpucx.Context(config=transport_config(tls_name)) as ctx:
            mine = ctx.register(np.zeros(64, np.uint8)).remote()
            w = ctx.create_worker()
            ep = w.connect(addr)
            forged = RemoteMemory(target, 64, mine.memory_type, mine.rkey)
            key = ep.unpack(forged)
            try:
                ep.put(np.full(64, 7, np.uint8), key, 0, timeout=3)
                ep.flush(timeout=3)
                landed = True
            except gpucx.TimeoutError:
                landed = False
            ours.put("report")
            seen = ours.get(30)
            ours.put("done")
            ep.close(force=True)
        if features is None:
            assert landed and seen == 7 * 64
        else:
            assert not landed and seen == 0
    finally:
        join_ok(proc, 60)
