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


#: Prefix of gpucx's own options in ``Context(config=...)``; they are never
#: passed to UCX.
GPUCX_PREFIX = "GPUCX_"
#: gpucx's own options and their defaults.
GPUCX_OPTIONS: dict[str, float] = {
    # Seconds between two liveness checks of a worker's peers on this host
    # (0 = never); see gpucx._liveness.
    "PEER_CHECK_INTERVAL": float(os.environ.get("GPUCX_PEER_CHECK_INTERVAL", "0.1")),
    # Largest array payload recv_array accepts, in bytes (0 = no limit); see
    # gpucx.ops.arrays.recv_array.
    "MAX_ARRAY_BYTES": 0.0,
}
#: gpucx options whose value must be a whole number.
GPUCX_INTEGER_OPTIONS = frozenset({"MAX_ARRAY_BYTES"})


def gpucx_options(config: Mapping[str, object] | None) -> dict[str, float]:
    """gpucx's own options (``GPUCX_*`` keys) of a context config.

    Raises
    ------
    ValueError
        For an unknown ``GPUCX_*`` key or a value that is not a number >= 0
        (a whole number for ``GPUCX_MAX_ARRAY_BYTES``).
    """
    out = dict(GPUCX_OPTIONS)
    if not isinstance(config, Mapping):
        return out
    for key, value in config.items():
        if not isinstance(key, str) or not key.upper().startswith(GPUCX_PREFIX):
            continue
        name = key.upper()[len(GPUCX_PREFIX) :]
        if name not in GPUCX_OPTIONS:
            known = sorted(GPUCX_PREFIX + k for k in GPUCX_OPTIONS)
            raise ValueError(f"unknown gpucx option {key!r}; known: {known}")
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            number = -1.0
        if not number >= 0:
            raise ValueError(
                f"gpucx option {key!r} must be a number >= 0, not {value!r}"
            )
        if name in GPUCX_INTEGER_OPTIONS and not number.is_integer():
            raise ValueError(
                f"gpucx option {key!r} must be a whole number >= 0, not {value!r}"
            )
        out[name] = number
    return out


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
            if key.upper().startswith(GPUCX_PREFIX):
                continue  # gpucx's own option (gpucx_options), not UCX's
            name = key[4:] if key.upper().startswith("UCX_") else key
            out[name.upper()] = _text(value)
    for name, value in DEFAULTS.items():
        if name not in out and f"UCX_{name}" not in os.environ:
            out[name] = value
    return out
