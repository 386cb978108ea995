"""Remote atomics: every operation at 4 and 8 bytes, the refusals before
UCX, and two processes racing on one counter."""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucx
from gpucx.ops import atomic as atomic_ops

from conftest import TRANSPORTS, channel_pair, join_ok, spawn
from peers_rma import adder
from test_rma import background

pytestmark = pytest.mark.timeout(120)


class AmoPair:
    """Two workers connected both ways.  ``path="ucx"``: without peer error
    handling, where UCX (>= 1.19) has atomic protocols and gpucx uses
    ``ucp_atomic_op_nbx``; ``path="emulated"``: the default endpoints, where
    gpucx runs atomics over its own active messages."""

    def __init__(self, ctx, path="ucx"):
        self.ctx = ctx
        self.a = ctx.create_worker()
        self.b = ctx.create_worker()
        eh = path == "emulated"
        self.ab = self.a.connect(self.b.address, error_handling=eh)
        self.ba = self.b.connect(self.a.address, error_handling=eh)
        assert atomic_ops.emulated(self.ab) == eh

    def drive(self, *reqs):
        while not all(r.done() for r in reqs):
            self.b.progress()
        return [r.result() for r in reqs]


@pytest.fixture(params=["ucx", "emulated"])
def amo(ctx, request):
    return AmoPair(ctx, request.param)


def counter(amo, dtype, values):
    mem = np.array(values, dtype)
    region = amo.ctx.register(mem)
    return mem, region, amo.ab.unpack(region.remote())


DT = {4: np.uint32, 8: np.uint64}


@pytest.mark.parametrize("nbytes", [4, 8])
def test_fetching_ops(amo, tls, nbytes):
    mask = (1 << (8 * nbytes)) - 1
    mem, region, key = counter(amo, DT[nbytes], [0, 10, 0b1100, 0b1010, 5])
    o = nbytes
    ep = amo.ab
    cases = [
        (ep.fetch_add_nb(key, 5, o, nbytes=nbytes), 10),
        (ep.fetch_and_nb(key, 0b0110, 2 * o, nbytes=nbytes), 0b1100),
        (ep.fetch_or_nb(key, 0b0101, 3 * o, nbytes=nbytes), 0b1010),
        (ep.fetch_xor_nb(key, 1, 4 * o, nbytes=nbytes), 5),
    ]
    got = amo.drive(*(r for r, _ in cases))
    assert got == [old for _, old in cases]
    assert list(mem) == [0, 15, 0b0100, 0b1111, 4]
    old = amo.drive(ep.swap_nb(key, mask, 0, nbytes=nbytes))[0]
    assert old == 0 and mem[0] == mask
    # compare_swap: swaps only when the value matches.
    assert amo.drive(ep.compare_swap_nb(key, 1, 2, 0, nbytes=nbytes)) == [mask]
    assert mem[0] == mask
    assert amo.drive(ep.compare_swap_nb(key, mask, 7, 0, nbytes=nbytes)) == [mask]
    assert mem[0] == 7
    region.close()


@pytest.mark.parametrize("nbytes", [4, 8])
def test_non_fetching_ops(amo, tls, nbytes):
    mem, region, key = counter(amo, DT[nbytes], [1, 0b1100, 0b1010, 6])
    ep = amo.ab
    reqs = [
        ep.atomic_add_nb(key, 41, 0, nbytes=nbytes),
        ep.atomic_and_nb(key, 0b0110, nbytes, nbytes=nbytes),
        ep.atomic_or_nb(key, 0b0101, 2 * nbytes, nbytes=nbytes),
        ep.atomic_xor_nb(key, 3, 3 * nbytes, nbytes=nbytes),
    ]
    assert amo.drive(*reqs) == [None] * 4
    with background(amo.b):
        ep.flush()
    assert list(mem) == [42, 0b0100, 0b1111, 5]
    region.close()


def test_blocking_forms(amo, tls):
    mem, region, key = counter(amo, np.uint64, [100, 0])
    ep = amo.ab
    with background(amo.b):
        assert ep.fetch_add(key, 1) == 100
        ep.atomic_add(key, -2)  # two's complement: decrement
        assert ep.fetch_add(key, 0) == 99
        assert ep.swap(key, 5, 8) == 0
        assert ep.compare_swap(key, 5, 6, 8) == 5
        ep.atomic_xor(key, 1, 8)
        ep.atomic_or(key, 8, 8)
        ep.atomic_and(key, 0xF, 8)
        assert ep.fetch_or(key, 0, 8) == 0b1111
        assert ep.fetch_and(key, 0xFF, 8) == 0b1111
        assert ep.fetch_xor(key, 0, 8) == 0b1111
        ep.flush()
    assert list(mem) == [99, 15]
    region.close()


def test_values_are_unsigned_words(amo):
    mem, region, key = counter(amo, np.uint32, [0, 0])
    ep = amo.ab
    assert amo.drive(ep.fetch_add_nb(key, -1, 0, nbytes=4)) == [0]
    assert amo.drive(ep.fetch_add_nb(key, 0, 0, nbytes=4)) == [0xFFFFFFFF]
    assert amo.drive(ep.fetch_add_nb(key, 2, 0, nbytes=4)) == [0xFFFFFFFF]
    assert mem[0] == 1 and mem[1] == 0  # wrapped within 4 bytes
    region.close()


# -- refusals ------------------------------------------------------------------


def test_alignment_checked(amo):
    mem, region, key = counter(amo, np.uint64, [0, 0, 0])
    for offset, nbytes in [(1, 8), (4, 8), (2, 4), (7, 4)]:
        with pytest.raises(ValueError, match="aligned"):
            amo.ab.fetch_add_nb(key, 1, offset, nbytes=nbytes)
    assert not mem.any()
    region.close()


@pytest.mark.parametrize("nbytes", [0, 1, 2, 16, "8"])
def test_nbytes_checked(amo, nbytes):
    mem, region, key = counter(amo, np.uint64, [0])
    with pytest.raises(ValueError, match="nbytes must be 4 or 8"):
        amo.ab.atomic_add_nb(key, 1, 0, nbytes=nbytes)
    region.close()


def test_out_of_bounds_atomic_refused(amo):
    mem, region, key = counter(amo, np.uint64, [0, 0])
    for call in (amo.ab.atomic_add, amo.ab.fetch_add_nb, amo.ab.swap):
        with pytest.raises(ValueError, match="offset=16 nbytes=8"):
            call(key, 1, 16)
    with pytest.raises(ValueError, match="offset=12 nbytes=8"):
        amo.ab.compare_swap(key, 0, 1, 12)  # straddles the end
    with pytest.raises(ValueError, match="offset=-8"):
        amo.ab.fetch_add(key, 1, -8)
    assert not mem.any()
    region.close()


@pytest.mark.parametrize(
    "value, nbytes",
    [(1 << 32, 4), (-(1 << 31) - 1, 4), (1 << 64, 8), (-(1 << 63) - 1, 8)],
)
def test_value_range_checked(amo, value, nbytes):
    mem, region, key = counter(amo, np.uint64, [0])
    with pytest.raises(ValueError, match="does not fit"):
        amo.ab.atomic_add_nb(key, value, 0, nbytes=nbytes)
    with pytest.raises(ValueError, match="does not fit"):
        amo.ab.compare_swap_nb(key, 0, value, 0, nbytes=nbytes)
    region.close()


def test_value_type_checked(amo):
    mem, region, key = counter(amo, np.uint64, [0])
    with pytest.raises(TypeError, match="value must be an int"):
        amo.ab.atomic_add_nb(key, 1.0)
    with pytest.raises(TypeError, match="RemoteKey"):
        amo.ab.atomic_add_nb(region.remote(), 1)
    region.close()


def test_read_only_region_refuses_atomics(amo):
    region = amo.ctx.register(bytes(8), writable=False)
    key = amo.ab.unpack(region.remote())
    with pytest.raises(ValueError, match="read-only"):
        amo.ab.fetch_add_nb(key, 1)
    region.close()


def test_closed_endpoint_and_key(amo):
    mem, region, key = counter(amo, np.uint64, [0])
    key.close()
    with pytest.raises(gpucx.ClosedError):
        amo.ab.fetch_add_nb(key, 1)
    amo.ab.close(force=True)
    with pytest.raises(gpucx.ClosedError):
        amo.ab.fetch_add(key, 1)
    region.close()


def test_default_endpoint_runs_atomics(ctx):
    """Endpoints with peer error handling (the default) run every atomic:
    UCX (>= 1.19) has no atomic protocol there, gpucx emulates them."""
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)  # peer error handling (the default)
    assert atomic_ops.emulated(ab)
    mem = np.zeros(1, np.uint64)
    region = ctx.register(mem)
    key = ab.unpack(region.remote())
    with background(b):
        assert ab.fetch_add(key, 3) == 0
        ab.flush()
    assert mem[0] == 3
    assert ab.error is None
    region.close()


# -- two processes racing ----------------------------------------------------------


@pytest.mark.parametrize("nbytes", [4, 8])
def test_two_processes_race_on_one_counter(tls, nbytes):
    n_ops = 300
    with gpucx.Context(config=TRANSPORTS[tls]) as ctx:
        w = ctx.create_worker()
        mem = np.zeros(4, DT[nbytes])
        region = ctx.register(mem)
        chans, children = [], []
        for _ in range(2):
            ours, theirs = channel_pair()
            children.append(spawn(adder, tls, theirs, n_ops, nbytes))
            ours.put((w.address, region.remote().to_bytes()))
            chans.append(ours)
        results = []
        try:
            # The owner progresses (TCP emulates atomics in software on the
            # target) until both adders report.
            pending = list(chans)
            while pending:
                w.progress()
                for c in list(pending):
                    if c._conn.poll(0):
                        kind, olds = c.get(5)
                        results.append(olds)
                        pending.remove(c)
            assert mem[0] == 2 * n_ops  # the exact total
            olds = sorted(results[0] + results[1])
            assert olds == list(range(2 * n_ops))  # every old value once
            for c in chans:
                c.put("bye")
        finally:
            for p in children:
                join_ok(p, 60)
        region.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eh", [False, True], ids=["ucx", "emulated"])
def test_atomics_on_an_accepted_endpoint(eh):
    """Listener.accept(error_handling=False) gives an endpoint UCX runs
    atomics on; the default one (peer error handling, no UCX protocol) runs
    gpucx's emulation."""
    with gpucx.Context(features={"tag", "rma", "amo", "am"}) as ctx:
        owner, user = ctx.create_worker(), ctx.create_worker()
        lst = owner.listen(host="127.0.0.1")
        ep = user.connect(("127.0.0.1", lst.port), error_handling=eh)
        back = None
        for _ in range(2000):
            user.progress()
            try:
                back = lst.accept(timeout=0.005, error_handling=eh)
                break
            except gpucx.TimeoutError:
                pass
        assert back is not None
        assert atomic_ops.emulated(back) == eh
        counter = np.zeros(1, np.uint64)
        with ctx.register(counter) as region:
            rkey = back.unpack(region.remote())
            req = back.fetch_add_nb(rkey, 5)
            end = time.monotonic() + 10
            while not req.done() and time.monotonic() < end:
                owner.progress()
                user.progress()
            assert req.result() == 0
            assert counter[0] == 5
            rkey.close()
        assert ep.error is None
