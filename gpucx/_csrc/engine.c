/*
 * The worker's progress engine, C side (gpucx/_engine.py is the Python
 * side): what Python has to do after progress (the due bits, gpucx_due),
 * progress itself (gpucx_progress, gpucx_progress_watch), and every wait
 * in C: the due-spin (gpucx__spin, gpucx_wait, gpucx_wait_due), the tail
 * of the fused post-and-wait helpers (gpucx__wait_posted) and the sleeps
 * on the event fd (gpucx_worker_sleep, gpucx_wait_sleep).  Appended right
 * after _ucx_helpers.c, whose slots and clock it uses, so that every area
 * after it can wait.
 */

/* ---- due bits and progress ---------------------------------------------- */

/* Bits of gpucx_progress's and gpucx_due's results: what Python has to do
 * after progress.  UCX's event count (the low bits) never comes near them. */
static const unsigned GPUCX_DUE_AM     = 1u << 31; /* messages for handlers */
static const unsigned GPUCX_DUE_NOTIFY = 1u << 30; /* notifications, handler set */
static const unsigned GPUCX_DUE_DROPS  = 1u << 29; /* drops Python has not seen */
static const unsigned GPUCX_DUE        = 7u << 29; /* any of them */
/* The most ucp_worker_progress calls one gpucx_progress makes: it goes on
 * while UCX reports events, so that messages arriving back to back reach
 * Python's handlers as one batch (one cold pass through the dispatch code
 * for many messages, not one per message), and stops after this many so
 * that one call stays short. */
#ifndef GPUCX_PROGRESS_ROUNDS
#define GPUCX_PROGRESS_ROUNDS 16
#endif

/* The due bits of w (what w->am and w->notify point to; see
 * gpucx_progress_watch).  The reads are unlocked: whatever one misses, the
 * next look sees. */
static unsigned gpucx_due(const gpucx_worker_state_t *w)
{
    const gpucx_am_state_t *st  = w->am;
    unsigned                due = 0;

    if (st != NULL) {
        if (st->tail != 0) {
            due |= GPUCX_DUE_AM;
        }
        if (st->drops != st->drops_seen) {
            due |= GPUCX_DUE_DROPS;
        }
    }
    if (w->notify != NULL && w->notify->count != 0) {
        due |= GPUCX_DUE_NOTIFY;
    }
    return due;
}

/* Progress the worker until UCX reports no event, at most
 * GPUCX_PROGRESS_ROUNDS times (UCX's own "while (ucp_worker_progress(w))"
 * idiom, bounded); returns UCX's event count with the due bits of what
 * Python has to do after it.  Worker.progress is one C call with one
 * argument this way (each cdata argument costs cffi a type check), and it
 * reads no cffi field to know what to run. */
static unsigned gpucx_progress(gpucx_worker_state_t *w)
{
    unsigned total = 0, n;
    int      i;

    for (i = 0; i < GPUCX_PROGRESS_ROUNDS; ++i) {
        n = ucp_worker_progress(w->worker);
        total += n;
        if (n == 0) {
            break;
        }
    }
    return total | gpucx_due(w);
}

/* Point gpucx_progress at the worker's AM state and, while a notification
 * handler is set, its notification counters (NULL otherwise). */
static void gpucx_progress_watch(gpucx_worker_state_t *w,
                                 gpucx_am_state_t *am,
                                 const gpucx_qstat_t *notify)
{
    w->am     = am;
    w->notify = notify;
}

/* ---- progress and waiting ---------------------------------------------- */

/* Progress until the slot completes or spin_ns pass, or (due not NULL)
 * until Python has work due on that worker state (GPUCX_WAIT_DUE); frees
 * the UCX request when complete.  Returns the slot status (UCS_INPROGRESS
 * if still pending). */
static inline ucs_status_t gpucx__spin(ucp_worker_h worker,
                                       const gpucx_worker_state_t *due,
                                       gpucx_slot_t *slot, uint64_t spin_ns)
{
    uint64_t deadline = 0;
    unsigned n        = 0;

    while (slot->status == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
        if (due != NULL && slot->status == UCS_INPROGRESS &&
            gpucx_due(due) != 0) {
            return (ucs_status_t)GPUCX_WAIT_DUE;
        }
        if ((++n & 63) == 0) {
            uint64_t now = gpucx__now_ns();
            if (deadline == 0) {
                deadline = now + spin_ns;
            } else if (now >= deadline) {
                break;
            }
        }
    }
    gpucx__release(slot);
    return slot->status;
}

/* Progress until the slot completes or spin_ns pass (gpucx__spin). */
static ucs_status_t gpucx_wait(ucp_worker_h worker, gpucx_slot_t *slot,
                               uint64_t spin_ns)
{
    return gpucx__spin(worker, NULL, slot, spin_ns);
}

/* gpucx_wait that also stops when Python has work due (messages for
 * handlers, notifications, drops): a blocking wait then runs the handlers
 * before it goes on, as the messages arrive, not once the operation is
 * done or the spin is over.  A handler's rendezvous receive (AmMessage.
 * receive_into) is posted that much sooner.  Returns the slot's status,
 * or GPUCX_WAIT_DUE (the slot still in progress). */
static ucs_status_t gpucx_wait_due(gpucx_worker_state_t *w,
                                   gpucx_slot_t *slot, uint64_t spin_ns)
{
    return gpucx__spin(w->worker, w, slot, spin_ns);
}

/* The tail of every fused post-and-wait helper (gpucx_*_wait): a post
 * that finished at once returns its status, one in flight is progressed
 * for up to spin_ns, or until Python has work due (gpucx_wait_due):
 * then it returns UCS_INPROGRESS, and Python's wait (request.block)
 * runs the handlers and goes on. */
static inline ucs_status_t gpucx__wait_posted(gpucx_worker_state_t *ws,
                                              gpucx_slot_t *slot,
                                              ucs_status_t posted,
                                              uint64_t spin_ns)
{
    ucs_status_t st;

    if (posted != UCS_INPROGRESS) {
        return slot->status;
    }
    st = gpucx_wait_due(ws, slot, spin_ns);
    return st == (ucs_status_t)GPUCX_WAIT_DUE ? UCS_INPROGRESS : st;
}

/* Sleep on the worker's event fd until something happens or timeout_ms pass
 * (-1 = forever), without holding the GIL (cffi releases it).  pfd, when
 * not negative, is slept on too: the epoll set of the pidfds of the local
 * peers the worker watches (gpucx/_liveness.py), readable once one of
 * them exited.  Returns the number of progress events seen, or
 * -GPUCX_PEER_EXITED when pfd woke it.  Safe to call with efd < 0: then it
 * only progresses. */
static int gpucx_worker_sleep(ucp_worker_h worker, int efd, int pfd,
                              int timeout_ms)
{
    unsigned      events = ucp_worker_progress(worker);
    ucs_status_t  st;
    struct pollfd pfds[2];
    nfds_t        n = 1;

    if (events != 0 || efd < 0) {
        return (int)events;
    }
    st = ucp_worker_arm(worker);
    if (st == UCS_ERR_BUSY) {
        return (int)ucp_worker_progress(worker);
    }
    if (st != UCS_OK) {
        return -1;
    }
    pfds[0].fd      = efd;
    pfds[0].events  = POLLIN;
    pfds[0].revents = 0;
    if (pfd >= 0) {
        pfds[1].fd      = pfd;
        pfds[1].events  = POLLIN;
        pfds[1].revents = 0;
        n               = 2;
    }
    poll(pfds, n, timeout_ms);
    events = ucp_worker_progress(worker);
    if (n == 2 && (pfds[1].revents & POLLIN)) {
        return -GPUCX_PEER_EXITED;
    }
    return (int)events;
}

/* Wait for a slot: spin for spin_ns, then sleep on the efd (and pfd, see
 * gpucx_worker_sleep) for at most timeout_ms (the Python side loops so
 * that signals and deadlines are checked).  Returns the slot's status, or
 * GPUCX_PEER_EXITED when the slot is still in progress and pfd woke the
 * sleep. */
static ucs_status_t gpucx_wait_sleep(ucp_worker_h worker, int efd, int pfd,
                                     gpucx_slot_t *slot, int timeout_ms)
{
    int r = 0;

    if (slot->status == UCS_INPROGRESS) {
        r = gpucx_worker_sleep(worker, efd, pfd, timeout_ms);
    }
    gpucx__release(slot);
    if (slot->status == UCS_INPROGRESS && r == -GPUCX_PEER_EXITED) {
        return (ucs_status_t)GPUCX_PEER_EXITED;
    }
    return slot->status;
}
