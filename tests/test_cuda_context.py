"""The allocation context (gpucx.mem.cuda.device_context): the one way,
besides the door, that code makes a device context current; it pops what it
pushed, whatever fails inside.

Test doubles only: the CUDA driver is tests/fakegpu.FakeDriver (which logs
every call and keeps the context stack), or the fake libcuda under the real
ctypes bindings (``fake_libcuda``).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import test_gpu_layer as _layer

import gpucx
from gpucx.mem import cuda as gcuda

pytestmark = pytest.mark.timeout(60)

#: The fixture that hides the driver (conftest's fake_driver installs a
#: FakeDriver, a test double).
no_driver = _layer.no_driver

DEV0, DEV1 = 0xC0, 0xC1  # FakeDriver's primary contexts of devices 0 and 1


def _pushes(drv) -> list:
    return [c for c in drv.calls if c[0] in ("push", "pop", "set_current")]


def test_pushes_and_pops_another_device(fake_driver):
    fake_driver.current = DEV0
    with gcuda.device_context(device=1) as ctx:
        assert ctx == DEV1 and fake_driver.current == DEV1
        assert fake_driver.stack == [DEV0]
    assert fake_driver.current == DEV0 and fake_driver.stack == []
    assert _pushes(fake_driver) == [("push", DEV1), ("pop",)]


def test_pushes_nothing_when_the_context_is_current(fake_driver):
    fake_driver.current = DEV1
    with gcuda.device_context(device=1) as ctx:
        assert ctx == DEV1
    arr = np.zeros(8, np.uint8)
    ptr = arr.ctypes.data
    fake_driver.pointers[ptr] = (int(gpucx.MemoryType.CUDA), 1, DEV1)
    with gcuda.device_context(ptr=ptr) as ctx:
        assert ctx == DEV1
    # Without ptr or device: the thread's device, current already.
    with gcuda.device_context() as ctx:
        assert ctx == DEV1
    assert _pushes(fake_driver) == []
    assert fake_driver.current == DEV1 and fake_driver.stack == []


def test_sets_a_context_when_none_is_current(fake_driver):
    # A fresh thread: the device is made current and left so (as
    # cudaSetDevice does), nothing pushed to pop.
    with gcuda.device_context(device=1):
        assert fake_driver.current == DEV1
    assert fake_driver.current == DEV1 and fake_driver.stack == []
    assert _pushes(fake_driver) == [("set_current", DEV1)]


def test_pops_on_an_exception(fake_driver):
    fake_driver.current = DEV0
    with pytest.raises(KeyError), gcuda.device_context(device=1):
        assert fake_driver.current == DEV1
        raise KeyError("inside")
    assert fake_driver.current == DEV0 and fake_driver.stack == []
    # KeyboardInterrupt too: whatever fails, the context goes.
    with pytest.raises(KeyboardInterrupt), gcuda.device_context(device=1):
        raise KeyboardInterrupt
    assert fake_driver.current == DEV0 and fake_driver.stack == []


def test_nests(fake_driver):
    fake_driver.current = DEV0
    with gcuda.device_context(device=1):
        assert fake_driver.stack == [DEV0]
        with gcuda.device_context(device=0):
            assert fake_driver.current == DEV0 and fake_driver.stack == [DEV0, DEV1]
            with gcuda.device_context(device=0):  # current: nothing pushed
                assert fake_driver.stack == [DEV0, DEV1]
        assert fake_driver.current == DEV1 and fake_driver.stack == [DEV0]
    assert fake_driver.current == DEV0 and fake_driver.stack == []


def test_a_failing_inner_context_leaves_the_outer_one(fake_driver):
    fake_driver.current = DEV0
    with gcuda.device_context(device=1):
        with pytest.raises(RuntimeError), gcuda.device_context(device=0):
            raise RuntimeError("inner")
        assert fake_driver.current == DEV1 and fake_driver.stack == [DEV0]
    assert fake_driver.current == DEV0 and fake_driver.stack == []


@pytest.mark.parametrize("device", [2, 7, -1, True, "0", 1.0])
def test_a_device_this_host_lacks_is_refused(fake_driver, device):
    fake_driver.current = DEV0
    with (
        pytest.raises(ValueError, match=r"this host has 2 CUDA device\(s\)"),
        gcuda.device_context(device=device),
    ):
        pytest.fail("entered")
    assert _pushes(fake_driver) == [] and fake_driver.current == DEV0


def test_the_device_count_is_asked_once_per_driver(fake_driver):
    fake_driver.current = DEV0
    for _ in range(3):
        with gcuda.device_context(device=1):
            pass
    assert fake_driver.names().count("device_count") == 1


def test_no_current_device_among_several(fake_driver):
    # No ptr, no device, nothing current, two devices and no CuPy: which
    # device is meant cannot be told, and nothing is made current.
    saved = sys.modules.pop("cupy", None)
    try:
        with pytest.raises(ValueError, match="none is current"), gcuda.device_context():
            pytest.fail("entered")
    finally:
        if saved is not None:
            sys.modules["cupy"] = saved
    assert _pushes(fake_driver) == []


def test_without_a_driver(no_driver):
    with (
        pytest.raises(gpucx.UnsupportedError, match="no CUDA driver"),
        gcuda.device_context(device=0),
    ):
        pytest.fail("entered")


def test_a_refused_context_leaves_nothing_pushed(fake_driver):
    fake_driver.current = DEV0

    def refuse(device):
        raise gcuda.DriverError("cuDevicePrimaryCtxRetain: test")

    fake_driver.primary_context = refuse
    with pytest.raises(gcuda.DriverError, match="test"), gcuda.device_context(device=1):
        pytest.fail("entered")
    assert fake_driver.current == DEV0 and fake_driver.stack == []


def test_over_the_real_bindings(fake_libcuda):
    # The fake libcuda's context stack (fake_depth): push and pop balance
    # through an exception, and a nested context of the current device
    # pushes nothing.
    drv = fake_libcuda
    drv.set_current(drv.primary_context(1))
    depth = drv._lib.fake_depth()
    with pytest.raises(OSError), gcuda.device_context(device=0) as ctx:
        assert drv.current_context() == ctx == drv.primary_context(0)
        assert drv._lib.fake_depth() == depth + 1
        with gcuda.device_context(device=0):
            assert drv._lib.fake_depth() == depth + 1
        raise OSError("inside")
    assert drv._lib.fake_depth() == depth
    assert drv.current_context() == drv.primary_context(1)
    with pytest.raises(ValueError, match="device=9"), gcuda.device_context(device=9):
        pass
