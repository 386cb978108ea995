"""``gpucx bench --api``: which path a figure measures, in the table and the
JSON; prepared transfer lists for put_bw/get_bw, AM batches for am_bw.
Figures are checked for presence, never for speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpucx.bench.suites import API_PATHS, Params

pytestmark = pytest.mark.timeout(180)

QUICK = ["-n", "50", "-w", "5", "--no-progress", "--timeout", "60"]


def bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "gpucx.cli", "bench", *args, *QUICK],
        capture_output=True,
        text=True,
        timeout=170,
    )


def _rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = stdout.splitlines()
    head = lines[0].split()
    rows = []
    for line in lines[2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return head, rows


@pytest.mark.parametrize(
    "api,tests",
    [
        ("c", "tag_bw,put_bw"),
        ("python", "tag_lat,get_bw"),
        ("prepared", "put_bw,get_bw"),
        ("prepared", "am_bw,put_bw"),
        ("c", "am_lat,am_bw"),
        ("python", "am_lat,am_bw"),
    ],
)
def test_api_in_table_and_json(api, tests, tmp_path):
    out = tmp_path / "bench.json"
    p = bench("-t", tests, "-s", "8,4K", "--api", api, "--json", str(out))
    assert p.returncode == 0, p.stderr
    head, rows = _rows(p.stdout)
    assert head[-1] == "api"
    assert len(rows) == 4 and {r[-1] for r in rows} == {api}
    assert f"api {api}: {API_PATHS[api]}" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["options"]["api"] == api
    for r in doc["results"]:
        assert r["api"] == api and r["api_path"] == API_PATHS[api]
        assert r["bandwidth_gbs"] is not None and r["bandwidth_gbs"] >= 0


def test_async_is_api_python(tmp_path):
    out = tmp_path / "bench.json"
    p = bench("-t", "tag_lat", "-s", "8", "--async", "--json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["options"]["api"] == "python"
    assert doc["results"][0]["api"] == "python"
    assert doc["results"][0]["mode"] == "async"


def test_prepared_refuses_other_tests():
    p = bench("-t", "tag_lat,put_bw", "--api", "prepared")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "--api prepared measures put_bw, get_bw, am_bw only" in lines[0]
    assert "tag_lat" in lines[0]


def test_params_check_api():
    base = {"test": "put_bw", "size": 8, "iters": 1, "warmup": 0}
    assert Params.from_dict({**base, "api": "prepared"}).api == "prepared"
    with pytest.raises(ValueError, match="api must be one of"):
        Params.from_dict({**base, "api": "fortran"})
