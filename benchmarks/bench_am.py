"""Active-message benchmarks: gpucx against UCX's own ucx_perftest, same run.

Measures between two processes on this host (default UCX transports):

* 8-byte AM round trip; reported as one-way latency (half the round trip),
  like the overall latency column of ``ucx_perftest -t ucp_am_lat``: with a
  handler per message on both sides, and with blocking ``am_send`` then
  blocking ``am_recv`` (posted receives, no handler);
* AM bandwidth at 1 MiB and 16 MiB against ``ucx_perftest -t ucp_am_bw``,
  with four receivers: a handler per message that calls ``receive_into``
  (a reused buffer, zero copy); a handler with a receive pool of ``POOL``
  buffers (``set_am_handler(..., into=bufs)``: the payload is received in
  the UCX callback before the handler runs); receives posted ahead with
  ``worker.am_recv_nb`` (matched in the UCX callback, no Python per
  message delivered, one call per message posted); and a round of them
  posted with one ``worker.am_recv_many_nb`` call.  The receiver acks each
  round (at least 64 MiB); the sender stays at most ``DEPTH`` rounds ahead;
  a run is ``--bw-rounds`` rounds, and perftest sends as many messages;
* with ``--only lat``: 64 KiB and 1 MiB AM latency through handlers on
  both sides (each payload received before the reply), with
  ``receive_into`` and with a one-buffer receive pool, against
  ``ucx_perftest -t ucp_am_lat``;
* ``send_array``/``recv_array`` bandwidth at 16 MiB against raw AM
  bandwidth (a fresh array per message, as ``recv_array`` returns);
* 8-byte message rate against the message rate of ``ucx_perftest -t
  ucp_am_bw -s 8``: ``am_send_nb`` per message, and a prepared batch
  (``ep.prepare_am``, one C call per round of ``RATE_ITERS`` messages); the
  receiver posts each round with ``am_recv_many_nb``.

Usage::

    .venv/bin/python benchmarks/bench_am.py [--rounds R] [--lat-iters N] [--bw-iters N]
        [--bw-rounds K] [--error-handling] [--only bw,rate,lat]

``--error-handling`` creates every endpoint with peer error handling
(gpucx's default) and runs perftest with ``-e``.

The machine is shared and its speed drifts by tens of percent within
seconds.  So the measurements run in interleaved rounds: each round runs
every gpucx figure right next to its reference, and the ratio is taken
within the round.  The table gives the median over the rounds of gpucx,
of the reference and of the per-round ratio, and the range of the ratios.
Both sides use UCX's default transports and, unless ``--error-handling``,
no peer error handling (perftest's default; gpucx ``error_handling=False``:
peer error handling rules out CMA zero-copy on this host), and message
buffers mapped by UCX
(``ctx.allocate``), as perftest's are: page size changes the copy speed
(NumPy puts arrays of 4 MiB and more on huge pages, which makes 16 MiB
faster than perftest's buffers).  Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import time

import numpy as np

import gpucx

PING, PONG, DATA, ACK = 1, 2, 3, 4
MIB = 1 << 20
#: Rounds of messages in flight in the bandwidth tests: the sender sends
#: round r once round r - DEPTH was acked; posted receives stay DEPTH
#: rounds ahead.
DEPTH = 2
#: Buffers in the receive pool of the "pool" receiver: two let one payload
#: land while the handler runs for the other.  More do not help a receiver
#: that copies on one thread, and cost cache: 8 buffers of 1 MiB were about
#: 13 % slower than 2 on this host (RESULTS.md).
POOL = 2
#: Messages per round of the 8-byte message-rate figures.
RATE_ITERS = 10000
#: Peer error handling on every endpoint (``--error-handling``).
EH = False


# -- gpucx peer ---------------------------------------------------------------


def _buffer(ctx, size: int, memory: str) -> np.ndarray:
    """A message buffer: mapped by UCX (``ctx.allocate``, as ucx_perftest
    allocates its buffers) or a NumPy array (which NumPy backs with huge
    pages from 4 MiB on)."""
    if memory == "ucx":
        return ctx.allocate(size).as_array(np.uint8)
    return np.empty(size, np.uint8)


def _server(
    conn, mode: str, size: int, iters: int, rounds: int, memory: str, eh: bool
) -> None:
    with gpucx.Context() as ctx:
        w = ctx.create_worker()
        if mode in ("posted", "group"):
            # Receives posted ahead, matched in the UCX callback: no Python
            # per message delivered.  "posted": one am_recv_nb per message;
            # "group": one am_recv_many_nb per round.  DEPTH rounds are
            # posted before the client can send (a message that finds
            # neither a posted receive nor a handler is dropped).
            buf = _buffer(ctx, size, memory)

            def post_round():
                if mode == "group":
                    return [w.am_recv_many_nb(DATA, [buf] * iters)]
                return [w.am_recv_nb(DATA, buf) for _ in range(iters)]

            posted = [post_round() for _ in range(min(DEPTH, rounds))]
        elif mode == "lat_posted":
            # The first receive is posted before the client may send.
            ping = np.zeros(size, np.uint8)
            req = w.am_recv_nb(PING, ping)
        conn.send(w.address)
        ep = w.connect(conn.recv(), error_handling=eh)
        if mode == "lat":
            pong = np.zeros(size, np.uint8)
            w.set_am_handler(PING, lambda msg: ep.am_send_nb(PONG, pong))
            progress = w.progress
            while not conn.poll(0):
                for _ in range(10000):  # a syscall per 10000 polls only
                    progress()
        elif mode == "lat_posted":
            # After the first receive, a ping that comes before the next
            # am_recv waits for it (kept): a plain loop loses nothing.
            pong = np.zeros(size, np.uint8)
            req.wait()
            ep.am_send(PONG, pong)
            for _ in range(rounds - 1):
                w.am_recv(PING, ping)
                ep.am_send(PONG, pong)
        elif mode == "bw":
            buf = _buffer(ctx, size, memory)
            reqs = []

            def on_data(msg):
                reqs.append(msg.receive_into(buf))

            w.set_am_handler(DATA, on_data)
            progress = w.progress
            ndone = 0  # reqs[:ndone] are complete
            while not conn.poll(0):
                for _ in range(1000):  # a syscall per 1000 polls only
                    progress()
                    # Completions are looked at once each, in order (a
                    # receive is done once its request says so); the next
                    # round may already be arriving: ack this round's
                    # first ``iters`` messages once they are in.
                    while ndone < len(reqs) and reqs[ndone].done():
                        ndone += 1
                    if ndone >= iters:
                        del reqs[:iters]
                        ndone -= iters
                        ep.am_send(ACK, b"")
        elif mode == "pool":
            # The handler's receive pool: rendezvous payloads are received
            # in the UCX callback before the handler runs; the handler only
            # counts (the buffer is free again when it returns).
            pool = [_buffer(ctx, size, memory) for _ in range(POOL)]
            got = [0]

            def on_pooled(msg):
                if msg.is_rndv:  # larger than the pool's buffers: never here
                    raise AssertionError("a message missed the receive pool")
                got[0] += 1

            w.set_am_handler(DATA, on_pooled, into=pool)
            progress = w.progress
            while not conn.poll(0):
                for _ in range(1000):  # a syscall per 1000 polls only
                    progress()
                    if got[0] >= iters:
                        got[0] -= iters
                        ep.am_send(ACK, b"")
        elif mode in ("posted", "group"):
            for r in range(rounds):
                reqs = posted.pop(0)
                reqs[-1].wait()  # the last is matched last: a C wait loop
                for req in reqs:
                    req.wait()
                if r + DEPTH < rounds:  # keep DEPTH rounds posted, then ack
                    posted.append(post_round())
                ep.am_send(ACK, b"")
        elif mode in ("lat_rndv", "lat_rndv_pool"):
            # Echo each PING of ``size`` bytes (a rendezvous payload) with a
            # PONG of the same size, receiving it first: through
            # receive_into, or, with a pool, in the UCX callback.
            rbuf, sbuf = _buffer(ctx, size, memory), _buffer(ctx, size, memory)
            inbox: list = []
            pool = [rbuf] if mode == "lat_rndv_pool" else None
            w.set_am_handler(PING, inbox.append, into=pool)
            progress = w.progress
            while not conn.poll(0):
                for _ in range(1000):  # a syscall per 1000 polls only
                    progress()
                    if inbox:
                        _take(inbox, rbuf)
                        ep.am_send(PONG, sbuf)
        elif mode == "array":
            count = 0
            while not conn.poll(0):
                try:
                    ep.recv_array(timeout=0.05)
                except gpucx.TimeoutError:
                    continue
                count += 1
                if count == iters:
                    count = 0
                    ep.am_send(ACK, b"")
        conn.recv()
        ep.close()


class _Peer:
    def __init__(
        self, mode: str, size: int, iters: int, rounds: int = 0, memory: str = "ucx"
    ):
        self.conn, theirs = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_server,
            args=(theirs, mode, size, iters, rounds, memory, EH),
            daemon=True,
        )
        self.proc.start()
        self.ctx = gpucx.Context()
        self.w = self.ctx.create_worker()
        self.ep = self.w.connect(self.conn.recv(), error_handling=EH)
        self.conn.send(self.w.address)

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)
        self.ctx.close()


def gpucx_am_lat(size: int, iters: int, runs: int = 1) -> float:
    """One-way latency in microseconds (half the round trip), averaged over
    ``iters`` round trips; the best of ``runs`` runs."""
    peer = _Peer("lat", size, iters)
    w, ep = peer.w, peer.ep
    got = [0]

    def on_pong(msg):
        got[0] += 1

    w.set_am_handler(PONG, on_pong)
    ping = np.zeros(size, np.uint8)
    warm = max(100, iters // 10)
    for i in range(warm):
        ep.am_send_nb(PING, ping)
        while got[0] == i:
            w.progress()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(iters):
            i = got[0]
            ep.am_send_nb(PING, ping)
            while got[0] == i:
                w.progress()
        best = min(best, time.perf_counter() - t0)
    peer.close()
    return best / iters / 2 * 1e6


def _take(inbox: list, rbuf) -> None:
    """The payload of the one message in ``inbox``, in ``rbuf`` (or in the
    pool buffer it was received into), the message let go of."""
    msg = inbox.pop()
    if msg.is_rndv:
        msg.receive_into(rbuf).wait()


def gpucx_am_lat_rndv(size: int, iters: int, pool: bool) -> float:
    """One-way latency in microseconds (half the round trip, the mean of
    ``iters``) of a ``size``-byte AM ping-pong through handlers on both
    sides, each payload received before the reply goes: with
    ``receive_into``, or (``pool``) into a one-buffer receive pool
    (``set_am_handler(..., into=[buf])``).  Blocking ``am_send``, as
    ``gpucx bench -t am_lat`` and ucx_perftest's ``ucp_am_lat``."""
    peer = _Peer("lat_rndv_pool" if pool else "lat_rndv", size, iters)
    w, ep = peer.w, peer.ep
    rbuf, sbuf = _buffer(peer.ctx, size, "ucx"), _buffer(peer.ctx, size, "ucx")
    inbox: list = []
    w.set_am_handler(PONG, inbox.append, into=[rbuf] if pool else None)
    progress = w.progress

    def one() -> None:
        ep.am_send(PING, sbuf)
        while not inbox:
            progress()
        _take(inbox, rbuf)

    for _ in range(max(10, iters // 10)):
        one()
    t0 = time.perf_counter()
    for _ in range(iters):
        one()
    took = time.perf_counter() - t0
    peer.close()
    return took / iters / 2 * 1e6


def gpucx_am_lat_posted(size: int, iters: int) -> float:
    """One-way latency in microseconds with posted receives on both sides:
    blocking ``am_send``, then blocking ``am_recv`` (one C call each; no
    handler runs)."""
    warm = max(100, iters // 10)
    peer = _Peer("lat_posted", size, iters, warm + iters)
    w, ep = peer.w, peer.ep
    ping = np.zeros(size, np.uint8)
    pong = np.zeros(size, np.uint8)
    recv, send = w.am_recv, ep.am_send
    # The first receive registers PONG before the server may reply.
    req = w.am_recv_nb(PONG, pong)
    send(PING, ping)
    req.wait()
    for _ in range(warm - 1):
        send(PING, ping)
        recv(PONG, pong)
    t0 = time.perf_counter()
    for _ in range(iters):
        send(PING, ping)
        recv(PONG, pong)
    dt = time.perf_counter() - t0
    peer.close()
    return dt / iters / 2 * 1e6


def _bw_rounds(w, ep, payload, iters, acks, kind, rounds, batch=None):
    """Send ``rounds`` rounds of ``iters`` messages, at most ``DEPTH`` rounds
    ahead of the receiver's acks; return when every round was acked.
    ``batch``: a prepared batch of one round's messages (kind "batch")."""
    post = ep.am_send_nb if kind != "array" else None
    base = acks[0]
    reqs: list = []
    for r in range(rounds):
        # Round r may go once round r - DEPTH was acked (for posted
        # receives: once the receiver has posted round r).
        while acks[0] - base < r - DEPTH + 1:
            w.progress()
        reqs = [r_ for r_ in reqs if not r_.done()]
        if batch is not None:
            reqs.append(batch.run_nb())
        elif post is not None:
            reqs += [post(DATA, payload) for _ in range(iters)]
        else:
            reqs += [ep.send_array_nb(payload) for _ in range(iters)]
    while acks[0] - base < rounds or not all(r_.done() for r_ in reqs):
        w.progress()


def gpucx_bw(
    size: int,
    iters: int,
    kind: str,
    rounds: int = 8,
    runs: int = 1,
    memory: str = "ucx",
):
    """Bandwidth in MiB/s over ``rounds`` rounds of ``iters`` messages, the
    best of ``runs`` runs: ``kind`` "am" (a handler calls receive_into),
    "pool" (a handler with a receive pool of ``POOL`` buffers), "posted"
    (receives posted ahead, one call each), "group" (posted a round at a
    time with ``am_recv_many_nb``), "batch" (as "group", the sender runs a
    prepared batch per round) or "array".  The receiver acks each
    round; the sender stays at most ``DEPTH`` rounds ahead, so the link
    never idles between rounds (perftest's ``ucp_am_bw`` streams too).
    ``memory``: where the send and receive buffers live (see ``_buffer``;
    arrays are always NumPy arrays)."""
    mode = {
        "am": "bw",
        "pool": "pool",
        "posted": "posted",
        "group": "group",
        "batch": "group",
    }.get(kind, "array")
    # With the warm-up round.
    peer = _Peer(mode, size, iters, 1 + rounds * runs, memory)
    w, ep = peer.w, peer.ep
    acks = [0]

    def on_ack(msg):
        acks[0] += 1

    w.set_am_handler(ACK, on_ack)
    if kind == "array":
        payload = np.ones(size // 4, np.float32)
    else:
        payload = _buffer(peer.ctx, size, memory)
        payload[:] = 1
    batch = ep.prepare_am(DATA, [payload] * iters) if kind == "batch" else None
    _bw_rounds(w, ep, payload, iters, acks, kind, 1, batch)  # warm-up round
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        _bw_rounds(w, ep, payload, iters, acks, kind, rounds, batch)
        best = min(best, time.perf_counter() - t0)
    if batch is not None:
        batch.close()
    peer.close()
    return size * iters * rounds / best / MIB


# -- ucx_perftest ---------------------------------------------------------------


def _perftest(test: str, size: int, iters: int, port: int) -> tuple[float, float]:
    """(overall one-way latency us, overall bandwidth MiB/s) from perftest
    (``-e`` with ``--error-handling``)."""
    import libucx

    root = pathlib.Path(libucx.__file__).resolve().parent
    exe = str(root / "bin" / "ucx_perftest")
    env = dict(os.environ, LD_LIBRARY_PATH=str(root / "lib"), UCX_MM_ERROR_HANDLING="y")
    args = ["-t", test, "-s", str(size), "-n", str(iters), "-p", str(port)]
    if EH:
        args.append("-e")
    server = subprocess.Popen(
        [exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):
            time.sleep(0.2)
            out = subprocess.run(
                [exe, "localhost", *args], env=env, capture_output=True, text=True
            )
            if out.returncode == 0:
                break
        else:
            raise RuntimeError(f"ucx_perftest {test} failed: {out.stderr[-500:]}")
    finally:
        server.wait(30)
    final = [ln for ln in out.stdout.splitlines() if ln.startswith("Final:")][-1]
    cols = final.split()
    return float(cols[4]), float(cols[6])


def perftest(test: str, size: int, iters: int, port: int, runs: int = 1):
    """Best of ``runs`` perftest runs: (lowest latency, highest bandwidth)."""
    res = [_perftest(test, size, iters, port + i) for i in range(runs)]
    return min(r[0] for r in res), max(r[1] for r in res)


def one_round(a, port: int) -> dict:
    """Every figure once, each gpucx run next to its reference:
    name -> (gpucx, reference, ratio)."""
    out: dict = {}
    if "rate" in a.only:
        # 8-byte message rate; perftest's bandwidth in MiB/s -> msg/s.
        n = RATE_ITERS
        _, pbw = perftest("ucp_am_bw", 8, n * 8, port + 17)
        prate = pbw * MIB / 8
        for kind, name in (("group", "am_send_nb"), ("batch", "prepared batch")):
            rate = gpucx_bw(8, n, kind) * MIB / 8
            out[f"AM 8 B rate, {name} (msg/s)"] = (rate, prate, rate / prate)
    if "lat" in a.only:
        # Rendezvous sizes: the payload is received before the reply.
        for k, (size, iters) in enumerate(((64 << 10, 2000), (MIB, 300))):
            plat, _ = perftest("ucp_am_lat", size, iters, port + 18 + k)
            name = f"AM latency {size >> 10} KiB"
            for pool, how in ((False, "receive_into"), (True, "pool")):
                lat = gpucx_am_lat_rndv(size, iters, pool)
                out[f"{name}, {how} (us)"] = (lat, plat, plat / lat)
    if "bw" not in a.only:
        return out
    lat = gpucx_am_lat(8, a.lat_iters)
    plat, _ = perftest("ucp_am_lat", 8, a.lat_iters, port)
    out["AM latency 8 B (us, one-way)"] = (lat, plat, plat / lat)
    lat = gpucx_am_lat_posted(8, a.lat_iters)
    out["AM latency 8 B, posted (us)"] = (lat, plat, plat / lat)
    for size in (MIB, 16 * MIB):
        # At least 64 MiB per ack, so the per-round ack is negligible.
        n = max(a.bw_iters, 64 * MIB // size)
        k = a.bw_rounds
        bw = gpucx_bw(size, n, "am", rounds=k)
        _, pbw = perftest("ucp_am_bw", size, n * k, port + size // MIB)  # as many
        pool = gpucx_bw(size, n, "pool", rounds=k)
        posted = gpucx_bw(size, n, "posted", rounds=k)
        group = gpucx_bw(size, n, "group", rounds=k)
        out[f"AM {size // MIB} MiB, handler (MiB/s)"] = (bw, pbw, bw / pbw)
        out[f"AM {size // MIB} MiB, handler+pool (MiB/s)"] = (pool, pbw, pool / pbw)
        out[f"AM {size // MIB} MiB, posted (MiB/s)"] = (posted, pbw, posted / pbw)
        out[f"AM {size // MIB} MiB, posted group (MiB/s)"] = (group, pbw, group / pbw)
    # Arrays are NumPy arrays: compare with raw AM between NumPy buffers.
    raw = gpucx_bw(16 * MIB, a.bw_iters, "am", memory="numpy")
    arr = gpucx_bw(16 * MIB, a.bw_iters, "array")
    out["send/recv_array 16 MiB (MiB/s)"] = (arr, raw, arr / raw)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lat-iters", type=int, default=20000)
    ap.add_argument("--bw-iters", type=int, default=32)
    ap.add_argument(
        "--bw-rounds",
        type=int,
        default=32,
        help="acked rounds of at least 64 MiB in each 1 MiB and 16 MiB "
        "bandwidth run; perftest sends as many messages (default 32: "
        "shorter runs charge gpucx's pipeline fill and last ack to a few "
        "tens of milliseconds)",
    )
    ap.add_argument("--port", type=int, default=13470)
    ap.add_argument(
        "--error-handling",
        action="store_true",
        help="endpoints with peer error handling; perftest -e",
    )
    ap.add_argument(
        "--only",
        default="bw,rate",
        help="bw (latency, bandwidth, arrays), rate (8-byte message rate), "
        "lat (64 KiB and 1 MiB latency, receive_into against a pool)",
    )
    a = ap.parse_args()
    global EH
    EH = a.error_handling
    rounds = [one_round(a, a.port + 20 * r) for r in range(a.rounds)]
    print(f"gpucx {gpucx.__version__}, UCX {'.'.join(map(str, gpucx.UCX_VERSION))}")
    print(
        f"medians over {a.rounds} interleaved rounds, peer error handling "
        f"{'on' if EH else 'off'}"
    )
    head = (
        f"{'measure':36} {'gpucx':>11} {'reference':>11} {'ratio':>6}  "
        f"{'ratio range':11}  best/best"
    )
    print(head)
    for name in rounds[0]:
        g, r, q = (statistics.median(x[name][i] for x in rounds) for i in range(3))
        lo = min(x[name][2] for x in rounds)
        hi = max(x[name][2] for x in rounds)
        # Each side's best round against the other's: robust when the
        # machine flips between fast and slow periods within a run.
        if "(us" in name:  # latency: lower is better
            best = min(x[name][1] for x in rounds) / min(x[name][0] for x in rounds)
        else:
            best = max(x[name][0] for x in rounds) / max(x[name][1] for x in rounds)
        rng = f"{lo:.2f}-{hi:.2f}"
        print(f"{name:36} {g:11.2f} {r:11.2f} {q:6.2f}  {rng:11}  {best:9.2f}")
    print("buffers: mapped by UCX on both sides, as ucx_perftest's; arrays: NumPy")
    print("reference: ucx_perftest, except send/recv_array (raw gpucx AM between")
    print("NumPy buffers);")
    print("ratio: gpucx/reference for bandwidth, reference/gpucx for latency,")
    print("taken within each round; best/best: each side's best round")


if __name__ == "__main__":
    main()
