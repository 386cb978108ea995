"""Memory types, mirroring ``ucs_memory_type_t`` (values read from UCX)."""

from __future__ import annotations

import enum

from .._lib import lib

_names = [
    "HOST",
    "CUDA",
    "CUDA_MANAGED",
    "ROCM",
    "ROCM_MANAGED",
    "RDMA",
    "ZE_HOST",
    "ZE_DEVICE",
    "ZE_MANAGED",
]
_members = {name: getattr(lib, f"UCS_MEMORY_TYPE_{name}") for name in _names}
if lib.GPUCX_MEMORY_TYPE_GAUDI >= 0:
    _members["GAUDI"] = lib.GPUCX_MEMORY_TYPE_GAUDI
_members["UNKNOWN"] = lib.UCS_MEMORY_TYPE_UNKNOWN

MemoryType = enum.IntEnum("MemoryType", _members, module=__name__)
MemoryType.__doc__ = """Kind of memory a buffer lives in (``ucs_memory_type_t``).

``HOST`` is ordinary system memory, ``CUDA`` NVIDIA device memory,
``CUDA_MANAGED`` CUDA unified memory, and so on; ``UNKNOWN`` lets UCX detect
the type itself.
"""

CUDA_TYPES = frozenset({MemoryType.CUDA, MemoryType.CUDA_MANAGED})

__all__ = ["MemoryType", "CUDA_TYPES"]
