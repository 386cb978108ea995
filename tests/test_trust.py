"""What a peer may touch: read-only regions (what UCX enforces on each
transport here) and the lifetime of region views."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import gpucx
from gpucx.mem import region as region_mod

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(__file__)

# -- read-only regions -----------------------------------------------------------

#: Every transport family here, and whether UCX refuses a remote put into a
#: region mapped without UCP_MEM_MAP_PROT_REMOTE_WRITE (measured; see
#: docs/rma.md "What a peer can reach").  None of them does: shared memory
#: moves the data with CMA (process_vm_writev) or UCX's own active messages,
#: TCP with active messages, and neither looks at the protection.
READ_ONLY_PUT_REFUSED = {
    "default": False,
    "tcp": False,
    "posix": False,
    "sysv": False,
    "cma": False,
    "sm": False,
}
_TLS = {
    "default": None,
    "tcp": {"TLS": "tcp"},
    "posix": {"TLS": "posix,self"},
    "sysv": {"TLS": "sysv,self"},
    "cma": {"TLS": "cma,posix"},
    "sm": {"TLS": "sm,self"},
}


def test_read_only_region_is_mapped_without_remote_write(monkeypatch):
    """register(writable=False) asks ucp_mem_map for no remote write
    permission (UCP_MEM_MAP_PROT_*); writable regions keep the default."""
    calls = []
    real = region_mod.lib

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def gpucx_mem_map(self, *args):
            calls.append(args[5])  # the readonly argument
            return real.gpucx_mem_map(*args)

    monkeypatch.setattr(region_mod, "lib", Spy())
    with gpucx.Context() as ctx:
        ro = ctx.register(bytes(64), writable=False)
        rw = ctx.register(bytearray(64))
        al = ctx.allocate(64)
        assert ro.readonly and not rw.readonly
        for r in (ro, rw, al):
            r.close()
    assert calls == [1, 0, 0]


@pytest.mark.parametrize("tls", sorted(READ_ONLY_PUT_REFUSED))
def test_what_ucx_enforces_on_a_read_only_region(tls):
    """A peer that ignores the token's read-only flag (a forged token) and
    puts into a region registered with writable=False: the outcome on each
    transport is the one docs/rma.md states.  gets work everywhere."""
    with gpucx.Context(config=_TLS[tls]) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ab = a.connect(b.address)
        mem = np.zeros(4096, np.uint8)
        region = ctx.register(mem, writable=False)
        r = region.remote()
        assert r.readonly
        forged = gpucx.RemoteMemory(r.address, r.nbytes, r.memory_type, r.rkey)
        key = ab.unpack(forged)
        honest = ab.unpack(r)
        with pytest.raises(ValueError, match="read-only"):
            ab.put(np.ones(8, np.uint8), honest)  # gpucx's own check
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                b.progress()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            refused = False
            try:
                ab.put(np.full(16, 7, np.uint8), key, 0, timeout=10)
                ab.flush(timeout=10)
            except gpucx.UCXError:
                refused = True
            landed = bool((mem[:16] == 7).all())
            out = bytearray(16)
            ab.get(out, key, 0, timeout=10)
        finally:
            stop.set()
            t.join(10)
        assert refused == READ_ONLY_PUT_REFUSED[tls]
        assert landed == (not READ_ONLY_PUT_REFUSED[tls])
        assert bytes(out) == mem[:16].tobytes()
        key.close()
        honest.close()
        region.close()


# -- views outlive neither the memory nor the process ------------------------------


@pytest.mark.parametrize("kind", ["allocated", "registered"])
def test_views_keep_the_memory_alive_after_close(kind):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "peers_views.py"), kind],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=HERE,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-500:], out.stderr[-1500:])
    assert "ok" in out.stdout.split()


def test_closing_an_unviewed_region_unmaps_at_once(ctx):
    region = ctx.allocate(4096)
    v = region.as_array()
    del v
    region.close()
    assert ctx._deferred_maps == 0
    region2 = ctx.allocate(4096)
    keep = region2.as_array()
    region2.close()
    assert ctx._deferred_maps == 1  # unmapped when `keep` goes
    del keep
    assert ctx._deferred_maps == 0
