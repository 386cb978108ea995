"""Two hosts on one machine: network namespaces joined by a veth pair
(tests/hosts.py), one process on each, reaching each other by TCP only."""

from __future__ import annotations

import json
import subprocess
import sys

import hosts as hostlib
import pytest

pytestmark = pytest.mark.timeout(60)

PEERS = str(hostlib.TESTS / "peers_hosts.py")


def _no_shared_memory(transports) -> None:
    names = {name for name, _ in transports}
    assert names and names <= {"tcp"}, transports


@pytest.mark.parametrize("how", ["listener", "address"])
def test_every_transfer_across_hosts(hosts, how):
    """Connect by (host, port) or by worker address from the other host;
    tag (eager and rendezvous), AM, put/get with a region token and
    send_array/recv_array both ways; both endpoints use TCP only."""
    a, b = hosts
    owner = a.python(PEERS, "owner", how, a.address, label="owner on host a")
    user = b.python(PEERS, "user", how, a.address, label="user on host b")
    user.put(owner.get())
    if how == "address":
        owner.put(user.get())
    o_done, o_transports, o_remote = owner.get()
    u_done, u_transports, u_local = user.get()
    assert o_done == u_done == "done"
    _no_shared_memory(o_transports)
    _no_shared_memory(u_transports)
    if how == "listener":
        assert o_remote[0] == b.address and u_local[0] == b.address, (o_remote, u_local)
    user.put(None)
    owner.put(None)
    user.join(30)
    owner.join(30)


def test_namespaces_are_torn_down():
    """The fixture leaves no namespace, interface or process behind."""
    reason = hostlib.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts on one machine: {reason}")
    with hostlib.make_hosts() as (a, b):
        names = [a.ns, b.ns]
        proc = a.popen(["sleep", "600"])
        peer = b.python("-c", "import time; time.sleep(600)")
    assert proc.poll() is not None and peer.proc.poll() is not None
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    assert not any(n in listed for n in names), listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "gxh" not in links, links


def test_bench_server_and_client_across_hosts(hosts, tmp_path):
    """`gpucx bench --server HOST` on one host, `--client` from the other."""
    a, b = hosts
    cli = [sys.executable, "-m", "gpucx.cli", "bench"]
    server = a.popen(
        [*cli, "--server", "--host", a.address, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    srv = hostlib.Peer(server, "bench server on host a")
    line = srv.readline(30)
    assert f"listening on {a.address}:" in line, (line, srv.stderr)
    port = int(line.rsplit(":", 1)[1])
    out = tmp_path / "bench.json"
    client = b.popen(
        [
            *cli,
            "--client",
            f"{a.address}:{port}",
            "-t",
            "tag_lat,tag_bw",
            "-s",
            "8,64K",
            "-n",
            "20",
            "-w",
            "2",
            "--no-progress",
            "--timeout",
            "30",
            "--json",
            str(out),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = client.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        raise AssertionError("bench client hung") from None
    assert client.returncode == 0, err
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4, results
    assert server.wait(30) == 0, srv.stderr
