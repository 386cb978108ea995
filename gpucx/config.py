"""Context configuration: features and UCX options.

UCX options are given without the ``UCX_`` prefix (``{"TLS": "tcp"}``) and
applied with ``ucp_config_modify`` on top of what ``UCX_*`` environment
variables say; gpucx never writes ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from ._lib import lib

FEATURES = {
    "tag": lib.UCP_FEATURE_TAG,
    "am": lib.UCP_FEATURE_AM,
    "rma": lib.UCP_FEATURE_RMA,
    "amo": lib.UCP_FEATURE_AMO32 | lib.UCP_FEATURE_AMO64,
    "stream": lib.UCP_FEATURE_STREAM,
}

THREAD_MODES = {
    "single": lib.UCS_THREAD_MODE_SINGLE,
    "serialized": lib.UCS_THREAD_MODE_SERIALIZED,
    "multi": lib.UCS_THREAD_MODE_MULTI,
}

#: Options gpucx sets when neither the user's config nor the environment
#: chooses them.  With peer error handling (gpucx's default), UCX drops its
#: shared-memory transports unless MM_ERROR_HANDLING is on, and local
#: traffic silently moves to TCP (about 10x slower).
DEFAULTS = {"MM_ERROR_HANDLING": "y"}


def feature_mask(features: Iterable[str] | None) -> tuple[int, frozenset[str]]:
    """Turn feature names into a ``UCP_FEATURE_*`` mask (wakeup always on).

    Raises
    ------
    ValueError
        For a name that is not one of ``tag, am, rma, amo, stream``.
    """
    names = frozenset(FEATURES) if features is None else frozenset(features)
    if isinstance(features, str):
        names = frozenset({features})
    unknown = sorted(names - FEATURES.keys())
    if unknown:
        raise ValueError(
            f"unknown feature(s) {unknown}; choose from {sorted(FEATURES)}"
        )
    if not names:
        raise ValueError("at least one feature is needed")
    mask = lib.UCP_FEATURE_WAKEUP
    for name in names:
        mask |= FEATURES[name]
    return mask, names


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "y" if value else "n"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def normalize(config: Mapping[str, object] | None) -> dict[str, str]:
    """Validate the user's options and add gpucx's defaults.

    Raises
    ------
    TypeError
        If ``config`` is not a mapping of strings to values.
    """
    out: dict[str, str] = {}
    if config is not None:
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, not {type(config).__name__}")
        for key, value in config.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"config keys must be non-empty strings, got {key!r}")
            name = key[4:] if key.upper().startswith("UCX_") else key
            out[name.upper()] = _text(value)
    for name, value in DEFAULTS.items():
        if name not in out and f"UCX_{name}" not in os.environ:
            out[name] = value
    return out
