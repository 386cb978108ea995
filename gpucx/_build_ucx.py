"""cffi builder for ``gpucx._ucx`` (API mode).  Build time only.

Finds UCX headers and libraries:

* ``GPUCX_UCX_PREFIX`` set: a system UCX installed under that prefix
  (``include/`` and ``lib/`` or ``lib64/``); the extension gets an rpath to it.
* otherwise: the ``libucx-cu12`` wheel (headers in ``libucx/include``); the
  runtime loads the wheel's libraries before importing the extension, so no
  rpath and no ``LD_LIBRARY_PATH`` are needed.

The cdefs come from ``gpucx/_cdefs/*.py`` (one module per UCX header, joined
in the order of ``_cdefs.MODULES``); the C source is one translation unit:
``_csrc/gpucx.h`` (``C_HEADER``: what the files share), included once at the
top, then ``_ucx_helpers.c`` and the per-area files in ``C_SOURCES``.
"""

import os
import pathlib
import runpy

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
CDEFS = HERE / "_cdefs"

# The header every C file shares (records, slot kinds, declarations of
# functions called before the file defining them), included at the top.
C_HEADER = "_csrc/gpucx.h"
# Per-area C helpers appended after _ucx_helpers.c, in this order.  Every one
# must be there (the header too): a missing source is a build error, never
# skipped.
C_SOURCES = ["_ucx_helpers.c"] + [
    f"_csrc/{name}.c"
    for name in (
        "engine",
        "worker",
        "ep",
        "tag",
        "am",
        "stream",
        "rma",
        "atomic",
        "am_batch",
        "bench",
        "sockaddr",
        "proto",
    )
]


def _check_sources():
    """Fail the build, naming every missing file, if a source is not there."""
    needed = [HERE / n for n in (C_HEADER, *C_SOURCES)] + [CDEFS / "__init__.py"]
    if needed[-1].is_file():
        order = runpy.run_path(str(needed[-1]))["MODULES"]
        needed += [CDEFS / f"{name}.py" for name in order]
    missing = [str(p.relative_to(HERE.parent)) for p in needed if not p.is_file()]
    if missing:
        raise RuntimeError(
            "cannot build gpucx._ucx: missing source file(s) "
            + ", ".join(missing)
            + " (an sdist without them is incomplete: see MANIFEST.in)"
        )


def _package_version():
    return runpy.run_path(str(HERE / "_version.py"))["__version__"]


def _ucx_location():
    prefix = os.environ.get("GPUCX_UCX_PREFIX", "").strip()
    if prefix:
        root = pathlib.Path(prefix).resolve()
        libdir = next(
            (d for d in (root / "lib", root / "lib64") if (d / "libucp.so").exists()),
            None,
        )
        if not (root / "include" / "ucp" / "api" / "ucp.h").exists() or libdir is None:
            raise RuntimeError(
                f"GPUCX_UCX_PREFIX={prefix}: expected include/ucp/api/ucp.h and "
                "lib/libucp.so (or lib64/) under it"
            )
        return str(root / "include"), str(libdir), str(root)
    try:
        import libucx
    except ImportError as exc:
        raise RuntimeError(
            "building gpucx needs the libucx-cu12 wheel (pip install libucx-cu12) "
            "or GPUCX_UCX_PREFIX pointing at a UCX installation"
        ) from exc
    root = pathlib.Path(libucx.__file__).resolve().parent
    return str(root / "include"), str(root / "lib"), ""


def _load_cdefs():
    order = runpy.run_path(str(CDEFS / "__init__.py"))["MODULES"]
    includes, types, functions = [], [], []
    for name in order:
        mod = runpy.run_path(str(CDEFS / f"{name}.py"))
        includes.append(mod["INCLUDES"])
        types.append(mod["TYPES"])
        functions.append(mod["FUNCTIONS"])
    # Per-area helper cdefs (helpers_am.py, ...) follow the core helpers.
    for path in sorted(CDEFS.glob("helpers_*.py")):
        mod = runpy.run_path(str(path))
        types.append(mod["TYPES"])
        functions.append(mod["FUNCTIONS"])
    return "\n".join(includes), "\n".join(types) + "\n".join(functions)


def build_ffi():
    _check_sources()
    include_dir, lib_dir, prefix = _ucx_location()
    includes, cdef = _load_cdefs()
    header = HERE / C_HEADER
    source = "\n".join(
        [includes, f'#include "{header.name}"']
        + [(HERE / name).read_text() for name in C_SOURCES]
    )
    ffi = FFI()
    ffi.cdef(cdef)
    extra_link = [f"-Wl,-rpath,{lib_dir}"] if prefix else []
    ffi.set_source(
        "gpucx._ucx",
        source,
        include_dirs=[include_dir, str(header.parent)],
        library_dirs=[lib_dir],
        libraries=["ucp", "ucs"],
        define_macros=[
            ("GPUCX_VERSION_STRING", f'"{_package_version()}"'),
            ("GPUCX_UCX_PREFIX_STRING", f'"{prefix}"'),
        ],
        extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
        extra_link_args=extra_link,
    )
    return ffi


ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent / "build" / "cffi"), verbose=True)
