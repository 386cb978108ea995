"""Dask distributed comm backend: the ``gpucx://`` scheme.

Registered through the ``distributed.comm.backends`` entry point, so
``LocalCluster(protocol="gpucx")`` and ``dask scheduler --protocol gpucx``
find it.  See docs/dask.md.
"""

from __future__ import annotations

try:
    import distributed  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "gpucx.dask needs Dask distributed: pip install 'gpucx[dask]'"
    ) from exc

from .comm import GpucxBackend, GpucxComm, GpucxConnector, GpucxListener

__all__ = ["GpucxBackend", "GpucxComm", "GpucxConnector", "GpucxListener"]
