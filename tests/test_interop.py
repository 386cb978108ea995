"""Plain UCP on the wire: gpucx talks to a C program using raw UCX calls."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ucp_echo(tmp_path_factory):
    """Compile tests/interop/ucp_echo.c against the UCX gpucx uses."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is needed to build the interop peer")
    prefix = os.environ.get("GPUCX_UCX_PREFIX")
    if prefix:
        inc, libdir = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
    else:
        import libucx

        root = os.path.dirname(libucx.__file__)
        inc, libdir = os.path.join(root, "include"), os.path.join(root, "lib")
    exe = str(tmp_path_factory.mktemp("interop") / "ucp_echo")
    subprocess.run(
        [
            cc,
            "-O1",
            "-o",
            exe,
            os.path.join(HERE, "interop", "ucp_echo.c"),
            f"-I{inc}",
            f"-L{libdir}",
            f"-Wl,-rpath,{libdir}",
            "-lucp",
            "-lucs",
        ],
        check=True,
        capture_output=True,
    )
    return exe


def _readline_progressing(peer, worker, timeout: float) -> str:
    """Read a line from the peer while progressing our worker: the peer's
    final flush may need our side to answer."""
    import select
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([peer.stdout], [], [], 0.001)
        if ready:
            return peer.stdout.readline().strip()
        worker.progress()
    raise AssertionError(f"peer said nothing for {timeout} s")


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_tag_echo_with_c_program(ucp_echo, tls):
    sizes = [0, 1, 8, 4096, 100_000, 1 << 20]
    env = dict(os.environ, UCX_MM_ERROR_HANDLING="y", UCX_WARN_UNUSED_ENV_VARS="n")
    config = None
    if tls == "tcp":
        env["UCX_TLS"] = "tcp"
        config = {"TLS": "tcp"}
    peer = subprocess.Popen(
        [ucp_echo, str(len(sizes))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = peer.stdout.readline().strip()
        while line.startswith("["):  # a UCX log line, not the address
            line = peer.stdout.readline().strip()
        their_address = bytes.fromhex(line)
        with gpucx.Context(features={"tag"}, config=config) as ctx:
            w = ctx.create_worker()
            ep = w.connect(their_address, raw=True)
            peer.stdin.write(w.address.hex() + "\n")
            peer.stdin.flush()
            for n in sizes:
                data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
                back = np.zeros(n, np.uint8)
                req = w.recv_nb(back, tag=43)
                ep.send(data, tag=42)
                assert req.wait(60) == (43, n)
                assert np.array_equal(back, data)
            assert _readline_progressing(peer, w, 60) == "done"
            peer.stdin.write("bye\n")
            peer.stdin.flush()
            assert peer.wait(60) == 0
            ep.close(force=True)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
