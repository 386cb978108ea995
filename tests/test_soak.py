"""Leaks and soak: ``benchmarks/soak.py`` in the test suite.

A tiny run in the default suite keeps the script working; ``-m soak`` runs
a tenth of the full counts and holds each phase to the drift targets
(< 1 MiB RSS, no new file descriptor after warm-up).
"""

from __future__ import annotations

import mmap
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))

import soak  # noqa: E402

SCRIPT = pathlib.Path(soak.__file__)


@pytest.mark.timeout(120)
def test_soak_smoke():
    results = soak.run(scale=0.0005)
    assert [r["phase"] for r in results] == list(soak.PHASES)
    for r in results:
        assert r["count"] == max(1, int(soak.COUNTS[r["phase"]] * 0.0005))
        assert r["fd_drift"] == 0, r


@pytest.mark.timeout(120)
def test_soak_script_cli(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--scale", "0.0002", "--phases", "tag,register"]
        + ["--json", str(out), "--check"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert "tag" in done.stdout and "register" in done.stdout
    assert out.read_text().count('"phase"') == 2


def test_soak_script_rejects_unknown_phase():
    with pytest.raises(SystemExit):
        soak.main(["--phases", "tag,nonsense"])


@pytest.mark.soak
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("phase", list(soak.PHASES))
def test_soak(phase):
    (r,) = soak.run(scale=0.1, phases=[phase])
    assert r["fd_drift"] <= soak.FD_LIMIT, r
    assert r["rss_drift"] < soak.RSS_LIMIT, r


def test_soak_measure_sees_leaks():
    """The measurement itself: a phase that keeps 64 KiB and one descriptor
    per step is reported over both targets."""
    kept: list = []

    def leak(i: int) -> None:
        # Fresh pages (not heap that earlier tests freed and RSS still counts).
        page = mmap.mmap(-1, 64 * 1024)
        page.write(b"x" * len(page))
        kept.append(page)
        if i % 50 == 0:
            kept.append(os.open(os.devnull, os.O_RDONLY))

    try:
        r = soak._soak("leak", 100, leak)
    finally:
        for k in kept:
            if isinstance(k, int):
                os.close(k)
    assert r["rss_drift"] >= soak.RSS_LIMIT
    assert r["fd_drift"] == 2
    assert not soak.within_target(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "script, args",
    [
        ("am_instructions.py", []),
        ("am_instructions.py", ["--sends"]),
        ("am_instructions.py", ["--window", "8", "--proto", "eager"]),
        ("tag_instructions.py", []),
    ],
)
def test_instruction_count_workloads_run(script, args):
    """``benchmarks/am_instructions.py`` and ``tag_instructions.py`` (the
    fixed workloads measured under callgrind) keep working: they send,
    receive and check their payload."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / script), "50", *args],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-2000:]
