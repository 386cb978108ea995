"""Active messages between two workers of one process, over each transport."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import gpucx
from gpucx.ops import am as _am

from conftest import Pair, check_transports, pump

pytestmark = pytest.mark.timeout(90)


def collect(worker, am_id):
    got = []
    worker.set_am_handler(am_id, got.append)
    return got


@pytest.mark.parametrize("proto", [None, "eager", "rndv"])
@pytest.mark.parametrize("nbytes", [0, 1, 100, 65536, 1 << 20])
def test_am_sizes_and_protocols(pair, tls, proto, nbytes):
    if proto == "rndv" and nbytes == 0:
        pytest.skip("a rendezvous of zero bytes is sent eagerly by UCX")
    got = collect(pair.b, 3)
    src = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    hdr = b"hdr-" + bytes([nbytes % 251])
    req = pair.ab.am_send_nb(3, src, header=hdr, proto=proto)
    pump(pair, lambda: got)
    (msg,) = got
    assert msg.am_id == 3
    assert msg.header == hdr
    assert msg.nbytes == nbytes
    if proto == "rndv":
        assert msg.is_rndv
    if proto == "eager":
        assert not msg.is_rndv
    out = np.zeros(nbytes, np.uint8)
    if not msg.is_rndv:
        assert bytes(msg.data) == src.tobytes()
    (n, _) = pair.drive(msg.receive_into(out), req)
    assert n == nbytes
    assert np.array_equal(out, src)
    # The record gave its data (and, for a rendezvous, its C header copy)
    # away with the receive; the message keeps its own header.
    assert id(msg._pair) not in pair.b._engine.am.held
    assert msg.header == hdr


def test_progress_returns_the_event_count_only(pair):
    # The C progress marks "queued work for Python" in the top three bits of
    # its result; progress() runs that work and returns UCX's event count.
    got = collect(pair.b, 4)
    pair.ab.am_send_nb(4, b"x")
    counts = []
    end = time.monotonic() + 10
    while not got and time.monotonic() < end:
        counts += [pair.a.progress(), pair.b.progress()]
    assert [bytes(m.data) for m in got] == [b"x"]
    assert any(counts) and all(0 <= n < 1 << 29 for n in counts)


def test_eager_data_is_a_readonly_view(pair):
    got = collect(pair.b, 1)
    pair.drive(pair.ab.am_send_nb(1, b"abcdef", proto="eager"))
    pump(pair, lambda: got)
    view = got[0].data
    assert view.readonly and bytes(view) == b"abcdef"
    del got[:]
    # The view alone keeps UCX's buffer alive.
    assert bytes(view) == b"abcdef"


def test_rndv_64mib_into_user_buffer(pair, tls):
    n = 64 << 20
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    got = collect(pair.b, 9)
    req = pair.ab.am_send_nb(9, src, proto="rndv")
    pump(pair, lambda: got, 30)
    msg = got[0]
    assert msg.is_rndv and msg.nbytes == n
    with pytest.raises(ValueError, match="rendezvous"):
        msg.data  # noqa: B018
    dst = np.zeros(n, np.uint8)
    n_got, _ = pair.drive(msg.receive_into(dst), req, timeout=60)
    assert n_got == n
    assert np.array_equal(src, dst)


def test_unreceived_rndv_is_discarded_and_sender_completes(pair):
    got = collect(pair.b, 2)
    req = pair.ab.am_send_nb(2, np.ones(1 << 20, np.uint8), proto="rndv")
    pump(pair, lambda: got)
    del got[:]  # the message (and its descriptor) is garbage now
    pair.drive(req)
    assert req.result() is None


def test_reply_endpoint(pair, tls):
    answers = collect(pair.a, 2)

    def echo(msg):
        assert msg.reply_ep is pair.ba
        msg.reply_ep.am_send_nb(2, bytes(msg.data)[::-1], header=msg.header)

    pair.b.set_am_handler(1, echo)
    pair.drive(pair.ab.am_send_nb(1, b"ping", header=b"h", reply=True))
    pump(pair, lambda: answers)
    assert answers[0].header == b"h" and bytes(answers[0].data) == b"gnip"
    # Without reply=True there is no reply endpoint.
    plain = collect(pair.b, 3)
    pair.drive(pair.ab.am_send_nb(3, b"x"))
    pump(pair, lambda: plain)
    assert plain[0].reply_ep is None


def test_reply_endpoint_of_unknown_peer_is_borrowed(ctx):
    """A sender the receiver never connected to: UCX's own endpoint is
    wrapped; replies work; closing the wrapper leaves UCX's endpoint alone."""
    a, b = ctx.create_worker(), ctx.create_worker()
    ab = a.connect(b.address)
    replies = []
    a.set_am_handler(2, replies.append)
    seen = []

    def echo(msg):
        seen.append(msg.reply_ep)
        msg.reply_ep.am_send_nb(2, b"pong")

    b.set_am_handler(1, echo)
    req = ab.am_send_nb(1, b"ping", reply=True)
    end = time.monotonic() + 10
    while not (replies and req.done()):
        a.progress()
        b.progress()
        assert time.monotonic() < end
    assert bytes(replies[0].data) == b"pong"
    assert isinstance(seen[0], gpucx.Endpoint)
    seen[0].close()
    assert seen[0].closed


def test_handler_replacement_and_removal(pair):
    first, second = [], []
    pair.b.set_am_handler(4, first.append)
    pair.drive(pair.ab.am_send_nb(4, b"1"))
    pump(pair, lambda: first)
    pair.b.set_am_handler(4, second.append)
    pair.drive(pair.ab.am_send_nb(4, b"2"))
    pump(pair, lambda: second)
    assert [bytes(m.data) for m in first] == [b"1"]
    assert [bytes(m.data) for m in second] == [b"2"]
    pair.b.set_am_handler(4, None)
    req = pair.ab.am_send_nb(4, b"3")
    with pytest.warns(RuntimeWarning, match="active message id 4.*dropped"):
        end = time.monotonic() + 10
        while pair.b._engine.amq.tail == 0 or not req.done():
            pair.a.progress()
            lib_progress_only(pair.b)
            assert time.monotonic() < end
        pair.b.progress()
    assert len(first) == 1 and len(second) == 1


def lib_progress_only(worker):
    """Progress without dispatching (to observe the C queue)."""
    from gpucx._lib import lib

    lib.ucp_worker_progress(worker._h)


def test_handler_exception_reaches_progress_and_queue_survives(pair):
    seen = []

    def handler(msg):
        seen.append(bytes(msg.data))
        if msg.header == b"boom":
            raise KeyError("from the handler")

    pair.b.set_am_handler(6, handler)
    reqs = [
        pair.ab.am_send_nb(6, b"a"),
        pair.ab.am_send_nb(6, b"b", header=b"boom"),
        pair.ab.am_send_nb(6, b"c"),
    ]
    end = time.monotonic() + 10
    while pair.b._engine.amq.tail < 3 or not all(r.done() for r in reqs):
        pair.a.progress()
        lib_progress_only(pair.b)
        assert time.monotonic() < end
    with pytest.raises(KeyError, match="from the handler"):
        pair.b.progress()
    assert seen == [b"a", b"b"]
    pair.b.progress()  # the rest is still queued, in order
    assert seen == [b"a", b"b", b"c"]


def test_handler_exception_reaches_request_wait(pair):
    def handler(msg):
        raise RuntimeError("handler failed")

    pair.b.set_am_handler(7, handler)
    pair.drive(pair.ab.am_send_nb(7, b"x"))
    recv = pair.b.recv_nb(bytearray(4), tag=99)  # never matched
    end = time.monotonic() + 10
    while pair.b._engine.amq.tail == 0:
        pair.a.progress()
        lib_progress_only(pair.b)
        assert time.monotonic() < end
    with pytest.raises(RuntimeError, match="handler failed"):
        recv.wait(timeout=5)


def test_arrival_order(pair):
    got = collect(pair.b, 8)
    reqs = [pair.ab.am_send_nb(8, i.to_bytes(4, "little")) for i in range(200)]
    pair.drive(*reqs)
    pump(pair, lambda: len(got) == 200)
    assert [int.from_bytes(m.data, "little") for m in got] == list(range(200))


def test_many_senders_one_receiver(ctx):
    recv = ctx.create_worker()
    senders = [ctx.create_worker() for _ in range(4)]
    eps = [s.connect(recv.address) for s in senders]
    got = []
    recv.set_am_handler(11, got.append)
    reqs = [
        ep.am_send_nb(11, bytes([i]) * (i + 1) * 1000, header=bytes([i, j]))
        for j in range(10)
        for i, ep in enumerate(eps)
    ]
    end = time.monotonic() + 20
    while len(got) < 40 or not all(r.done() for r in reqs):
        for w in senders + [recv]:
            w.progress()
        assert time.monotonic() < end
    for i in range(4):
        mine = [m for m in got if m.header[0] == i]
        assert [m.header[1] for m in mine] == list(range(10))
        assert all(bytes(m.data) == bytes([i]) * (i + 1) * 1000 for m in mine)


def test_blocking_am_send(pair):
    got = collect(pair.b, 1)
    pair.ab.am_send(1, np.arange(10, dtype=np.int64), header=b"blk")
    pump(pair, lambda: got)
    assert np.frombuffer(got[0].data, np.int64).tolist() == list(range(10))


def test_eager_receive_into_copies(pair):
    got = collect(pair.b, 1)
    pair.drive(pair.ab.am_send_nb(1, b"0123456789", proto="eager"))
    pump(pair, lambda: got)
    out = bytearray(16)
    assert got[0].receive_into(out).wait() == 10
    assert out[:10] == b"0123456789"
    with pytest.raises(gpucx.AlreadyReceivedError, match="already received"):
        got[0].data  # noqa: B018


# -- errors -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 0xFF00, 0xFFFF, 1 << 16])
def test_bad_am_ids(pair, bad):
    with pytest.raises(ValueError, match="reserved"):
        pair.b.set_am_handler(bad, print)
    with pytest.raises(ValueError, match="reserved"):
        pair.ab.am_send(bad, b"x")
    with pytest.raises(ValueError, match="reserved"):
        pair.ab.am_send_nb(bad, b"x")


def test_am_id_type_and_handler_type(pair):
    with pytest.raises(TypeError, match="am_id"):
        pair.b.set_am_handler("1", print)
    with pytest.raises(TypeError, match="callable"):
        pair.b.set_am_handler(1, "not callable")


def test_bad_proto(pair):
    with pytest.raises(ValueError, match="proto"):
        pair.ab.am_send(1, b"x", proto="fast")
    with pytest.raises(ValueError, match="proto"):
        pair.ab.am_send_nb(1, b"x", proto=3)


def test_oversized_header(pair):
    limit = gpucx._lib.lib.gpucx_am_max_header(pair.a._h)
    with pytest.raises(ValueError, match="header of"):
        pair.ab.am_send_nb(1, b"x", header=b"h" * (limit + 1))


def test_receive_into_errors(pair):
    got = collect(pair.b, 1)
    req = pair.ab.am_send_nb(1, np.ones(1 << 20, np.uint8), proto="rndv")
    pump(pair, lambda: got)
    msg = got[0]
    with pytest.raises(gpucx.MessageTruncatedError) as info:
        msg.receive_into(bytearray(10))
    assert info.value.buffer_size == 10 and info.value.message_size == 1 << 20
    with pytest.raises(BufferError):
        msg.receive_into(bytes(1 << 20))  # read-only target
    with pytest.raises(BufferError):
        msg.receive_into(np.zeros(2 << 20, np.uint8)[::2])  # not contiguous
    out = np.zeros(1 << 20, np.uint8)
    pair.drive(msg.receive_into(out), req)
    with pytest.raises(gpucx.AlreadyReceivedError, match="already received"):
        msg.receive_into(out)
    assert out.all()


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_receive_into_fortran_order_array(pair, proto):
    """A Fortran-ordered array is contiguous memory: receive_into takes it
    (the general buffer path, not the C-contiguous fast path)."""
    got = collect(pair.b, 1)
    src = np.arange(64 * 128, dtype=np.uint8)
    req = pair.ab.am_send_nb(1, src, proto=proto)
    pump(pair, lambda: got)
    out = np.zeros((64, 128), np.uint8, order="F")
    (n, _) = pair.drive(got[0].receive_into(out), req)
    assert n == src.nbytes
    assert np.array_equal(out.ravel(order="K"), src)


def test_closed_endpoint_and_worker(ctx):
    p = Pair(ctx)
    p.ab.close()
    with pytest.raises(gpucx.ClosedError):
        p.ab.am_send(1, b"x")
    with pytest.raises(gpucx.ClosedError):
        p.ab.am_send_nb(1, b"x")
    p.b.close()
    with pytest.raises(gpucx.ClosedError):
        p.b.set_am_handler(1, print)


def test_worker_close_with_queued_messages(ctx):
    p = Pair(ctx)
    got = collect(p.b, 1)
    reqs = [p.ab.am_send_nb(1, b"e" * 100, proto="eager") for _ in range(5)]
    p.drive(*reqs)
    end = time.monotonic() + 10
    while p.b._engine.amq.tail == 0:
        lib_progress_only(p.b)
        assert time.monotonic() < end
    held = None
    p.b.progress()
    held = got[0]  # a message alive when its worker closes
    p.b.close()
    assert held.nbytes == 100
    with pytest.raises(gpucx.ClosedError):
        held.receive_into(bytearray(100))
    del held, got
    p.a.close()


def test_context_without_am_feature():
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        with pytest.raises(gpucx.UnsupportedError, match="am"):
            w.set_am_handler(1, print)
        ep = w.connect(w.address)
        with pytest.raises(gpucx.UnsupportedError, match="am"):
            ep.am_send_nb(1, b"x")
        with pytest.raises(gpucx.UnsupportedError, match="am"):
            ep.send_array(np.zeros(3))
        with pytest.raises(gpucx.UnsupportedError, match="am"):
            ep.recv_array(timeout=1)


def test_reserved_range():
    assert range(0xFF00, 0x10000) == _am.RESERVED_AM_IDS
    assert _am.ARRAY_AM_ID in _am.RESERVED_AM_IDS
    assert _am.MAX_USER_AM_ID == 0xFEFF


# -- two processes -------------------------------------------------------------


@pytest.mark.parametrize("via_listener", [False, True], ids=["address", "listener"])
def test_am_echo_across_processes(tls, via_listener):
    from conftest import channel_pair, join_ok, spawn, transport_config
    from peers_am import BACK, ECHO, am_echo_peer

    if tls == "default" and via_listener:
        pytest.skip("listener over default transports is covered by tcp/shm")
    q, theirs = channel_pair()
    child = spawn(am_echo_peer, tls, theirs, via_listener)
    try:
        with gpucx.Context(config=transport_config(tls, via_listener)) as ctx:
            w = ctx.create_worker()
            kind, where = q.get(60)
            if via_listener:
                ep = w.connect(("127.0.0.1", where))
            else:
                ep = w.connect(where)
                q.put(w.address)
            back = []
            w.set_am_handler(BACK, back.append)
            cases = [(0, None), (8, "eager"), (100_000, None), (4 << 20, "rndv")]
            for i, (n, proto) in enumerate(cases):
                src = np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8)
                ep.am_send(ECHO, src, header=b"case%d" % i, reply=True, proto=proto)
                end = time.monotonic() + 60
                while not back:
                    w.progress()
                    assert time.monotonic() < end, f"no echo for case {i}"
                msg = back.pop()
                assert msg.header == b"case%d" % i and msg.nbytes == n
                if proto == "rndv":
                    assert msg.is_rndv
                out = np.zeros(n, np.uint8)
                msg.receive_into(out).wait(60)
                assert np.array_equal(out, src)
            q.put(("bye", None))
            _, transports = q.get(60)
            check_transports(tls, transports, ep.transports)
            q.put("ok")
    finally:
        join_ok(child, 60)


def test_multi_thread_worker_delivers_each_message_once():
    """A "multi" worker progressed by two threads at once: the C queue is
    locked, so each message reaches the handler exactly once."""
    import threading

    with gpucx.Context() as ctx:
        a = ctx.create_worker(thread_mode="multi")
        b = ctx.create_worker(thread_mode="multi")
        ab = a.connect(b.address)
        got = []
        b.set_am_handler(1, lambda m: got.append(int.from_bytes(m.data, "little")))
        n = 500
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                b.progress()

        threads = [threading.Thread(target=spin) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            reqs = [ab.am_send_nb(1, i.to_bytes(4, "little")) for i in range(n)]
            end = time.monotonic() + 30
            while len(got) < n or not all(r.done() for r in reqs):
                a.progress()
                assert time.monotonic() < end
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        assert sorted(got) == list(range(n))


def test_internal_handlers_on_reserved_ids(pair):
    got = []
    _am.set_internal_handler(pair.b._engine, 0xFF00, got.append)
    pair.drive(_am.send_internal_nb(pair.ab, 0xFF00, b"note", header=b"n"))
    pump(pair, lambda: got)
    assert got[0].am_id == 0xFF00 and bytes(got[0].data) == b"note"
    for bad in (5, _am.ARRAY_AM_ID):
        with pytest.raises(ValueError, match="reserved"):
            _am.set_internal_handler(pair.b._engine, bad, print)
    with pytest.raises(ValueError, match="reserved"):
        _am.send_internal_nb(pair.ab, 5, b"x")


# -- message records are pooled: reuse never touches a live message ---------------


def test_held_messages_and_views_survive_record_reuse(pair):
    """Messages kept by the user, and views of their data, stay intact while
    hundreds of later messages go through the worker's record pool."""
    got = collect(pair.b, 4)
    kept, views = [], []
    for i in range(300):
        payload = bytes([i % 251]) * (1 + i % 64)
        hdr = i.to_bytes(2, "little")
        pair.drive(pair.ab.am_send_nb(4, payload, header=hdr, proto="eager"))
        pump(pair, lambda: got)
        msg = got.pop()
        if i % 7 == 0:
            kept.append((i, msg))
        elif i % 11 == 0:
            views.append((i, msg.data))
        del msg
    for i, msg in kept:
        assert msg.header == i.to_bytes(2, "little")
        assert bytes(msg.data) == bytes([i % 251]) * (1 + i % 64)
    for i, view in views:
        assert bytes(view) == bytes([i % 251]) * (1 + i % 64)
    am = pair.b._engine.am
    assert len(am.held) == len(kept) + len(views)
    del kept, views, msg, view
    assert not am.held  # every record went back
    assert len(am.free) <= _am._POOL_MAX


def test_dropped_message_with_receive_in_flight_keeps_its_record(pair):
    """The handler drops the message right after receive_into: the pending
    receive holds it, so later messages cannot reuse its completion slot."""
    n = 1 << 20
    srcs = [np.full(n, k, np.uint8) for k in range(1, 9)]
    dsts = [np.zeros(n, np.uint8) for _ in srcs]
    reqs = []
    pair.b.set_am_handler(6, lambda msg: reqs.append(msg.receive_into(dsts[len(reqs)])))
    sends = [pair.ab.am_send_nb(6, s, proto="rndv") for s in srcs]
    pump(pair, lambda: len(reqs) == len(srcs))
    assert [n] * len(srcs) == [r for r, *_ in [pair.drive(r, timeout=30) for r in reqs]]
    pair.drive(*sends)
    for k, dst in enumerate(dsts, 1):
        assert (dst == k).all()
    assert not pair.b._engine.am.held


def test_pool_is_bounded(pair):
    got = collect(pair.b, 8)
    reqs = [
        pair.ab.am_send_nb(8, b"x", proto="eager") for _ in range(3 * _am._POOL_MAX)
    ]
    pair.drive(*reqs)
    pump(pair, lambda: len(got) == len(reqs))
    assert len(pair.b._engine.am.held) == len(reqs)
    del got[:]
    assert not pair.b._engine.am.held
    assert len(pair.b._engine.am.free) == _am._POOL_MAX


def test_record_of_a_message_not_kept_goes_back_when_its_handler_returns(pair):
    """A handler that keeps nothing: the record is back in the pool right
    after it (no finalizer), and the next message reuses it."""
    am = pair.b._engine.am
    seen = []
    pair.b.set_am_handler(9, lambda msg: seen.append((type(msg), id(msg._pair))))
    for k in range(5):
        pair.drive(pair.ab.am_send_nb(9, bytes([k]) * 64, proto="eager"))
        pump(pair, lambda k=k: len(seen) == k + 1)
        assert not am.held
    assert {t for t, _ in seen} == {gpucx.AmMessage}
    assert len({i for _, i in seen}) == 1  # one record, reused


def test_kept_message_gives_its_record_back_when_collected(pair):
    am = pair.b._engine.am
    got = collect(pair.b, 10)
    pair.drive(pair.ab.am_send_nb(10, b"kept" * 16, proto="eager"))
    pump(pair, lambda: got)
    assert type(got[0]) is _am._KeptMessage
    assert isinstance(got[0], gpucx.AmMessage)
    assert len(am.held) == 1
    assert bytes(got[0].data) == b"kept" * 16
    del got[:]
    assert not am.held


def test_message_in_a_raising_handlers_traceback_stays_valid(pair):
    """The exception's traceback holds the message: its data stays readable
    until the exception is gone, then the record goes back."""
    am = pair.b._engine.am

    def handler(msg):
        raise KeyError(msg)

    pair.b.set_am_handler(11, handler)
    pair.drive(pair.ab.am_send_nb(11, b"boom" * 8, proto="eager"))
    with pytest.raises(KeyError) as info:
        pump(pair, lambda: False)
    (msg,) = info.value.args
    assert bytes(msg.data) == b"boom" * 8
    assert len(am.held) == 1
    del msg, info
    assert not am.held


def test_rendezvous_receive_hands_the_record_to_its_request(pair):
    """After a rendezvous receive_into the request owns the record (its
    completion slot) and gives it back once done; the message keeps its
    header and its reply endpoint."""
    am = pair.b._engine.am
    got = collect(pair.b, 12)
    src = np.arange(1 << 16, dtype=np.uint8)
    send = pair.ab.am_send_nb(12, src, header=b"h", proto="rndv", reply=True)
    pump(pair, lambda: got)
    msg = got.pop()
    out = np.zeros_like(src)
    req = msg.receive_into(out)
    rec_pair = req._keep[1]
    assert msg._pair is None and not am.held
    assert all(p is not rec_pair for p in am.free)
    (n, _) = pair.drive(req, send)
    assert n == src.nbytes and np.array_equal(out, src)
    assert any(p is rec_pair for p in am.free)
    assert msg.header == b"h"
    assert msg.reply_ep is not None
    with pytest.raises(gpucx.AlreadyReceivedError):
        msg.receive_into(out)


def test_blocking_reply_inside_a_blocking_wait(tls):
    """A blocking recv sleeps; its wait runs an AM handler that replies with a
    blocking send.  The two blocking calls must not share a completion slot:
    the recv returns only with its own message."""
    from conftest import channel_pair, join_ok, spawn, transport_config
    from peers_am import nested_reply_peer

    q, theirs = channel_pair()
    child = spawn(nested_reply_peer, tls, theirs)
    try:
        with gpucx.Context(config=transport_config(tls)) as ctx:
            w = ctx.create_worker()
            ep = w.connect(q.get(60))
            q.put(w.address)
            replied = []

            def on_ping(msg):
                msg.reply_ep.am_send(4, b"pong")
                replied.append(bytes(msg.data))

            w.set_am_handler(3, on_ping)
            buf = np.zeros(4096, np.uint8)
            info = w.recv(buf, tag=7, timeout=30)
            assert replied == [b"ping"]
            assert info == (7, 4096)
            assert np.array_equal(buf, np.arange(4096, dtype=np.uint8))
            q.put("bye")
            ep.close()
    finally:
        join_ok(child, 60)


# -- posted receives (worker.am_recv_nb / am_recv) ----------------------------------


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_posted_receives_match_in_order_without_the_handler(pair, tls, proto):
    n = 100 if proto == "eager" else 1 << 20
    handled = collect(pair.b, 12)
    bufs = [np.zeros(n, np.uint8) for _ in range(3)]
    recvs = [pair.b.am_recv_nb(12, buf) for buf in bufs]
    sends = [
        pair.ab.am_send_nb(12, np.full(n, k + 1, np.uint8), proto=proto)
        for k in range(3)
    ]
    assert pair.drive(*recvs, *sends, timeout=30)[:3] == [n, n, n]
    for k, buf in enumerate(bufs):
        assert (buf == k + 1).all()
    assert not handled  # matched messages never reach the handler


def test_messages_without_a_posted_receive_go_to_the_handler(pair):
    handled = collect(pair.b, 13)
    buf = bytearray(8)
    recv = pair.b.am_recv_nb(13, buf)
    sends = [pair.ab.am_send_nb(13, b"first!!!"), pair.ab.am_send_nb(13, b"second")]
    pair.drive(recv, *sends)
    assert recv.result() == 8 and bytes(buf) == b"first!!!"
    pump(pair, lambda: handled)
    assert bytes(handled[0].data) == b"second"


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_posted_receive_too_small_fails_and_drops_the_message(pair, tls, proto):
    small = pair.b.am_recv_nb(14, np.zeros(10, np.uint8))
    big = np.zeros(100, np.uint8)
    nxt = pair.b.am_recv_nb(14, big)
    s1 = pair.ab.am_send_nb(14, np.ones(100, np.uint8), proto=proto)
    s2 = pair.ab.am_send_nb(14, np.full(100, 7, np.uint8), proto=proto)
    end = time.monotonic() + 10
    while not (small.done() and nxt.done() and s1.done() and s2.done()):
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    with pytest.raises(gpucx.MessageTruncatedError) as err:
        small.result()
    assert err.value.buffer_size == 10 and err.value.message_size == 100
    assert s1.result() is None  # the sender completes
    assert nxt.result() == 100 and (big == 7).all()


def test_posted_receive_cancel_and_timeout_lose_nothing(pair):
    handled = collect(pair.b, 15)
    req = pair.b.am_recv_nb(15, bytearray(4))
    assert req.cancel()
    assert req.done() and req not in pair.b._engine.pending  # settled at once
    assert not req.cancel()
    with pytest.raises(gpucx.CanceledError):
        req.wait(5)
    with pytest.raises(gpucx.TimeoutError):
        pair.b.am_recv(15, bytearray(4), timeout=0.1)
    pair.drive(pair.ab.am_send_nb(15, b"kept"))
    pump(pair, lambda: handled)  # withdrawn receives took nothing
    assert bytes(handled[0].data) == b"kept"
    buf = bytearray(4)
    req = pair.b.am_recv_nb(15, buf)
    pair.drive(req, pair.ab.am_send_nb(15, b"next"))
    assert req.result() == 4 and bytes(buf) == b"next"


def test_blocking_am_recv_of_an_empty_message(pair):
    req = pair.b.am_recv_nb(16, bytearray(0))
    pair.drive(req, pair.ab.am_send_nb(16, b""))
    assert req.result() == 0


def test_posted_receive_errors(pair):
    from fakegpu import FakeCudaArrayV2

    with pytest.raises(ValueError, match="am_id"):
        pair.b.am_recv_nb(0xFF10, bytearray(4))
    with pytest.raises(TypeError):
        pair.b.am_recv_nb("1", bytearray(4))
    with pytest.raises(BufferError):
        pair.b.am_recv_nb(17, b"read-only")
    # CUDA memory passes the CUDA door: here, a context that cannot move it.
    with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot be moved"):
        pair.b.am_recv_nb(17, FakeCudaArrayV2(np.zeros(8, np.uint8)))
    with pytest.raises(gpucx.UnsupportedError, match="CUDA memory cannot be moved"):
        pair.b.am_recv_many_nb(17, [FakeCudaArrayV2(np.zeros(8, np.uint8))])
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        with pytest.raises(gpucx.UnsupportedError, match='"am" feature'):
            w.am_recv_nb(17, bytearray(4))


def test_worker_close_cancels_posted_receives(ctx):
    p = Pair(ctx)
    req = p.b.am_recv_nb(18, bytearray(4))
    p.b.close()
    with pytest.raises((gpucx.CanceledError, gpucx.ClosedError)):
        req.wait(5)
    with pytest.raises(gpucx.ClosedError):
        p.b.am_recv_nb(18, bytearray(4))
    p.a.close()


# -- kept messages: an id used with posted receives and no handler ----------------


def _kept(worker, am_id):
    from gpucx._lib import lib

    return lib.gpucx_am_kept(worker._engine.am.regs[am_id])


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_messages_before_a_receive_wait_for_it(pair, tls, proto):
    n = 64 if proto == "eager" else 1 << 20
    first = np.zeros(n, np.uint8)
    req = pair.b.am_recv_nb(41, first)  # the id now keeps what finds no receive
    sends = [
        pair.ab.am_send_nb(41, np.full(n, k + 1, np.uint8), proto=proto)
        for k in range(5)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped
        pump(pair, lambda: req.done() and _kept(pair.b, 41) == 4)
        assert req.result() == n and (first == 1).all()
        # One by one, then as a group: in arrival order.
        buf = np.zeros(n, np.uint8)
        assert pair.drive(pair.b.am_recv_nb(41, buf)) == [n]
        assert (buf == 2).all()
        bufs = [np.zeros(n, np.uint8) for _ in range(3)]
        group = pair.b.am_recv_many_nb(41, bufs)
        assert pair.drive(group, *sends, timeout=30)[0] == [n, n, n]
    assert [int(b[0]) for b in bufs] == [3, 4, 5]
    assert all((b == b[0]).all() for b in bufs)
    assert _kept(pair.b, 41) == 0


def test_group_takes_kept_messages_then_posts_the_rest(pair):
    pair.b.am_recv_nb(42, bytearray(1)).cancel()  # registers the id
    pair.drive(pair.ab.am_send_nb(42, b"k1"), pair.ab.am_send_nb(42, b"k2"))
    pump(pair, lambda: _kept(pair.b, 42) == 2)
    bufs = [bytearray(2) for _ in range(4)]
    req = pair.b.am_recv_many_nb(42, bufs)
    assert not req.done()  # two buffers are still posted
    pair.drive(pair.ab.am_send_nb(42, b"p3"), pair.ab.am_send_nb(42, b"p4"))
    assert pair.drive(req)[0] == [2, 2, 2, 2]
    assert bufs == [
        bytearray(b"k1"),
        bytearray(b"k2"),
        bytearray(b"p3"),
        bytearray(b"p4"),
    ]


def test_one_buffer_group_takes_kept_messages_then_posts_the_rest(pair):
    # One buffer posted many times goes to C as one entry: kept messages and
    # posted members must land in it in order all the same.
    pair.b.am_recv_nb(43, bytearray(1)).cancel()  # registers the id
    pair.drive(pair.ab.am_send_nb(43, b"k1"), pair.ab.am_send_nb(43, b"k2"))
    pump(pair, lambda: _kept(pair.b, 43) == 2)
    buf = bytearray(2)
    req = pair.b.am_recv_many_nb(43, [buf] * 4)
    assert not req.done() and buf == bytearray(b"k2")  # kept ones landed
    pair.drive(pair.ab.am_send_nb(43, b"p3"))
    pump(pair, lambda: buf == bytearray(b"p3"))
    assert not req.done()
    pair.drive(pair.ab.am_send_nb(43, b"p4"), req)
    assert req.result() == [2, 2, 2, 2] and buf == bytearray(b"p4")


def test_group_of_repeated_buffers_keeps_each_position(pair):
    a, b = np.zeros(4, np.uint8), np.zeros(8, np.uint8)
    req = pair.b.am_recv_many_nb(44, [a, b, a, b, b])
    sends = [
        pair.ab.am_send_nb(44, np.full(n, k, np.uint8))
        for k, n in enumerate((4, 8, 3, 6, 8), 1)
    ]
    assert pair.drive(req, *sends)[0] == [4, 8, 3, 6, 8]
    assert a.tolist() == [3, 3, 3, 1] and (b == 5).all()


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_kept_message_too_large_fails_that_receive_only(pair, proto):
    pair.b.am_recv_nb(43, bytearray(1)).cancel()
    s1 = pair.ab.am_send_nb(43, np.ones(5000, np.uint8), proto=proto)
    s2 = pair.ab.am_send_nb(43, np.full(10, 9, np.uint8), proto=proto)
    pump(pair, lambda: _kept(pair.b, 43) == 2)
    with pytest.raises(gpucx.MessageTruncatedError) as err:
        pair.b.am_recv(43, np.zeros(100, np.uint8), timeout=10)
    assert err.value.buffer_size == 100 and err.value.message_size == 5000
    buf = np.zeros(10, np.uint8)
    # (A rendezvous fetch in one process needs the sender's progress too.)
    assert pair.drive(pair.b.am_recv_nb(43, buf), s1, s2)[0] == 10
    assert (buf == 9).all()  # and both senders completed


def test_setting_a_handler_hands_it_the_kept_messages(pair):
    pair.b.am_recv_nb(44, bytearray(1)).cancel()
    pair.drive(*(pair.ab.am_send_nb(44, b"m%d" % i) for i in range(3)))
    pump(pair, lambda: _kept(pair.b, 44) == 3)
    got = collect(pair.b, 44)
    pump(pair, lambda: len(got) == 3)
    assert [bytes(m.data) for m in got] == [b"m0", b"m1", b"m2"]
    assert _kept(pair.b, 44) == 0
    # Cleared again: messages are kept for receives once more.
    pair.b.set_am_handler(44, None)
    pair.drive(pair.ab.am_send_nb(44, b"m3"))
    pump(pair, lambda: _kept(pair.b, 44) == 1)
    buf = bytearray(2)
    assert pair.b.am_recv(44, buf, timeout=5) == 2 and buf == b"m3"


def test_blocking_am_recv_times_out_then_keeps(pair):
    buf = bytearray(4)
    with pytest.raises(gpucx.TimeoutError):
        pair.b.am_recv(45, buf, timeout=0.1)
    pair.drive(pair.ab.am_send_nb(45, b"late"))
    pump(pair, lambda: _kept(pair.b, 45) == 1)  # not taken by the withdrawn one
    assert pair.b.am_recv(45, buf, timeout=5) == 4 and buf == b"late"


@pytest.mark.parametrize("nbytes", [64, 1 << 20], ids=["eager", "rndv"])
def test_worker_close_releases_kept_messages(ctx, nbytes):
    from gpucx._lib import ffi, lib

    p = Pair(ctx)
    p.b.am_recv_nb(46, bytearray(1)).cancel()
    sends = [p.ab.am_send_nb(46, np.ones(nbytes, np.uint8)) for _ in range(3)]
    pump(p, lambda: _kept(p.b, 46) == 3)
    held = p.b.stats()["am_kept"]
    assert held.count == 3 and held.bytes == (3 * nbytes if nbytes == 64 else 0)
    # The C queue outlives the worker's close; its counters drop as each
    # message's data goes back (gpucx_am_release: to UCX, or freed).
    amq = p.b._engine.amq
    p.b.close()
    kept, queue = ffi.new("gpucx_qstat_t *"), ffi.new("gpucx_qstat_t *")
    lib.gpucx_am_stats(amq, kept, queue)
    assert (kept.count, kept.bytes) == (0, 0)
    # A rendezvous sender completes once the receiver gave its message back;
    # an eager one had completed already.
    assert [s.wait(10) for s in sends] == [None] * 3
    p.a.close()


# -- receives posted together (worker.am_recv_many_nb / am_recv_many) -------------


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_group_receives_in_order_one_request(pair, tls, proto):
    sizes = [100, 1, 0, 4096] if proto == "eager" else [1 << 20, 3 << 19, 1 << 16]
    handled = collect(pair.b, 30)
    bufs = [np.zeros(n + 5, np.uint8) for n in sizes]
    req = pair.b.am_recv_many_nb(30, bufs)
    sends = [
        pair.ab.am_send_nb(30, np.full(n, k + 1, np.uint8), proto=proto)
        for k, n in enumerate(sizes)
    ]
    assert pair.drive(req, *sends, timeout=30)[0] == sizes
    for k, (n, buf) in enumerate(zip(sizes, bufs, strict=True)):
        assert (buf[:n] == k + 1).all() and not buf[n:].any()
    assert not handled


def test_group_and_single_receives_share_one_order(pair):
    handled = collect(pair.b, 31)
    first = bytearray(4)
    group = [bytearray(4), bytearray(4)]
    last = bytearray(4)
    r1 = pair.b.am_recv_nb(31, first)
    r2 = pair.b.am_recv_many_nb(31, group)
    r3 = pair.b.am_recv_nb(31, last)
    sends = [pair.ab.am_send_nb(31, b"m%d.." % i) for i in range(5)]
    got = pair.drive(r1, r2, r3, *sends)
    assert got[:3] == [4, [4, 4], 4]
    assert [bytes(b) for b in (first, *group, last)] == [
        b"m0..",
        b"m1..",
        b"m2..",
        b"m3..",
    ]
    pump(pair, lambda: handled)  # the fifth found no receive: the handler
    assert bytes(handled[0].data) == b"m4.."


def test_one_buffer_many_times_and_empty_group(pair):
    buf = np.zeros(8, np.uint8)
    req = pair.b.am_recv_many_nb(32, [buf] * 3)
    sends = [pair.ab.am_send_nb(32, np.full(8, i, np.uint8)) for i in (1, 2, 3)]
    assert pair.drive(req, *sends)[0] == [8, 8, 8]
    assert (buf == 3).all()  # the last message landed last
    empty = pair.b.am_recv_many_nb(32, [])
    assert empty.done() and empty.wait() == []
    assert pair.b.am_recv_many(32, (), timeout=1) == []


@pytest.mark.parametrize("proto", ["eager", "rndv"])
def test_group_member_too_small_fails_the_group_after_all_land(pair, tls, proto):
    bufs = [np.zeros(100, np.uint8), np.zeros(10, np.uint8), np.zeros(100, np.uint8)]
    req = pair.b.am_recv_many_nb(33, bufs)
    sends = [
        pair.ab.am_send_nb(33, np.full(100, k + 1, np.uint8), proto=proto)
        for k in range(3)
    ]
    end = time.monotonic() + 10
    while not (req.done() and all(s.done() for s in sends)):
        pair.a.progress()
        pair.b.progress()
        assert time.monotonic() < end
    with pytest.raises(gpucx.MessageTruncatedError, match="100 bytes") as err:
        req.result()
    assert err.value.message_size == 100
    assert all(s.result() is None for s in sends)  # every sender completes
    assert (bufs[0] == 1).all() and (bufs[2] == 3).all()  # the others landed
    assert not bufs[1].any()


def test_group_cancel_and_timeout_withdraw_the_unmatched(pair):
    handled = collect(pair.b, 34)
    bufs = [bytearray(4) for _ in range(3)]
    req = pair.b.am_recv_many_nb(34, bufs)
    pair.drive(pair.ab.am_send_nb(34, b"one!"))
    end = time.monotonic() + 5
    while bufs[0] != b"one!":
        pair.b.progress()
        assert time.monotonic() < end
    assert req.cancel()
    with pytest.raises(gpucx.CanceledError):
        req.wait(5)
    assert bytes(bufs[0]) == b"one!"  # matched before the cancel: kept
    with pytest.raises(gpucx.TimeoutError):
        pair.b.am_recv_many(34, [bytearray(4), bytearray(4)], timeout=0.1)
    pair.drive(pair.ab.am_send_nb(34, b"kept"))
    pump(pair, lambda: handled)  # withdrawn receives took nothing
    assert bytes(handled[0].data) == b"kept"


def test_group_receive_errors(pair):
    from fakegpu import FakeCudaArrayV2

    with pytest.raises(ValueError, match="am_id"):
        pair.b.am_recv_many_nb(0xFF10, [bytearray(4)])
    with pytest.raises(TypeError, match="sequence of buffers"):
        pair.b.am_recv_many_nb(35, 7)
    with pytest.raises(BufferError, match="buffer 1"):
        pair.b.am_recv_many_nb(35, [bytearray(4), b"read-only"])
    with pytest.raises(TypeError, match="buffer 0"):
        pair.b.am_recv_many_nb(35, [object()])
    same = bytearray(4)
    with pytest.raises(BufferError, match="buffer 3"):
        pair.b.am_recv_many_nb(35, [same, same, same, b"read-only", same])
    cannot = "buffer 1: .*CUDA memory cannot be moved"
    with pytest.raises(gpucx.UnsupportedError, match=cannot):
        pair.b.am_recv_many_nb(
            35, [bytearray(4), FakeCudaArrayV2(np.zeros(8, np.uint8))]
        )
    # Nothing was posted by the refused calls.
    buf = bytearray(4)
    req = pair.b.am_recv_nb(35, buf)
    pair.drive(req, pair.ab.am_send_nb(35, b"free"))
    assert bytes(buf) == b"free"
    with gpucx.Context(features={"tag"}) as ctx:
        w = ctx.create_worker()
        with pytest.raises(gpucx.UnsupportedError, match='"am" feature'):
            w.am_recv_many_nb(35, [bytearray(4)])


def test_worker_close_cancels_group_receives(ctx):
    p = Pair(ctx)
    req = p.b.am_recv_many_nb(36, [bytearray(4), bytearray(4)])
    p.b.close()
    with pytest.raises((gpucx.CanceledError, gpucx.ClosedError)):
        req.wait(5)
    with pytest.raises(gpucx.ClosedError):
        p.b.am_recv_many_nb(36, [bytearray(4)])
    p.a.close()


def _post_each(w, bufs):
    reqs = [w.am_recv_nb(11, buf) for buf in bufs]
    return lambda: [r.wait(60) for r in reqs]


def _post_groups(w, bufs):
    # Half in one group, the rest in another.
    reqs = [w.am_recv_many_nb(11, bufs[:4]), w.am_recv_many_nb(11, bufs[4:])]
    return lambda: reqs[0].wait(60) + reqs[1].wait(60)


def _blocking_loop(w, bufs):
    # One receive registers the id before the burst; the rest of the burst
    # waits as kept messages for a loop of blocking receives.
    first = w.am_recv_nb(11, bufs[0])
    return lambda: [first.wait(60)] + [w.am_recv(11, b, timeout=60) for b in bufs[1:]]


@pytest.mark.parametrize(
    "receive", [_post_each, _post_groups, _blocking_loop], ids=lambda f: f.__name__
)
def test_posted_receives_across_processes(tls, receive):
    from peers_am import burst_receiver

    sizes = [0, 1, 100, 8192, 65536, 1 << 20, 4 << 20, 3]
    with burst_receiver(tls, sizes) as (w, _ep, q):
        bufs = [np.zeros(n, np.uint8) for n in sizes]
        results = receive(w, bufs)
        q.put("go")
        assert results() == sizes
        for i, buf in enumerate(bufs):
            assert (buf == i % 251 + 1).all()
