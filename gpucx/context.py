"""The UCX context: features, configuration, memory domain."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from . import config as _config
from ._handle import Handle, raise_closed, register_root
from ._lib import ffi, lib
from .errors import check
from .mem import region as _region
from .mem.memtype import MemoryType

__all__ = ["Context"]


def _peer_timeout(cfg, options: Mapping[str, str], seconds: float) -> dict[str, str]:
    """Set on ``cfg`` the UCX options of ``GPUCX_PEER_TIMEOUT`` that this
    UCX knows and nobody chose; return those set.

    Which set depends on whether this UCX has ``TCP_USER_TIMEOUT``
    (:func:`gpucx.config.peer_timeout_options`): tried first where nobody
    chose it; taken as there from UCX 1.22 on where somebody did.
    """
    from ._lib import UCX_VERSION

    name = _config.USER_TIMEOUT
    out: dict[str, str] = {}
    if name in options or f"UCX_{name}" in os.environ:
        user_timeout = UCX_VERSION >= (1, 22)
    else:
        value = _config.peer_timeout_candidates(options, seconds).get(name)
        user_timeout = False
        if value is not None:
            st = lib.ucp_config_modify(cfg, name.encode(), value.encode())
            user_timeout = st == lib.UCS_OK
            if user_timeout:
                out[name] = value
    for key, value in _config.peer_timeout_candidates(
        options, seconds, user_timeout
    ).items():
        if key in out:
            continue
        if lib.ucp_config_modify(cfg, key.encode(), value.encode()) == lib.UCS_OK:
            out[key] = value
    return out


class Context(Handle):
    """A UCX application context (``ucp_init``).

    Parameters
    ----------
    features : iterable of str, optional
        Subset of ``{"tag", "am", "rma", "amo", "stream"}``; ``None`` = all.
    config : dict, optional
        UCX options without the ``UCX_`` prefix, e.g. ``{"TLS": "tcp"}``.
        ``UCX_*`` environment variables still apply underneath.  Unless
        chosen, gpucx sets ``MM_ERROR_HANDLING=y`` so that shared memory
        stays in use with peer error handling, and the GPU path options of
        ``gpucx.config.TUNED`` that this UCX knows (:attr:`tuned`; see
        docs/gpu.md, "Settings gpucx applies").  Keys starting with
        ``GPUCX_`` are gpucx's own options, never passed to UCX:
        ``GPUCX_PEER_CHECK_INTERVAL`` (seconds between liveness checks of
        peers on this host, default 0.1, 0 = off; see the guide's "Peer
        failure"), ``GPUCX_SPIN_US`` (how long blocking calls busy-poll,
        default 5000; both also read from the environment),
        ``GPUCX_MAX_ARRAY_BYTES`` (the largest array, in bytes, that
        ``recv_array`` of this context's workers accepts; default 4 GiB,
        0 = no limit), the caps of the queues a peer can fill
        (``GPUCX_AM_KEPT_MAX_COUNT`` and the others listed in
        docs/reliability.md, "Bounded queues"), ``GPUCX_MAX_STRANDED_BYTES``
        (what operations given up on same-host endpoints may hold before
        ``connect(mode="same-host")`` refuses; default 512 MiB, 0 = no
        limit; see the guide's "Endpoint modes") and ``GPUCX_PEER_TIMEOUT``
        (seconds within which a peer on another host that stops answering
        fails the operations pending on it, default 10, 0 = UCX's own
        timeouts; also read from the environment; gpucx sets the UCX
        keepalive and TCP timeout options of
        ``gpucx.config.peer_timeout_options`` for it, where this UCX knows
        them and nobody chose them, and lists them in :attr:`tuned`; see
        docs/reliability.md, "Peers on other hosts").

    Raises
    ------
    ValueError
        For an unknown feature, or a UCX option UCX does not know or whose
        value it rejects (the message names the option), or an unknown or
        negative ``GPUCX_*`` option (or a fractional byte or count cap),
        or a bad ``GPUCX_SPIN_US`` / ``GPUCX_PEER_CHECK_INTERVAL`` /
        ``GPUCX_PEER_TIMEOUT`` environment variable; the message names the
        option.
    TypeError
        If ``config`` is not a dict of strings.
    gpucx.UCXError
        If ``ucp_init`` fails.
    """

    def __init__(
        self,
        features: Iterable[str] | None = None,
        config: Mapping[str, object] | None = None,
    ):
        self._init_handle()
        mask, names = _config.feature_mask(features)
        options = _config.normalize(config)
        own = _config.gpucx_options(config)
        cfg = ffi.new("ucp_config_t **")
        check(lib.gpucx_config_create(cfg), "ucp_config_read")
        out = ffi.new("ucp_context_h *")
        try:
            for name, value in options.items():
                st = lib.ucp_config_modify(cfg[0], name.encode(), value.encode())
                if st != lib.UCS_OK:
                    raise ValueError(
                        f"UCX config option {name!r}: unknown option or invalid "
                        f"value {value!r}"
                    )
            # The GPU path options this UCX knows (ucp_config_read loaded the
            # transports' option tables); one it rejects is not there to tune.
            tuned: dict[str, str] = {}
            for name, value in _config.tuned_candidates(options).items():
                st = lib.ucp_config_modify(cfg[0], name.encode(), value.encode())
                if st == lib.UCS_OK:
                    tuned[name] = value
            tuned.update(_peer_timeout(cfg[0], options, own["PEER_TIMEOUT"]))
            check(lib.gpucx_context_create(cfg[0], mask, b"gpucx", out), "ucp_init")
        finally:
            lib.ucp_config_release(cfg[0])
        self._h = out[0]
        self.features = names
        self.config = options
        #: The UCX options gpucx set, for the GPU paths (``config.TUNED``)
        #: and for ``GPUCX_PEER_TIMEOUT`` (``config.peer_timeout_options``):
        #: those this UCX knows and neither ``config`` nor the environment
        #: chose.  Not in :attr:`config`, which holds what was asked for.
        self.tuned = tuned
        #: ``GPUCX_PEER_TIMEOUT``: seconds within which a peer on another
        #: host that stops answering fails what is pending on it (0 = UCX's
        #: own timeouts).
        self.peer_timeout = own["PEER_TIMEOUT"]
        #: ``GPUCX_ON_TIMEOUT``: ``"park"`` or ``"release"``, the default
        #: of every endpoint's :attr:`Endpoint.on_timeout`.
        self.on_timeout = _config.ON_TIMEOUT_MODES[int(own["ON_TIMEOUT"])]
        #: ``GPUCX_MAX_STRANDED_BYTES``: bytes that operations given up on
        #: same-host endpoints may hold before ``connect(mode="same-host")``
        #: refuses (0 = no limit; :attr:`gpucx.Worker.stranded_bytes`).
        self.max_stranded_bytes = int(own["MAX_STRANDED_BYTES"])
        self._cuda_ipc_rma = bool(own["CUDA_IPC_RMA"])
        self._max_array_bytes = int(own["MAX_ARRAY_BYTES"])
        self._options = own
        # Regions exported for gpucx's emulated atomics (gpucx.ops.atomic).
        self._amo_exports = lib.gpucx_amo_exports_new(1 if "amo" in names else 0)
        # Closed regions whose memory UCX allocated and a view still uses
        # (gpucx.mem.region): ucp_cleanup waits until they are unmapped.
        self._deferred_maps = 0
        self._cleanup_deferred = False
        register_root(self)

    def __repr__(self) -> str:
        state = "closed" if self._h is None else ",".join(sorted(self.features))
        return f"<gpucx.Context {state}>"

    @property
    def options(self) -> dict[str, float | str]:
        """gpucx's own options (the ``GPUCX_*`` keys, without the prefix) as
        this context took them: ``Context(config=...)`` over the environment
        over the defaults (``gpucx.config.GPUCX_OPTIONS``).  A copy; numbers,
        except ``ON_TIMEOUT``, which is its mode's name."""
        out: dict[str, float | str] = dict(self._options)
        out["ON_TIMEOUT"] = self.on_timeout
        return out

    @property
    def cuda_ipc_rma(self) -> bool:
        """``GPUCX_CUDA_IPC_RMA``: whether gpucx's own same-host path
        serves puts and gets on CUDA regions of a peer on this host (the
        owner's allocation mapped through its CUDA IPC handle, copies by
        the copy engines: docs/rma.md); False leaves every operation to
        UCX."""
        return self._cuda_ipc_rma

    @property
    def max_array_bytes(self) -> int:
        """``GPUCX_MAX_ARRAY_BYTES``: the largest array
        :meth:`Endpoint.recv_array` accepts when its ``max_bytes`` is None
        (0 = no limit); a larger one is refused before anything is
        allocated."""
        return self._max_array_bytes

    @property
    def memory_types(self) -> frozenset[MemoryType]:
        """Memory types this context's transports can move."""
        h = self._h
        if h is None:
            raise_closed(self)
        bits = lib.gpucx_context_memory_types(h)
        return frozenset(m for m in MemoryType if m.value < 64 and bits >> m.value & 1)

    @property
    def cuda_problem(self) -> str | None:
        """Why this context cannot move CUDA memory, or None when it can.

        CUDA memory moves when UCX lists CUDA among this context's memory
        types (a UCX built with CUDA whose ``cuda_copy`` transport loaded
        under this ``UCX_TLS``) and a CUDA driver with a device is present.
        The text names what is missing; operations on CUDA buffers raise
        :class:`~gpucx.UnsupportedError` with it.
        """
        if self._h is None:
            raise_closed(self)
        from .mem import cuda

        return cuda.problem(self)

    @property
    def cuda_available(self) -> bool:
        """Whether this context can move CUDA memory (see :attr:`cuda_problem`)."""
        return self.cuda_problem is None

    def create_worker(self, thread_mode: str = "single"):
        """Create a :class:`~gpucx.Worker` (``"single"``, ``"serialized"``,
        ``"multi"``).

        Raises
        ------
        ValueError
            For an unknown thread mode.
        gpucx.ClosedError
            If the context is closed.
        """
        from .worker import Worker

        return Worker(self, thread_mode)

    # -- memory domain (facades over gpucx.mem.region) -------------------------

    register = _region.register
    allocate = _region.allocate

    def _close_children(self) -> None:
        # Every worker serves what its peers sent (and gives back what
        # nobody received), then every worker's endpoints close, while all
        # the workers live: a flush close needs its peer to progress, and
        # the peer may be a sibling worker.  Closed worker by worker, the
        # second worker's endpoints would wait out the deadline for a peer
        # already destroyed with operations it had not served (an emulated
        # put's completion, a rendezvous message nobody took).
        from .worker import Worker

        workers: list[Any] = [
            c for c in self._children if isinstance(c, Worker) and not c.closed
        ]
        for w in workers:
            w._let_go_of_peers()
        self._close_all(ep for w in workers for ep in w._endpoints())
        super()._close_children()

    def _release(self) -> None:
        if self._deferred_maps:
            # An array view of UCX-allocated memory is still alive: the
            # cleanup (which would free that memory) runs when it is gone.
            self._cleanup_deferred = True
            return
        self._cleanup(self._h)

    def _unmap_when_gone(self, memory, memh) -> None:
        """Unmap ``memh``, the mapping of a closed region whose memory UCX
        allocated, once ``memory`` (what the region's array views hold) is
        gone: the memory is the mapping's, and a view still uses it.  This
        context's cleanup waits for it (gpucx.mem.region)."""
        self._deferred_maps += 1
        weakref.finalize(memory, self._unmapped, self._h, memh, os.getpid())

    def _unmapped(self, h, memh, pid: int) -> None:
        """The last view of a closed region allocated by UCX is gone: unmap
        it, and finish the cleanup if it waited for that.  Never in a forked
        child (the UCX state belongs to the parent)."""
        if os.getpid() != pid:
            return
        lib.gpucx_mem_unmap(h, memh)
        self._deferred_maps -= 1
        if self._deferred_maps == 0 and self._cleanup_deferred:
            self._cleanup_deferred = False
            self._cleanup(h)

    def _cleanup(self, h) -> None:
        lib.ucp_cleanup(h)
        lib.gpucx_amo_exports_free(self._amo_exports)
        self._amo_exports = ffi.NULL
