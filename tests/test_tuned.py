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


# -- GPUCX_PEER_TIMEOUT: UCX's keepalive and TCP timeouts (docs/reliability.md,
# "Peers on other hosts"; measured across two emulated hosts in test_hosts.py)

_PEER_NAMES = (
    "TCP_USER_TIMEOUT",
    "TCP_KEEPIDLE",
    "KEEPALIVE_INTERVAL",
    "KEEPALIVE_NUM_EPS",
    "TCP_KEEPINTVL",
    "TCP_KEEPCNT",
)


@pytest.fixture
def no_peer_env(monkeypatch):
    """No UCX_* choice of the peer timeout options, no GPUCX_PEER_TIMEOUT."""
    for name in _PEER_NAMES:
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    monkeypatch.delenv("GPUCX_PEER_TIMEOUT", raising=False)
    return monkeypatch


def _peer_tuned(ctx) -> dict:
    return {k: v for k, v in ctx.tuned.items() if k in _PEER_NAMES}


def test_peer_timeout_default_maps_onto_ucx_options(no_peer_env):
    with gpucx.Context() as ctx:
        assert ctx.peer_timeout == 10.0
        tuned = _peer_tuned(ctx)
        for name in tuned:
            assert name not in ctx.config  # what gpucx tuned stays apart
    if gpucx.UCX_VERSION >= (1, 22):
        assert tuned == {
            "TCP_USER_TIMEOUT": "6000ms",
            "TCP_KEEPIDLE": "inf",
            "KEEPALIVE_INTERVAL": "2000ms",
            "KEEPALIVE_NUM_EPS": "inf",
        }
    else:
        assert tuned == {
            "TCP_KEEPIDLE": "4s",
            "TCP_KEEPINTVL": "1s",
            "TCP_KEEPCNT": "3",
        }


def test_peer_timeout_from_environment_and_config(no_peer_env):
    no_peer_env.setenv("GPUCX_PEER_TIMEOUT", "3")
    with gpucx.Context() as ctx:
        assert ctx.peer_timeout == 3.0
        if gpucx.UCX_VERSION >= (1, 22):
            assert ctx.tuned["TCP_USER_TIMEOUT"] == "1800ms"
            assert ctx.tuned["KEEPALIVE_INTERVAL"] == "600ms"
    with gpucx.Context(config={"GPUCX_PEER_TIMEOUT": 20}) as ctx:  # config wins
        assert ctx.peer_timeout == 20.0
        if gpucx.UCX_VERSION >= (1, 22):
            assert ctx.tuned["TCP_USER_TIMEOUT"] == "12000ms"
    with gpucx.Context(config={"GPUCX_PEER_TIMEOUT": 0}) as ctx:
        assert _peer_tuned(ctx) == {}  # 0: UCX's own timeouts


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_bad_peer_timeout_names_the_option(no_peer_env, value):
    no_peer_env.setenv("GPUCX_PEER_TIMEOUT", value)
    with pytest.raises(ValueError, match="environment variable GPUCX_PEER_TIMEOUT"):
        gpucx.Context()
    no_peer_env.delenv("GPUCX_PEER_TIMEOUT")
    with pytest.raises(ValueError, match="gpucx option 'GPUCX_PEER_TIMEOUT'"):
        gpucx.Context(config={"GPUCX_PEER_TIMEOUT": value})


def test_users_choice_wins_over_peer_timeout(no_peer_env):
    with gpucx.Context(config={"TCP_KEEPIDLE": "5s"}) as ctx:
        assert "TCP_KEEPIDLE" not in ctx.tuned
        assert ctx.config["TCP_KEEPIDLE"] == "5s"
    if gpucx.UCX_VERSION < (1, 22):
        return
    no_peer_env.setenv("UCX_TCP_USER_TIMEOUT", "30s")
    with gpucx.Context() as ctx:
        # The user's TCP timeout, with the rest of the set built on it.
        assert "TCP_USER_TIMEOUT" not in ctx.tuned
        assert ctx.tuned["KEEPALIVE_INTERVAL"] == "2000ms"


def test_ucx_without_user_timeout_gets_the_kernel_keepalive(no_peer_env):
    """Where UCX has no TCP_USER_TIMEOUT (before 1.22), gpucx sets the
    kernel's keepalive sooner and leaves UCX's keepalive interval alone."""
    no_peer_env.setattr(_config, "USER_TIMEOUT", "NO_SUCH_TCP_USER_TIMEOUT")
    with gpucx.Context() as ctx:
        assert _peer_tuned(ctx) == {
            "TCP_KEEPIDLE": "4s",
            "TCP_KEEPINTVL": "1s",
            "TCP_KEEPCNT": "3",
        }
        assert "NO_SUCH_TCP_USER_TIMEOUT" not in ctx.tuned


def test_peer_timeout_options_fit_inside_the_deadline():
    """The worst case of each set: a keepalive message at most one interval
    after the peer is lost, then the TCP timeout; or the kernel's probes
    (whole seconds)."""
    for seconds in (1, 2.5, 3, 10, 60, 600):
        opts = _config.peer_timeout_options(seconds)
        interval = float(opts["KEEPALIVE_INTERVAL"][0][:-2]) / 1000
        user = float(opts["TCP_USER_TIMEOUT"][0][:-2]) / 1000
        assert interval + user <= 0.8 * seconds + 1e-9, seconds
        old = _config.peer_timeout_options(seconds, user_timeout=False)
        idle, intvl = (float(old[k][0][:-1]) for k in ("TCP_KEEPIDLE", "TCP_KEEPINTVL"))
        total = idle + int(old["TCP_KEEPCNT"][0]) * intvl
        assert total <= max(0.75 * seconds, 2), seconds
    assert _config.peer_timeout_options(0) == {}


def test_info_reports_the_peer_timeout_options(no_peer_env):
    info = collect()
    peer = info["peer_timeout"]
    assert peer["seconds"] == 10.0
    rows = {r["option"]: r for r in peer["options"]}
    user_timeout = gpucx.UCX_VERSION >= (1, 22)
    assert set(rows) == set(_config.peer_timeout_options(10, user_timeout))
    assert all(r["applied"] and r["state"] == "set by gpucx" for r in rows.values())
    text = format_info(info)
    assert "UCX settings for GPUCX_PEER_TIMEOUT=10 s" in text
    for name, row in rows.items():
        assert f"{name}={row['value']}: set by gpucx" in text
    no_peer_env.setenv("GPUCX_PEER_TIMEOUT", "0")
    info = collect()
    assert info["peer_timeout"]["options"] == []
    assert "GPUCX_PEER_TIMEOUT=0: UCX's own timeouts" in format_info(info)
