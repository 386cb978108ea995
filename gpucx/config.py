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

#: UCX options gpucx sets for the GPU paths, each with why (``gpucx info``
#: prints both).  Unlike :data:`DEFAULTS` each is set only where this UCX
#: knows it (a UCX without CUDA transports has no ``CUDA_IPC_*`` options,
#: UCX before 1.22 has no ``RMA_PPLN_ENABLE``), and never where the user's
#: config or a ``UCX_*`` variable chooses it: ``Context.tuned`` says which
#: took effect.  Measured on one H100 (benchmarks/RESULTS.md, "GPU paths at
#: the machine's speed"); each replaces a fallback UCX takes on a single-GPU
#: or PCIe node, and none changes a host-to-host protocol.
TUNED = {
    "CUDA_IPC_ENABLE_GET_ZCOPY": (
        "y",
        "get of GPU memory over CUDA IPC; UCX turns it off when device 0 "
        "has no NVLink (one GPU, PCIe), leaving a software emulation over "
        "shared memory at about 1 GB/s",
    ),
    "RNDV_PIPELINE_ERROR_HANDLING": (
        "y",
        "host/GPU rendezvous pipelines (staged through GPU fragments over "
        "CUDA IPC) with peer error handling, gpucx's default; without it "
        "UCX falls back to copy-in/copy-out over shared memory",
    ),
    "RMA_PPLN_ENABLE": (
        "y",
        "put/get between host and GPU memory by rendezvous (UCX 1.22 and "
        "later, peers on 1.22 too) rather than software emulation",
    ),
}


#: Prefix of gpucx's own options in ``Context(config=...)``; they are never
#: passed to UCX.
GPUCX_PREFIX = "GPUCX_"
_MiB = 1 << 20
#: gpucx's own options and their defaults (docs/reliability.md lists them).
GPUCX_OPTIONS: dict[str, float] = {
    # Seconds between two liveness checks of a worker's peers on this host
    # (0 = never); see gpucx._liveness.  Also read from the environment.
    "PEER_CHECK_INTERVAL": 0.1,
    # Microseconds a blocking call spins progressing before it sleeps on the
    # worker's event fd.  Also read from the environment.
    "SPIN_US": 5000.0,
    # Largest array payload recv_array accepts, in bytes (0 = no limit); see
    # gpucx.ops.arrays.recv_array.
    "MAX_ARRAY_BYTES": float(4 << 30),
    # Caps of the queues a peer fills without the application's help (0 =
    # no cap); past one, messages are dropped and counted (Worker.stats()).
    # Active messages kept for posted receives (all ids of a worker).
    "AM_KEPT_MAX_COUNT": 16384.0,
    "AM_KEPT_MAX_BYTES": float(64 * _MiB),
    # Active messages waiting for their handler (a worker progressed by a
    # ProgressThread only, or by C waits that do not run handlers).
    "AM_QUEUE_MAX_COUNT": 16384.0,
    "AM_QUEUE_MAX_BYTES": float(64 * _MiB),
    # Put-with-notify notifications not yet taken.
    "NOTIFY_MAX_COUNT": 16384.0,
    "NOTIFY_MAX_BYTES": float(16 * _MiB),
    # Arrays (send_array) waiting for recv_array, all senders together.
    "ARRAY_QUEUE_MAX_COUNT": 4096.0,
    "ARRAY_QUEUE_MAX_BYTES": float(64 * _MiB),
    # gpucx's own same-host path for put/get on CUDA regions (1 = on, 0 =
    # off: UCX serves every put and get); see docs/rma.md.  Also read from
    # the environment.
    "CUDA_IPC_RMA": 1.0,
    # Seconds within which a peer on another host that stops answering (its
    # host or link gone, or the peer not taking data) fails the operations
    # pending on it (0 = UCX's own timeouts); mapped onto UCX options by
    # peer_timeout_options, docs/reliability.md "Peers on other hosts".
    # Also read from the environment.
    "PEER_TIMEOUT": 10.0,
    # Most bytes of page-locked host memory a worker holds to stage host
    # payloads into device memory (0 = off: UCX receives them straight into
    # device memory); see gpucx.ops._staging and docs/gpu.md.  Also read from
    # the environment.
    "STAGING_BYTES": float(256 * _MiB),
    # What a blocking operation whose deadline passed does with an operation
    # UCX cannot withdraw: 0 "park" (keep its buffer until UCX lets go), 1
    # "release" (force-close its endpoint first); written as either name.
    # docs/reliability.md "Deadlines and the buffer".  Also read from the
    # environment.
    "ON_TIMEOUT": 0.0,
    # Bytes that operations given up on same-host endpoints may hold while
    # UCX keeps them (0 = no limit); past it, connect(mode="same-host")
    # refuses (Worker.stranded_bytes, docs/guide.md "Endpoint modes").
    "MAX_STRANDED_BYTES": float(512 * _MiB),
}
#: The values of ``GPUCX_ON_TIMEOUT`` (and of every ``on_timeout=``), by
#: their number in :data:`GPUCX_OPTIONS`.
ON_TIMEOUT_MODES = ("park", "release")
#: gpucx options whose value must be a whole number.
GPUCX_INTEGER_OPTIONS = frozenset(
    {
        "MAX_ARRAY_BYTES",
        "AM_KEPT_MAX_COUNT",
        "AM_KEPT_MAX_BYTES",
        "AM_QUEUE_MAX_COUNT",
        "AM_QUEUE_MAX_BYTES",
        "NOTIFY_MAX_COUNT",
        "NOTIFY_MAX_BYTES",
        "ARRAY_QUEUE_MAX_COUNT",
        "ARRAY_QUEUE_MAX_BYTES",
        "CUDA_IPC_RMA",
        "STAGING_BYTES",
        "ON_TIMEOUT",
        "MAX_STRANDED_BYTES",
    }
)
#: gpucx options also read from the environment (``GPUCX_<NAME>``); a
#: ``Context(config=...)`` value wins.
GPUCX_ENV_OPTIONS = (
    "PEER_CHECK_INTERVAL",
    "SPIN_US",
    "CUDA_IPC_RMA",
    "PEER_TIMEOUT",
    "STAGING_BYTES",
    "ON_TIMEOUT",
)


def on_timeout_mode(value: object) -> str:
    """Check an ``on_timeout=`` value: ``"park"`` or ``"release"``.

    Raises
    ------
    ValueError
        For any other value.
    """
    if value not in ON_TIMEOUT_MODES:
        raise ValueError(f"on_timeout must be one of {ON_TIMEOUT_MODES}, not {value!r}")
    return value  # type: ignore[return-value]


def _number(name: str, value: object, where: str) -> float:
    """Check one gpucx option value; ``where`` names its origin."""
    if name == "ON_TIMEOUT":
        text = str(value).strip().lower()
        if text in ON_TIMEOUT_MODES:
            return float(ON_TIMEOUT_MODES.index(text))
        if text not in ("0", "1", "0.0", "1.0"):
            raise ValueError(
                f"{where} must be one of {ON_TIMEOUT_MODES} (or 0, 1), not {value!r}"
            )
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        number = -1.0
    if not 0 <= number < float("inf"):
        raise ValueError(f"{where} must be a number >= 0, not {value!r}")
    if name in GPUCX_INTEGER_OPTIONS and not number.is_integer():
        raise ValueError(f"{where} must be a whole number >= 0, not {value!r}")
    return number


def gpucx_options(config: Mapping[str, object] | None) -> dict[str, float]:
    """gpucx's own options (``GPUCX_*`` keys) of a context config, over the
    ``GPUCX_*`` environment variables of :data:`GPUCX_ENV_OPTIONS`.

    Raises
    ------
    ValueError
        For an unknown ``GPUCX_*`` key, or a value (in ``config`` or in the
        environment) that is not a finite number >= 0 (a whole number for
        the byte and count caps); the message names the variable.
    """
    out = dict(GPUCX_OPTIONS)
    for name in GPUCX_ENV_OPTIONS:
        env = os.environ.get(GPUCX_PREFIX + name)
        if env is not None:
            where = f"environment variable {GPUCX_PREFIX + name}"
            out[name] = _number(name, env, where)
    if not isinstance(config, Mapping):
        return out
    for key, value in config.items():
        if not isinstance(key, str) or not key.upper().startswith(GPUCX_PREFIX):
            continue
        name = key.upper()[len(GPUCX_PREFIX) :]
        if name not in GPUCX_OPTIONS:
            known = sorted(GPUCX_PREFIX + k for k in GPUCX_OPTIONS)
            raise ValueError(f"unknown gpucx option {key!r}; known: {known}")
        out[name] = _number(name, value, f"gpucx option {key!r}")
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


def tuned_candidates(options: Mapping[str, str]) -> dict[str, str]:
    """The :data:`TUNED` options neither ``options`` (the user's, after
    :func:`normalize`) nor a ``UCX_*`` environment variable chooses."""
    return {
        name: value
        for name, (value, _why) in TUNED.items()
        if name not in options and f"UCX_{name}" not in os.environ
    }


def _ms(seconds: float) -> str:
    """A UCX time value in whole milliseconds (at least 1)."""
    return f"{max(1, round(seconds * 1000))}ms"


#: The UCX option that bounds how long TCP waits for its peer (UCX 1.22 and
#: later); :func:`peer_timeout_options` builds on it where UCX has it.
USER_TIMEOUT = "TCP_USER_TIMEOUT"


def peer_timeout_options(
    seconds: float, user_timeout: bool = True
) -> dict[str, tuple[str, str]]:
    """The UCX options that make a peer on another host that stops
    answering fail the operations pending on it within ``seconds``
    (``GPUCX_PEER_TIMEOUT``), each with why; empty for 0.

    Over TCP, UCX learns of a lost peer only when the kernel gives up on the
    connection.  Left alone, a side with data in flight waits for the
    kernel's retransmission limit (``net.ipv4.tcp_retries2``, about 15
    minutes), and only the side that opened the connection probes it when
    idle (TCP keepalive after 10 s, then the system's probes: over 20 s);
    the side that accepted it never notices.  With ``T = seconds``:

    ``user_timeout`` (a UCX with ``TCP_USER_TIMEOUT``, 1.22 and later):
    ``TCP_USER_TIMEOUT`` = 0.6 T resets a connection whose data stays
    unacknowledged, or whose peer keeps its receive window shut, that long;
    ``TCP_KEEPIDLE=inf`` turns the kernel's keepalive off, which makes UCX
    run its own on TCP (it skips transports with a keepalive of their own):
    a small message on each endpoint with peer error handling, both sides,
    every ``KEEPALIVE_INTERVAL`` = 0.2 T (``KEEPALIVE_NUM_EPS=inf``: every
    endpoint each round), so an idle connection has data in flight within
    0.2 T of losing its peer and is reset 0.6 T later.

    Otherwise: the kernel's keepalive, sooner (``TCP_KEEPIDLE`` = 0.4 T,
    ``TCP_KEEPINTVL`` = 0.1 T, ``TCP_KEEPCNT`` = 3, whole seconds): an idle
    connection is reset after about 0.7 T on the side that opened it.  UCX's
    keepalive interval is left alone there: its message, sent into a dead
    link, would stop the kernel's probes.
    """
    if seconds <= 0:
        return {}
    if user_timeout:
        return {
            USER_TIMEOUT: (
                _ms(0.6 * seconds),
                "TCP resets a connection whose data stays unacknowledged, or "
                "whose peer keeps its receive window shut, this long; without "
                "it a side with data in flight to a lost host waits for the "
                "kernel's retransmission limit (~15 min)",
            ),
            "TCP_KEEPIDLE": (
                "inf",
                "no kernel keepalive, so that UCX runs its own on TCP (the "
                "kernel's runs on the side that opened a connection only)",
            ),
            "KEEPALIVE_INTERVAL": (
                _ms(0.2 * seconds),
                "UCX's keepalive message on each endpoint with peer error "
                "handling, this often: an idle connection to a lost host "
                "gets data in flight, which TCP_USER_TIMEOUT then bounds",
            ),
            "KEEPALIVE_NUM_EPS": (
                "inf",
                "every endpoint in each keepalive round (UCX's 128 would "
                "stretch the interval past 128 endpoints)",
            ),
        }
    idle = max(1, round(0.4 * seconds))
    intvl = max(1, round(0.1 * seconds))
    count = max(1, round(0.3 * seconds / intvl))
    return {
        "TCP_KEEPIDLE": (
            f"{idle}s",
            "the kernel probes an idle connection after this long (this UCX "
            "has no TCP_USER_TIMEOUT: a side with data in flight still waits "
            "for the kernel's retransmission limit)",
        ),
        "TCP_KEEPINTVL": (f"{intvl}s", "between the kernel's keepalive probes"),
        "TCP_KEEPCNT": (
            str(count),
            "unanswered probes before the kernel resets an idle connection",
        ),
    }


def peer_timeout_candidates(
    options: Mapping[str, str], seconds: float, user_timeout: bool = True
) -> dict[str, str]:
    """The :func:`peer_timeout_options` neither ``options`` (the user's,
    after :func:`normalize`) nor a ``UCX_*`` environment variable chooses."""
    return {
        name: value
        for name, (value, _why) in peer_timeout_options(seconds, user_timeout).items()
        if name not in options and f"UCX_{name}" not in os.environ
    }
