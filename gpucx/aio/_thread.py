"""ProgressThread: progress a worker from a background thread."""

from __future__ import annotations

import threading

from .._internal import engine as _engine_of
from .._lib import lib
from ._faces import Worker as _AioWorker


class ProgressThread:
    """Progress a worker from a background thread, for blocking-API users
    who want completions without calling ``progress()``.

    The worker must have ``thread_mode="multi"``: the thread and the
    application then call into UCX concurrently, and UCX's own lock keeps
    that safe (gpucx adds no lock of its own).  The thread sleeps on the
    worker's event fd when idle.  It runs no Python handler, but its
    progress answers peers' heartbeat pings (in C), so a process whose
    main thread computes for long keeps its peers from failing it
    (docs/reliability.md, "The heartbeat").

    Raises
    ------
    ValueError
        If the worker is not in ``"multi"`` thread mode.
    """

    def __init__(self, worker):
        if worker.thread_mode != "multi":
            raise ValueError(
                'a progress thread needs a worker created with thread_mode="multi"'
            )
        if isinstance(worker, _AioWorker):
            # The face's own worker (the face once forwarded every
            # attribute, its engine included, to it).
            worker = worker.worker
        self._engine = e = _engine_of(worker)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="gpucx-progress", daemon=True
        )
        # The worker stops the thread before it destroys the UCX worker.
        e.on_close.append(self.stop)
        self._thread.start()

    def _loop(self) -> None:
        e = self._engine
        while not self._stop.is_set():
            h = e.h
            if h is None:
                return
            lib.gpucx_worker_sleep(h, e.efd, -1, 50)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and wait for it (wakes it through the fd)."""
        if self._stop.is_set():
            return
        self._stop.set()
        h = self._engine.h
        if h is not None:
            lib.ucp_worker_signal(h)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
