"""distributed-gpucx.* configuration: schema, parsing, UCX options."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("distributed")

import dask.config  # noqa: E402
import jsonschema  # noqa: E402
import yaml  # noqa: E402

from gpucx.dask import _runtime as rt  # noqa: E402

HERE = os.path.join(os.path.dirname(rt.__file__))


def _load(name):
    with open(os.path.join(HERE, name)) as f:
        return yaml.safe_load(f)


def test_defaults_match_the_schema():
    jsonschema.validate(_load("gpucx-dask.yaml"), _load("gpucx-dask-schema.yaml"))


def test_schema_refuses_unknown_keys_and_bad_values():
    schema = _load("gpucx-dask-schema.yaml")
    for bad in (
        {"distributed-gpucx": {"no-such-key": 1}},
        {"distributed-gpucx": {"progress": "spin"}},
        {"distributed-gpucx": {"max-frames": -1}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_defaults_are_registered_with_dask():
    assert any("distributed-gpucx" in d for d in dask.config.defaults)
    s = rt.settings()
    assert s.connect_timeout == 5 and s.close_timeout == 2
    assert s.inline_threshold == 16 * 1024
    assert s.limits.max_frames == 65536
    assert s.limits.max_frame_bytes == 32 << 30


def test_settings_follow_the_config():
    with dask.config.set(
        {
            "distributed-gpucx.connect-timeout": "250ms",
            "distributed-gpucx.inline-threshold": "1 KiB",
            "distributed-gpucx.max-message-size": "1 MiB",
            "distributed-gpucx.max-stranded-bytes": "2 MiB",
        }
    ):
        s = rt.settings()
    assert s.connect_timeout == 0.25
    assert s.inline_threshold == 1024
    assert s.limits.max_total_bytes == 1 << 20
    assert s.max_stranded == 2 << 20
    assert rt.settings().max_stranded == 512 << 20


@pytest.mark.parametrize(
    "key, value",
    [
        ("connect-timeout", "0s"),
        ("inline-threshold", -1),
        ("progress", "spin"),
        ("max-stranded-bytes", -1),
    ],
)
def test_bad_settings_are_refused(key, value):
    with (
        dask.config.set({f"distributed-gpucx.{key}": value}),
        pytest.raises(ValueError),
    ):
        rt.settings()


def test_ucx_options_go_to_the_context_not_the_environment(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    before = dict(os.environ)
    with dask.config.set(
        {
            "distributed-gpucx.tls": ["sm", "tcp"],
            "distributed-gpucx.environment": {"rndv-thresh": 8192, "UCX_Foo": "y"},
            "distributed-gpucx.peer-check-interval": 0.5,
        }
    ):
        cfg = rt.context_config()
    assert cfg["TLS"] == ["sm", "tcp"]
    assert cfg["RNDV_THRESH"] == 8192 and cfg["FOO"] == "y"
    assert cfg["GPUCX_PEER_CHECK_INTERVAL"] == 0.5
    assert dict(os.environ) == before


def test_max_stranded_bytes_is_the_contexts_cap():
    """``max-stranded-bytes`` is what the comm's context refuses same-host
    data endpoints past (``GPUCX_MAX_STRANDED_BYTES``)."""
    assert rt.context_config()["GPUCX_MAX_STRANDED_BYTES"] == 512 << 20
    with dask.config.set({"distributed-gpucx.max-stranded-bytes": "3 MiB"}):
        cfg = rt.context_config()
        assert cfg["GPUCX_MAX_STRANDED_BYTES"] == 3 << 20
        assert rt.context().max_stranded_bytes == 3 << 20


def test_peer_timeout_reaches_the_context(monkeypatch):
    """``peer-timeout`` is the comm context's GPUCX_PEER_TIMEOUT (which maps
    onto UCX's keepalive and TCP options); null leaves gpucx's default."""
    monkeypatch.delenv("GPUCX_PEER_TIMEOUT", raising=False)
    assert "GPUCX_PEER_TIMEOUT" not in rt.context_config()
    with dask.config.set({"distributed-gpucx.peer-timeout": "3s"}):
        cfg = rt.context_config()
        assert cfg["GPUCX_PEER_TIMEOUT"] == 3.0
        import gpucx

        with gpucx.Context(config=cfg) as ctx:
            assert ctx.peer_timeout == 3.0
    with dask.config.set({"distributed-gpucx.peer-timeout": 0}):
        assert rt.context_config()["GPUCX_PEER_TIMEOUT"] == 0.0
    with (
        dask.config.set({"distributed-gpucx.peer-timeout": "-1s"}),
        pytest.raises(ValueError, match="peer-timeout"),
    ):
        rt.context_config()


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    with dask.config.set({"distributed-gpucx.tls": "sm"}):
        assert "TLS" not in rt.context_config()


def test_the_comm_context_has_no_memory_access_features():
    ctx = rt.context()
    assert ctx.features == frozenset({"tag", "am"})


def test_spin_reaches_the_loop_worker():
    import asyncio

    assert rt.settings().spin_us == 200
    with dask.config.set({"distributed-gpucx.spin": "20us"}):
        s = rt.settings()
        assert s.spin_us == 20

        async def main():
            lw = rt.acquire(s)
            try:
                assert lw.aw._drv._spin_ns == 20_000
            finally:
                rt.release(lw)

        asyncio.run(main())
    with (
        dask.config.set({"distributed-gpucx.spin": -0.001}),
        pytest.raises(ValueError),
    ):
        rt.settings()
