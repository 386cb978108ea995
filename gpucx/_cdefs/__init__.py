"""cffi declarations, one module per UCX header (build time only).

Each module defines ``INCLUDES`` (C preprocessor lines), ``TYPES`` and
``FUNCTIONS`` (cdef text).  ``gpucx/_build_ucx.py`` joins them in the order of
``MODULES``.  Nothing here is imported at runtime.
"""

MODULES = [
    "ucs",
    "ucp_context",
    "ucp_worker",
    "ucp_ep",
    "ucp_mem",
    "ucp_ops",
    "helpers",
]
