"""The CUDA door (gpucx.mem.cuda.door): every operation on device memory
posts through it, so an operation that fails after the device context was
pushed leaves no context pushed.

Test doubles only: the CUDA driver is tests/fakegpu.FakeDriver and the
"device" memory is host memory behind a fake ``__cuda_array_interface__``;
the post itself is replaced by a spy that raises instead of handing fake
device memory to UCX.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_layer import CUDA, PostSpy, _Posted, _setup_fake

from gpucx._engine import Engine
from gpucx.mem import cuda as gcuda
from gpucx.ops import am_batch as _am_batch
from gpucx.ops import rma as _rma
from gpucx.ops import stream as _stream
from gpucx.ops import tag as _tag
from gpucx.ops.am import _send as _am_send

from fakegpu import FakeCudaArrayV2

pytestmark = pytest.mark.timeout(60)

OTHER_CTX = 0xC0  # device 0's context, current in this thread
OWNER_CTX = 0xC1  # device 1 owns the fake device memory: pushed for the post


def _exported(pair, nbytes):
    mem = np.zeros(nbytes, np.uint8)
    region = pair.ctx.register(mem)
    return region, pair.ab.unpack(region.remote())


# (ops module, post function the spy fails, index of its memory type, the call)
OPS = [
    (_tag, "gpucx_tag_send_wait", 5, lambda p, b, k: p.ab.send(b, tag=1)),
    (_tag, "gpucx_tag_send", 4, lambda p, b, k: p.ab.send_nb(b, tag=1)),
    (_tag, "gpucx_tag_send_iov", 4, lambda p, b, k: p.ab.send_nb([b], tag=1)),
    (_tag, "gpucx_tag_recv_wait", 5, lambda p, b, k: p.b.recv(b, tag=1)),
    (_tag, "gpucx_tag_recv", 5, lambda p, b, k: p.b.recv(b, tag=1, timeout=1)),
    (_tag, "gpucx_tag_recv", 5, lambda p, b, k: p.b.recv_nb(b, tag=1)),
    (_tag, "gpucx_tag_recv_iov", 5, lambda p, b, k: p.b.recv_nb([b], tag=1)),
    (_stream, "gpucx_stream_send_wait", 4, lambda p, b, k: p.ab.stream_send(b)),
    (_stream, "gpucx_stream_send", 3, lambda p, b, k: p.ab.stream_send_nb(b)),
    (_stream, "gpucx_stream_recv_wait", 4, lambda p, b, k: p.ab.stream_recv(b)),
    (_stream, "gpucx_stream_recv", 3, lambda p, b, k: p.ab.stream_recv_nb(b)),
    (_am_send, "gpucx_am_send_wait", 7, lambda p, b, k: p.ab.am_send(7, b)),
    (_am_send, "gpucx_am_send", 6, lambda p, b, k: p.ab.am_send_nb(7, b)),
    (_rma, "gpucx_put_wait", 6, lambda p, b, k: p.ab.put(b, k)),
    (_rma, "gpucx_put", 5, lambda p, b, k: p.ab.put_nb(b, k)),
    (_rma, "gpucx_put_notify", 5, lambda p, b, k: p.ab.put_nb(b, k, notify=b"n")),
    (_rma, "gpucx_get_wait", 6, lambda p, b, k: p.ab.get(b, k)),
    (_rma, "gpucx_get", 5, lambda p, b, k: p.ab.get_nb(b, k)),
    (_rma, "gpucx_xfer_run", None, lambda p, b, k: p.ab.prepare_put([(b, k, 0)]).run()),
    (
        _am_batch,
        "gpucx_am_batch_run",
        None,
        lambda p, b, k: p.ab.prepare_am(7, [b]).run(),
    ),
]


@pytest.mark.parametrize(
    ("module", "name", "mt_index", "call"),
    OPS,
    ids=[f"{op[1]}-{i}" for i, op in enumerate(OPS)],
)
def test_failed_post_leaves_no_context_pushed(
    fake_driver, pair, monkeypatch, module, name, mt_index, call
):
    arr = np.arange(32, dtype=np.uint8)
    events = []
    _setup_fake(fake_driver, pair, monkeypatch, arr, device=1, polls=0)
    fake_driver.observer = events.append
    fake_driver.current = OTHER_CTX
    region, key = _exported(pair, arr.nbytes)
    try:
        monkeypatch.setattr(
            module, "lib", PostSpy(module.lib, {name}, events, mt_index or 0)
        )
        with pytest.raises(_Posted):
            call(pair, FakeCudaArrayV2(arr), key)
    finally:
        monkeypatch.undo()
        key.close()
        region.close()
    kinds = [e[0] for e in events]
    assert ("push", OWNER_CTX) in events
    post = kinds.index("post")
    assert "push" in kinds[:post] and "pop" in kinds[post:]
    assert kinds.count("push") == kinds.count("pop")
    if mt_index is not None:
        assert events[post][2] == CUDA
    # The failure popped what the door pushed: the thread's context is back.
    assert fake_driver.current == OTHER_CTX and fake_driver.stack == []


def test_door_pops_on_any_exception(fake_driver, pair):
    arr = np.arange(16, dtype=np.uint8)
    _setup_fake(fake_driver, pair, pytest.MonkeyPatch(), arr, device=1, polls=0)
    fake_driver.current = OTHER_CTX
    ptr = arr.__array_interface__["data"][0]
    with pytest.raises(KeyError), gcuda.door(pair.a._engine, ptr, CUDA, None, "test"):
        assert fake_driver.current == OWNER_CTX
        raise KeyError("after the push")
    assert fake_driver.current == OTHER_CTX and fake_driver.stack == []
    # ready(): through the door with nothing posted, nothing left pushed.
    gcuda.door(pair.a._engine, ptr, CUDA, None, "test").ready()
    assert fake_driver.current == OTHER_CTX and fake_driver.stack == []


def test_host_memory_does_not_enter_the_door(fake_driver, pair, monkeypatch):
    # The host fast path posts without the CUDA layer: no driver call at all.
    events = []
    fake_driver.observer = events.append
    monkeypatch.setattr(gcuda, "door", None)  # entering it would fail
    buf = bytearray(8)
    req = pair.b.recv_nb(buf, tag=4)
    pair.ab.send(b"12345678", tag=4)
    pair.drive(req)
    assert buf == b"12345678"
    assert events == []


_INPROGRESS = _tag.lib.UCS_INPROGRESS


@pytest.mark.parametrize(
    ("module", "name", "mt_index", "call"),
    [
        (_tag, "gpucx_tag_recv_wait", 5, lambda p, b: p.b.recv(b, tag=1)),
        (_tag, "gpucx_tag_recv", 5, lambda p, b: p.b.recv(b, tag=1, timeout=5)),
        (_stream, "gpucx_stream_recv_wait", 4, lambda p, b: p.ab.stream_recv(b)),
        (
            _stream,
            "gpucx_stream_recv",
            3,
            lambda p, b: p.ab.stream_recv(b, timeout=5),
        ),
    ],
    ids=["tag-recv", "tag-recv-timeout", "stream-recv", "stream-recv-timeout"],
)
def test_blocking_receive_waits_outside_the_door(
    fake_driver, pair, monkeypatch, module, name, mt_index, call
):
    """A blocking receive into device memory posts through the door and
    waits after it: no device context stays pushed while the wait runs
    handlers (user code) for as long as the message takes."""
    arr = np.arange(32, dtype=np.uint8)
    events = []
    _setup_fake(fake_driver, pair, monkeypatch, arr, device=1, polls=0)
    fake_driver.observer = events.append
    fake_driver.current = OTHER_CTX
    monkeypatch.setattr(
        module,
        "lib",
        PostSpy(module.lib, {name}, events, mt_index, returns=_INPROGRESS),
    )
    seen = []

    def block(engine, slot, timeout, keep=None, *args):
        seen.append((fake_driver.current, list(fake_driver.stack)))
        return 0  # finished

    # The engine's block: the wait of every blocking operation.
    monkeypatch.setattr(Engine, "block", block)
    call(pair, FakeCudaArrayV2(arr))
    kinds = [e[0] for e in events]
    post = kinds.index("post")
    assert "push" in kinds[:post] and "pop" in kinds[post:]
    assert events[post][2] == CUDA
    assert seen == [(OTHER_CTX, [])]
    assert fake_driver.current == OTHER_CTX and fake_driver.stack == []
