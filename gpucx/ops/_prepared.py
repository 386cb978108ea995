"""What prepared batches share (:class:`~gpucx.Transfer`, :class:`AmBatch`):
the closed state, ``len()``, the with-statement, and the checks and CUDA
door around one run, and what a run's status becomes."""

from __future__ import annotations

from typing import Any

from .._handle import raise_closed
from .._internal import engine, handle
from .._lib import ffi
from ..errors import ClosedError
from ..mem import cuda as _cuda
from ..request import Request, _DoneAtPost, _new_done, finish


class Prepared:
    """Base of the prepared batches.  A subclass sets ``endpoint``,
    ``_items``, ``_count``, ``_keep`` (None once closed), ``_cuda_ptr`` and
    ``_cuda_mt`` (the first device buffer, or None)."""

    __slots__ = (
        "endpoint",
        "nbytes",
        "_items",
        "_count",
        "_keep",
        "_cuda_ptr",
        "_cuda_mt",
        "__weakref__",
    )

    endpoint: Any
    _items: Any
    _count: int
    _keep: list | None
    _cuda_ptr: int | None
    _cuda_mt: int

    def __len__(self) -> int:
        return self._count

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._keep is None

    def close(self) -> None:
        """Let go of the buffers.  Runs still in flight keep what they use
        until they complete.  Safe to call twice."""
        self._keep = None
        self._items = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _engine(self):
        """The progress engine of the endpoint's worker."""
        return engine(self.endpoint)

    def _open(self):
        """The engine and endpoint handle of a run; ClosedError if the
        batch or its endpoint is closed."""
        if self._keep is None:
            raise ClosedError(f"{type(self).__name__} is closed")
        ep = self.endpoint
        if ep.closed:
            raise_closed(ep)
        return engine(ep), handle(ep)

    def _through_door(self, e, stream, what: str, run, *args):
        """``run(*args)``, inside the CUDA door when the batch holds device
        memory or a ``stream`` is given (host batches skip it)."""
        if self._cuda_ptr is None and stream is None:
            return run(*args)
        with _cuda.door(e, self._cuda_ptr or 0, self._cuda_mt, stream, what):
            return run(*args)

    def _request(self, st: int, op, keep, what: str, holds=None) -> Request:
        """The request of a run posted with status ``st`` (``run_nb``):
        settled when every item finished at the post, else tracked on the
        run's own slot (``op.slot``), holding ``keep`` (and naming the
        remote keys it uses, ``holds``) until it completes."""
        if st == 0:
            return _new_done(_DoneAtPost)
        ep = self.endpoint
        slot = ffi.addressof(op, "slot")
        return Request(engine(ep), slot, keep, what, None, ep, None, holds)

    def _finish(self, st: int, op, keep, what: str, timeout, holds=None) -> None:
        """Complete a blocking run posted with status ``st`` (``run``): wait
        while it is pending, raise its first error."""
        if st:
            ep = self.endpoint
            slot = ffi.addressof(op, "slot")
            finish(engine(ep), slot, st, timeout, what, ep, keep, holds)
