"""The one entry to the compiled extension.

Loads libucx (the ``libucx-cu12`` wheel by default, or the UCX installation
named by ``GPUCX_UCX_PREFIX``), imports ``gpucx._ucx``, and checks that the
extension matches this package and that the runtime UCX is new enough.  Every
other module gets ``ffi`` and ``lib`` from here.
"""

from __future__ import annotations

import os

from ._version import __version__

# The oldest UCX the supported range (pyproject, README "UCX versions")
# starts at; older releases differ in behaviour gpucx relies on (1.19 accepts
# unknown config keys and warns about MM_ERROR_HANDLING without shared-memory
# transports; see benchmarks/RESULTS.md, "UCX versions").
MIN_UCX = (1, 20)

_prefix = os.environ.get("GPUCX_UCX_PREFIX", "").strip()

if not _prefix:
    try:
        import libucx
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise ImportError(
            "gpucx needs the libucx-cu12 wheel (pip install libucx-cu12), or "
            "GPUCX_UCX_PREFIX set to a UCX installation it was built against"
        ) from exc
    # dlopen the wheel's libucs/libucp so the extension's DT_NEEDED entries
    # resolve without LD_LIBRARY_PATH.
    libucx.load_library()

try:
    from ._ucx import ffi, lib
except ImportError as exc:
    raise ImportError(
        f"cannot import the gpucx extension ({exc}). Rebuild it with "
        "`pip install -e .` (and the same GPUCX_UCX_PREFIX as at run time)."
    ) from exc


def _check() -> tuple[int, int, int]:
    built = ffi.string(lib.gpucx_package_version()).decode()
    if built != __version__:
        raise ImportError(
            f"gpucx extension was built for gpucx {built}, this is {__version__}: "
            "rebuild it with `pip install -e .`"
        )
    built_prefix = ffi.string(lib.gpucx_build_ucx_prefix()).decode()
    if built_prefix != (os.path.realpath(_prefix) if _prefix else ""):
        raise ImportError(
            f"gpucx was built against UCX at {built_prefix or 'the libucx wheel'} "
            f"but GPUCX_UCX_PREFIX is {_prefix or 'unset'}: set it to the same "
            "value as at build time, or rebuild with `pip install -e .`"
        )
    v = ffi.new("unsigned[3]")
    lib.ucp_get_version(v, v + 1, v + 2)
    loaded = (v[0], v[1], v[2])
    problem = version_problem(loaded)
    if problem:
        raise ImportError(problem)
    return loaded


def version_problem(loaded: tuple[int, int, int]) -> str | None:
    """Why the loaded UCX version cannot be used, or None if it can."""
    if loaded[:2] < MIN_UCX:
        return (
            f"gpucx needs UCX >= {MIN_UCX[0]}.{MIN_UCX[1]}, the loaded libucp is "
            f"{'.'.join(map(str, loaded))}: upgrade libucx-cu12 or point "
            "GPUCX_UCX_PREFIX at a newer UCX"
        )
    return None


UCX_VERSION = _check()

__all__ = ["ffi", "lib", "UCX_VERSION", "MIN_UCX"]
