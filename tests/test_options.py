"""gpucx's own options: a bad value is one clear ValueError naming the
variable, at Context() time (never at import, never a "bad tag")."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gpucx

from conftest import Pair

pytestmark = pytest.mark.timeout(60)

_ENV = ["GPUCX_SPIN_US", "GPUCX_PEER_CHECK_INTERVAL"]


@pytest.mark.parametrize("name", _ENV)
@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", ""])
def test_bad_environment_value_fails_at_context_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"environment variable {name} must be"):
        gpucx.Context()


@pytest.mark.parametrize("name", _ENV)
def test_bad_config_value_fails_at_context_naming_it(name):
    with pytest.raises(ValueError, match=f"gpucx option '{name}' must be"):
        gpucx.Context(config={name: -1})


def test_import_never_fails_on_a_bad_environment():
    env = dict(os.environ, GPUCX_SPIN_US="-5", GPUCX_PEER_CHECK_INTERVAL="x")
    code = (
        "import gpucx\n"
        "try:\n"
        "    gpucx.Context()\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ValueError: environment variable GPUCX_" in out.stdout


def test_spin_from_environment_and_config(monkeypatch):
    monkeypatch.setenv("GPUCX_SPIN_US", "7")
    with gpucx.Context(config={"TLS": "tcp"}) as ctx:
        assert ctx.create_worker()._engine.spin_ns == 7000
    with gpucx.Context(config={"GPUCX_SPIN_US": 0}) as ctx:  # config wins
        p = Pair(ctx)
        assert p.a._engine.spin_ns == 0
        # Blocking calls work without any spinning.
        buf = np.zeros(4, np.uint8)
        r = p.b.recv_nb(buf, tag=3)
        p.ab.send(np.arange(4, dtype=np.uint8), tag=3)
        p.drive(r)
        assert buf.tolist() == [0, 1, 2, 3]
    monkeypatch.setenv("GPUCX_PEER_CHECK_INTERVAL", "0.25")
    with gpucx.Context() as ctx:
        assert ctx.create_worker()._engine.peer_interval == 0.25


def test_payload_already_received_is_one_error_type(pair):
    """A second receive of one message's payload: AlreadyReceivedError,
    for an AM's .data and receive_into and for a probed tag message."""
    assert issubclass(gpucx.AlreadyReceivedError, RuntimeError)
    got = []
    pair.b.set_am_handler(3, got.append)
    pair.drive(pair.ab.am_send_nb(3, b"abcd", proto="eager"))
    while not got:
        pair.b.progress()
    msg = got[0]
    msg.receive_into(bytearray(4)).wait(5)
    with pytest.raises(gpucx.AlreadyReceivedError):
        bytes(msg.data)
    with pytest.raises(gpucx.AlreadyReceivedError):
        msg.receive_into(bytearray(4))
    pair.drive(pair.ab.send_nb(b"xy", tag=5))
    probe = None
    while probe is None:
        pair.a.progress()
        probe = pair.b.probe(tag=5, remove=True)
    pair.drive(probe.recv_nb(bytearray(2)))
    with pytest.raises(gpucx.AlreadyReceivedError):
        probe.recv_nb(bytearray(2))


def test_context_options_say_what_the_context_took(monkeypatch):
    """``ctx.options``: config over environment over defaults, a copy, with
    the timeout mode by name; ``gpucx info`` lists each and says which the
    environment set."""
    from gpucx.config import GPUCX_OPTIONS, GPUCX_PREFIX
    from gpucx.info import collect, format_info

    for name in GPUCX_OPTIONS:
        monkeypatch.delenv(GPUCX_PREFIX + name, raising=False)
    monkeypatch.setenv("GPUCX_STAGING_BYTES", "4096")
    monkeypatch.setenv("GPUCX_SPIN_US", "7")
    with gpucx.Context(config={"GPUCX_SPIN_US": 3, "GPUCX_ON_TIMEOUT": "release"}) as c:
        opts = c.options
        assert set(opts) == set(GPUCX_OPTIONS)
        assert opts["SPIN_US"] == 3  # the config key wins over the environment
        assert opts["STAGING_BYTES"] == 4096
        assert opts["ON_TIMEOUT"] == "release"
        assert opts["PEER_TIMEOUT"] == GPUCX_OPTIONS["PEER_TIMEOUT"]
        opts["SPIN_US"] = 99
        assert c.options["SPIN_US"] == 3  # a copy
    rows = {r["option"]: r for r in collect()["options"]}
    assert set(rows) == {GPUCX_PREFIX + n for n in GPUCX_OPTIONS}
    assert rows["GPUCX_STAGING_BYTES"] == {
        "option": "GPUCX_STAGING_BYTES",
        "value": 4096,
        "state": "set by the environment",
    }
    assert rows["GPUCX_ON_TIMEOUT"]["value"] == "park"
    assert rows["GPUCX_ON_TIMEOUT"]["state"] == "default"
    text = format_info(collect())
    assert "  GPUCX_STAGING_BYTES=4096: set by the environment" in text
    assert "  GPUCX_PEER_TIMEOUT=10: default" in text
