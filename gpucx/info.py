"""``gpucx info``: what UCX gpucx runs on, and what it can move here.

Transports and devices come from the ``ucx_info -d`` of the same UCX (run
with that UCX's libraries); memory types from a :class:`~gpucx.Context`.
It sits beside the CLI, not under ``gpucx.bench`` (it measures nothing);
``gpucx.bench.info`` stays an alias of this module.
"""

from __future__ import annotations

import ctypes
import subprocess

import gpucx

__all__ = ["collect", "format_info", "parse_ucx_info", "sockaddr_note"]


def parse_ucx_info(text: str) -> list[dict]:
    """Memory domains of ``ucx_info -d`` output: component, memory types and
    ``(transport, device)`` pairs."""
    domains: list[dict] = []
    cur: dict | None = None
    transport = None
    for raw in text.splitlines():
        line = raw.strip().lstrip("#").strip()
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "Memory domain":
            cur = {
                "domain": value,
                "component": value,
                "memory_types": [],
                "transports": [],
            }
            domains.append(cur)
            transport = None
        elif cur is None:
            continue
        elif key == "Component":
            cur["component"] = value
        elif key == "memory types":
            cur["memory_types"] = [
                m.split("(")[0].strip() for m in value.split("),") if m.strip()
            ]
        elif key == "Transport":
            transport = value
        elif key == "Device" and transport is not None:
            cur["transports"].append([transport, value])
    return domains


def sockaddr_note(ucx_version: str) -> str:
    """What a ``(host, port)`` peer must run: the same UCX minor version."""
    minor = ".".join(ucx_version.split(".")[:2])
    return (
        f"(host, port) connections (worker.listen / connect) need the peer on "
        f"UCX {minor}.x too: UCX's client/server wireup does not cross UCX "
        "minor versions"
    )


def _cuda_driver() -> str | None:
    """The CUDA driver version if libcuda loads and reports one, else None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    try:
        if cuda.cuInit(0) != 0 or cuda.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except AttributeError:
        return None
    return f"{v.value // 1000}.{v.value % 1000 // 10}"


def collect() -> dict:
    """Everything ``gpucx info`` prints, as a dict."""
    from .bench.errors import BenchSetupError
    from .bench.perftest import ucx_dirs, ucx_tool

    bindir, libdir = ucx_dirs()
    domains: list[dict] = []
    error = None
    try:
        path, env = ucx_tool("ucx_info")
        out = subprocess.run(
            [path, "-d"], env=env, capture_output=True, text=True, timeout=60
        )
        domains = parse_ucx_info(out.stdout)
    except (BenchSetupError, OSError, subprocess.TimeoutExpired) as exc:
        error = str(exc)
    with gpucx.Context() as ctx:
        options = ctx.options
        memory_types = sorted(m.name for m in ctx.memory_types)
        problem = ctx.cuda_problem
        tuned = dict(ctx.tuned)
        peer_timeout = ctx.peer_timeout
    transports = sorted({t for d in domains for t, _ in d["transports"]})
    cuda_tls = [t for t in transports if t.startswith(("cuda", "gdr"))]
    driver = _cuda_driver()
    return {
        "gpucx_version": gpucx.__version__,
        "ucx_version": ".".join(map(str, gpucx.UCX_VERSION)),
        "ucx_library_dir": libdir,
        "ucx_bin_dir": bindir,
        "memory_types": memory_types,
        "domains": domains,
        "transports": transports,
        "cuda": {
            "driver": driver,
            "transports": cuda_tls,
            "can_move_cuda_memory": bool(
                driver and cuda_tls and "CUDA" in memory_types and problem is None
            ),
            "problem": problem,
        },
        "ucx_info_error": error,
        "tuned": _tuned(tuned),
        "peer_timeout": {
            "seconds": peer_timeout,
            "options": _peer_timeout(tuned, peer_timeout),
            "heartbeat": _heartbeat(peer_timeout),
        },
        "options": _options(options),
    }


def _options(values: dict) -> list[dict]:
    """gpucx's own options as a default context takes them: each with its
    value and whether it is the default (else the environment set it)."""
    from .config import GPUCX_OPTIONS, GPUCX_PREFIX, ON_TIMEOUT_MODES

    rows = []
    for name, number in GPUCX_OPTIONS.items():
        value = values[name]
        default: float | str = number
        if name == "ON_TIMEOUT":
            default = ON_TIMEOUT_MODES[int(number)]
        elif float(value).is_integer():
            value = int(value)
        rows.append(
            {
                "option": GPUCX_PREFIX + name,
                "value": value,
                "state": "default" if value == default else "set by the environment",
            }
        )
    return rows


def _heartbeat(seconds: float) -> str:
    """What gpucx's own heartbeat does at ``GPUCX_PEER_TIMEOUT`` ``seconds``
    (gpucx/_heartbeat.py)."""
    if seconds <= 0:
        return "off"
    return (
        f"a gpucx peer that operations wait on is pinged every {0.2 * seconds:g} s "
        f"of silence and fails them after {seconds:g} s without an answer"
    )


def _tuned(applied: dict[str, str]) -> list[dict]:
    """Each GPU path option of ``config.TUNED``: its value, whether gpucx
    set it here, and why (or why not)."""
    from .config import TUNED

    return _rows(TUNED, applied)


def _peer_timeout(applied: dict[str, str], seconds: float) -> list[dict]:
    """Each UCX option of ``GPUCX_PEER_TIMEOUT`` (``seconds``), as
    :func:`_tuned` has them: the set of a UCX with ``TCP_USER_TIMEOUT``
    (1.22 and later), the kernel keepalive set before
    (``config.peer_timeout_options``)."""
    from .config import USER_TIMEOUT, peer_timeout_options

    user_timeout = USER_TIMEOUT in applied or gpucx.UCX_VERSION >= (1, 22)
    return _rows(peer_timeout_options(seconds, user_timeout), applied)


def _rows(table: dict[str, tuple[str, str]], applied: dict[str, str]) -> list[dict]:
    """One row per option of ``table``: value, whether gpucx set it (it is
    in ``applied``), its state in words and why."""
    import os

    rows = []
    for name, (value, why) in table.items():
        env = os.environ.get(f"UCX_{name}")
        if name in applied:
            state = "set by gpucx"
        elif env is not None:
            state = f"UCX_{name}={env} in the environment"
        else:
            state = (
                "not set: no such option in this UCX (too old, or the "
                "transport did not load)"
            )
        rows.append(
            {
                "option": name,
                "value": value,
                "applied": name in applied,
                "state": state,
                "why": why,
            }
        )
    return rows


def format_info(info: dict) -> str:
    """The text ``gpucx info`` prints."""
    lines = [
        f"gpucx        {info['gpucx_version']}",
        f"UCX          {info['ucx_version']} ({info['ucx_library_dir']})",
        f"  note: {sockaddr_note(info['ucx_version'])}",
        f"memory types {', '.join(info['memory_types']) or '-'}",
    ]
    cuda = info["cuda"]
    if cuda["can_move_cuda_memory"]:
        lines.append(
            f"CUDA         yes: driver {cuda['driver']}, transports "
            f"{', '.join(cuda['transports'])}"
        )
    else:
        why = []
        if not cuda["driver"]:
            why.append("no CUDA driver")
        if not cuda["transports"]:
            why.append("no CUDA transports loaded")
        if "CUDA" not in info["memory_types"]:
            why.append("UCX context has no CUDA memory type")
        lines.append(f"CUDA         no ({'; '.join(why)})")
        if cuda.get("problem"):
            lines.append(f"  why: {cuda['problem']}")
    if info.get("tuned"):
        lines.append(
            'UCX settings gpucx applies (docs/gpu.md, "Settings gpucx applies")'
        )
        for t in info["tuned"]:
            lines.append(f"  {t['option']}={t['value']}: {t['state']}")
            lines.append(f"    {t['why']}")
    peer = info.get("peer_timeout")
    if peer is not None:
        seconds = f"{peer['seconds']:g}"
        where = 'docs/reliability.md, "Peers on other hosts"'
        if not peer["options"]:
            lines.append(f"GPUCX_PEER_TIMEOUT=0: UCX's own timeouts ({where})")
        else:
            lines.append(f"UCX settings for GPUCX_PEER_TIMEOUT={seconds} s ({where})")
        for t in peer["options"]:
            lines.append(f"  {t['option']}={t['value']}: {t['state']}")
            lines.append(f"    {t['why']}")
        if "heartbeat" in peer:
            lines.append(f"  heartbeat: {peer['heartbeat']}")
    if info.get("options"):
        lines.append('gpucx options (docs/guide.md, "gpucx\'s options")')
        for t in info["options"]:
            lines.append(f"  {t['option']}={t['value']}: {t['state']}")
    lines.append("transports   (transport/device, memory domain)")
    for d in info["domains"]:
        for t, dev in d["transports"]:
            mts = ",".join(d["memory_types"]) or "-"
            lines.append(f"  {t + '/' + dev:<24} {d['domain']} (memory: {mts})")
    if info.get("ucx_info_error"):
        lines.append(f"  (ucx_info failed: {info['ucx_info_error']})")
    return "\n".join(lines)
