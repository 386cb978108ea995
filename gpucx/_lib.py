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

#: UCX's grace period for its memory hooks (UCX 1.22 and up): when libucs
#: loads, UCM patches mmap, munmap and the like in place and waits this long
#: after each patch, in case another thread is running the function just
#: patched (50 ms each by default, about 0.4 s per process start).
_GRACE = "UCX_MEM_BISTRO_GRACE_DURATION"


def _single_threaded() -> bool:
    """Whether this process has one thread (Linux: /proc/self/task)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _load() -> None:
    """Load libucx and the extension.

    In a process with one thread no other thread can be inside a function
    UCM patches, so the grace period guards nothing: it is set to 0 for
    the load, unless the user set it, and removed again before UCX reads
    its configuration (an older UCX, which has no such option, never sees
    it; child processes do not inherit it).  A process that started threads
    first (NumPy's OpenBLAS pool, for one) keeps UCX's default.
    """
    fast = _GRACE not in os.environ and _single_threaded()
    if fast:
        os.environ[_GRACE] = "0"
    try:
        if not _prefix:
            try:
                import libucx
            except ImportError as exc:  # pragma: no cover - a dependency
                raise ImportError(
                    "gpucx needs the libucx-cu12 wheel (pip install "
                    "libucx-cu12), or GPUCX_UCX_PREFIX set to a UCX "
                    "installation it was built against"
                ) from exc
            # dlopen the wheel's libucs/libucp so the extension's DT_NEEDED
            # entries resolve without LD_LIBRARY_PATH.
            libucx.load_library()
        try:
            from . import _ucx  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                f"cannot import the gpucx extension ({exc}). Rebuild it with "
                "`pip install -e .` (and the same GPUCX_UCX_PREFIX as at run "
                "time)."
            ) from exc
    finally:
        if fast:
            os.environ.pop(_GRACE, None)


_load()
from ._ucx import ffi, lib  # noqa: E402


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
