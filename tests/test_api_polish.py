"""The public surface a ucxx/mpi4py user reaches for: exports, the aio
endpoints, keyword-only close, Request.cancelled(), probe's return type, the
remote-key names, and region views."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpucx

pytestmark = pytest.mark.timeout(60)


def test_view_of_registered_region_outlives_close():
    """A view keeps the registered object alive: valid after close."""
    with gpucx.Context(features={"rma"}) as ctx:
        data = np.arange(64, dtype=np.uint8)
        region = ctx.register(data)
        view = region.as_array(np.uint8)
        del data
        region.close()
        gc.collect()
        assert (view == np.arange(64, dtype=np.uint8)).all()
