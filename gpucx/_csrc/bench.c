/*
 * gpucx bench: timing loops for `gpucx bench`.
 *
 * Appended after _ucx_helpers.c (one translation unit).  The loops post,
 * progress and time whole runs of tag, RMA and active-message operations
 * in C, so that the figures measure UCX and gpucx's buffers, not the
 * Python interpreter: one Python->C crossing per measured point, none per
 * message.
 *
 * The loops post through the shared helpers (gpucx_tag_send/recv in tag.c,
 * gpucx__rma in rma.c, gpucx_am_send and gpucx_am_post in am.c); the RMA
 * loop's registration and remote keys come from the product path
 * (gpucx_mem_map, gpucx_rkey_pack/unpack), the AM loops' receives are
 * gpucx's posted receives.
 *
 * Every loop has a deadline.  The caller owns the slot array (and the
 * acknowledgement word): on timeout or failure, pending receives are
 * canceled and drained for a bounded time; whatever UCX still holds then
 * (a rendezvous send to a peer that stopped answering cannot be canceled)
 * stays pending in its slot, and the Python side parks those slots on the
 * worker, which settles them when the endpoint and worker close.  Slots
 * of kind GPUCX_SLOT_TAG_RECV hold tag receives, GPUCX_SLOT_AM_POSTED posted
 * AM receives.
 */

/* Check the deadline once every this many progress calls. */
#define GPUCX_BENCH_CHECK_MASK 1023

typedef struct gpucx_bench_ctl {
    ucp_worker_h worker;
    uint64_t     deadline_ns; /* absolute CLOCK_MONOTONIC time */
    unsigned     spins;
} gpucx_bench_ctl_t;

/* Progress until the slot completes or the deadline passes. */
static inline ucs_status_t gpucx__bench_wait(gpucx_bench_ctl_t *c,
                                             gpucx_slot_t *slot)
{
    while (slot->status == UCS_INPROGRESS) {
        ucp_worker_progress(c->worker);
        if ((++c->spins & GPUCX_BENCH_CHECK_MASK) == 0 &&
            gpucx__now_ns() >= c->deadline_ns) {
            return UCS_ERR_TIMED_OUT;
        }
    }
    gpucx__release(slot);
    return slot->status;
}

/* Start a run: the clock and the deadline; returns the start time. */
static inline uint64_t gpucx__bench_start(gpucx_bench_ctl_t *c,
                                          ucp_worker_h worker,
                                          uint64_t timeout_ns)
{
    uint64_t t0 = gpucx__now_ns();

    c->worker      = worker;
    c->deadline_ns = t0 + timeout_ns;
    c->spins       = 0;
    return t0;
}

/* Make a window slot free for the next post: wait for its operation if it
 * is still in flight, release its request, and return its status. */
static inline ucs_status_t gpucx__bench_reuse(gpucx_bench_ctl_t *c,
                                              gpucx_slot_t *slot)
{
    if (slot->status == UCS_INPROGRESS) {
        return gpucx__bench_wait(c, slot);
    }
    gpucx__release(slot);
    return slot->status;
}

/* Wait for the first n slots in turn; the first failure ends the wait. */
static ucs_status_t gpucx__bench_wait_all(gpucx_bench_ctl_t *c,
                                          gpucx_slot_t *slots, unsigned n)
{
    ucs_status_t st = UCS_OK;
    unsigned     i;

    for (i = 0; i < n && st == UCS_OK; i++) {
        st = gpucx__bench_wait(c, &slots[i]);
    }
    return st;
}

/* Whether slot holds a receive: a tag receive or a posted AM receive
 * (gpucx_am_post). */
static inline int gpucx__bench_is_recv(const gpucx_slot_t *slot)
{
    return slot->kind == GPUCX_SLOT_TAG_RECV ||
           slot->kind == GPUCX_SLOT_AM_POSTED;
}

/* Cancel pending receives (sends cannot be canceled reliably) and progress
 * for a bounded time so that what can finish does; release finished
 * requests.  Slots still pending stay for the caller to park. */
static void gpucx__bench_abort(gpucx_bench_ctl_t *c, gpucx_slot_t *slots,
                               unsigned n)
{
    uint64_t end;
    unsigned i;
    int      busy = 0;

    for (i = 0; i < n; i++) {
        if (gpucx__bench_is_recv(&slots[i])) {
            gpucx_slot_cancel(c->worker, &slots[i]);
        }
    }
    end = gpucx__now_ns() + 1000000000ull;
    do {
        ucp_worker_progress(c->worker);
        busy = 0;
        for (i = 0; i < n; i++) {
            busy |= slots[i].status == UCS_INPROGRESS &&
                    gpucx__bench_is_recv(&slots[i]);
        }
    } while (busy && gpucx__now_ns() < end);
    for (i = 0; i < n; i++) {
        gpucx__release(&slots[i]);
    }
}

/* End a run: the time since t0 into *elapsed_ns and, on failure, the
 * abort above over the run's n slots.  Returns st. */
static ucs_status_t gpucx__bench_end(gpucx_bench_ctl_t *c, uint64_t t0,
                                     ucs_status_t st, gpucx_slot_t *slots,
                                     unsigned n, uint64_t *elapsed_ns)
{
    *elapsed_ns = gpucx__now_ns() - t0;
    if (st != UCS_OK) {
        gpucx__bench_abort(c, slots, n);
    }
    return st;
}

/* What a window loop posts: tag sends or receives, puts or gets, active
 * messages. */
enum {
    GPUCX_BENCH_SEND,
    GPUCX_BENCH_RECV,
    GPUCX_BENCH_PUT,
    GPUCX_BENCH_GET,
    GPUCX_BENCH_AM
};

typedef struct gpucx_bench_op {
    int        what; /* GPUCX_BENCH_* */
    ucp_ep_h   ep;
    void      *buf;
    size_t     len;
    int        mt;
    uint64_t   tag;   /* tag operations */
    uint64_t   raddr; /* RMA */
    ucp_rkey_h rkey;  /* RMA */
    unsigned   am_id; /* active messages */
} gpucx_bench_op_t;

/* Post one operation of op into slot (receives get GPUCX_SLOT_TAG_RECV,
 * for the abort above). */
static inline ucs_status_t gpucx__bench_post(gpucx_bench_ctl_t *c,
                                             const gpucx_bench_op_t *op,
                                             gpucx_slot_t *slot)
{
    slot->kind = op->what == GPUCX_BENCH_RECV ? GPUCX_SLOT_TAG_RECV
                                              : GPUCX_SLOT_PLAIN;
    switch (op->what) {
    case GPUCX_BENCH_SEND:
        return gpucx_tag_send(op->ep, op->buf, op->len, op->tag, op->mt, 0,
                              slot);
    case GPUCX_BENCH_RECV:
        return gpucx_tag_recv(c->worker, op->buf, op->len, op->tag,
                              UINT64_MAX, op->mt, slot);
    case GPUCX_BENCH_AM: /* as ep.am_send_nb(id, buf): no header, no flags */
        return gpucx_am_send(op->ep, op->am_id, NULL, 0, op->buf, op->len,
                             op->mt, 0, slot);
    default:
        return gpucx__rma(op->ep, op->what == GPUCX_BENCH_GET, op->buf,
                          op->len, op->raddr, op->rkey, op->mt, slot);
    }
}

/* The sliding window of the bandwidth loops: `iters` posts of op, at most
 * `window` outstanding (a slot is reused as soon as its operation
 * completed), then wait for all of them. */
static inline ucs_status_t gpucx__bench_window(gpucx_bench_ctl_t *c,
                                               const gpucx_bench_op_t *op,
                                               gpucx_slot_t *slots,
                                               unsigned window, uint64_t iters)
{
    uint64_t     i;
    ucs_status_t st;

    for (i = 0; i < iters; i++) {
        gpucx_slot_t *s = &slots[i % window];

        st = gpucx__bench_reuse(c, s);
        if (st != UCS_OK) {
            return st;
        }
        st = gpucx__bench_post(c, op, s);
        if (UCS_STATUS_IS_ERR(st)) {
            return st;
        }
        /* No progress while the window has room, as ucx_perftest's loops
         * (wait_send_window/wait_recv_window): the reuse above progresses
         * when a slot is still in flight.  A receiver that progressed once
         * per post would drain the transport faster than it posts, and
         * every message past its posted receives would wait, copied, in
         * UCX's unexpected queue. */
    }
    return gpucx__bench_wait_all(c, slots, window);
}

/* Bandwidth stream: `iters` posts of op (sends when send=1, receives when
 * send=0), at most `window` outstanding.  The receiving side then sends an
 * 8-byte acknowledgement with `ack_tag`, and the sending side waits for it
 * (its receive is posted first, so that it is expected), so the sender's
 * time covers delivery of the last byte.  slots has window + 1 zeroed
 * entries (the last one carries the acknowledgement, into *ack).
 * *elapsed_ns gets the time from the first post to the end. */
static ucs_status_t gpucx__bench_acked_stream(ucp_worker_h worker,
                                              const gpucx_bench_op_t *op,
                                              int send, uint64_t ack_tag,
                                              uint64_t iters, unsigned window,
                                              uint64_t timeout_ns,
                                              gpucx_slot_t *slots,
                                              uint64_t *ack,
                                              uint64_t *elapsed_ns)
{
    gpucx_bench_ctl_t c;
    uint64_t          t0;
    ucs_status_t      st = UCS_OK;
    unsigned          nslots;

    if (window == 0) {
        return UCS_ERR_INVALID_PARAM;
    }
    nslots = window + 1;
    t0 = gpucx__bench_start(&c, worker, timeout_ns);
    if (send) {
        slots[window].kind = GPUCX_SLOT_TAG_RECV;
        st = gpucx_tag_recv(worker, ack, sizeof(*ack), ack_tag, UINT64_MAX,
                            UCS_MEMORY_TYPE_HOST, &slots[window]);
        if (UCS_STATUS_IS_ERR(st)) {
            goto out;
        }
        st = UCS_OK;
    }
    st = gpucx__bench_window(&c, op, slots, window, iters);
    if (st != UCS_OK) {
        goto out;
    }
    if (!send) {
        st = gpucx_tag_send(op->ep, ack, sizeof(*ack), ack_tag,
                            UCS_MEMORY_TYPE_HOST, 0, &slots[window]);
        if (UCS_STATUS_IS_ERR(st)) {
            goto out;
        }
    }
    st = gpucx__bench_wait(&c, &slots[window]);
out:
    return gpucx__bench_end(&c, t0, st, slots, nslots, elapsed_ns);
}

/* Tag bandwidth: `iters` sends (send=1) or receives (send=0) of `len` bytes
 * with `tag`, acknowledged as above. */
static ucs_status_t gpucx_bench_tag_stream(ucp_worker_h worker, ucp_ep_h ep,
                                           int send, void *buf, size_t len,
                                           int mt, uint64_t tag,
                                           uint64_t ack_tag, uint64_t iters,
                                           unsigned window,
                                           uint64_t timeout_ns,
                                           gpucx_slot_t *slots, uint64_t *ack,
                                           uint64_t *elapsed_ns)
{
    gpucx_bench_op_t op = {send ? GPUCX_BENCH_SEND : GPUCX_BENCH_RECV,
                           ep, buf, len, mt, tag, 0, NULL, 0};

    return gpucx__bench_acked_stream(worker, &op, send, ack_tag, iters,
                                     window, timeout_ns, slots, ack,
                                     elapsed_ns);
}

/* Active-message bandwidth, sending side: `iters` messages of `len` bytes
 * to handler `id`, acknowledged as above.  The receiver takes them into
 * receives it posted ahead (am_recv_many_nb: matched in gpucx's UCX
 * callback) and sends the acknowledgement from Python. */
static ucs_status_t gpucx_bench_am_stream(ucp_worker_h worker, ucp_ep_h ep,
                                          unsigned id, void *buf, size_t len,
                                          int mt, uint64_t ack_tag,
                                          uint64_t iters, unsigned window,
                                          uint64_t timeout_ns,
                                          gpucx_slot_t *slots, uint64_t *ack,
                                          uint64_t *elapsed_ns)
{
    gpucx_bench_op_t op = {GPUCX_BENCH_AM, ep, buf, len, mt, 0, 0, NULL, id};

    return gpucx__bench_acked_stream(worker, &op, 1, ack_tag, iters, window,
                                     timeout_ns, slots, ack, elapsed_ns);
}

/* A ping-pong's receive: a tag receive, or (reg not NULL) a receive posted
 * for reg's active-message id, as am_recv_nb posts it. */
static inline ucs_status_t gpucx__bench_pp_recv(ucp_worker_h worker,
                                                gpucx_am_reg_t *reg,
                                                void *rbuf, int rmt,
                                                size_t len, uint64_t tag,
                                                gpucx_slot_t *slot)
{
    if (reg != NULL) {
        return gpucx_am_post(reg, rbuf, len, slot);
    }
    slot->kind = GPUCX_SLOT_TAG_RECV;
    return gpucx_tag_recv(worker, rbuf, len, tag, UINT64_MAX, rmt, slot);
}

/* A ping-pong's send: a tag send, or (am) an active message to id `tag`,
 * as am_send_nb sends it (no header, no flags). */
static inline ucs_status_t gpucx__bench_pp_send(ucp_ep_h ep, int am,
                                                void *sbuf, int smt,
                                                size_t len, uint64_t tag,
                                                gpucx_slot_t *slot)
{
    slot->kind = GPUCX_SLOT_PLAIN;
    if (am) {
        return gpucx_am_send(ep, (unsigned)tag, NULL, 0, sbuf, len, smt, 0,
                             slot);
    }
    return gpucx_tag_send(ep, sbuf, len, tag, smt, 0, slot);
}

/* Ping-pong: the initiator sends `len` bytes from sbuf and receives the
 * echo into rbuf, `iters` times; the responder receives, then sends.  The
 * initiator's receive is posted before its send.  Tag messages with `tag`,
 * or (reg not NULL) active messages to id `tag` received through reg.
 * When rtt_ns is not NULL the initiator stores each round trip there (ns).
 * slots has 2 zeroed entries.  *elapsed_ns gets the whole run. */
static ucs_status_t gpucx__bench_pingpong(ucp_worker_h worker, ucp_ep_h ep,
                                          gpucx_am_reg_t *reg, int initiator,
                                          void *sbuf, int smt, void *rbuf,
                                          int rmt, size_t len, uint64_t tag,
                                          uint64_t iters, uint64_t timeout_ns,
                                          gpucx_slot_t *slots,
                                          uint64_t *rtt_ns,
                                          uint64_t *elapsed_ns)
{
    gpucx_bench_ctl_t c;
    uint64_t          i, t0, t;
    ucs_status_t      st = UCS_OK;

    t0 = gpucx__bench_start(&c, worker, timeout_ns);
    for (i = 0; i < iters; i++) {
        t  = gpucx__now_ns();
        st = gpucx__bench_pp_recv(worker, reg, rbuf, rmt, len, tag,
                                  &slots[0]);
        if (UCS_STATUS_IS_ERR(st)) {
            goto out;
        }
        if (!initiator) {
            st = gpucx__bench_wait(&c, &slots[0]);
            if (st != UCS_OK) {
                goto out;
            }
        }
        st = gpucx__bench_pp_send(ep, reg != NULL, sbuf, smt, len, tag,
                                  &slots[1]);
        if (UCS_STATUS_IS_ERR(st)) {
            goto out;
        }
        st = gpucx__bench_wait(&c, &slots[1]);
        if (st != UCS_OK) {
            goto out;
        }
        if (initiator) {
            st = gpucx__bench_wait(&c, &slots[0]);
            if (st != UCS_OK) {
                goto out;
            }
            if (rtt_ns != NULL) {
                rtt_ns[i] = gpucx__now_ns() - t;
            }
        }
    }
out:
    return gpucx__bench_end(&c, t0, st, slots, 2, elapsed_ns);
}

/* Tag ping-pong (see gpucx__bench_pingpong). */
static ucs_status_t gpucx_bench_tag_pingpong(ucp_worker_h worker, ucp_ep_h ep,
                                             int initiator, void *sbuf,
                                             int smt, void *rbuf, int rmt,
                                             size_t len, uint64_t tag,
                                             uint64_t iters,
                                             uint64_t timeout_ns,
                                             gpucx_slot_t *slots,
                                             uint64_t *rtt_ns,
                                             uint64_t *elapsed_ns)
{
    return gpucx__bench_pingpong(worker, ep, NULL, initiator, sbuf, smt, rbuf,
                                 rmt, len, tag, iters, timeout_ns, slots,
                                 rtt_ns, elapsed_ns);
}

/* Active-message ping-pong (see gpucx__bench_pingpong): messages to id,
 * received into host memory rbuf (rmt must say so) through receives posted
 * for reg's id (the registration am_recv_nb uses; the caller made it). */
static ucs_status_t gpucx_bench_am_pingpong(ucp_worker_h worker, ucp_ep_h ep,
                                            gpucx_am_reg_t *reg, unsigned id,
                                            int initiator, void *sbuf,
                                            int smt, void *rbuf, int rmt,
                                            size_t len, uint64_t iters,
                                            uint64_t timeout_ns,
                                            gpucx_slot_t *slots,
                                            uint64_t *rtt_ns,
                                            uint64_t *elapsed_ns)
{
    if (reg == NULL || rmt != UCS_MEMORY_TYPE_HOST) {
        return UCS_ERR_INVALID_PARAM; /* posted receives take host memory */
    }
    return gpucx__bench_pingpong(worker, ep, reg, initiator, sbuf, smt, rbuf,
                                 rmt, len, id, iters, timeout_ns, slots,
                                 rtt_ns, elapsed_ns);
}

/* RMA bandwidth: `iters` puts (get=0) or gets (get=1) of `len` bytes between
 * buf and remote_addr, at most `window` outstanding, then an endpoint flush
 * (so the time covers remote completion).  slots has window + 1 zeroed
 * entries.  *elapsed_ns gets the whole run. */
static ucs_status_t gpucx_bench_rma_stream(ucp_worker_h worker, ucp_ep_h ep,
                                           int get, void *buf, size_t len,
                                           int mt, uint64_t remote_addr,
                                           ucp_rkey_h rkey, uint64_t iters,
                                           unsigned window,
                                           uint64_t timeout_ns,
                                           gpucx_slot_t *slots,
                                           uint64_t *elapsed_ns)
{
    gpucx_bench_op_t  op = {get ? GPUCX_BENCH_GET : GPUCX_BENCH_PUT,
                            ep, buf, len, mt, 0, remote_addr, rkey, 0};
    gpucx_bench_ctl_t c;
    uint64_t          t0;
    ucs_status_t      st = UCS_OK;
    unsigned          nslots;

    if (window == 0) {
        return UCS_ERR_INVALID_PARAM;
    }
    nslots = window + 1; /* the last slot carries the flush */
    t0 = gpucx__bench_start(&c, worker, timeout_ns);
    st = gpucx__bench_window(&c, &op, slots, window, iters);
    if (st != UCS_OK) {
        goto out;
    }
    st = gpucx_ep_flush(ep, &slots[window]);
    if (UCS_STATUS_IS_ERR(st)) {
        goto out;
    }
    st = gpucx__bench_wait(&c, &slots[window]);
out:
    return gpucx__bench_end(&c, t0, st, slots, nslots, elapsed_ns);
}
