"""benchmarks/bench_dask.py --workloads: the code path at toy sizes (the
figures come from the full run, see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

pytest.importorskip("distributed")

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))

import bench_dask  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def test_workloads_both_schemes_write_json(tmp_path, capsys):
    out = tmp_path / "w.json"
    bench_dask.main(
        [
            "--workloads",
            "--rounds",
            "2",
            "--rechunk-n",
            "256",
            "--rechunk-chunks",
            "4",
            "--pulls",
            "2",
            "--pull-size",
            "64K",
            "--p2p-memory",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert res["rechunk"] == {
        "n": 256,
        "chunks": 4,
        "bytes": 256 * 256 * 8,
        "disk": False,
    }
    assert res["pull"] == {"bytes": 64 << 10, "pulls_per_round": 2}
    assert len(res["rounds"]) == 2
    for row in res["rounds"]:
        assert set(row) == {"tcp", "gpucx"}
        for v in row.values():
            assert v["rechunk_s"] > 0 and v["rechunk_cpu_s"] >= 0
            assert len(v["pull_s"]) == 2 and all(t > 0 for t in v["pull_s"])
            assert len(v["pull_fetch_s"]) == 2
    assert set(res["median"]) == {"tcp", "gpucx"}
    table = capsys.readouterr().out
    assert "| median |" in table and "pull ratio" in table
