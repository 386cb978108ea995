"""Memory regions and remote-memory tokens: registration, the binary
layout, pickling, and every malformed blob refused before UCX sees it."""

from __future__ import annotations

import pickle
import random
import struct
import zlib

import numpy as np
import pytest

import gpucx
from gpucx.mem.remote import FORMAT_VERSION, MAGIC

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def token(ctx):
    arr = np.zeros(256, np.uint8)
    with ctx.register(arr) as region:
        yield region.remote()


# -- regions ------------------------------------------------------------------


def test_register_describes_memory(ctx):
    arr = np.arange(32, dtype=np.float64)
    region = ctx.register(arr)
    assert region.address == arr.ctypes.data
    assert region.nbytes == arr.nbytes
    assert region.memory_type is gpucx.MemoryType.HOST
    assert region.obj is not None and not region.readonly
    view = region.as_array(np.float64)
    assert np.array_equal(view, arr)
    view[3] = -1.0
    assert arr[3] == -1.0
    region.close()
    assert region.closed and region.obj is None


def test_register_holds_object_alive(ctx):
    arr = np.full(100, 7, np.uint8)
    region = ctx.register(arr)
    del arr
    assert np.all(region.as_array() == 7)
    region.close()


def test_allocate_and_view(ctx):
    with ctx.allocate(4096) as region:
        assert region.nbytes == 4096 and region.obj is None
        assert region.memory_type is gpucx.MemoryType.HOST
        a = region.as_array(np.uint32, (32, 32))
        a[:] = 5
        assert region.as_array(np.uint32).sum() == 5 * 1024
        assert region.as_array(np.uint8, 10).shape == (10,)


@pytest.mark.parametrize("bad", [0, -1])
def test_allocate_rejects_bad_size(ctx, bad):
    with pytest.raises(ValueError, match="positive"):
        ctx.allocate(bad)


def test_allocate_rejects_non_int(ctx):
    with pytest.raises(TypeError, match="int"):
        ctx.allocate(4.0)


def test_register_rejects_empty(ctx):
    with pytest.raises(ValueError, match="empty"):
        ctx.register(bytearray())


def test_register_read_only_needs_writable_false(ctx):
    with pytest.raises(BufferError):
        ctx.register(b"read only bytes")
    with ctx.register(b"read only bytes", writable=False) as region:
        assert region.readonly and region.remote().readonly


def test_register_rejects_non_contiguous(ctx):
    with pytest.raises(BufferError):
        ctx.register(np.zeros((8, 8))[:, ::2])


def test_as_array_bounds(ctx):
    with ctx.allocate(10) as region:
        with pytest.raises(ValueError, match="whole number"):
            region.as_array(np.uint32)
        with pytest.raises(ValueError, match="needs 16 bytes"):
            region.as_array(np.uint32, 4)


def test_closed_region_raises(ctx):
    region = ctx.allocate(64)
    region.close()
    region.close()  # idempotent
    for call in (region.pack_rkey, region.remote, region.as_array):
        with pytest.raises(gpucx.ClosedError):
            call()


def test_context_close_unmaps_regions():
    ctx = gpucx.Context()
    regions = [ctx.allocate(1024), ctx.register(bytearray(100))]
    ctx.create_worker()
    ctx.close()
    assert all(r.closed for r in regions)
    with pytest.raises(gpucx.ClosedError):
        ctx.register(bytearray(10))
    with pytest.raises(gpucx.ClosedError):
        ctx.allocate(10)


def test_context_closes_workers_before_regions():
    ctx = gpucx.Context()
    w = ctx.create_worker()
    region = ctx.allocate(64)  # newer than the worker
    w2 = ctx.create_worker()
    order = []
    for obj in (w, region, w2):
        obj._release = (lambda o, f: lambda: (order.append(o), f())[1])(
            obj, obj._release
        )
    ctx.close()
    assert order[-1] is region and set(order[:2]) == {w, w2}


def test_pack_rkey_is_stable(ctx):
    with ctx.allocate(64) as region:
        assert region.pack_rkey() == region.pack_rkey()
        assert len(region.pack_rkey()) > 0


# -- the token ---------------------------------------------------------------


def test_token_fields(ctx):
    with ctx.allocate(512) as region:
        r = region.remote()
        assert (r.address, r.nbytes, r.memory_type) == (
            region.address,
            512,
            gpucx.MemoryType.HOST,
        )
        assert r.rkey == region.pack_rkey() and not r.readonly


def test_token_layout_is_documented(token):
    blob = token.to_bytes()
    magic, version, mtype, flags, address, nbytes, rlen = struct.unpack_from(
        "<4sBBHQQI", blob
    )
    assert (magic, version, flags) == (MAGIC, FORMAT_VERSION, 0)
    assert (address, nbytes, mtype) == (token.address, 256, int(token.memory_type))
    assert blob[28 : 28 + rlen] == token.rkey
    assert len(blob) == 28 + rlen + 4
    (crc,) = struct.unpack_from("<I", blob, 28 + rlen)
    assert crc == zlib.crc32(blob[: 28 + rlen])


def test_token_round_trip_bytes(token):
    back = gpucx.RemoteMemory.from_bytes(token.to_bytes())
    assert back == token and hash(back) == hash(token)
    assert gpucx.RemoteMemory.from_bytes(bytearray(token.to_bytes())) == token
    assert gpucx.RemoteMemory.from_bytes(memoryview(token.to_bytes())) == token


def test_token_round_trip_pickle(token):
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(token, protocol=proto)
        if proto >= 3:  # protocol 2 stores bytes as latin-1 text
            assert token.to_bytes() in data  # through the documented layout
        assert pickle.loads(data) == token


def test_token_is_immutable(token):
    with pytest.raises(AttributeError):
        token.nbytes = 1 << 40


def test_readonly_flag_round_trips():
    r = gpucx.RemoteMemory(0x1000, 64, gpucx.MemoryType.HOST, b"k", readonly=True)
    assert gpucx.RemoteMemory.from_bytes(r.to_bytes()).readonly


def _reseal(body: bytes) -> bytes:
    """Append a valid checksum (to reach the checks behind it)."""
    return body + struct.pack("<I", zlib.crc32(body))


def _header(**kw) -> bytes:
    f = dict(magic=MAGIC, version=1, mtype=0, flags=0, address=0x1000, nbytes=64)
    f.update(kw)
    rkey = kw.pop("rkey", b"rk")
    rlen = kw.get("rlen", len(rkey))
    return (
        struct.pack(
            "<4sBBHQQI",
            f["magic"],
            f["version"],
            f["mtype"],
            f["flags"],
            f["address"],
            f["nbytes"],
            rlen,
        )
        + rkey
    )


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"", "truncated"),
        (b"GXRM", "truncated"),
        (_reseal(_header(magic=b"XXXX")), "magic"),
        (_reseal(_header(version=3)), "version 3"),
        (_reseal(_header(version=0)), "version 0"),
        (_reseal(_header(rlen=0, rkey=b"")) + b"\0", "rkey length 0"),
        (_reseal(_header(rlen=1 << 20)), "rkey length"),
        (_reseal(_header(rlen=10)), "truncated"),
        (_reseal(_header()) + b"extra", "oversized"),
        (_header() + b"\0\0\0\0", "checksum"),
        (_reseal(_header(flags=0x80)), "flags"),
        (_reseal(_header(mtype=200)), "memory type"),
        (_reseal(_header(address=(1 << 64) - 8, nbytes=64)), "wraps"),
    ],
    ids=[
        "empty",
        "magic-only",
        "wrong-magic",
        "newer-version",
        "version-0",
        "empty-rkey",
        "huge-rkey",
        "short-rkey",
        "trailing-bytes",
        "bad-checksum",
        "unknown-flags",
        "unknown-memory-type",
        "wrapping-region",
    ],
)
def test_from_bytes_rejects(blob, message):
    with pytest.raises(ValueError, match=message):
        gpucx.RemoteMemory.from_bytes(blob)


def test_from_bytes_rejects_non_bytes():
    with pytest.raises(TypeError, match="bytes"):
        gpucx.RemoteMemory.from_bytes("a string")


def test_from_bytes_fuzz(token):
    """1000 garbage and mutated blobs: a clear ValueError each time."""
    rng = random.Random(1234)
    good = token.to_bytes()
    for i in range(1000):
        kind = i % 4
        if kind == 0:
            blob = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        elif kind == 1:  # flip one to eight bytes
            b = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(b))
                b[pos] ^= rng.randint(1, 255)
            blob = bytes(b)
        elif kind == 2:  # cut or extend
            cut = rng.randrange(len(good))
            blob = good[:cut] if rng.random() < 0.5 else good + good[: cut + 1]
        else:  # valid magic and version, random rest
            blob = good[:5] + bytes(
                rng.getrandbits(8) for _ in range(rng.randrange(0, 100))
            )
        with pytest.raises(ValueError, match="remote-memory token"):
            gpucx.RemoteMemory.from_bytes(blob)


def test_unpack_rejects_malformed_blob(pair):
    with pytest.raises(ValueError, match="magic"):
        pair.ab.unpack(b"Z" * 64)
    with pytest.raises(TypeError):
        pair.ab.unpack(12345)


# -- damaged packed keys reach UCX padded ---------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls", ["default", "tcp", "shm"])
def test_truncated_rkey_unpack_never_reads_past_the_blob(tls):
    """Every prefix of a real packed key, sealed into a token with a valid
    checksum (as a crafted token would be), reaches ``ucp_ep_rkey_unpack``
    from a zero-padded copy: UCX parses zeros past the end instead of
    whatever follows the blob in memory (unpadded, the default transports
    crashed on the 2-byte prefix), and the process survives all of them."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, os.path.join(here, "peers_rkey.py"), tls, "trunc", "0"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=here,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-500:], out.stderr[-1000:])
    assert "survived" in out.stdout.split()  # UCX logs to stdout too


@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_garbage_rkey_reaches_ucx_from_a_padded_copy(ctx, monkeypatch, n):
    """What UCX gets for a garbage key: a copy of it followed by RKEY_PAD
    zero bytes (UCX itself is not called here: it trusts a key's contents
    and may crash on garbage, see docs/rma.md)."""
    import random

    from gpucx.mem import remote as remote_mod

    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def gpucx_rkey_unpack(self, ep, blob, out):
            seen.append(bytes(ffi.buffer(blob, n + remote_mod.RKEY_PAD)))
            return lib.UCS_ERR_INVALID_PARAM

    from gpucx._lib import ffi, lib

    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    garbage = random.Random(n).randbytes(n)
    token = gpucx.RemoteMemory(0x1000, 64, gpucx.MemoryType.HOST, garbage)
    monkeypatch.setattr(remote_mod, "lib", Spy())
    with pytest.raises(gpucx.UCXError):
        ab.unpack(token.to_bytes())
    assert seen == [garbage + bytes(remote_mod.RKEY_PAD)]
