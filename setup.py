"""Build hook: cffi compiles gpucx._ucx from gpucx/_build_ucx.py (API mode).

``gpucx/_build_ucx.py`` (like ``gpucx/_cdefs/`` and the C sources) is needed
only to build the extension: the sdist carries it (MANIFEST.in), the wheel
does not.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD_ONLY_MODULES = {("gpucx", "_build_ucx")}


class BuildPy(build_py):
    """build_py that leaves the build-time-only modules out of the wheel."""

    def find_package_modules(self, package, package_dir):
        return [
            (pkg, mod, path)
            for pkg, mod, path in super().find_package_modules(package, package_dir)
            if (pkg, mod) not in BUILD_ONLY_MODULES
        ]


# cffi compiles the extension against the stable ABI (it is gpucx/_ucx.abi3.so),
# so one wheel serves every CPython the package supports: tag it cp310-abi3.
setup(
    cffi_modules=["gpucx/_build_ucx.py:ffibuilder"],
    cmdclass={"build_py": BuildPy},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
