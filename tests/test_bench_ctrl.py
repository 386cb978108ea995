"""``gpucx bench`` control messages from a peer that breaks the protocol.

The bench peers exchange small JSON documents (``gpucx.bench.session``).  A
malformed, truncated, oversized, wrong-typed or incomplete message must end
in a clear error -- ``BadControlMessage`` / ``BenchFailed`` on the client,
an ``{"error": ...}`` answer from the serving side, which keeps serving --
never a hang, a traceback from deep inside or an allocation the message
chose.  The fuzz tests run a sample by default and >= 10,000 cases under
``-m fuzz`` (``tests/fuzzing.py``).
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from hypothesis import strategies as st

import gpucx
from gpucx.bench import runner as _runner
from gpucx.bench.peer import serve
from gpucx.bench.runner import BenchFailed, run_point
from gpucx.bench.session import (
    _CTRL_MAX,
    CTRL_TAG,
    BadControlMessage,
    PeerGone,
    Session,
    parse_ctrl,
    reply_field,
    spawn_local,
)
from gpucx.bench.suites import MAX_ITERS, MAX_WINDOW, TESTS, Params

from conftest import Pair
from fuzzing import fuzzed, run

pytestmark = pytest.mark.timeout(600)

GOOD_PARAMS = Params("tag_lat", 8, 5, 1).to_dict()


# -- parse_ctrl --------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b'{"op": "run"', "not JSON"),  # truncated
        (b'{"op": "quit"} trailing', "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"op": "\xc3"}', "not UTF-8"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'"quit"', "JSON str, not an object"),
        (b"null", "JSON NoneType, not an object"),
        (b"12", "JSON int, not an object"),
        (b"[" * 60000 + b"]" * 60000, "control message of 120000 bytes"),
        (b"[" * 30000 + b"]" * 30000, "nests too deep"),
        (b"{}" + b" " * _CTRL_MAX, f"at most {_CTRL_MAX}"),
        (b'{"a": 1' + b"9" * 20000 + b"}", "not JSON"),  # int digits limit
    ],
)
def test_parse_ctrl_refuses(data, match):
    with pytest.raises(BadControlMessage, match=match):
        parse_ctrl(data)


def test_parse_ctrl_accepts_objects():
    assert parse_ctrl(b'{"op": "quit"}') == {"op": "quit"}
    assert parse_ctrl(memoryview(b' {"ok": true, "x": [1, 2.5]} ')) == {
        "ok": True,
        "x": [1, 2.5],
    }
    assert issubclass(BadControlMessage, PeerGone)


# -- Params.from_dict --------------------------------------------------------------


def _params(**changes):
    d = dict(GOOD_PARAMS)
    for k, v in changes.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    return d


_DROP = object()


@pytest.mark.parametrize(
    "d,match",
    [
        (None, "params must be an object"),
        ([1, 2], "params must be an object"),
        (_params(bogus=1), "unknown field"),
        (_params(size=_DROP), r"missing field\(s\) \['size'\]"),
        (_params(test="nope"), "unknown test 'nope'"),
        (_params(test=["tag_lat"]), "unknown test"),
        (_params(size=-1), "size must be an int in"),
        (_params(size=1 << 40), "size must be an int in"),
        (_params(size="8"), "size must be an int"),
        (_params(size=8.0), "size must be an int"),
        (_params(size=True), "size must be an int"),
        (_params(iters=0), "iters must be an int in"),
        (_params(iters=MAX_ITERS + 1), "iters must be an int in"),
        (_params(warmup=-1), "warmup must be an int in"),
        (_params(window=0), "window must be an int in"),
        (_params(window=MAX_WINDOW + 1), "window must be an int in"),
        (_params(client_mem="nvram"), "bad --memory kind 'nvram'"),
        (_params(server_mem=None), "bad --memory kind None"),
        (_params(use_async="yes"), "use_async must be true or false"),
        (_params(timeout=0), "timeout must be a number"),
        (_params(timeout=float("inf")), "timeout must be a number"),
        (_params(timeout=float("nan")), "timeout must be a number"),
        (_params(timeout="1"), "timeout must be a number"),
        (_params(size="x" * 1000), r"not 'xxx.*\.\.\.$"),  # quoted, cut short
    ],
)
def test_params_from_dict_refuses(d, match):
    with pytest.raises(ValueError, match=match):
        Params.from_dict(d)


def test_params_from_dict_accepts_the_client_s_own():
    for name in TESTS:
        p = Params(name, 64, 10, 2, window=4, use_async=True, timeout=5)
        assert Params.from_dict(p.to_dict()) == p
    assert Params.from_dict(_params(timeout=3)).timeout == 3


# -- replies on the client side ----------------------------------------------------


@pytest.mark.parametrize(
    "reply,exc,match",
    [
        ({}, BadControlMessage, "neither ok nor an error"),
        ({"ok": 1}, BadControlMessage, "neither ok nor an error"),
        ({"ok": "true"}, BadControlMessage, "neither ok nor an error"),
        ({"error": 5}, BadControlMessage, "field 'error' is 5, not a str"),
        ({"error": "peer: no"}, _runner._PeerFailed, "peer: no"),
    ],
)
def test_answers_checked(reply, exc, match):
    with pytest.raises(exc, match=match):
        _runner._answer(reply)
    assert _runner._answer({"ok": True, "x": 1}) == {"ok": True, "x": 1}


def test_reply_field():
    assert reply_field({"a": 3}, "a", int) == 3
    with pytest.raises(BadControlMessage, match="without 'a'"):
        reply_field({}, "a", int)
    with pytest.raises(BadControlMessage, match="'a' is True, not a int"):
        reply_field({"a": True}, "a", int)
    with pytest.raises(BadControlMessage, match="not a str"):
        reply_field({"a": [1]}, "a", str)
    with pytest.raises(BadControlMessage, match="not a int/float"):
        reply_field({"a": "1"}, "a", (int, float))


# -- over UCX, in one process: a server Session fed garbage ------------------------


class ServedPair:
    """A ``serve()`` loop on worker b in a thread; worker a is the client,
    sending raw bytes and reading the answers with a client Session."""

    def __init__(self):
        self.ctx = gpucx.Context()
        pair = Pair(self.ctx)
        self.pair = pair
        self.server = Session(self.ctx, pair.b, pair.ba, role="server", timeout=30)
        self.client = Session(self.ctx, pair.a, pair.ab, role="client", timeout=30)
        self.errors: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            serve(self.server)
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def ask(self, raw: bytes) -> dict:
        self.pair.ab.send(raw, tag=CTRL_TAG)
        return self.client.recv_ctrl(30)

    def close(self):
        try:
            if self.thread.is_alive():
                assert self.ask(b'{"op": "quit"}') == {"ok": True}
            self.thread.join(30)
            assert not self.thread.is_alive(), "serve() did not return"
            assert self.errors == []
        finally:
            self.ctx.close()


@pytest.fixture
def served():
    sp = ServedPair()
    try:
        yield sp
    finally:
        sp.close()


HOSTILE = [
    (b"", "not JSON"),
    (b"\x00" * 16, "not JSON"),
    (b"\xff" * 8, "not UTF-8"),
    (b'{"op": "run", "params": {"test": "tag_lat", "size": 8', "not JSON"),
    (b"[]", "JSON list"),
    (b"[" * 30000 + b"]" * 30000, "nests too deep"),
    (b'{"op": ["run"]}', "unknown control message \\['run'\\]"),
    (b'{"op": "run"}', "params must be an object, not None"),
    (b'{"op": "run", "params": []}', "params must be an object"),
    (b'{"op": "run", "params": {"test": "tag_lat"}}', "missing field"),
    (
        json.dumps({"op": "run", "params": _params(size=1 << 60)}).encode(),
        "size must be an int in",
    ),
    (
        json.dumps({"op": "run", "params": _params(window=1 << 40)}).encode(),
        "window must be an int in",
    ),
    (json.dumps({"op": "x" * 5000}).encode(), "unknown control message 'xxx"),
]


@pytest.mark.parametrize("raw,match", HOSTILE)
def test_server_answers_garbage_and_keeps_serving(served, raw, match):
    reply = served.ask(raw)
    assert set(reply) == {"error"} and reply["error"].startswith("peer: ")
    assert len(reply["error"]) < 400  # quoted values are cut short
    assert re.search(match, reply["error"]), reply
    assert served.ask(b'{"op": "hello"}')["ok"] is True


def test_server_answers_an_oversized_message(served):
    reply = served.ask(b"{" + b" " * (_CTRL_MAX + 100) + b"}")
    assert "peer: control message of" in reply["error"]
    assert f"at most {_CTRL_MAX}" in reply["error"]
    assert served.ask(b'{"op": "hello"}')["ok"] is True


@pytest.mark.parametrize(
    "instead,match",
    [
        (b"\x00not json", "peer: control message is not JSON"),
        (b'{"op": "more"}', "peer: unexpected control message"),
    ],
)
def test_server_answers_garbage_instead_of_fin(served, instead, match):
    # A one-sided point: the server prepares a region, then waits for "fin".
    params = Params("put_lat", 64, 5, 1, timeout=10).to_dict()
    ready = served.ask(json.dumps({"op": "run", "params": params}).encode())
    assert ready["ok"] is True and isinstance(ready["remote"], str)
    reply = served.ask(instead)
    assert re.match(match, reply["error"]), reply
    assert served.ask(b'{"op": "hello"}')["ok"] is True


def _mutations():
    """Valid control messages, then cut, bit-flipped, spliced or replaced."""
    docs = [
        {"op": "hello"},
        {"op": "run", "params": GOOD_PARAMS},
        {"op": "fin"},
        {"ok": True, "remote": "00ff", "address": 4096},
    ]
    valid = st.sampled_from([json.dumps(d).encode() for d in docs])
    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(1 << 70), max_value=1 << 70)
        | st.floats(allow_nan=True)
        | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )
    field_swap = st.builds(
        lambda name, value: json.dumps(
            {"op": "run", "params": {**GOOD_PARAMS, name: value}}
        ).encode(),
        st.sampled_from(sorted(GOOD_PARAMS) + ["extra"]),
        json_values,
    )
    cut = st.builds(lambda b, n: b[: n % max(len(b), 1)], valid, st.integers(0, 999))
    flip = st.builds(
        lambda b, i, bit: (
            b[: i % len(b)] + bytes([b[i % len(b)] ^ (1 << bit)]) + b[i % len(b) + 1 :]
        ),
        valid,
        st.integers(0, 999),
        st.integers(0, 7),
    )
    splice = st.builds(
        lambda b, i, junk: b[: i % len(b)] + junk + b[i % len(b) :],
        valid,
        st.integers(0, 999),
        st.binary(max_size=40),
    )
    top = st.builds(lambda v: json.dumps(v).encode(), json_values)
    return st.one_of(st.binary(max_size=200), cut, flip, splice, field_swap, top)


def _expected(raw: bytes):
    """What the server should do: "error", or None when the message is one
    a test cannot send here (a real run, a quit) and must be skipped."""
    try:
        msg = parse_ctrl(raw)
    except BadControlMessage:
        return "error"
    op = msg.get("op")
    if op == "quit":
        return None
    if op == "hello":
        return "hello"
    if op == "run":
        try:
            Params.from_dict(msg.get("params"))
        except ValueError:
            return "error"
        return None  # a valid point: the server would start measuring
    return "error"


@fuzzed
def test_fuzz_server_control_messages(profile):
    """Mutated control messages over UCX: each answered with an error (or
    hello's ok), never a hang or a crash of the serving loop."""
    sp = ServedPair()
    sent = {"n": 0}

    def body(raw):
        want = _expected(raw)
        if want is None:
            return
        reply = sp.ask(raw)
        if want == "hello":
            assert reply["ok"] is True
        else:
            assert set(reply) == {"error"}, reply
            assert reply["error"].startswith("peer: ") and len(reply["error"]) < 400
        sent["n"] += 1
        assert sp.thread.is_alive()

    try:
        run("bench control messages (server)", profile, _mutations(), body)
        assert sent["n"] > 0
    finally:
        sp.close()


@fuzzed
def test_fuzz_parse_ctrl_and_params(profile):
    """Every mutation is a dict and Params or a ValueError, or a
    BadControlMessage -- no other exception escapes the checks."""

    def body(raw):
        try:
            msg = parse_ctrl(raw)
        except BadControlMessage as exc:
            assert str(exc).startswith("control message")
            return
        assert isinstance(msg, dict)
        try:
            p = Params.from_dict(msg.get("params"))
        except ValueError as exc:
            assert str(exc).startswith("params") and len(str(exc)) < 400
            return
        assert p.test in TESTS and 0 < p.window <= MAX_WINDOW

    run("bench control messages (parsers)", profile, _mutations(), body)


# -- the client side: a peer that answers garbage ----------------------------------


class LyingServer:
    """Worker b answers each control message from worker a with ``replies``
    (raw bytes, in turn), from a thread."""

    def __init__(self, replies):
        self.ctx = gpucx.Context()
        pair = Pair(self.ctx)
        self.pair = pair
        self.client = Session(self.ctx, pair.a, pair.ab, role="client", timeout=10)
        self.replies = list(replies)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self):
        buf = bytearray(_CTRL_MAX)
        while self.replies and not self.stop.is_set():
            req = self.pair.b.recv_nb(buf, tag=CTRL_TAG)
            while not req.done() and not self.stop.is_set():
                self.pair.b.progress()
            if not req.done():
                req.cancel()
                return
            self.pair.ba.send(self.replies.pop(0), tag=CTRL_TAG)

    def close(self):
        self.stop.set()
        self.thread.join(30)
        self.ctx.close()


@pytest.mark.parametrize(
    "reply,match",
    [
        (b"\x00garbage", "tag_lat 8: control message is not JSON"),
        (b"[true]", "is a JSON list"),
        (b"{}", "neither ok nor an error"),
        (b'{"error": {"x": 1}}', "field 'error' is"),
        (b'{"error": "peer: refused"}', "tag_lat 8: peer: refused"),
        (b"{" + b" " * (_CTRL_MAX + 10) + b"}", f"at most {_CTRL_MAX}"),
    ],
)
def test_client_fails_clearly_on_a_bad_reply(reply, match):
    ls = LyingServer([reply])
    try:
        start = time.monotonic()
        with pytest.raises(BenchFailed, match=match):
            run_point(ls.client, Params("tag_lat", 8, 5, 1, timeout=10))
        assert time.monotonic() - start < 9  # failed at once, no timeout
    finally:
        ls.close()


@pytest.mark.parametrize(
    "test,extra,match",
    [
        ("put_lat", {}, "without 'remote'"),
        ("put_lat", {"remote": 5}, "'remote' is 5, not a str"),
        ("put_lat", {"remote": "zz"}, "region token is malformed"),
        ("put_lat", {"remote": "00ff"}, "region token is malformed"),
        ("put_bw", {"remote": "00ff"}, "without 'address'"),
        ("put_bw", {"address": "0x10"}, "'address' is '0x10', not a int"),
        ("get_bw", {"address": -1}, "address -1 is not 64-bit"),
        ("get_bw", {"address": 1 << 64}, "is not 64-bit"),
    ],
)
def test_client_fails_clearly_on_a_bad_rma_reply(test, extra, match):
    ls = LyingServer([json.dumps({"ok": True, **extra}).encode()])
    try:
        with pytest.raises(BenchFailed, match=f"{test} 64: .*{match}"):
            run_point(ls.client, Params(test, 64, 5, 1, timeout=10))
    finally:
        ls.close()


# -- two processes: the real peer process, fed garbage -----------------------------


@pytest.mark.timeout(120)
def test_peer_process_answers_garbage_and_still_measures():
    with spawn_local(None, True, 0, 30.0) as sess:
        for raw, match in HOSTILE + [(b"{" + b" " * (_CTRL_MAX + 1) + b"}", "at most")]:
            sess.ep.send(raw, tag=CTRL_TAG)
            reply = sess.recv_ctrl(30)
            assert "error" in reply, (raw[:40], reply)
            assert re.search(match, reply["error"]), reply
        r = run_point(sess, Params("tag_lat", 8, 5, 1))
        assert r["latency_us"] > 0
        assert sess.call({"op": "quit"}) == {"ok": True}
        sess.finished = True
    assert sess._proc.returncode == 0


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(iters=MAX_ITERS + 1), "--iters must be in"),
        (dict(warmup=MAX_ITERS + 1), "--warmup must be in"),
        (dict(window=MAX_WINDOW + 1), "--window must be in"),
        (dict(timeout=2e6), "--timeout must be in"),
        (dict(timeout=float("nan")), "--timeout must be in"),
    ],
)
def test_client_refuses_what_the_peer_would(opts, match):
    """The client checks the same limits before any process starts."""
    from gpucx.bench.memory import BenchSetupError
    from gpucx.bench.runner import BenchOptions, validate

    with pytest.raises(BenchSetupError, match=match):
        validate(BenchOptions(**opts))
    validate(BenchOptions(iters=MAX_ITERS, warmup=0, window=MAX_WINDOW))
