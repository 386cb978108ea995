"""The UCX options gpucx sets for the GPU paths (``gpucx.config.TUNED``).

Each is set only where this UCX knows it and nobody chose it; none may change
a host-to-host protocol.  Their effect on GPU memory is measured on a GPU
(benchmarks/RESULTS.md, "GPU paths at the machine's speed").
"""

from __future__ import annotations

import numpy as np
import pytest

import gpucx
from gpucx import config as _config
from gpucx.info import collect, format_info

from conftest import Pair
from test_rma import background

pytestmark = pytest.mark.timeout(60)


def _known(name: str) -> bool:
    """Whether this UCX takes ``name`` as a context option."""
    try:
        gpucx.Context(config={name: _config.TUNED[name][0]}).close()
    except ValueError:
        return False
    return True


def test_tuned_options_are_set_where_this_ucx_knows_them(monkeypatch):
    for name in _config.TUNED:
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    with gpucx.Context() as ctx:
        for name, (value, why) in _config.TUNED.items():
            assert why
            if _known(name):
                assert ctx.tuned[name] == value, name
            else:
                assert name not in ctx.tuned, name
            # What the user asked for stays apart from what gpucx tuned.
            assert name not in ctx.config
        has_cuda = "CUDA" in ctx.memory_types
    # RNDV_PIPELINE_ERROR_HANDLING exists in every UCX gpucx supports.
    assert ctx.tuned["RNDV_PIPELINE_ERROR_HANDLING"] == "y"
    if gpucx.UCX_VERSION >= (1, 22):
        assert ctx.tuned["RMA_PPLN_ENABLE"] == "y"
    if not has_cuda:
        # No cuda_ipc transport loaded: its option does not exist here.
        assert "CUDA_IPC_ENABLE_GET_ZCOPY" not in ctx.tuned


def test_users_choice_wins_over_tuned(monkeypatch):
    monkeypatch.delenv("UCX_RMA_PPLN_ENABLE", raising=False)
    with gpucx.Context(config={"RNDV_PIPELINE_ERROR_HANDLING": False}) as ctx:
        assert "RNDV_PIPELINE_ERROR_HANDLING" not in ctx.tuned
        assert ctx.config["RNDV_PIPELINE_ERROR_HANDLING"] == "n"
    monkeypatch.setenv("UCX_RNDV_PIPELINE_ERROR_HANDLING", "n")
    with gpucx.Context() as ctx:
        assert "RNDV_PIPELINE_ERROR_HANDLING" not in ctx.tuned
        assert "RNDV_PIPELINE_ERROR_HANDLING" not in ctx.config


def test_an_option_this_ucx_lacks_is_skipped_not_an_error(monkeypatch):
    """A tuned option UCX rejects is left out; the same name given by the
    user is still an error naming it."""
    monkeypatch.setitem(_config.TUNED, "NO_SUCH_OPTION_X", ("y", "test"))
    with gpucx.Context() as ctx:
        assert "NO_SUCH_OPTION_X" not in ctx.tuned
    with pytest.raises(ValueError, match="NO_SUCH_OPTION_X"):
        gpucx.Context(config={"NO_SUCH_OPTION_X": "y"})


def test_host_transfers_unchanged_under_tuned_options(tls, ctx):
    """Tag, AM, put and get of host memory move the right bytes with the
    tuned options on, over each transport family (they select no
    host-to-host protocol: the tables UCX_PROTO_INFO prints for host memory
    are the same with them on and off)."""
    assert ctx.tuned
    pair = Pair(ctx)
    src = np.arange(1 << 18, dtype=np.uint32)  # 1 MiB: rendezvous
    out = np.zeros_like(src)
    pair.drive(pair.b.recv_nb(out, tag=3), pair.ab.send_nb(src, tag=3))
    assert np.array_equal(out, src)
    got = []
    pair.b.set_am_handler(9, lambda m: got.append(m.receive_into(out)))
    pair.drive(pair.ab.am_send_nb(9, src[::-1].copy(), proto="rndv"))
    pair.drive(*got)
    assert np.array_equal(out, src[::-1])
    region = ctx.register(out)
    key = pair.ab.unpack(region.remote())
    pair.drive(pair.ab.put_nb(src, key))
    with background(pair.b):
        pair.ab.flush(timeout=10)
    assert np.array_equal(out, src)
    back = np.zeros_like(src)
    pair.drive(pair.ab.get_nb(back, key))
    assert np.array_equal(back, src)
    key.close()
    region.close()


def test_info_reports_each_tuned_option():
    info = collect()
    rows = {r["option"]: r for r in info["tuned"]}
    assert set(rows) == set(_config.TUNED)
    assert rows["RNDV_PIPELINE_ERROR_HANDLING"]["applied"] in (True, False)
    text = format_info(info)
    assert "UCX settings gpucx applies" in text
    for name, row in rows.items():
        assert f"{name}={row['value']}: {row['state']}" in text
