"""Memory types, mirroring ``ucs_memory_type_t`` (values read from UCX)."""

from __future__ import annotations

import enum

from .._lib import lib


class MemoryType(enum.IntEnum):
    """Kind of memory a buffer lives in (``ucs_memory_type_t``).

    ``HOST`` is ordinary system memory, ``CUDA`` NVIDIA device memory,
    ``CUDA_MANAGED`` CUDA unified memory, and so on; ``UNKNOWN`` lets UCX
    detect the type itself.  Values are read from the UCX headers.
    """

    HOST = lib.UCS_MEMORY_TYPE_HOST
    CUDA = lib.UCS_MEMORY_TYPE_CUDA
    CUDA_MANAGED = lib.UCS_MEMORY_TYPE_CUDA_MANAGED
    ROCM = lib.UCS_MEMORY_TYPE_ROCM
    ROCM_MANAGED = lib.UCS_MEMORY_TYPE_ROCM_MANAGED
    RDMA = lib.UCS_MEMORY_TYPE_RDMA
    ZE_HOST = lib.UCS_MEMORY_TYPE_ZE_HOST
    ZE_DEVICE = lib.UCS_MEMORY_TYPE_ZE_DEVICE
    ZE_MANAGED = lib.UCS_MEMORY_TYPE_ZE_MANAGED
    UNKNOWN = lib.UCS_MEMORY_TYPE_UNKNOWN


CUDA_TYPES = frozenset({MemoryType.CUDA, MemoryType.CUDA_MANAGED})
"""The CUDA memory types (device and managed memory)."""

# Plain-int forms for the hot paths, which compare the ``int`` memory types
# that the C helpers return: every module imports these, none redefines them.
HOST_INT: int = int(MemoryType.HOST)
CUDA_INTS: frozenset[int] = frozenset(int(m) for m in CUDA_TYPES)

__all__ = ["MemoryType", "CUDA_TYPES", "HOST_INT", "CUDA_INTS"]
