"""Alias of :mod:`gpucx.info` (``gpucx info`` moved beside the CLI)."""

import sys

from .. import info as _info

sys.modules[__name__] = _info
