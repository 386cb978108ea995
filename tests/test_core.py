"""Context, Worker, Endpoint, Listener: configuration, lifetime, errors."""

from __future__ import annotations

import gc
import os
import select
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import gpucx
from gpucx.errors import check, error_for, status_name

pytestmark = pytest.mark.timeout(60)


# -- errors ------------------------------------------------------------------


def test_status_table_maps_each_class():
    from gpucx._lib import lib

    assert isinstance(error_for(lib.UCS_ERR_CANCELED, "x"), gpucx.CanceledError)
    assert isinstance(error_for(lib.UCS_ERR_CONNECTION_RESET, "x"), gpucx.PeerError)
    assert isinstance(error_for(lib.UCS_ERR_ENDPOINT_TIMEOUT, "x"), gpucx.PeerError)
    assert isinstance(
        error_for(lib.UCS_ERR_FIRST_LINK_FAILURE - 3, "x"), gpucx.PeerError
    )
    assert isinstance(error_for(lib.UCS_ERR_TIMED_OUT, "x"), TimeoutError)
    assert isinstance(error_for(lib.UCS_ERR_UNSUPPORTED, "x"), gpucx.UnsupportedError)
    assert isinstance(error_for(lib.UCS_ERR_INVALID_ADDR, "x"), ValueError)
    err = error_for(lib.UCS_ERR_NO_MEMORY, "alloc")
    assert type(err) is gpucx.UCXError
    assert err.status == lib.UCS_ERR_NO_MEMORY
    assert err.status_name == "UCS_ERR_NO_MEMORY"
    assert str(err).startswith("alloc: ")
    assert issubclass(gpucx.PeerError, ConnectionError)
    assert status_name(lib.UCS_ERR_LAST_ENDPOINT_FAILURE) == "UCS_ERR_ENDPOINT_FAILURE"


def test_check_raises_and_passes():
    from gpucx._lib import lib

    check(lib.UCS_OK, "fine")
    with pytest.raises(gpucx.CanceledError, match="^op: "):
        check(lib.UCS_ERR_CANCELED, "op")


# -- context and config ---------------------------------------------------------


def test_context_features_and_memory_types():
    with gpucx.Context(features={"tag"}) as ctx:
        assert ctx.features == {"tag"}
        assert gpucx.MemoryType.HOST in ctx.memory_types
    with gpucx.Context() as ctx:
        assert ctx.features == {"tag", "am", "rma", "amo", "stream"}


def test_unknown_feature():
    with pytest.raises(ValueError, match="unknown feature"):
        gpucx.Context(features={"tag", "teleport"})


def test_unknown_config_option_names_it():
    with pytest.raises(ValueError, match="NO_SUCH_OPTION"):
        gpucx.Context(config={"NO_SUCH_OPTION": "1"})


def test_invalid_config_value_names_it():
    with pytest.raises(ValueError, match="RNDV_THRESH"):
        gpucx.Context(config={"RNDV_THRESH": "not-a-size"})


def test_config_is_not_a_dict():
    with pytest.raises(TypeError):
        gpucx.Context(config=[("TLS", "tcp")])


def test_config_does_not_touch_environ():
    before = dict(os.environ)
    with gpucx.Context(config={"TLS": "tcp", "UCX_RNDV_THRESH": 8192}) as ctx:
        assert ctx.config["TLS"] == "tcp"
        assert ctx.config["RNDV_THRESH"] == "8192"
        assert ctx.config["MM_ERROR_HANDLING"] == "y"
    assert dict(os.environ) == before


def test_mm_error_handling_keeps_shared_memory():
    """Peer error handling stays on shared memory; opting out moves to TCP."""
    for mm, expect_shm in (("y", True), ("n", False)):
        with gpucx.Context(config={"MM_ERROR_HANDLING": mm}) as ctx:
            a, b = ctx.create_worker(), ctx.create_worker()
            ep = a.connect(b.address)
            names = {t for t, _ in ep.transports}
            assert bool(names & {"posix", "sysv"}) == expect_shm, names


def test_bad_thread_mode():
    with gpucx.Context() as ctx, pytest.raises(ValueError, match="thread_mode"):
        ctx.create_worker(thread_mode="turbo")


@pytest.mark.parametrize("mode", ["single", "serialized", "multi"])
def test_thread_modes(mode):
    with gpucx.Context() as ctx:
        w = ctx.create_worker(thread_mode=mode)
        assert w.thread_mode == mode
        assert isinstance(w.progress(), int)
        assert len(w.address) > 8


def test_worker_address_is_stable_bytes():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        assert isinstance(w.address, bytes)
        assert w.address == w.address
        assert w.fileno() >= 0


def _readable(fd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_worker_arm_and_signal():
    """arm() says whether the event fd may be slept on; signal() wakes it."""
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        while not w.arm():
            w.progress()
        assert not _readable(w.fileno())  # armed, nothing happened since
        w.signal()
        assert _readable(w.fileno(), 5)  # the signal wakes a sleeper
        assert not w.arm()  # the signal is an event: progress first
        while not w.arm():
            w.progress()
        assert not _readable(w.fileno())


def test_worker_flush_completes_puts_remotely():
    """A put in flight is in the target's memory once flush returns (flush
    alone progresses this worker; a thread progresses the target)."""
    with gpucx.Context() as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        ep = w.connect(peer.address)
        mem = np.zeros(1 << 22, np.uint8)
        region = ctx.register(mem)
        key = ep.unpack(region.remote())
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                peer.progress()

        t = threading.Thread(target=serve)
        req = ep.put_nb(np.full(1 << 22, 7, np.uint8), key)
        t.start()
        try:
            w.flush(timeout=10)
            assert (mem == 7).all()
        finally:
            stop.set()
            t.join(10)
        assert req.done() and req.result() is None
        key.close()
        region.close()


class _FenceSpy:
    """The extension module as gpucx.worker sees it, with ucp_worker_fence
    recorded and answering ``status``."""

    def __init__(self, lib):
        self._lib, self.calls, self.status = lib, [], lib.UCS_OK

    def __getattr__(self, name):
        if name != "ucp_worker_fence":
            return getattr(self._lib, name)
        return lambda h: self.calls.append(h) or self.status


def test_worker_fence_asks_ucx_and_checks_its_answer(monkeypatch):
    from gpucx import worker as _worker
    from gpucx._internal import handle

    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        spy = _FenceSpy(_worker.lib)
        monkeypatch.setattr(_worker, "lib", spy)
        w.fence()
        assert spy.calls == [handle(w)]
        spy.status = spy.UCS_ERR_NO_MEMORY
        with pytest.raises(gpucx.UCXError, match="ucp_worker_fence") as err:
            w.fence()
        assert err.value.status_name == "UCS_ERR_NO_MEMORY"


def test_closed_worker_refuses_flush_fence_arm_signal():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        w.close()
        for call in (w.flush, w.fence, w.arm, w.signal, w.fileno):
            with pytest.raises(gpucx.ClosedError):
                call()


# -- lifetime -------------------------------------------------------------------


def test_close_is_ordered_and_idempotent():
    ctx = gpucx.Context()
    w = ctx.create_worker()
    other = ctx.create_worker()
    ep = w.connect(other.address)
    lst = w.listen()
    ctx.close()
    for obj in (ep, lst, w, other, ctx):
        assert obj.closed
    ctx.close()
    w.close()
    ep.close()


def test_use_after_close_raises_closed_error():
    ctx = gpucx.Context()
    w = ctx.create_worker()
    peer = ctx.create_worker()
    ep = w.connect(peer.address)
    ep.close()
    with pytest.raises(gpucx.ClosedError, match="Endpoint is closed"):
        ep.send(b"x")
    with pytest.raises(gpucx.ClosedError):
        ep.send_nb(b"x")
    with pytest.raises(gpucx.ClosedError):
        _ = ep.transports
    w.close()
    for call in (
        lambda: w.progress(),
        lambda: w.recv(bytearray(1)),
        lambda: w.recv_nb(bytearray(1)),
        lambda: w.probe(),
        lambda: w.connect(peer.address),
        lambda: w.listen(),
        lambda: w.address,
        lambda: w.flush(),
    ):
        with pytest.raises(gpucx.ClosedError):
            call()
    ctx.close()
    with pytest.raises(gpucx.ClosedError):
        ctx.create_worker()


def test_context_managers():
    with gpucx.Context() as ctx:
        with ctx.create_worker() as w, ctx.create_worker() as peer:
            with w.connect(peer.address) as ep:
                assert not ep.closed
            assert ep.closed
        assert w.closed
    assert ctx.closed


def test_unclosed_objects_warn_and_close():
    ctx = gpucx.Context()
    w = ctx.create_worker()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        del w
        gc.collect()
    # The context still holds the worker weakly: dropping it warns and closes.
    assert any(issubclass(r.category, ResourceWarning) for r in rec)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        del ctx
        gc.collect()
    assert any(issubclass(r.category, ResourceWarning) for r in rec)


def test_no_crash_at_interpreter_exit():
    """Objects left open (and requests pending) at exit are closed in order.
    The unmatched rendezvous send holds the flush close to its deadline,
    shortened here from CLOSE_TIMEOUT_S to 1 s to spare the suite 9 s."""
    code = (
        "import gpucx, numpy as np\n"
        "import gpucx._handle; gpucx._handle.CLOSE_TIMEOUT_S = 1.0\n"
        "ctx = gpucx.Context()\n"
        "a, b = ctx.create_worker(), ctx.create_worker()\n"
        "ep = a.connect(b.address)\n"
        "l = b.listen()\n"
        "r = b.recv_nb(np.zeros(4), tag=9)\n"
        "s = ep.send_nb(np.ones(1 << 20), tag=3)\n"
        "import sys; sys.modules['keep'] = (ctx, a, b, ep, l, r, s)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


_GRACE_PROBE = """
import os, sys, threading
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
if sys.argv[1] == "user":
    os.environ["UCX_MEM_BISTRO_GRACE_DURATION"] = "20ms"
import libucx
seen = []
load = libucx.load_library
libucx.load_library = lambda: (
    seen.append(os.environ.get("UCX_MEM_BISTRO_GRACE_DURATION")), load())
import gpucx
gpucx.Context().close()  # UCX reads its configuration: no unknown variable
print(seen, os.environ.get("UCX_MEM_BISTRO_GRACE_DURATION"))
"""


@pytest.mark.parametrize(
    "case,during,after",
    [("alone", "'0'", "None"), ("thread", "None", "None"), ("user", "'20ms'", "20ms")],
)
def test_ucx_loads_without_the_hook_grace_only_in_a_single_thread(case, during, after):
    """UCM's grace period after each hook it patches protects other threads
    running the patched function: with one thread there is none, and gpucx
    loads UCX without it (set for the load only); with another thread, or a
    user's own setting, UCX gets what it would have got."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_MEM_BISTRO_GRACE_DURATION"}
    if env.get("GPUCX_UCX_PREFIX"):
        pytest.skip("gpucx loads the UCX of GPUCX_UCX_PREFIX, not the wheel's")
    out = subprocess.run(
        [sys.executable, "-c", _GRACE_PROBE, case],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{during}]", after]
    assert "UCX_MEM_BISTRO_GRACE_DURATION" not in out.stderr  # no UCX warning


def test_forked_child_cannot_use_parent_objects_but_can_make_its_own():
    ctx = gpucx.Context()
    w = ctx.create_worker()
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            try:
                w.progress()
            except gpucx.ClosedError as exc:
                if "forked child" in str(exc):
                    with gpucx.Context() as c2:
                        c2.create_worker().progress()
                        code = 0
        finally:
            os.write(wfd, bytes([code]))
            os._exit(code)
    os.close(wfd)
    result = os.read(r, 1)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    assert result == b"\x00"
    assert os.waitstatus_to_exitcode(status) == 0
    w.progress()  # the parent is unaffected
    ctx.close()


# -- connecting -------------------------------------------------------------------


@pytest.mark.parametrize(
    "blob",
    [b"", b"\x00" * 4, bytes([0x0E]) + b"\x00" * 40, bytes([0xFF]) * 64],
    ids=["empty", "short", "bad-version", "all-ones"],
)
def test_garbage_worker_address(blob):
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        with pytest.raises(gpucx.InvalidAddressError):
            w.connect(blob)


def test_truncated_worker_address():
    with gpucx.Context() as ctx:
        w, peer = ctx.create_worker(), ctx.create_worker()
        with pytest.raises(gpucx.InvalidAddressError):
            w.connect(peer.address[:12])


def test_connect_bad_address_types():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        with pytest.raises(TypeError):
            w.connect("127.0.0.1:1234")
        with pytest.raises(TypeError):
            w.connect(("127.0.0.1", "1234"))
        with pytest.raises(ValueError):
            w.connect(("127.0.0.1", 0))
        with pytest.raises(gpucx.InvalidAddressError):
            w.connect(("no-such-host.invalid", 1234))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_to_port_nobody_listens_on_fails_fast():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        ep = w.connect(("127.0.0.1", _free_port()))
        with pytest.raises(gpucx.PeerError):
            ep.send(b"anyone there?", tag=1)
        assert isinstance(ep.error, gpucx.PeerError)
        ep.close()


def test_listener_accept_timeout_and_port():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        lst = w.listen(host="127.0.0.1")
        assert 0 < lst.port < 65536
        with pytest.raises(gpucx.TimeoutError):
            lst.accept(timeout=0.2)
        with pytest.raises(ValueError):
            w.listen(port=70000)


def test_listener_port_in_use():
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        lst = w.listen(host="127.0.0.1")
        with pytest.raises(gpucx.UCXError):
            w.listen(port=lst.port, host="127.0.0.1")


def test_listener_accepts_in_one_process():
    with gpucx.Context() as ctx:
        server, client = ctx.create_worker(), ctx.create_worker()
        lst = server.listen(host="127.0.0.1")
        ep = client.connect(("127.0.0.1", lst.port))
        peer = None
        for _ in range(2000):
            client.progress()
            try:
                peer = lst.accept(timeout=0.005)
                break
            except gpucx.TimeoutError:
                pass
        assert peer is not None
        got = bytearray(5)
        req = server.recv_nb(got, tag=4)
        snd = ep.send_nb(b"hello", tag=4)
        while not (req.done() and snd.done()):
            client.progress()
            server.progress()
        assert req.result() == (4, 5) and got == b"hello"


def test_endpoint_error_is_none_when_healthy():
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        assert ep.error is None
        assert ep.worker is a
        assert "Endpoint" in repr(ep)


def test_numpy_roundtrip_smoke():
    with gpucx.Context() as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        out = np.zeros(3)
        req = b.recv_nb(out, tag=1)
        ep.send(np.array([1.0, 2.0, 3.0]), tag=1)
        assert req.wait(5) == (1, 24)
        assert out.tolist() == [1.0, 2.0, 3.0]


def test_ucx_version_gate():
    from gpucx._lib import MIN_UCX, version_problem

    assert version_problem((1, 22, 0)) is None
    assert version_problem(MIN_UCX + (0,)) is None
    msg = version_problem((1, 14, 2))
    assert "1.14.2" in msg and "1.20" in msg
    assert gpucx.UCX_VERSION >= MIN_UCX + (0,)
