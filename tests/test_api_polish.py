"""The public surface a ucxx/mpi4py user reaches for: exports, the aio
endpoints, keyword-only close, Request.cancelled(), probe's return type, the
remote-key names, and region views."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)


def test_view_of_registered_region_outlives_close():
    """A view keeps the registered object alive: valid after close."""
    with gpucx.Context(features={"rma"}) as ctx:
        data = np.arange(64, dtype=np.uint8)
        region = ctx.register(data)
        view = region.as_array(np.uint8)
        del data
        region.close()
        gc.collect()
        assert (view == np.arange(64, dtype=np.uint8)).all()


def test_exports():
    from gpucx.mem.cuda import DriverError
    from gpucx.ops.rma import NOTIFY_MAX, Transfer

    assert gpucx.Transfer is Transfer and gpucx.DriverError is DriverError
    assert gpucx.NOTIFY_MAX == NOTIFY_MAX > 0
    assert {"Transfer", "DriverError", "NOTIFY_MAX"} <= set(gpucx.__all__)


def test_aio_is_an_attribute_without_importing_asyncio_up_front():
    code = (
        "import sys, gpucx\n"
        "assert 'asyncio' not in sys.modules and 'gpucx.aio' not in sys.modules\n"
        "assert gpucx.aio.Worker.__module__ == 'gpucx.aio'\n"
        "try:\n"
        "    gpucx.nonexistent\n"
        "except AttributeError as e:\n"
        "    assert 'nonexistent' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_split_modules_keep_the_public_classes_module():
    # Issue 36 split gpucx.aio, gpucx.ops.am and gpucx.mem.cuda by concern;
    # their classes still read as the public module's.
    import gpucx.aio
    from gpucx.mem import cuda

    assert gpucx.AmMessage.__module__ == "gpucx.ops.am"
    assert gpucx.DriverError.__module__ == cuda.Driver.__module__ == "gpucx.mem.cuda"
    assert gpucx.aio.ProgressThread.__module__ == "gpucx.aio"


def test_aio_worker_hands_out_aio_endpoints():
    """connect / listen().accept / aaccept on an aio worker all give the aio
    endpoint, with asend."""
    import asyncio

    import gpucx.aio

    async def main():
        with gpucx.Context(config={"TLS": "tcp"}) as ctx:
            async with gpucx.aio.Worker(ctx) as srv, gpucx.aio.Worker(ctx) as cli:
                lst = srv.listen(port=0)
                assert isinstance(lst, gpucx.aio.Listener)
                ep = cli.connect(srv.address)
                assert isinstance(ep, gpucx.aio.Endpoint) and hasattr(ep, "asend")
                out = bytearray(5)
                await asyncio.gather(ep.asend(b"hello", tag=3), srv.arecv(out, tag=3))
                assert out == b"hello"
                # (host, port): the listener's aaccept, then its blocking
                # accept for a second client.
                pending = asyncio.ensure_future(lst.aaccept(timeout=20))
                c1 = await cli.aconnect(("127.0.0.1", lst.port))
                s1 = await pending
                assert isinstance(c1, gpucx.aio.Endpoint)
                assert isinstance(s1, gpucx.aio.Endpoint)
                back = bytearray(4)
                await asyncio.gather(s1.asend(b"back", tag=4), cli.arecv(back, tag=4))
                assert back == b"back"
                c2 = cli.connect(("127.0.0.1", lst.port))
                assert isinstance(c2, gpucx.aio.Endpoint)
                s2 = await srv.aaccept(lst, timeout=20)
                assert isinstance(s2, gpucx.aio.Endpoint)
                with pytest.raises(TypeError):
                    s2.close(True)  # force is keyword-only
                s2.close(force=True)

    asyncio.run(main())


def test_listener_accept_gives_aio_endpoint():
    """The aio listener's blocking accept() wraps the endpoint too."""
    import asyncio

    import gpucx.aio

    async def main():
        with gpucx.Context(config={"TLS": "tcp"}) as ctx:
            async with gpucx.aio.Worker(ctx) as srv:
                lst = srv.listen(port=0)
                peer_ctx = gpucx.Context(config={"TLS": "tcp"})
                peer = peer_ctx.create_worker(thread_mode="multi")
                with gpucx.aio.ProgressThread(peer):
                    # Kept: an endpoint dropped here would flush-close at
                    # once, blocking this thread (and srv) mid-wireup.
                    pep = peer.connect(("127.0.0.1", lst.port))
                    ep = lst.accept(timeout=20)
                    assert isinstance(ep, gpucx.aio.Endpoint)
                    assert isinstance(ep.endpoint, gpucx.Endpoint)
                # Nothing progresses srv during this synchronous close: its
                # flush would wait out the default 10 s.
                pep.close(force=True)
                peer_ctx.close()

    asyncio.run(main())


def test_endpoint_close_force_is_keyword_only():
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        with pytest.raises(TypeError):
            ep.close(True)
        ep.close(force=True)
        assert ep.closed


def test_request_cancelled_method_and_property_alias():
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        req = w.recv_nb(bytearray(8), tag=99)
        assert not req.cancelled() and not req.canceled
        assert req.cancel() is True
        req.done()
        assert req.cancelled() and req.canceled
        assert isinstance(req.exception(), gpucx.CanceledError)


def test_probe_returns_one_type():
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        ep = a.connect(b.address)
        for i in (1, 2):
            ep.send_nb(b"m%d" % i, tag=40 + i)
        peek = None
        for _ in range(2000):
            a.progress()
            peek = b.probe(tag=41)
            if peek is not None:
                break
        assert isinstance(peek, gpucx.ProbedMessage) and not peek.removed
        assert tuple(peek) == (41, 2)
        out = bytearray(2)
        assert peek.recv(out, timeout=5) == (41, 2) and out == b"m1"
        with pytest.raises(RuntimeError):
            peek.recv(out)
        taken = None
        for _ in range(2000):
            a.progress()
            taken = b.probe(tag=42, remove=True)
            if taken is not None:
                break
        assert isinstance(taken, gpucx.ProbedMessage) and taken.removed
        assert taken.recv(out, timeout=5) == (42, 2) and out == b"m2"
        assert b.probe(tag=41) is None and b.probe(tag=42) is None


def test_ucx_rkey_is_named_apart_from_the_token():
    with gpucx.Context(features={"rma"}) as ctx:
        w = ctx.create_worker()
        region = ctx.register(bytearray(64))
        assert region.ucx_rkey() == region.pack_rkey() == region.remote().rkey
        ep = w.connect(w.address)
        with pytest.raises(ValueError, match=r"region\.remote\(\).*ucx_rkey"):
            ep.unpack(region.ucx_rkey())
        key = ep.unpack(region.remote())
        assert isinstance(key, gpucx.RemoteKey)
