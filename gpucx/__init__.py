"""gpucx: move array data between processes and GPUs through UCX.

The public names; everything else is internal.  See the user guide in
``docs/`` and the contract in ``DESIGN.md``.
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
    TimeoutError,
    UCXError,
    UnsupportedError,
)
from .listener import Listener
from .mem.memtype import MemoryType
from .mem.region import MemoryRegion
from .mem.remote import RemoteKey, RemoteMemory
from .ops.am import AmMessage
from .ops.tag import TAG_MASK_FULL, ProbedMessage
from .request import RecvInfo, Request
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
    "TAG_MASK_FULL",
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
    "QueueStats",
]
