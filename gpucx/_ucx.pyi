# The cffi extension built from gpucx/_build_ucx.py.  Its surface is the
# cdefs in gpucx/_cdefs/; cffi objects are dynamic, so they are typed Any.
from typing import Any

ffi: Any
lib: Any
