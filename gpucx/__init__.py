"""gpucx: move array data between processes and GPUs through UCX.

The public names; everything else is internal.  The guides are in ``docs/``
(built with the API reference by ``mkdocs build``: see ``mkdocs.yml``).
``gpucx.aio`` (asyncio) is imported on first use as an attribute, or with
``import gpucx.aio``.
"""

from ._bounds import QueueStats
from ._lib import UCX_VERSION
from ._version import __version__
from .context import Context
from .endpoint import Endpoint
from .errors import (
    AlreadyReceivedError,
    CanceledError,
    ClosedError,
    DroppedMessagesWarning,
    InvalidAddressError,
    MessageTruncatedError,
    PeerError,
    SlowPathWarning,
    TimeoutError,
    UCXError,
    UnsupportedError,
)
from .listener import Listener
from .mem.cuda import DriverError
from .mem.memtype import MemoryType
from .mem.region import MemoryRegion
from .mem.remote import RemoteKey, RemoteMemory
from .ops.am import AmMessage
from .ops.rma import NOTIFY_MAX, Transfer
from .ops.tag import TAG_MASK_FULL, ProbedMessage
from .protocols import request_protocol as _request_protocol
from .request import RecvInfo, Request
from .request import set_awaiter as _set_awaiter
from .request import set_protocol_reader as _set_protocol_reader
from .worker import Worker

__all__ = [
    "__version__",
    "UCX_VERSION",
    "Context",
    "Worker",
    "Endpoint",
    "Listener",
    "Request",
    "RecvInfo",
    "ProbedMessage",
    "AmMessage",
    "MemoryType",
    "MemoryRegion",
    "RemoteMemory",
    "RemoteKey",
    "Transfer",
    "TAG_MASK_FULL",
    "NOTIFY_MAX",
    "UCXError",
    "ClosedError",
    "CanceledError",
    "MessageTruncatedError",
    "PeerError",
    "TimeoutError",
    "UnsupportedError",
    "InvalidAddressError",
    "AlreadyReceivedError",
    "DroppedMessagesWarning",
    "SlowPathWarning",
    "QueueStats",
    "DriverError",
]


def _first_await(req):
    # The first ``await`` of a request loads gpucx.aio, which registers its
    # own awaiter for the next ones (the request layer knows no event loop).
    from . import aio

    return aio.wait_request(req)


_set_awaiter(_first_await)
# Request.protocol reads UCX's report through the operations' layer, which
# the request layer below it does not import (docs/layout.md, "Layers").
_set_protocol_reader(_request_protocol)


def __getattr__(name: str):
    # ``gpucx.aio`` without ``import gpucx.aio``: imported on first use, so
    # ``import gpucx`` does not pull in asyncio.
    if name == "aio":
        import importlib

        return importlib.import_module(".aio", __name__)
    raise AttributeError(f"module 'gpucx' has no attribute {name!r}")
