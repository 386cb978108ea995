"""Dask clusters over gpucx:// (real scheduler, workers, nannies)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster, Nanny, Scheduler, Worker  # noqa: E402
from distributed.utils_test import gen_cluster, gen_test, inc  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@gen_cluster(client=True, scheduler_kwargs={"protocol": "gpucx"})
async def test_tasks_over_gpucx(c, s, a, b):
    assert s.address.startswith("gpucx://")
    assert a.address.startswith("gpucx://") and b.address.startswith("gpucx://")
    assert await c.submit(inc, 1) == 2
    x = da.random.random((300, 300), chunks=(100, 100))
    y = (x + x.T).sum()
    assert abs(await c.compute(y) - 2 * float((await c.compute(x)).sum())) < 1e-6
    # 12 MB scatter and gather.
    arr = np.random.default_rng(3).random(1_500_000)
    [fut] = await c.scatter([arr])
    np.testing.assert_array_equal(await fut, arr)
    # Worker-to-worker: made on a, consumed on b.
    made = c.submit(np.ones, 2_000_000, workers=[a.address], pure=False)
    total = c.submit(np.sum, made, workers=[b.address], pure=False)
    assert await total == 2_000_000


@pytest.mark.parametrize("cls", [Worker, Nanny])
@gen_test(timeout=60)
async def test_protocol_from_the_scheduler_address(cls):
    async with (
        Scheduler(protocol="gpucx", dashboard_address=":0") as s,
        cls(s.address) as w,
        Client(s.address, asynchronous=True) as c,
    ):
        assert w.address.startswith("gpucx://")
        assert await c.submit(inc, 41) == 42


@gen_test(timeout=60)
async def test_local_cluster_processes_worker_to_worker_and_clean_close(caplog):
    caplog.set_level(logging.WARNING, logger="distributed")
    async with (
        LocalCluster(
            protocol="gpucx",
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=":0",
            asynchronous=True,
        ) as cluster,
        Client(cluster, asynchronous=True) as c,
    ):
        assert cluster.scheduler_address.startswith("gpucx://")
        await c.wait_for_workers(2)
        wa, wb = sorted(cluster.scheduler.workers)
        assert wa.startswith("gpucx://") and wb.startswith("gpucx://")
        made = c.submit(np.arange, 4_000_000, workers=[wa], pure=False)
        total = c.submit(np.sum, made, workers=[wb], pure=False)
        assert await total == np.arange(4_000_000).sum()
        arr = np.random.default_rng(4).random(1_000_000)
        fut = await c.scatter(arr, workers=[wa])
        moved = c.submit(lambda x: x * 2, fut, workers=[wb], pure=False)
        np.testing.assert_array_equal(await moved, arr * 2)
        gathered = await c.gather(c.map(inc, range(50)))
        assert gathered == list(range(1, 51))
    await asyncio.sleep(0.2)
    noisy = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "gpucx" in r.getMessage()
    ]
    assert not noisy, noisy


@gen_test(timeout=30)
async def test_client_to_an_unreachable_scheduler_times_out_with_oserror():
    async with Scheduler(protocol="gpucx", dashboard_address=":0") as s:
        addr = s.address
    with pytest.raises(OSError, match="Timed out trying to connect"):
        await Client(addr, asynchronous=True, timeout=1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dask_scheduler_and_worker_cli_over_gpucx(tmp_path):
    """``dask scheduler --protocol gpucx`` and ``dask worker gpucx://...``."""
    import os
    import re
    import subprocess
    import sys
    import time

    dask_cli = os.path.join(os.path.dirname(sys.executable), "dask")
    log = tmp_path / "scheduler.log"
    procs = []
    try:
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [
                        dask_cli,
                        "scheduler",
                        "--protocol",
                        "gpucx",
                        "--port",
                        "0",
                        "--host",
                        "127.0.0.1",
                        "--no-dashboard",
                    ],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
        addr = None
        deadline = time.monotonic() + 60
        while addr is None and time.monotonic() < deadline:
            m = re.search(r"Scheduler at:\s+(gpucx://\S+)", log.read_text())
            addr = m.group(1) if m else None
            time.sleep(0.2)
        assert addr, log.read_text()
        procs.append(
            subprocess.Popen(
                [
                    dask_cli,
                    "worker",
                    addr,
                    "--nthreads",
                    "1",
                    "--no-nanny",
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        with Client(addr, timeout=30) as c:
            c.wait_for_workers(1, timeout=60)
            assert all(w.startswith("gpucx://") for w in c.scheduler_info()["workers"])
            assert c.submit(inc, 1).result(timeout=30) == 2
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
