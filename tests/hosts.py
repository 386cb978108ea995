"""Emulated "hosts" on one machine: network namespaces joined through another.

Each host is a network namespace of its own (``ip netns add``) holding one
end of a veth pair, with an address on a private /24 that exists only on
the hosts' interfaces (no route leads anywhere else, and the root namespace
never sees any of them); :func:`make_hosts` makes two by default, or more.
The other ends sit in one more namespace, the wire, enslaved to a bridge:
what the wire does to frames (slows them, drops them: :func:`slow_link`,
:func:`cut_link`) happens beyond each host's kernel, as in a network, so a
host's TCP sees loss and not a local error.  A process starts on a host
through ``ip netns exec NS unshare --uts --mount --ipc`` with a fresh tmpfs
on ``/dev/shm``, a hostname of its own and a boot id of its own (a file
bound over ``/proc/sys/kernel/random/boot_id``), so UCX finds no shared
memory (no POSIX or System V segments, no common hostname or system id)
between two hosts and reaches the other one by TCP only, and gpucx, which
tells a process of this host by its boot id (``gpucx._address.is_local``),
sees a process of another host.

:func:`make_hosts` is a context manager that always tears down: every
process it started is killed (process group and anything else left in the
namespaces), then the namespaces are deleted, which removes the veth pairs
and the bridge.  Names carry the pid of the test run (``gpucx-h<pid>-a``,
``-b``, ... and ``-w``), so parallel runs do not clash, and namespaces of
this prefix left by a run whose process is gone are removed at the next
start.

:class:`Peer` talks to a child over its stdin/stdout, one JSON value a line
(bytes as ``{"b": hex}``), with a timeout on every read: a multiprocessing
queue does not cross namespaces, a pipe does.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

PREFIX = "gpucx-h"
SUBNET = "10.231.0"
#: Host letters: "a" is 10.231.0.1, "b" .2, and so on ("w" is the wire).
LETTERS = "abcdefgh"
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class HostsUnavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made on this machine, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {p.stderr.strip()}")
    return p


def _ns_pids(ns: str) -> list[int]:
    p = _run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_ns(ns: str) -> None:
    """Kill every process in ``ns`` and delete it (removing its veth end)."""
    for _ in range(50):
        pids = _ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _run("ip", "netns", "delete", ns, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_up(links: list[tuple[str, str]], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    for ns, ifname in links:
        while True:
            out = _run("ip", "-n", ns, "-o", "link", "show", "dev", ifname).stdout
            if "LOWER_UP" in out and "state UP" in out:
                break
            if time.monotonic() > end:
                raise HostsUnavailable(
                    f"{ifname} in {ns} not up after {timeout} s: {out}"
                )
            time.sleep(0.01)


def clean_stale() -> None:
    """Remove namespaces of this prefix, and folders of boot ids, whose test
    run is gone."""
    p = _run("ip", "netns", "list", check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-[a-z]", name)
        if m and not _alive(int(m.group(1))):
            _kill_ns(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-boot-*"):
        m = re.match(rf"{PREFIX}(\d+)-boot-", folder.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)


class Peer:
    """A child process on a host, spoken to one JSON line at a time."""

    def __init__(self, proc: subprocess.Popen, label: str):
        self.proc = proc
        self.label = label
        self._lines: queue.Queue = queue.Queue()
        self._err: list[str] = []
        threading.Thread(
            target=self._read, args=(proc.stdout, True), daemon=True
        ).start()
        threading.Thread(
            target=self._read, args=(proc.stderr, False), daemon=True
        ).start()

    def _read(self, stream, out: bool) -> None:
        for line in stream:
            (self._lines.put if out else self._err.append)(line)
        if out:
            self._lines.put(None)

    @property
    def stderr(self) -> str:
        return "".join(self._err[-40:])

    def put(self, obj) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(encode(obj)) + "\n")
        self.proc.stdin.flush()

    def get(self, timeout: float = 30.0):
        """The next value the child printed; fails after ``timeout`` s or
        when the child exits without printing one."""
        return decode(json.loads(self.readline(timeout)))

    def readline(self, timeout: float = 30.0) -> str:
        """The next line the child printed (as :meth:`get`, not decoded)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.label} said nothing for {timeout} s; stderr:\n{self.stderr}"
            ) from None
        if line is None:
            self.proc.wait(5)
            raise AssertionError(
                f"{self.label} exited ({self.proc.returncode}) without an answer; "
                f"stderr:\n{self.stderr}"
            )
        return line

    def freeze(self) -> None:
        """Stop the child (SIGSTOP to its process group): alive, its kernel
        still answering TCP for it, the process not running."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let a frozen child run again (SIGCONT)."""
        os.killpg(self.proc.pid, signal.SIGCONT)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for a clean exit; fail (the fixture kills it) otherwise."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.label} hung for {timeout} s") from None
        assert rc == 0, f"{self.label} exited with {rc}; stderr:\n{self.stderr}"


def encode(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"b": bytes(obj).hex()}
    if isinstance(obj, (list, tuple)):
        return [encode(x) for x in obj]
    return obj


def decode(obj):
    if isinstance(obj, dict) and set(obj) == {"b"}:
        return bytes.fromhex(obj["b"])
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    return obj


def child_channel():
    """The child's end of a :class:`Peer` (a program started with
    :meth:`Host.python`): keep the original stdout for the protocol and
    point fd 1, where UCX writes its log, at stderr.  Call it before gpucx
    makes a context.  Returns ``(put, get)``: one JSON value a line each
    way (:func:`encode`, :func:`decode`); ``get`` exits the child (status
    3) once the test is gone."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def put(obj) -> None:
        out.write(json.dumps(encode(obj)) + "\n")
        out.flush()

    def get():
        line = sys.stdin.readline()
        if not line:
            sys.exit(3)  # the test is gone
        return decode(json.loads(line))

    return put, get


class Host:
    """One emulated host: a network namespace, its end of a veth pair to the
    wire, and its address."""

    def __init__(
        self,
        ns: str,
        ifname: str,
        address: str,
        hostname: str,
        boot_id_file: str | None = None,
    ):
        self.ns = ns
        self.ifname = ifname
        self.address = address
        self.hostname = hostname
        #: A file holding this host's boot id, bound over the kernel's in
        #: every process started here (None: the machine's own).
        self.boot_id_file = boot_id_file
        #: The wire's namespace and its port towards this host.
        self.wire_ns = ""
        self.wire_if = ""
        self.procs: list[subprocess.Popen] = []

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (own UTS, mount and IPC namespaces, a
        fresh /dev/shm, the host's boot id); the process is killed at
        teardown."""
        boot = (
            f"mount --bind {self.boot_id_file} /proc/sys/kernel/random/boot_id && "
            if self.boot_id_file
            else ""
        )
        script = (
            f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {boot}"
            f'hostname {self.hostname} && exec "$@"'
        )
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        kwargs["env"] = env
        kwargs.setdefault("text", True)
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.ns,
                "unshare",
                "--uts",
                "--mount",
                "--ipc",
                "sh",
                "-c",
                script,
                "sh",
                *argv,
            ],  # fmt: skip
            start_new_session=True,
            **kwargs,
        )
        self.procs.append(proc)
        return proc

    def python(
        self, *args: str, label: str | None = None, env: dict | None = None
    ) -> Peer:
        """A Python child (``python *args``) spoken to through :class:`Peer`;
        ``env`` adds to this process's environment."""
        proc = self.popen(
            [sys.executable, "-u", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=1,
            env=None if env is None else {**os.environ, **env},
        )
        return Peer(proc, label or f"{self.hostname}: {' '.join(args)}")

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.procs.clear()


def _tc(ns: str, *args: str, check: bool = True) -> None:
    _run("ip", "netns", "exec", ns, "tc", "qdisc", *args, check=check)


def slow_link(hosts: list[Host], rate: str = "100mbit") -> None:
    """Limit each direction of the link to ``rate`` (a token bucket on each
    of the wire's ports), so that a large transfer is still in flight when
    the test cuts the link."""
    for h in hosts:
        _tc(h.wire_ns, "replace", "dev", h.wire_if, "root", "tbf", "rate", rate,
            "burst", "64kb", "latency", "100ms")  # fmt: skip


def cut_link(hosts: list[Host], how: str) -> None:
    """Lose everything between the hosts, both ways, without telling them.

    ``"drop"``: the wire drops every frame it would pass on (a queue of
    length 0 on each of its ports), as a network that lost the path does;
    each host's kernel still sends, successfully, into it.  ``"down"``:
    the first host's interface goes down (its routes go with it, so its
    kernel fails every send at once), and the second host sees a host that
    vanished.  Only the TCP timers of the processes can notice either."""
    if how == "down":
        _run("ip", "-n", hosts[0].ns, "link", "set", hosts[0].ifname, "down")
    elif how == "drop":
        for h in hosts:
            _tc(h.wire_ns, "replace", "dev", h.wire_if, "root", "pfifo", "limit", "0")
    else:
        raise ValueError(f"how must be 'down' or 'drop', not {how!r}")


def mend_link(hosts: list[Host]) -> None:
    """Undo :func:`cut_link` and :func:`slow_link`: every interface up, no
    queue discipline of ours left on the wire."""
    for h in hosts:
        _tc(h.wire_ns, "del", "dev", h.wire_if, "root", check=False)
        _run("ip", "-n", h.ns, "link", "set", h.ifname, "up")
    _wait_up([(h.ns, h.ifname) for h in hosts])


def start_bench_server(host: Host) -> tuple[Peer, int]:
    """``gpucx bench --server`` on ``host``, listening on its address:
    ``(peer, port)`` once it said where it listens."""
    proc = host.popen(
        [sys.executable, "-m", "gpucx.cli", "bench", "--server", "--host",
         host.address, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    srv = Peer(proc, f"bench server on {host.hostname}")
    line = srv.readline(60)
    if f"listening on {host.address}:" not in line:
        raise AssertionError(f"bench server: {line!r}; {srv.stderr}")
    return srv, int(line.rsplit(":", 1)[1])


def _boot_id_file(folder: str, name: str) -> str:
    """A file in ``folder`` holding a fresh boot id (as the kernel writes
    one: a random UUID and a newline)."""
    path = os.path.join(folder, name)
    Path(path).write_text(f"{uuid.uuid4()}\n")
    return path


@contextlib.contextmanager
def make_hosts(n: int = 2, default_route: bool = False):
    """Yield ``n`` :class:`Host` objects (a, b, ...; 10.231.0.1, .2, ...)
    joined through the wire (a bridge in a namespace of its own) on a
    private /24, each with a boot id of its own; always tear down.

    ``default_route``: each host also routes every other address to its
    interface, as a host on a network has a default route (what leaves that
    way reaches no one: nothing on the bridge answers for it), so that
    "the address through which the Internet is reached", which Dask gives
    out for a server bound to 0.0.0.0, is the host's own.

    Raises :class:`HostsUnavailable` when the namespaces cannot be made, and
    ``ValueError`` for an ``n`` outside 1-8."""
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"make_hosts: n must be 1-{len(LETTERS)}, not {n}")
    reason = unavailable_reason()
    if reason:
        raise HostsUnavailable(reason)
    clean_stale()
    pid = os.getpid()
    wire = f"{PREFIX}{pid}-w"
    boot_dir = tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-boot-")
    try:
        # Interface names are at most 15 bytes: "gxh" + pid (<= 7 digits) + 1.
        hosts = [
            Host(
                f"{PREFIX}{pid}-{x}",
                f"gxh{pid}{x}",
                f"{SUBNET}.{i + 1}",
                f"gpucx-host-{x}",
                _boot_id_file(boot_dir, x),
            )
            for i, x in enumerate(LETTERS[:n])
        ]
    except BaseException:
        shutil.rmtree(boot_dir, ignore_errors=True)
        raise
    for h in hosts:
        h.wire_ns, h.wire_if = wire, f"gxw{pid}{h.ifname[-1]}"
    bridge = f"gxbr{pid}"
    made: list[str] = []
    try:
        for ns in [h.ns for h in hosts] + [wire]:
            _kill_ns(ns)  # a leftover of this very run (an earlier test)
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", wire, "link", "add", bridge, "type", "bridge")
        _run("ip", "-n", wire, "link", "set", bridge, "up")
        for h in hosts:
            # Both ends are made inside their namespaces: neither ever exists
            # in the machine's own namespace.
            _run(
                "ip", "link", "add", h.ifname, "netns", h.ns,
                "type", "veth", "peer", "name", h.wire_if, "netns", wire,
            )  # fmt: skip
            _run("ip", "-n", wire, "link", "set", h.wire_if, "master", bridge)
            _run("ip", "-n", wire, "link", "set", h.wire_if, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.ifname)
            _run("ip", "-n", h.ns, "link", "set", h.ifname, "up")
            if default_route:
                _run("ip", "-n", h.ns, "route", "add", "default", "dev", h.ifname)
        # A veth end is operationally up (carrier on) a moment after both
        # ends are set up; UCX skips an interface that is not, and each
        # process lists interfaces once, when its context is made.
        _wait_up([(h.ns, h.ifname) for h in hosts])
        yield hosts
    finally:
        for h in hosts:
            h.kill_all()
        for ns in made:
            _kill_ns(ns)
        shutil.rmtree(boot_dir, ignore_errors=True)


@contextlib.contextmanager
def hosts_or_skip(n: int = 2, **kwargs):
    """:func:`make_hosts` (``n``, ``kwargs``) for a pytest fixture: skips the
    test, saying why, where the namespaces cannot be made."""
    import pytest

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"{n} hosts on one machine: {reason}")
    try:
        cm = make_hosts(n, **kwargs)
        made = cm.__enter__()
    except HostsUnavailable as e:
        pytest.skip(f"{n} hosts on one machine: {e}")
    try:
        yield made
    finally:
        cm.__exit__(None, None, None)
