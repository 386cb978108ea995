"""Two hosts on one machine: network namespaces joined through a bridge
(tests/hosts.py), one process on each, reaching each other by TCP only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hosts as hostlib
import pytest

import gpucx

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


def _boot_id(host) -> str:
    proc = host.popen(
        ["cat", "/proc/sys/kernel/random/boot_id"], stdout=subprocess.PIPE
    )
    out, _ = proc.communicate(timeout=10)
    return out.strip()


def test_namespaces_are_torn_down():
    """The fixture leaves no namespace, interface, process or file behind;
    three hosts (the bridge takes any number) each see a boot id of their
    own."""
    reason = hostlib.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts on one machine: {reason}")
    with hostlib.make_hosts(3) as (a, b, c):
        names = [a.ns, b.ns, c.ns, a.wire_ns]
        boot_files = [h.boot_id_file for h in (a, b, c)]
        proc = a.popen(["sleep", "600"])
        peer = b.python("-c", "import time; time.sleep(600)")
        boots = {_boot_id(h) for h in (a, b, c)}
        machine = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert len(boots) == 3 and machine not in boots, (boots, machine)
        assert c.address == f"{hostlib.SUBNET}.3"
    assert proc.poll() is not None and peer.proc.poll() is not None
    assert not any(Path(f).exists() for f in boot_files), boot_files
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    assert not any(n in listed for n in names), listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "gxh" not in links and "gxw" not in links and "gxbr" not in links, links


def test_a_dead_runs_boot_id_folder_is_removed(tmp_path):
    """A run killed outright leaves its folder of boot ids; the next
    ``make_hosts`` removes it (and keeps a live run's)."""
    reason = hostlib.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts on one machine: {reason}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp = Path(hostlib.tempfile.gettempdir())
    stale = tmp / f"{hostlib.PREFIX}{dead.pid}-boot-test"
    live = tmp / f"{hostlib.PREFIX}{os.getppid()}-boot-test"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "a").write_text("x\n")
    try:
        with hostlib.make_hosts(1):
            pass
        assert not stale.exists() and live.exists()
    finally:
        for folder in (stale, live):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("n", [0, 9])
def test_make_hosts_refuses_a_count_it_cannot_name(n):
    with pytest.raises(ValueError, match="n must be 1-8"), hostlib.make_hosts(n):
        pass


def test_bench_server_and_client_across_hosts(hosts, tmp_path):
    """`gpucx bench --server HOST` on one host, `--client` from the other."""
    a, b = hosts
    cli = [sys.executable, "-m", "gpucx.cli", "bench"]
    srv, port = hostlib.start_bench_server(a)
    server = srv.proc
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


# -- a host that vanishes (issue 35) -----------------------------------------

#: Bytes of each rendezvous tag send in flight when the link is cut: 5 s of
#: a link slowed to 100 Mbit/s.
_IN_FLIGHT = 64 << 20
_OPS = {"tag recv (matched)", "tag send (rendezvous)", "put", "get"}
_OPS |= {"am send (rendezvous)"}


#: UCX before 1.22 has no TCP_USER_TIMEOUT: gpucx can only make the kernel's
#: keepalive sooner there, and a side with data in flight to a lost host
#: waits for the kernel's retransmission limit (docs/reliability.md).
needs_user_timeout = pytest.mark.skipif(
    gpucx.UCX_VERSION < (1, 22),
    reason="UCX before 1.22 has no TCP_USER_TIMEOUT: a lost host is not bounded",
)


def _pending_pair(a, b, env=None, ops=("all", "all")):
    """Start the ``pending`` peers on both hosts (``ops`` of each: "all",
    "send" or "recv"); return them once every operation is posted, with
    what each context tuned."""
    n = str(_IN_FLIGHT)
    pa = a.python(PEERS, "pending", "a", a.address, n, ops[0], env=env)
    pb = b.python(PEERS, "pending", "b", a.address, n, ops[1], env=env)
    _, port = pa.get()
    pb.put(port)
    _both_closed(pa, pb)
    (_, tuned), (_, tuned_b) = pa.get(), pb.get()
    assert tuned == tuned_b
    return pa, pb, tuned


def _both_closed(pa, pb) -> None:
    """Let each side count its descriptors once both closed a connection."""
    assert pa.get() == pb.get() == ["closed"]
    pa.put("count")
    pb.put("count")


def _all_failed_within(ended, deadline: float, who: str, ops: str = "all") -> dict:
    """Every pending operation (of ``ops``, see :func:`_pending_pair`) ended
    with PeerError within ``deadline`` s; return {operation: seconds}."""
    _, outcome, later, later_s = ended
    expected = {"send": {"tag send (rendezvous)"}, "recv": {"tag recv (matched)"}}
    assert set(outcome) == expected.get(ops, _OPS), outcome
    for op, (names, seconds) in outcome.items():
        assert "PeerError" in names, (who, op, names)
        assert seconds <= deadline, (who, op, seconds, outcome)
    # The endpoint stays failed: a later operation fails at once.
    assert later[0] == "PeerError" and later_s < 1.0, (who, later, later_s)
    return {op: round(s, 2) for op, (_, s) in outcome.items()}


@needs_user_timeout
@pytest.mark.timeout(45)
def test_link_down_mid_transfer_fails_everything_pending_on_both_sides(hosts):
    """The link goes down while both sides have a rendezvous send, its
    matched receive, a put, a get and a rendezvous AM in flight: every one
    of them, on both sides, ends with PeerError within the default
    GPUCX_PEER_TIMEOUT (10 s), with no process exiting; once the link is
    back both sides connect again, and neither keeps a file descriptor of
    the lost connection."""
    a, b = hosts
    hostlib.slow_link(hosts)
    pa, pb, tuned = _pending_pair(a, b)
    assert tuned["TCP_USER_TIMEOUT"] == "6000ms", tuned
    assert tuned["KEEPALIVE_INTERVAL"] == "2000ms", tuned
    time.sleep(0.5)  # the payloads are moving
    cut = time.monotonic()
    hostlib.cut_link(hosts, "down")
    pa.put(["cut", cut])
    pb.put(["cut", cut])
    times = {
        "a": _all_failed_within(pa.get(20), 10.0, "a"),
        "b": _all_failed_within(pb.get(20), 10.0, "b"),
    }
    assert pa.proc.poll() is None and pb.proc.poll() is None
    hostlib.mend_link(hosts)
    pa.put("again")
    pb.put("again")
    _both_closed(pa, pb)
    for peer in (pa, pb):
        _, baseline, now = peer.get()
        assert now == baseline, (peer.label, baseline, now, times)
        peer.put(None)
        peer.join(10)


@needs_user_timeout
@pytest.mark.timeout(30)
def test_peer_timeout_option_sets_the_deadline(hosts):
    """GPUCX_PEER_TIMEOUT=3 (environment): the network between the hosts
    drops everything while b sends to a; b's send and a's receive, on a
    side that sends nothing but keepalives, fail within 3 s (the default
    takes 6-8 s)."""
    a, b = hosts
    hostlib.slow_link(hosts)
    env = {"GPUCX_PEER_TIMEOUT": "3"}
    pa, pb, tuned = _pending_pair(a, b, env=env, ops=("recv", "send"))
    assert tuned["TCP_USER_TIMEOUT"] == "1800ms", tuned
    time.sleep(0.5)
    cut = time.monotonic()
    hostlib.cut_link(hosts, "drop")
    pa.put(["cut", cut])
    pb.put(["cut", cut])
    _all_failed_within(pa.get(20), 3.0, "a", "recv")
    _all_failed_within(pb.get(20), 3.0, "b", "send")
    for peer in (pa, pb):
        peer.put(None)
        peer.join(10)


@needs_user_timeout
@pytest.mark.timeout(40)
def test_frozen_peer_fails_the_pending_operations_of_a_sender(hosts):
    """The peer on host b is frozen (SIGSTOP) mid-transfer: its kernel still
    answers TCP, but it takes no more data, so the receive window it
    advertises to a stays shut.  Everything pending on a's endpoint ends
    with PeerError within 10 s.  Once b runs again, everything pending on
    its side ends with PeerError too, at once."""
    a, b = hosts
    hostlib.slow_link(hosts)
    pa, pb, _ = _pending_pair(a, b)
    time.sleep(0.5)
    frozen = time.monotonic()
    pb.freeze()
    pa.put(["cut", frozen])
    _all_failed_within(pa.get(20), 10.0, "a")
    thawed = time.monotonic()
    pb.thaw()
    pb.put(["cut", thawed])
    _all_failed_within(pb.get(20), 2.0, "b")
    for peer in (pa, pb):
        peer.put(None)
        peer.join(10)


@pytest.mark.timeout(30)
def test_frozen_peer_that_is_sent_nothing_is_detected_by_the_heartbeat(hosts):
    """A rendezvous send waits for a frozen peer to fetch it, with no data
    in flight: the peer's kernel acknowledges the request and every
    keepalive, so TCP and UCX see nothing.  gpucx's heartbeat does: the
    peer answered a ping before it froze, then nothing for
    GPUCX_PEER_TIMEOUT (2 s), and the send fails with PeerError within
    about that.  Once the peer runs again, its receive of that send fails
    at once (the abort notice, or the closed connection)."""
    a, b = hosts
    env = {"GPUCX_PEER_TIMEOUT": "2"}
    pa = a.python(PEERS, "unanswered", "a", a.address, "6", env=env)
    pb = b.python(PEERS, "unanswered", "b", a.address, "0", env=env)
    _, port = pa.get()
    pb.put(port)
    assert pb.get() == ["connected"]
    assert pa.get()[0] == "posted"
    pb.freeze()
    frozen = time.monotonic()
    pa.put(["watch", frozen])
    _, done, outcome = pa.get(20)
    assert done, outcome
    names, seconds = outcome
    assert "PeerError" in names and "did not answer for 2 s" in names[-1], names
    assert seconds <= 2.0 + 1.0, seconds
    pb.thaw()
    pb.put("receive")
    _, (names, seconds) = pb.get(20)
    assert "PeerError" in names and seconds < 2.0, (names, seconds)
    pb.put(None)
    pa.put(None)
    pb.join(10)
    pa.join(10)
