"""Output of ``gpucx bench``: the table, the JSON document, the plot."""

from __future__ import annotations

import json
import os
import platform
import socket

import gpucx

from .sizes import format_size

__all__ = ["environment", "format_table", "write_json", "write_plot", "ProgressBar"]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> list[str]:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return [
            cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)
        ]
    except Exception:  # no CuPy, no driver, no device: the report's
        return []  # environment then names no GPU (it describes, never fails)


def environment(transports=None, tls: str | None = None) -> dict:
    """Where the figures were taken: versions, transports, CPU, GPU."""
    from .perftest import ucx_dirs

    return {
        "gpucx_version": gpucx.__version__,
        "ucx_version": ".".join(map(str, gpucx.UCX_VERSION)),
        "ucx_library_dir": ucx_dirs()[1],
        "tls": tls or "default",
        "transports": [list(t) for t in (transports or [])],
        "hostname": socket.gethostname(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpus": _gpu_names(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _protocol_cell(r: dict) -> str:
    """The protocol column: UCX's description and transports, "(slow)"
    where gpucx.protocols rates it a slow path, "-" where UCX did not say."""
    proto = r.get("protocol")
    if not proto:
        return "-"
    return f"{proto} (slow)" if r.get("protocol_slow") else proto


def format_table(results: list[dict], with_perftest: bool = False) -> str:
    """A fixed-width table of the results."""
    head = [
        "test",
        "size",
        "iters",
        "lat med us",
        "lat p99 us",
        "lat avg us",
        "BW GB/s",
        "msg/s",
    ]
    # UCX's protocol of the measured side (gpucx.protocols), as text: after
    # the figures, before the columns read from the right (api, perftest).
    head += ["protocol", "api"]
    proto_col = len(head) - 2
    if with_perftest:
        head += ["perftest lat med us", "perftest GB/s", "gpucx/perftest"]
    with_limit = any(r.get("limit") for r in results)
    if with_limit:
        head += ["limit", "limit GB/s", "of limit"]
    rows = [head]
    for r in results:
        row = [
            r["test"],
            format_size(r["size"]),
            str(r["iters"]),
            _num(r["latency_us"], ".2f"),
            _num(r["latency_p99_us"], ".2f"),
            _num(r["latency_avg_us"], ".2f"),
            _num(r["bandwidth_gbs"], ".3f"),
            _num(r["msg_rate"], ",.0f"),
            _protocol_cell(r),
            r.get("api", "c"),
        ]
        if with_perftest:
            pt = r.get("perftest") or {}
            row += [
                _num(pt.get("latency_us"), ".2f"),
                _num(pt.get("bandwidth_gbs"), ".3f"),
                _num(r.get("ratio"), ".2f")
                if r.get("ratio") is not None
                else pt.get("error", "-")[:40]
                if pt
                else "-",
            ]
        if with_limit:
            row += _limit_cells(r.get("limit"))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 or i == proto_col else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [
        "",
        "Latency (*_lat tests): one-way, half a round trip, like ucx_perftest; "
        "fadd_lat: the whole fetch-and-add; put_lat: half of put + flush.",
        "Bandwidth tests: lat avg = time per message; GB/s = 1e9 bytes/s.",
        "protocol: what UCX selected on the measuring side for the row's size "
        "(gpucx.protocols; (slow): a slow path by its rules; -: UCX did not say).",
    ]
    for api in sorted({r.get("api", "c") for r in results}):
        path = next(r.get("api_path") for r in results if r.get("api", "c") == api)
        if path:
            notes.append(f"api {api}: {path} (--api c|python|prepared).")
    if with_perftest:
        notes.append(
            "gpucx/perftest: bandwidth ratio for *_bw tests, perftest median "
            "latency / gpucx median latency for *_lat tests (1 = same speed, "
            "higher = gpucx faster)."
        )
        if any("host" in r.get("memory", "host").split(":") for r in results):
            notes.append(
                "host memory: gpucx's is NumPy's, ucx_perftest maps its own "
                "through UCX; -m ucx in place of host compares like for like."
            )
    if with_limit:
        notes += _limit_notes(results)
    return "\n".join(lines + notes)


def _limit_cells(limit: dict | None) -> list[str]:
    if not limit:
        return ["-", "-", "-"]
    return [
        limit["kind"],
        _num(limit.get("gbps"), ".3f"),
        _num(limit.get("fraction"), ".3g"),
    ]


def _limit_notes(results: list[dict]) -> list[str]:
    """What the limit columns mean, and why a copy has no figure."""
    notes = [
        "limit: this machine's copy between the row's memory kinds, in its "
        "direction, at its size (cuMemcpyAsync timed with CUDA events, "
        "gpucx.bench.limits); of limit = BW / limit. d2d: device to device; "
        "h2d/d2h_pinned: page-locked host memory (the row's ucx memory); "
        "_pageable: NumPy memory (the row's host memory; the JSON adds the "
        "pinned figure). Latency and host-only rows: none."
    ]
    errors = {
        lim["error"]
        for r in results
        for lim in (r.get("limit") or {}, (r.get("limit") or {}).get("pinned") or {})
        if lim.get("error")
    }
    notes += [f"limit not measured: {e}" for e in sorted(errors)]
    return notes


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


def plot_problem() -> str | None:
    """Why ``--plot`` cannot work here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'gpucx[plot]'"
    return None


def write_plot(path: str, results: list[dict]) -> None:
    """Bandwidth and latency against size, one line per test (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for test in dict.fromkeys(r["test"] for r in results):
        rs = sorted((r for r in results if r["test"] == test), key=lambda r: r["size"])
        sizes = [max(r["size"], 1) for r in rs]
        ax_bw.plot(sizes, [r["bandwidth_gbs"] for r in rs], "o-", label=f"{test}")
        lat = [
            r["latency_us"] if r["latency_us"] is not None else r["latency_avg_us"]
            for r in rs
        ]
        ax_lat.plot(sizes, lat, "o-", label=test)
        pts = [r for r in rs if r.get("perftest") and "bandwidth_gbs" in r["perftest"]]
        if pts:
            ps = [max(r["size"], 1) for r in pts]
            ax_bw.plot(
                ps,
                [r["perftest"]["bandwidth_gbs"] for r in pts],
                "x--",
                label=f"{test} (ucx_perftest)",
            )
            ax_lat.plot(
                ps,
                [r["perftest"]["latency_us"] for r in pts],
                "x--",
                label=f"{test} (ucx_perftest)",
            )
    for ax, ylabel in ((ax_bw, "bandwidth (GB/s)"), (ax_lat, "latency (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ax_bw.set_title("gpucx bench: bandwidth")
    ax_lat.set_title("latency (one-way for *_lat, per message for *_bw)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class ProgressBar:
    """tqdm when it is installed, else a one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool, stream):
        self._n = 0
        self._total = total
        self._stream = stream
        self._enabled = enabled
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(
                    total=total,
                    desc="gpucx bench",
                    unit="pt",
                    file=stream,
                    leave=False,
                    dynamic_ncols=True,
                )
            except ImportError:
                pass

    def update(self, label: str) -> None:
        self._n += 1
        if not self._enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label, refresh=False)
            self._tqdm.update(1)
            return
        done = int(30 * self._n / max(self._total, 1))
        self._stream.write(
            f"\rgpucx bench [{'#' * done}{'.' * (30 - done)}] "
            f"{self._n}/{self._total} {label[:30]:30}"
        )
        self._stream.flush()

    def close(self) -> None:
        if not self._enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            self._stream.write("\r" + " " * 80 + "\r")
            self._stream.flush()
