"""The supported UCX range, and what a (host, port) peer must share with us.

UCX's client/server (sockaddr) wireup does not cross UCX minor versions, so
a failed ``(host, port)`` connection says so, with the version this process
runs; a worker-address connection does not carry that hint.  The range itself
is exercised release by release by ``ci/ucx-matrix``.
"""

from __future__ import annotations

import pathlib
import re
import socket

import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_host_port_connection_names_the_ucx_minor_version():
    minor = ".".join(map(str, gpucx.UCX_VERSION[:2]))
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        ep = w.connect(("127.0.0.1", _free_port()))
        with pytest.raises(gpucx.PeerError) as info:
            ep.flush(timeout=20)
        msg = str(info.value)
        assert f"UCX {minor} like this process" in msg, msg
        assert "does not cross UCX minor versions" in msg
        assert "does not cross UCX minor versions" in str(ep.error)


def test_address_connection_has_no_wireup_hint():
    """Only (host, port) endpoints carry the hint: a worker-address endpoint
    does not go through UCX's client/server wireup."""
    with gpucx.Context(features={"tag"}) as ctx:
        a, b = ctx.create_worker(), ctx.create_worker()
        by_address = a.connect(b.address)
        listener = b.listen(port=0)
        by_port = a.connect(("127.0.0.1", listener.port))
        assert by_address._failure_hint() == ""
        assert "minor version" in by_port._failure_hint()
        # Nobody accepts it: a flush close would wait out its deadline.
        by_port.close(force=True)


def test_declared_range_matches_runtime_minimum():
    """pyproject's libucx-cu12 range starts at the UCX gpucx refuses below."""
    from gpucx._lib import MIN_UCX

    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]$", text, re.M)
    assert deps is not None
    spec = re.search(r'"libucx-cu12>=(\d+)\.(\d+),<(\d+)\.(\d+)"', deps.group(1))
    assert spec is not None, deps.group(1)
    lo = (int(spec.group(1)), int(spec.group(2)))
    assert lo == MIN_UCX
    assert gpucx.UCX_VERSION[:2] >= lo
    readme = (ROOT / "README.md").read_text()
    assert f"libucx-cu12 {lo[0]}.{lo[1]}" in readme
