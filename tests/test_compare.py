"""benchmarks/compare.py: gpucx bench against ucx_perftest over rounds."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))

import compare  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SCRIPT = pathlib.Path(compare.__file__)


def _row(test, bw, pbw, lat=None, plat=None):
    return {
        "test": test,
        "bandwidth_gbs": bw,
        "latency_us": lat,
        "perftest": {"bandwidth_gbs": pbw, "latency_us": plat},
    }


def test_top_compares_the_means_of_each_sides_best_rounds():
    # Bimodal rounds: gpucx's two best (10, 8) against perftest's (20, 12).
    rs = [_row("am_bw", 10, 3), _row("am_bw", 2, 20), _row("am_bw", 8, 12)]
    assert compare.top(rs, 2) == pytest.approx(9 / 16)
    assert compare.top(rs, 1) == pytest.approx(compare.best(rs)) == 0.5
    assert compare.top(rs, 10) == pytest.approx(20 / 35)  # every round
    # Latency: the lowest are the best; the ratio is perftest / gpucx.
    lat = [_row("am_lat", 0, 0, 2.0, 1.0), _row("am_lat", 0, 0, 4.0, 3.0)]
    assert compare.top(lat, 1) == pytest.approx(0.5)
    assert compare.top(lat, 2) == pytest.approx(2 / 3)


def test_several_apis_are_measured_in_every_round():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "-t", "am_bw", "-s", "64K", "-n", "300"]
        + ["-m", "ucx", "--api", "python,c", "--rounds", "2", "--top", "2"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| am_bw")]
    assert [r.split("|")[1].strip() for r in rows] == ["am_bw [python]", "am_bw [c]"]
    assert "| top 2 |" in out.stdout
    for r in rows:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert float(cells[5]) > 0 and float(cells[6]) > 0  # both sides' GB/s
        assert len(cells[-1].split(",")) == 2  # a ratio per round
        assert float(cells[-2]) > 0  # top 2


@pytest.mark.parametrize("args", [["--api", "fast"], ["--top", "0"]])
def test_bad_options_are_refused(args):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--api takes c, python and prepared" in out.stderr


# -- benchmarks/ucxx_am.py (run from a venv with ucxx; its perftest half here) ---


def test_ucxx_am_script_reads_perftests_bandwidth():
    # The ucxx half needs ucxx and its own libucx (not this venv's); the
    # perftest half runs on whichever libucx is installed.
    import ucxx_am

    gbs = ucxx_am.perftest_round(1 << 16, 2000)
    assert 0.05 < gbs < 500
    out = subprocess.run(
        [sys.executable, ucxx_am.__file__, "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--window" in out.stdout
