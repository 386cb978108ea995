/*
 * gpucx.h: what gpucx's C files share.
 *
 * The builder (gpucx/_build_ucx.py) makes one translation unit: this header,
 * included once at the top, then _ucx_helpers.c and the per-area files of
 * _csrc/ in the order of _build_ucx.C_SOURCES.  Here: the headers every file
 * uses, the records Python reads, what a slot's kind says, the codes helpers
 * return that are not UCX statuses, and the functions one file calls before
 * the file that defines them comes (each under the name of that file).  A
 * function called only after its definition needs no declaration.
 */
#ifndef GPUCX_H
#define GPUCX_H

#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define GPUCX_MIN_UCX UCP_VERSION(1, 20)

#if UCP_API_VERSION < GPUCX_MIN_UCX
#error "gpucx needs UCX >= 1.20 headers (libucx-cu12 >= 1.20)"
#endif

#define GPUCX_CONNQ_CAP 256

/* ---- records shared with Python (cdefs: gpucx/_cdefs/helpers.py) ------ */

typedef struct gpucx_slot {
    ucs_status_t        status; /* UCS_INPROGRESS while UCX owns the op */
    int                 kind;   /* gpucx_slot_kind_t (below) */
    void               *req;    /* UCX request handle while pending */
    ucp_tag_recv_info_t info;   /* UCX writes tag receive info here */
    uint64_t            tag;    /* tag receives: sender tag */
    size_t              length; /* receives: bytes received */
    uint64_t            value;  /* atomics: fetched value */
} gpucx_slot_t;

struct gpucx_worker_state;

typedef struct gpucx_ep_state {
    ucs_status_t               error; /* UCS_OK until UCX reports a failure */
    ucp_ep_h                   ep;
    struct gpucx_worker_state *worker;
} gpucx_ep_state_t;

struct gpucx_amo_emu;
struct gpucx_am_state;
struct gpucx_qstat;

typedef struct gpucx_worker_state {
    ucp_worker_h       worker;
    int                efd;
    /* gpucx's atomics over active messages (atomic.c), or NULL. */
    struct gpucx_amo_emu *amo;
    /* What gpucx_progress looks at after progress (engine.c): the handler
     * queue, and the notification queue's counters while Python has a
     * notification handler (else NULL). */
    struct gpucx_am_state     *am;
    const struct gpucx_qstat *notify;
} gpucx_worker_state_t;

/* The connection-request ring has one producer (the UCX callback, inside
 * ucp_worker_progress, which a ProgressThread may run) and one consumer
 * side (Python after progress, maybe several threads of a "multi"
 * worker).  tail is written by the producer only, head by consumers with a
 * CAS; release stores pair with acquire loads on the other side, so an
 * entry is complete before a consumer sees it and taken before the
 * producer reuses it. */
typedef struct gpucx_listener_state {
    ucp_listener_h     listener;
    unsigned           head; /* consumers (CAS) */
    unsigned           tail; /* the producer */
    ucp_conn_request_h q[GPUCX_CONNQ_CAP];
} gpucx_listener_state_t;

/* Accounting of one queue a peer can fill (kept AM messages, the handler
 * queue, notifications): what it holds now, its caps and what the caps
 * dropped.  Guarded by the lock of the queue it describes. */
typedef struct gpucx_qstat {
    size_t   count;
    size_t   bytes;
    size_t   max_count;     /* SIZE_MAX: no cap */
    size_t   max_bytes;     /* SIZE_MAX: no cap */
    uint64_t dropped;
    uint64_t dropped_bytes;
} gpucx_qstat_t;

/* A worker's active-message state (am.c): the handler queue and the
 * counters of both AM queues.  Here because the engine (engine.c) reads
 * its tail and drop counters to say what is due; am.c owns the rest. */
typedef struct gpucx_am_state {
    ucp_worker_h    worker;
    unsigned        head;    /* next message to pop */
    unsigned        tail;    /* next free entry; head == tail: empty */
    unsigned        cap;
    struct gpucx_am_msg *q;
    /* Caps and counters (guarded by lock): queue describes q[head, tail),
     * kept every reg's kq together.  drops counts every message a cap (or
     * lack of memory) dropped, here and in the worker's notification
     * queue; Python compares it with what it saw to warn. */
    gpucx_qstat_t   queue;
    gpucx_qstat_t   kept;
    uint64_t        drops;
    uint64_t        drops_seen; /* drops when Python last looked (Python) */
    /* Push (inside progress) and pop (Python) may run in different threads
     * of a "multi" worker; uncontended, the lock costs a few ns. */
    pthread_mutex_t lock;
} gpucx_am_state_t;

/* ---- slot kinds ---------------------------------------------------------- */

/* What a slot holds beside its status (slot->kind), for the code that must
 * tell operations UCX does not hold apart (gpucx_slot_cancel) and for the
 * benchmark loops' bookkeeping.  The Python side never reads or sets it. */
typedef enum gpucx_slot_kind {
    /* A UCX request (slot->req while pending), or nothing pending. */
    GPUCX_SLOT_PLAIN     = 0,
    /* A tag receive the benchmark loops posted (bench.c: canceled when a
     * loop gives up; UCX holds it). */
    GPUCX_SLOT_TAG_RECV  = 1,
    /* A posted AM receive no message matched yet: slot->value holds its
     * gpucx_am_reg_t * (am.c). */
    GPUCX_SLOT_AM_POSTED = 2,
    /* The slot of receives posted as a group while members are pending: it
     * is the first member of its gpucx_am_group_t (am.c). */
    GPUCX_SLOT_AM_GROUP  = 3,
    /* An atomic gpucx runs over active messages (atomic.c). */
    GPUCX_SLOT_AMO_EMU   = 4,
} gpucx_slot_kind_t;

/* ---- codes that are not UCX statuses -------------------------------------- */

/* Helpers return them where a ucs_status_t goes: UCX's statuses are UCS_OK
 * (0), UCS_INPROGRESS (1) and negative errors, so each is a distinct
 * positive value (the cdefs of gpucx/_cdefs give Python the same ones). */

/* What gpucx_wait_sleep returns (and, negated, gpucx_worker_sleep) when
 * the peers' fd woke it: a local peer the worker watches exited. */
#define GPUCX_PEER_EXITED 2
/* What gpucx_wait_due returns when it stopped because Python has work due
 * (gpucx_due), the slot still in progress. */
#define GPUCX_WAIT_DUE 3
/* What gpucx_am_post_mt and gpucx_am_post_group return when a kept eager
 * message must be copied into a device buffer by Python (am.c). */
#define GPUCX_AM_COPY_IN 5

/* ---- called before the file that defines them ----------------------------- */

struct gpucx_am_reg;
struct gpucx_am_group;

/* am.c */
static int gpucx__am_unpost(struct gpucx_am_reg *reg, gpucx_slot_t *slot);
static void gpucx__am_unpost_group(struct gpucx_am_group *g);

/* atomic.c */
static void gpucx__amo_ep_failed(struct gpucx_amo_emu *emu, ucp_ep_h ep,
                                 ucs_status_t status);
static void gpucx__amo_emu_cancel(ucp_worker_h worker, gpucx_slot_t *slot);

#endif /* GPUCX_H */
