"""Build hook: cffi compiles gpucx._ucx from gpucx/_build_ucx.py (API mode)."""

from setuptools import setup

setup(cffi_modules=["gpucx/_build_ucx.py:ffibuilder"])
