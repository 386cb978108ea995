"""Shared fixtures: contexts per transport family, worker pairs, peers.

Every test has a pytest-timeout (``timeout`` in pyproject.toml); tests that
spawn processes pass explicit, shorter join timeouts so a hang is a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest


def _ucx_grace_off() -> None:
    """UCX 1.22 and up wait UCX_MEM_BISTRO_GRACE_DURATION (50 ms) after each
    function their memory hooks patch when libucs loads: about 0.4 s per
    process, and the suite starts hundreds of processes, most with NumPy's
    thread pool already running, so gpucx's own rule (gpucx/_lib.py: no
    grace in a single-threaded process) does not apply to them.  No thread
    of theirs is inside mmap then, so the suite and its children load UCX
    without the grace.  Older UCX has no such option (and would warn about
    an unknown variable), a user's setting is kept."""
    if os.environ.get("GPUCX_UCX_PREFIX"):
        return  # another UCX: its version is not known before it loads
    try:
        import libucx

        version = tuple(int(x) for x in libucx.__version__.split(".")[:2])
    except (ImportError, AttributeError, ValueError):
        return
    if version >= (1, 22):
        os.environ.setdefault("UCX_MEM_BISTRO_GRACE_DURATION", "0")


_ucx_grace_off()

import gpucx  # noqa: E402

#: Transport families every transfer test runs over.
TRANSPORTS = {
    "default": None,
    "tcp": {"TLS": "tcp"},
    "shm": {"TLS": "sm,self"},
}


def transport_config(tls: str, listener: bool = False):
    """Context config for a family; client/server connections (listeners)
    need ``tcp`` in TLS for UCX's connection manager, data still moves over
    shared memory."""
    cfg = TRANSPORTS[tls]
    if listener and cfg is not None and "tcp" not in cfg["TLS"]:
        cfg = {"TLS": cfg["TLS"] + ",tcp"}
    return cfg


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=sorted(TRANSPORTS))
def tls(request):
    """Name of a transport family (default, tcp, shm)."""
    return request.param


@pytest.fixture
def ctx(request):
    """A context over the transport family of the ``tls`` fixture (if used)."""
    name = request.getfixturevalue("tls") if "tls" in request.fixturenames else None
    c = gpucx.Context(config=TRANSPORTS[name] if name else None)
    yield c
    c.close()


class Pair:
    """Two workers of one context in this process, connected both ways."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.a = ctx.create_worker()
        self.b = ctx.create_worker()
        self.ab = self.a.connect(self.b.address)
        self.ba = self.b.connect(self.a.address)

    def drive(self, *reqs, timeout: float = 10.0):
        """Progress both workers until every request is done; return results."""
        end = time.monotonic() + timeout
        while not all(r.done() for r in reqs):
            self.a.progress()
            self.b.progress()
            if time.monotonic() > end:
                raise AssertionError(f"requests still pending after {timeout} s")
        return [r.result() for r in reqs]


def spin(pair, rounds: int = 200) -> None:
    """Progress both workers of ``pair`` ``rounds`` times, waiting for
    nothing: whatever would happen meanwhile has had its chance."""
    for _ in range(rounds):
        pair.a.progress()
        pair.b.progress()


def pump(pair, cond, timeout=10.0):
    """Progress both workers of ``pair`` until ``cond()`` is true."""
    end = time.monotonic() + timeout
    while not cond():
        pair.a.progress()
        pair.b.progress()
        if time.monotonic() > end:
            raise AssertionError(f"condition not met after {timeout} s")


def check_transports(tls: str, *transport_lists) -> None:
    """The transports endpoints report (``Endpoint.transports``: lists of
    ``(name, device)``) belong to the family ``tls`` selected."""
    names = {t for transports in transport_lists for t, _ in transports}
    if tls == "tcp":
        assert names <= {"tcp"}, names
    if tls == "shm":
        assert names & {"posix", "sysv"}, names


@pytest.fixture
def pair(ctx):
    return Pair(ctx)


def spawn(target, *args, timeout: float = 60.0):
    """Run ``target(*args)`` in a fresh (spawned) process; return the Process."""
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def join_ok(proc, timeout: float = 60.0) -> None:
    """Join a child; fail (and kill it) on a hang or a non-zero exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise AssertionError(f"child {proc.pid} hung for {timeout} s")
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"


class Channel:
    """One end of a duplex pipe to a peer process, with timed receives."""

    def __init__(self, conn):
        self._conn = conn

    def put(self, obj) -> None:
        self._conn.send(obj)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message is ready to be read."""
        return self._conn.poll(timeout)

    def get(self, timeout: float = 60.0):
        if not self._conn.poll(timeout):
            raise AssertionError(f"peer said nothing for {timeout} s")
        return self._conn.recv()


def channel_pair():
    """``(ours, theirs)``: two connected :class:`Channel` ends."""
    a, b = mp.get_context("spawn").Pipe(duplex=True)
    return Channel(a), Channel(b)


@pytest.fixture
def hosts():
    """Two emulated hosts (tests/hosts.py): network namespaces joined by a
    veth pair, each starting processes with a fresh /dev/shm; always torn
    down.  Skips where namespaces cannot be made."""
    import hosts as _hosts

    reason = _hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts on one machine: {reason}")
    try:
        cm = _hosts.make_hosts()
        made = cm.__enter__()
    except _hosts.HostsUnavailable as e:
        pytest.skip(f"two hosts on one machine: {e}")
    try:
        yield made
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def lib_path(tmp_path_factory):
    """The fake CUDA driver (tests/fakecuda/libcuda_fake.c, a test double
    for the GPU this machine lacks), built once a run as libcuda.so.1."""
    from fakegpu import build_fake_libcuda

    return build_fake_libcuda(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")


@pytest.fixture
def fake_libcuda(lib_path):
    """gpucx's CUDA driver replaced by the fake library for one test
    (``peers_ipc.fake_driver``); reset and the real one restored after."""
    from peers_ipc import fake_driver

    from gpucx.mem import cuda

    previous = cuda.set_driver(None, "replaced below")
    d = fake_driver(lib_path)
    yield d
    d._lib.fake_reset()
    cuda.restore_driver(previous)


@pytest.fixture
def fake_driver():
    """gpucx's CUDA driver replaced by ``fakegpu.FakeDriver`` (a test double
    in Python: pointer attributes, contexts and streams it is told) for one
    test; the real state restored after."""
    from gpucx.mem import cuda

    from fakegpu import FakeDriver

    drv = FakeDriver()
    previous = cuda.set_driver(drv)
    yield drv
    cuda.restore_driver(previous)
