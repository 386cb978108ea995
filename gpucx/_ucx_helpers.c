/*
 * gpucx C helpers.
 *
 * Everything that runs inside ucp_worker_progress() lives in this file (and
 * the per-area files the builder appends after it): completion callbacks
 * record status, length and tag into a gpucx_slot_t, the endpoint-error and
 * connection-request callbacks push into small C rings.  Python reads those
 * records after progress returns; no Python code is ever called from UCX.
 *
 * Post helpers build ucp_request_param_t here so that one Python->C crossing
 * posts an operation, and the fused *_wait helpers post and progress in one
 * crossing for the blocking API.
 */
#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
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

#define GPUCX_ERRQ_CAP  256
#define GPUCX_CONNQ_CAP 256

/* ---- records shared with Python --------------------------------------- */

typedef struct gpucx_slot {
    ucs_status_t        status; /* UCS_INPROGRESS while UCX owns the op */
    int                 kind;   /* free for the Python side */
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

/* The two rings below have one producer (a UCX callback, inside
 * ucp_worker_progress, which a ProgressThread may run) and one consumer
 * side (Python after progress, maybe several threads of a "multi"
 * worker).  tail is written by the producer only, head by consumers with a
 * CAS; release stores pair with acquire loads on the other side, so an
 * entry is complete before a consumer sees it and taken before the
 * producer reuses it. */
struct gpucx_amo_emu;

typedef struct gpucx_worker_state {
    ucp_worker_h       worker;
    int                efd;
    /* gpucx's atomics over active messages (atomic.c), or NULL. */
    struct gpucx_amo_emu *amo;
    unsigned           err_head; /* consumers (CAS) */
    unsigned           err_tail; /* the producer */
    gpucx_ep_state_t  *err_q[GPUCX_ERRQ_CAP];
} gpucx_worker_state_t;

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

/* Set the caps of s (0: no cap) and clear its counters. */
static void gpucx_qstat_init(gpucx_qstat_t *s, size_t max_count, size_t max_bytes)
{
    memset(s, 0, sizeof(*s));
    s->max_count = max_count ? max_count : SIZE_MAX;
    s->max_bytes = max_bytes ? max_bytes : SIZE_MAX;
}

/* Charge a message of nbytes to s if it fits under both caps (returns 1);
 * otherwise count it as dropped, bump *drops (the worker-wide counter the
 * Python side watches to warn) and return 0. */
static int gpucx__qstat_admit(gpucx_qstat_t *s, size_t nbytes, uint64_t *drops)
{
    if (s->count < s->max_count && nbytes <= s->max_bytes - s->bytes) {
        s->count++;
        s->bytes += nbytes;
        return 1;
    }
    s->dropped++;
    s->dropped_bytes += nbytes;
    if (drops != NULL) {
        __atomic_fetch_add(drops, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

static inline void gpucx__qstat_leave(gpucx_qstat_t *s, size_t nbytes)
{
    s->count--;
    s->bytes -= nbytes;
}

static const char *gpucx_package_version(void) { return GPUCX_VERSION_STRING; }
static const char *gpucx_build_ucx_prefix(void) { return GPUCX_UCX_PREFIX_STRING; }
static const unsigned GPUCX_HEADERS_MAJOR = UCP_API_MAJOR;
static const unsigned GPUCX_HEADERS_MINOR = UCP_API_MINOR;
static const unsigned GPUCX_ERRQ_CAPACITY = GPUCX_ERRQ_CAP;
static const unsigned GPUCX_CONNQ_CAPACITY = GPUCX_CONNQ_CAP;


/* ---- status names ------------------------------------------------------ */

static const char *gpucx_status_name(ucs_status_t st)
{
    switch (st) {
#define GPUCX_NAME(_s) case _s: return #_s;
    GPUCX_NAME(UCS_OK)
    GPUCX_NAME(UCS_INPROGRESS)
    GPUCX_NAME(UCS_ERR_NO_MESSAGE)
    GPUCX_NAME(UCS_ERR_NO_RESOURCE)
    GPUCX_NAME(UCS_ERR_IO_ERROR)
    GPUCX_NAME(UCS_ERR_NO_MEMORY)
    GPUCX_NAME(UCS_ERR_INVALID_PARAM)
    GPUCX_NAME(UCS_ERR_UNREACHABLE)
    GPUCX_NAME(UCS_ERR_INVALID_ADDR)
    GPUCX_NAME(UCS_ERR_NOT_IMPLEMENTED)
    GPUCX_NAME(UCS_ERR_MESSAGE_TRUNCATED)
    GPUCX_NAME(UCS_ERR_NO_PROGRESS)
    GPUCX_NAME(UCS_ERR_BUFFER_TOO_SMALL)
    GPUCX_NAME(UCS_ERR_NO_ELEM)
    GPUCX_NAME(UCS_ERR_SOME_CONNECTS_FAILED)
    GPUCX_NAME(UCS_ERR_NO_DEVICE)
    GPUCX_NAME(UCS_ERR_BUSY)
    GPUCX_NAME(UCS_ERR_CANCELED)
    GPUCX_NAME(UCS_ERR_SHMEM_SEGMENT)
    GPUCX_NAME(UCS_ERR_ALREADY_EXISTS)
    GPUCX_NAME(UCS_ERR_OUT_OF_RANGE)
    GPUCX_NAME(UCS_ERR_TIMED_OUT)
    GPUCX_NAME(UCS_ERR_EXCEEDS_LIMIT)
    GPUCX_NAME(UCS_ERR_UNSUPPORTED)
    GPUCX_NAME(UCS_ERR_REJECTED)
    GPUCX_NAME(UCS_ERR_NOT_CONNECTED)
    GPUCX_NAME(UCS_ERR_CONNECTION_RESET)
    GPUCX_NAME(UCS_ERR_ENDPOINT_TIMEOUT)
#undef GPUCX_NAME
    default:
        if (st <= UCS_ERR_FIRST_LINK_FAILURE && st >= UCS_ERR_LAST_LINK_FAILURE) {
            return "UCS_ERR_LINK_FAILURE";
        }
        if (st <= UCS_ERR_FIRST_ENDPOINT_FAILURE &&
            st >= UCS_ERR_LAST_ENDPOINT_FAILURE) {
            return "UCS_ERR_ENDPOINT_FAILURE";
        }
        return "UCS_ERR_UNKNOWN";
    }
}

/* ---- time -------------------------------------------------------------- */

static inline uint64_t gpucx__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- completion callbacks (run inside ucp_worker_progress) ------------ */

static void gpucx__send_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)request;
    ((gpucx_slot_t *)user_data)->status = status;
}

static void gpucx__tag_recv_cb(void *request, ucs_status_t status,
                               const ucp_tag_recv_info_t *info, void *user_data)
{
    gpucx_slot_t *slot = (gpucx_slot_t *)user_data;
    (void)request;
    if (info != NULL) {
        slot->tag    = info->sender_tag;
        slot->length = info->length;
    }
    slot->status = status;
}

static void gpucx__amo_ep_failed(struct gpucx_amo_emu *emu, ucp_ep_h ep,
                                 ucs_status_t status);

static void gpucx__ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    gpucx_ep_state_t     *st = (gpucx_ep_state_t *)arg;
    gpucx_worker_state_t *w  = st->worker;
    /* Emulated atomics still waiting for this peer's reply fail now. */
    gpucx__amo_ep_failed(w->amo, ep, status);
    if (st->error == UCS_OK) {
        st->error = status;
    }
    unsigned tail = w->err_tail; /* only this callback writes it */
    /* A full ring loses the notice, not the error: st->error is set and
     * the endpoint's next operation reports it. */
    if (tail - __atomic_load_n(&w->err_head, __ATOMIC_ACQUIRE) < GPUCX_ERRQ_CAP) {
        w->err_q[tail % GPUCX_ERRQ_CAP] = st;
        __atomic_store_n(&w->err_tail, tail + 1, __ATOMIC_RELEASE);
    }
}

static void gpucx__conn_cb(ucp_conn_request_h req, void *arg)
{
    gpucx_listener_state_t *ls   = (gpucx_listener_state_t *)arg;
    unsigned                tail = ls->tail; /* only this callback writes it */

    if (tail - __atomic_load_n(&ls->head, __ATOMIC_ACQUIRE) < GPUCX_CONNQ_CAP) {
        ls->q[tail % GPUCX_CONNQ_CAP] = req;
        __atomic_store_n(&ls->tail, tail + 1, __ATOMIC_RELEASE);
    } else {
        ucp_listener_reject(ls->listener, req);
    }
}

/* ---- slots ------------------------------------------------------------- */

/* Free the UCX request exactly once, after its callback ran. */
static inline void gpucx__release(gpucx_slot_t *slot)
{
    if (slot->req != NULL && slot->status != UCS_INPROGRESS) {
        ucp_request_free(slot->req);
        slot->req = NULL;
    }
}

/* Record the outcome of a post: NULL = done now, error pointer = failed now,
 * anything else = pending; the callback writes slot->status later. */
static inline ucs_status_t gpucx__posted(gpucx_slot_t *slot, ucs_status_ptr_t p)
{
    if (p == NULL) {
        slot->status = UCS_OK;
        slot->req    = NULL;
    } else if (UCS_PTR_IS_ERR(p)) {
        slot->status = UCS_PTR_STATUS(p);
        slot->req    = NULL;
    } else {
        slot->req = p;
        /* Should the callback already have run, free the request now: a
         * caller that sees a final status holds no reference to it. */
        gpucx__release(slot);
    }
    return slot->status;
}

/* Tag receives that complete at once report through recv_info.tag_info. */
static inline ucs_status_t gpucx__tag_posted(gpucx_slot_t *slot,
                                             ucs_status_ptr_t p)
{
    if (p == NULL) {
        slot->tag    = slot->info.sender_tag;
        slot->length = slot->info.length;
    }
    return gpucx__posted(slot, p);
}

static void gpucx_slot_release(gpucx_slot_t *slot)
{
    gpucx__release(slot);
}

struct gpucx_am_reg;
struct gpucx_am_group;
static int gpucx__am_unpost(struct gpucx_am_reg *reg, gpucx_slot_t *slot);
static void gpucx__am_unpost_group(struct gpucx_am_group *g);
/* A slot of an atomic gpucx runs over active messages (atomic.c). */
#define GPUCX_SLOT_AMO_EMU 4
static void gpucx__amo_emu_cancel(ucp_worker_h worker, gpucx_slot_t *slot);

static ucs_status_t gpucx_slot_cancel(ucp_worker_h worker, gpucx_slot_t *slot)
{
    if (slot->status == UCS_INPROGRESS && slot->req != NULL) {
        ucp_request_cancel(worker, slot->req);
    } else if (slot->status == UCS_INPROGRESS && slot->kind == 2) {
        /* A posted AM receive no message matched yet (am.c). */
        gpucx__am_unpost((struct gpucx_am_reg *)(uintptr_t)slot->value, slot);
    } else if (slot->status == UCS_INPROGRESS && slot->kind == 3) {
        /* Receives posted as a group (am.c): the slot opens the group. */
        gpucx__am_unpost_group((struct gpucx_am_group *)slot);
    } else if (slot->status == UCS_INPROGRESS &&
               slot->kind == GPUCX_SLOT_AMO_EMU) {
        gpucx__amo_emu_cancel(worker, slot);
    }
    return slot->status;
}

static inline void gpucx__param_init(ucp_request_param_t *p, gpucx_slot_t *slot,
                                     int memory_type)
{
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p->user_data    = slot;
    if (memory_type >= 0) {
        p->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        p->memory_type   = (ucs_memory_type_t)memory_type;
    }
    slot->status = UCS_INPROGRESS;
    slot->req    = NULL;
}

/* ---- progress and waiting ---------------------------------------------- */

/* Progress until the slot completes or spin_ns pass; frees the UCX request
 * when complete.  Returns the slot status (UCS_INPROGRESS if still pending). */
static ucs_status_t gpucx_wait(ucp_worker_h worker, gpucx_slot_t *slot,
                               uint64_t spin_ns)
{
    uint64_t deadline = 0;
    unsigned n        = 0;

    while (slot->status == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
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

/* Sleep on the worker's event fd until something happens or timeout_ms pass
 * (-1 = forever), without holding the GIL (cffi releases it).  Returns the
 * number of progress events seen.  Safe to call with efd < 0: then it only
 * progresses. */
static int gpucx_worker_sleep(ucp_worker_h worker, int efd, int timeout_ms)
{
    unsigned      events = ucp_worker_progress(worker);
    ucs_status_t  st;
    struct pollfd pfd;

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
    pfd.fd      = efd;
    pfd.events  = POLLIN;
    pfd.revents = 0;
    poll(&pfd, 1, timeout_ms);
    return (int)ucp_worker_progress(worker);
}

/* Wait for a slot: spin for spin_ns, then sleep on the efd in slices of at
 * most slice_ms, for at most timeout_ms in all (-1 = one slice only; the
 * Python side loops so that signals and deadlines are checked). */
static ucs_status_t gpucx_wait_sleep(ucp_worker_h worker, int efd,
                                     gpucx_slot_t *slot, int timeout_ms)
{
    if (slot->status == UCS_INPROGRESS) {
        gpucx_worker_sleep(worker, efd, timeout_ms);
    }
    gpucx__release(slot);
    return slot->status;
}

/* ---- context ----------------------------------------------------------- */

static ucs_status_t gpucx_config_create(ucp_config_t **out)
{
    return ucp_config_read(NULL, NULL, out);
}

static ucs_status_t gpucx_context_create(ucp_config_t *config, uint64_t features,
                                         const char *name, ucp_context_h *out)
{
    ucp_params_t params;

    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME |
                        UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features          = features;
    params.name              = name;
    params.mt_workers_shared = 1;
    return ucp_init(&params, config, out);
}

static uint64_t gpucx_context_memory_types(ucp_context_h ctx)
{
    ucp_context_attr_t attr;

    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(ctx, &attr) != UCS_OK) {
        return 0;
    }
    return attr.memory_types;
}

/* ---- worker ------------------------------------------------------------ */

static ucs_status_t gpucx_worker_create(ucp_context_h ctx, int thread_mode,
                                        int want_efd, gpucx_worker_state_t *st)
{
    ucp_worker_params_t params;
    ucs_status_t        status;

    memset(&params, 0, sizeof(params));
    params.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = (ucs_thread_mode_t)thread_mode;
    memset(st, 0, sizeof(*st));
    st->efd = -1;
    status  = ucp_worker_create(ctx, &params, &st->worker);
    if (status != UCS_OK) {
        return status;
    }
    if (want_efd && ucp_worker_get_efd(st->worker, &st->efd) != UCS_OK) {
        st->efd = -1;
    }
    return UCS_OK;
}

/* Copy the worker address into a malloc'ed buffer the caller frees with
 * gpucx_free (so the Python side needs one ffi.gc, no UCX call). */
static ucs_status_t gpucx_worker_address(ucp_worker_h worker, void **out,
                                         size_t *len)
{
    ucp_worker_attr_t attr;
    ucs_status_t      status;

    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    status          = ucp_worker_query(worker, &attr);
    if (status != UCS_OK) {
        return status;
    }
    *out = malloc(attr.address_length);
    if (*out == NULL) {
        ucp_worker_release_address(worker, attr.address);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(*out, attr.address, attr.address_length);
    *len = attr.address_length;
    ucp_worker_release_address(worker, attr.address);
    return UCS_OK;
}

static void gpucx_free(void *p)
{
    free(p);
}

/* Pop one failed endpoint from the worker's error ring, or NULL. */
static gpucx_ep_state_t *gpucx_worker_pop_error(gpucx_worker_state_t *w)
{
    gpucx_ep_state_t *st;
    unsigned          head = __atomic_load_n(&w->err_head, __ATOMIC_ACQUIRE);

    /* Consumers may be several Python threads (cffi drops the GIL): the
     * entry read before a successful CAS was not reused meanwhile, since
     * the producer reuses it only after head moved past it. */
    do {
        if (head == __atomic_load_n(&w->err_tail, __ATOMIC_ACQUIRE)) {
            return NULL;
        }
        st = w->err_q[head % GPUCX_ERRQ_CAP];
    } while (!__atomic_compare_exchange_n(&w->err_head, &head, head + 1, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return st;
}

static ucs_status_t gpucx_worker_flush(ucp_worker_h worker, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, ucp_worker_flush_nbx(worker, &p));
}

/* ---- endpoints --------------------------------------------------------- */

static void gpucx__ep_params(ucp_ep_params_t *params, int err_mode_peer,
                             gpucx_ep_state_t *st)
{
    memset(params, 0, sizeof(*params));
    params->field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params->err_mode   = err_mode_peer ? UCP_ERR_HANDLING_MODE_PEER
                                       : UCP_ERR_HANDLING_MODE_NONE;
    params->err_handler.cb  = gpucx__ep_err_cb;
    params->err_handler.arg = st;
    st->error               = UCS_OK;
}

static ucs_status_t gpucx_ep_create_address(gpucx_worker_state_t *w,
                                            const void *address,
                                            int err_mode_peer,
                                            gpucx_ep_state_t *st)
{
    ucp_ep_params_t params;

    gpucx__ep_params(&params, err_mode_peer, st);
    st->worker = w;
    params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)address;
    return ucp_ep_create(w->worker, &params, &st->ep);
}

static ucs_status_t gpucx_ep_create_sockaddr(gpucx_worker_state_t *w,
                                             const char *host, uint16_t port,
                                             int err_mode_peer,
                                             gpucx_ep_state_t *st)
{
    ucp_ep_params_t  params;
    struct addrinfo  hints, *res = NULL;
    char             service[8];
    ucs_status_t     status;

    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(service, sizeof(service), "%u", (unsigned)port);
    if (getaddrinfo(host, service, &hints, &res) != 0 || res == NULL) {
        return UCS_ERR_INVALID_ADDR;
    }
    gpucx__ep_params(&params, err_mode_peer, st);
    st->worker = w;
    params.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    params.flags           = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr   = res->ai_addr;
    params.sockaddr.addrlen = res->ai_addrlen;
    status = ucp_ep_create(w->worker, &params, &st->ep);
    freeaddrinfo(res);
    return status;
}

static ucs_status_t gpucx_ep_create_conn(gpucx_worker_state_t *w,
                                         ucp_conn_request_h req,
                                         int err_mode_peer,
                                         gpucx_ep_state_t *st)
{
    ucp_ep_params_t params;

    gpucx__ep_params(&params, err_mode_peer, st);
    st->worker = w;
    params.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = req;
    return ucp_ep_create(w->worker, &params, &st->ep);
}

static ucs_status_t gpucx_ep_close(ucp_ep_h ep, int force, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return gpucx__posted(slot, ucp_ep_close_nbx(ep, &p));
}

static ucs_status_t gpucx_ep_flush(ucp_ep_h ep, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, ucp_ep_flush_nbx(ep, &p));
}

/* Fill names[2*i], names[2*i+1] with transport and device of each lane. */
static int gpucx_ep_transports(ucp_ep_h ep, const char **names, unsigned max)
{
    ucp_ep_attr_t          attr;
    ucp_transport_entry_t  entries[64];
    unsigned               i;

    if (max > 64) {
        max = 64;
    }
    attr.field_mask                = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries        = entries;
    attr.transports.num_entries    = max;
    attr.transports.entry_size     = sizeof(ucp_transport_entry_t);
    if (ucp_ep_query(ep, &attr) != UCS_OK) {
        return -1;
    }
    for (i = 0; i < attr.transports.num_entries; i++) {
        names[2 * i]     = entries[i].transport_name;
        names[2 * i + 1] = entries[i].device_name;
    }
    return (int)attr.transports.num_entries;
}

/* ---- listener ---------------------------------------------------------- */

static ucs_status_t gpucx_listener_create(ucp_worker_h worker, const char *host,
                                          uint16_t port,
                                          gpucx_listener_state_t *ls)
{
    ucp_listener_params_t params;
    struct addrinfo       hints, *res = NULL;
    char                  service[8];
    ucs_status_t          status;

    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags    = AI_PASSIVE;
    snprintf(service, sizeof(service), "%u", (unsigned)port);
    if (getaddrinfo(host, service, &hints, &res) != 0 || res == NULL) {
        return UCS_ERR_INVALID_ADDR;
    }
    memset(ls, 0, sizeof(*ls));
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                        UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr      = res->ai_addr;
    params.sockaddr.addrlen   = res->ai_addrlen;
    params.conn_handler.cb    = gpucx__conn_cb;
    params.conn_handler.arg   = ls;
    status = ucp_listener_create(worker, &params, &ls->listener);
    freeaddrinfo(res);
    return status;
}

static int gpucx_listener_port(ucp_listener_h listener)
{
    ucp_listener_attr_t attr;

    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(listener, &attr) != UCS_OK) {
        return -1;
    }
    if (attr.sockaddr.ss_family == AF_INET) {
        return ntohs(((struct sockaddr_in *)&attr.sockaddr)->sin_port);
    }
    if (attr.sockaddr.ss_family == AF_INET6) {
        return ntohs(((struct sockaddr_in6 *)&attr.sockaddr)->sin6_port);
    }
    return -1;
}

static ucp_conn_request_h gpucx_listener_pop(gpucx_listener_state_t *ls)
{
    ucp_conn_request_h req;
    unsigned           head = __atomic_load_n(&ls->head, __ATOMIC_ACQUIRE);

    do { /* several consumers: see gpucx_worker_pop_error */
        if (head == __atomic_load_n(&ls->tail, __ATOMIC_ACQUIRE)) {
            return NULL;
        }
        req = ls->q[head % GPUCX_CONNQ_CAP];
    } while (!__atomic_compare_exchange_n(&ls->head, &head, head + 1, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return req;
}

/* Reject everything still queued (listener close). */
static void gpucx_listener_drain(gpucx_listener_state_t *ls)
{
    ucp_conn_request_h req;

    while ((req = gpucx_listener_pop(ls)) != NULL) {
        ucp_listener_reject(ls->listener, req);
    }
}

/* ---- tag matching ------------------------------------------------------ */

static ucs_status_t gpucx_tag_send(ucp_ep_h ep, const void *buf, size_t len,
                                   uint64_t tag, int memory_type, int sync,
                                   gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, sync ? ucp_tag_send_sync_nbx(ep, buf, len, tag, &p)
                                    : ucp_tag_send_nbx(ep, buf, len, tag, &p));
}

/* A list of buffers sent as one message (UCX IOV datatype).  The iov array
 * must stay alive until completion: the Python Request holds it. */
static ucs_status_t gpucx_tag_send_iov(ucp_ep_h ep, const ucp_dt_iov_t *iov,
                                       size_t count, uint64_t tag,
                                       int memory_type, int sync,
                                       gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.send = gpucx__send_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    return gpucx__posted(slot, sync ? ucp_tag_send_sync_nbx(ep, iov, count, tag, &p)
                                    : ucp_tag_send_nbx(ep, iov, count, tag, &p));
}

static ucs_status_t gpucx_tag_recv(ucp_worker_h worker, void *buf, size_t len,
                                   uint64_t tag, uint64_t mask, int memory_type,
                                   gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.recv = gpucx__tag_recv_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    p.recv_info.tag_info = &slot->info;
    return gpucx__tag_posted(slot, ucp_tag_recv_nbx(worker, buf, len, tag, mask, &p));
}

static ucs_status_t gpucx_tag_recv_iov(ucp_worker_h worker, ucp_dt_iov_t *iov,
                                       size_t count, uint64_t tag, uint64_t mask,
                                       int memory_type, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.recv = gpucx__tag_recv_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype           = ucp_dt_make_iov();
    p.recv_info.tag_info = &slot->info;
    return gpucx__tag_posted(slot,
                             ucp_tag_recv_nbx(worker, iov, count, tag, mask, &p));
}

/* Blocking API: post and progress in one crossing. */
static ucs_status_t gpucx_tag_send_wait(ucp_worker_h worker, ucp_ep_h ep,
                                        const void *buf, size_t len,
                                        uint64_t tag, int memory_type,
                                        gpucx_slot_t *slot, uint64_t spin_ns)
{
    if (gpucx_tag_send(ep, buf, len, tag, memory_type, 0, slot) !=
        UCS_INPROGRESS) {
        return slot->status;
    }
    return gpucx_wait(worker, slot, spin_ns);
}

static ucs_status_t gpucx_tag_recv_wait(ucp_worker_h worker, void *buf,
                                        size_t len, uint64_t tag, uint64_t mask,
                                        int memory_type, gpucx_slot_t *slot,
                                        uint64_t spin_ns)
{
    if (gpucx_tag_recv(worker, buf, len, tag, mask, memory_type, slot) !=
        UCS_INPROGRESS) {
        return slot->status;
    }
    return gpucx_wait(worker, slot, spin_ns);
}

/* Probe: returns 1 and fills info when a matching message is there.  With
 * remove=1 the message is taken off the queue and *msg must be received
 * with gpucx_tag_msg_recv. */
static int gpucx_tag_probe(ucp_worker_h worker, uint64_t tag, uint64_t mask,
                           int remove, ucp_tag_recv_info_t *info,
                           ucp_tag_message_h *msg)
{
    ucp_tag_message_h m = ucp_tag_probe_nb(worker, tag, mask, remove, info);

    *msg = m;
    return m != NULL;
}

static ucs_status_t gpucx_tag_msg_recv(ucp_worker_h worker, void *buf,
                                       size_t len, ucp_tag_message_h msg,
                                       int memory_type, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.recv = gpucx__tag_recv_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    p.recv_info.tag_info = &slot->info;
    return gpucx__tag_posted(slot, ucp_tag_msg_recv_nbx(worker, buf, len, msg, &p));
}
