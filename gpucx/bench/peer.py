"""The serving side of ``gpucx bench``.

Run as ``python -m gpucx.bench.peer`` by the client itself (worker
addresses over stdin/stdout), or through ``gpucx bench --server`` (a
Listener) for runs between two hosts.  It answers the client's control
messages and runs its half of each measurement.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import gpucx

from .._internal import abandon
from .._stdio import take_stdout
from .errors import BenchSetupError
from .session import BadControlMessage, PeerGone, Session, context_config, quote
from .suites import DEFAULT_TESTS, TESTS, Params, server_features

__all__ = ["serve", "serve_listener", "main"]


def serve(sess: Session, tests=None) -> None:
    """Answer control messages until the client says ``quit``.

    ``tests``: the names this server runs (None: every test); a request for
    another one is answered with an error naming the option to start the
    server with."""
    while True:
        try:
            cmd = sess.recv_ctrl(None)
        except BadControlMessage as exc:
            # Tag messages keep their boundaries: answer, and read the next.
            sess.send_ctrl({"error": f"peer: {exc}"})
            continue
        op = cmd.get("op")
        if op == "quit":
            sess.send_ctrl({"ok": True})
            return
        if op == "hello":
            sess.send_ctrl({"ok": True, "version": gpucx.__version__})
            continue
        if op != "run":
            sess.send_ctrl({"error": f"peer: unknown control message {quote(op)}"})
            continue
        try:
            params = Params.from_dict(cmd.get("params"))
            if tests is not None and params.test not in tests:
                raise BenchSetupError(
                    f"this server serves {','.join(tests)}, not {params.test}: "
                    f"start it with -t {params.test} (it enables the context "
                    "features a test needs, rma and amo included, only for the "
                    "tests it is started with)"
                )
            test = TESTS[params.test](sess, params, server=True)
            extra = test.prepare()
        except Exception as exc:
            sess.send_ctrl({"error": _describe(exc)})
            continue
        sess.send_ctrl({"ok": True, **extra})
        try:
            test.serve()
        except BadControlMessage as exc:
            sess.send_ctrl({"error": f"peer: {exc}"})
        except PeerGone:
            raise
        except Exception as exc:
            sess.send_ctrl({"error": _describe(exc)})
        else:
            sess.send_ctrl({"ok": True})
        finally:
            test.cleanup()


#: How long a server's close waits for its last answer to leave.
FINISH_TIMEOUT_S = 5.0


def _finish(sess: Session, ctx, ep) -> None:
    """Close, or abandon after a failed C loop left UCX holding operations
    (see :attr:`Session.tainted`).

    A flush close, bounded: the answer to ``quit`` may still sit in UCX's
    send queue when ``serve`` returns (over TCP a send completes once UCX
    holds it), and a force close would drop it, failing the client's quit
    with "the peer went away" (about one run in twelve between two hosts).
    """
    if sess.tainted:
        abandon(ctx, "abandoned after a failed benchmark")
    else:
        ep.close(timeout=FINISH_TIMEOUT_S)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (BenchSetupError, gpucx.UCXError, ValueError)):
        return f"peer: {exc}"
    return "peer: " + "".join(traceback.format_exception_only(exc)).strip()


def _use_device(device: int) -> None:
    try:
        import cupy
    except ImportError:
        return
    try:
        cupy.cuda.Device(device).use()
    except Exception:  # CuPy without a usable device: the peer's memory
        pass  # setup (bench.memory) reports the real problem with its context


#: Addresses that mean "every interface".
ALL_INTERFACES = ("0.0.0.0", "::", "")


def serve_listener(
    host: str,
    port: int,
    tls: str | None,
    error_handling: bool,
    device: int,
    timeout: float,
    out=sys.stdout,
    tests=DEFAULT_TESTS,
) -> None:
    """``gpucx bench --server``: accept one client and serve it.

    The context gets only the features ``tests`` need (``rma`` for the
    one-sided tests, ``amo`` for ``fadd_lat``): a peer reaches registered
    memory only while the server runs such a test.  Listening on every
    interface prints a warning: any host that reaches the port can connect.
    """
    tests = tuple(dict.fromkeys(tests))
    features = server_features(tests)
    with gpucx.Context(
        features=features, config=context_config(tls, listener=True)
    ) as ctx:
        w = ctx.create_worker()
        lst = w.listen(port=port, host=host)
        if host.strip("[]") in ALL_INTERFACES:
            print(
                f"gpucx bench server: warning: listening on all interfaces "
                f"({host or '0.0.0.0'}): any host that reaches port {lst.port} can "
                "connect and run tests here; use --host to listen on one "
                "address",
                file=sys.stderr,
                flush=True,
            )
        print(f"gpucx bench server listening on {host}:{lst.port}", file=out)
        print(
            f"gpucx bench server: tests {','.join(tests)}; context features "
            f"{','.join(sorted(features))}",
            file=out,
            flush=True,
        )
        ep = lst.accept()
        sess = Session(ctx, w, ep, role="server", device=device, timeout=timeout)
        try:
            serve(sess, tests)
        except PeerGone as exc:
            print(f"gpucx bench server: {exc}", file=sys.stderr)
        finally:
            _finish(sess, ctx, ep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpucx.bench.peer")
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--tls", default=None)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--no-error-handling", action="store_true")
    args = ap.parse_args(argv)
    # The address handshake keeps the original stdout to itself: a UCX log
    # line in the pipe would end the handshake, and unread ones would fill
    # the pipe and stall this peer.
    control = take_stdout()
    _use_device(args.device)
    eh = not args.no_error_handling
    with gpucx.Context(config=context_config(args.tls)) as ctx:
        w = ctx.create_worker()
        control.write(f"ADDRESS {w.address.hex()}\n".encode())
        control.close()
        line = sys.stdin.readline().split()
        if len(line) != 2 or line[0] != "ADDRESS":
            print("gpucx bench peer: no address from the client", file=sys.stderr)
            return 1
        ep = w.connect(bytes.fromhex(line[1]), error_handling=eh)
        sess = Session(
            ctx, w, ep, role="server", device=args.device, parent_pid=args.parent_pid
        )
        try:
            serve(sess)
        except PeerGone:
            return 1
        finally:
            _finish(sess, ctx, ep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
