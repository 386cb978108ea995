"""What memory is: the buffer door, memory types (registration comes next)."""

from .buffer import Buffer, as_buffer, set_stream_sync_hook
from .memtype import MemoryType

__all__ = ["Buffer", "as_buffer", "set_stream_sync_hook", "MemoryType"]
