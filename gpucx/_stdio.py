"""Standard output for machine-read output, apart from UCX's log.

UCX writes its log (``UCX_LOG_LEVEL``, the ``UCX_PROTO_INFO`` tables) to
the process's stdout unless ``UCX_LOG_FILE`` says otherwise.  Where gpucx
prints something another program reads (``gpucx info --json``, the address
handshake of ``gpucx bench``'s local peer), such a line would corrupt it.
"""

from __future__ import annotations

import os
import sys
from typing import BinaryIO

__all__ = ["take_stdout"]


def take_stdout() -> BinaryIO:
    """Keep the process's stdout for the caller and send the rest to stderr,
    for the rest of the process (a command-line program's, not a library's).

    Returns an unbuffered binary file on the original stdout; file
    descriptor 1 (where UCX and ``print`` write) then points at stderr, so
    the user still sees UCX's log, and nothing else reaches the caller's
    reader.
    """
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    return out
