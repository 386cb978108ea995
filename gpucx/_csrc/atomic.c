/*
 * gpucx C helpers: remote atomics on 4- and 8-byte words.
 *
 * Two paths behind one completion slot:
 *
 * - direct: ucp_atomic_op_nbx, where UCX has an atomic protocol to the peer
 *   (endpoints without peer error handling);
 * - emulated: where UCX has none (UCX >= 1.19 offers no atomic protocol on
 *   endpoints with peer error handling, gpucx's default), gpucx sends the
 *   operation as an active message on the reserved id GPUCX_AMO_REQ_AM_ID.
 *   The target's C handler checks it against the regions its context
 *   exported (registered, remote() called, writable, host memory: see
 *   gpucx_amo_export_add), applies it with __atomic builtins and answers on
 *   GPUCX_AMO_REPLY_AM_ID with the old value or an error status.  The
 *   initiator's C handler completes the slot.  No Python runs in either
 *   handler.
 *
 * The operand and the reply buffer live in a gpucx_amo_t next to the slot,
 * so both stay valid until the operation completes even if the blocking
 * caller stops waiting.
 */

#include <pthread.h>

typedef struct gpucx_amo_wire_req {
    uint32_t magic;
    uint8_t  opcode;
    uint8_t  nbytes;
    uint8_t  fetch;
    uint8_t  reserved;
    uint64_t seq;
    uint64_t base;    /* the region as the initiator's token names it */
    uint64_t size;
    uint64_t offset;  /* of the word in the region */
    uint64_t operand; /* the value; the expected value for CSWAP */
    uint64_t swap;    /* CSWAP: the new value */
} gpucx_amo_wire_req_t;

typedef struct gpucx_amo_wire_rep {
    uint32_t magic;
    int32_t  status;
    uint64_t seq;
    uint64_t value;
} gpucx_amo_wire_rep_t;

#define GPUCX_AMO_REQ_AM_ID   0xFF20u
#define GPUCX_AMO_REPLY_AM_ID 0xFF21u
#define GPUCX_AMO_MAGIC       0x4f4d4158u /* "XAMO" */
#define GPUCX_AMO_WAIT_SEND   1u
#define GPUCX_AMO_WAIT_REPLY  2u

typedef struct gpucx_amo {
    gpucx_slot_t slot;
    union {
        uint32_t u32;
        uint64_t u64;
    } operand;
    union {
        uint32_t u32;
        uint64_t u64;
    } reply;
    /* emulated path */
    struct gpucx_amo_emu *emu;
    ucp_ep_h              ep;
    unsigned              waits;    /* GPUCX_AMO_WAIT_* still outstanding */
    ucs_status_t          error;
    gpucx_amo_wire_req_t  msg;
} gpucx_amo_t;

static const int GPUCX_AMO_ADD   = UCP_ATOMIC_OP_ADD;
static const int GPUCX_AMO_SWAP  = UCP_ATOMIC_OP_SWAP;
static const int GPUCX_AMO_CSWAP = UCP_ATOMIC_OP_CSWAP;
static const int GPUCX_AMO_AND   = UCP_ATOMIC_OP_AND;
static const int GPUCX_AMO_OR    = UCP_ATOMIC_OP_OR;
static const int GPUCX_AMO_XOR   = UCP_ATOMIC_OP_XOR;
static const unsigned GPUCX_AMO_REQ_ID   = GPUCX_AMO_REQ_AM_ID;

/* ---- exported regions (target side, one table per context) ------------ */

typedef struct gpucx_amo_export {
    uintptr_t key; /* the region's ucp_mem_h */
    uint64_t  base;
    uint64_t  size;
    int       host;
} gpucx_amo_export_t;

typedef struct gpucx_amo_exports {
    pthread_mutex_t     lock;
    int                 serve; /* the context has the "amo" feature */
    size_t              count;
    size_t              cap;
    gpucx_amo_export_t *v;
} gpucx_amo_exports_t;

static gpucx_amo_exports_t *gpucx_amo_exports_new(int serve)
{
    gpucx_amo_exports_t *x = (gpucx_amo_exports_t *)calloc(1, sizeof(*x));

    if (x != NULL) {
        pthread_mutex_init(&x->lock, NULL);
        x->serve = serve;
    }
    return x;
}

static void gpucx_amo_exports_free(gpucx_amo_exports_t *x)
{
    if (x != NULL) {
        pthread_mutex_destroy(&x->lock);
        free(x->v);
        free(x);
    }
}

/* A writable region was exported (its token made): emulated atomics may
 * reach [base, base + size) from now on. */
static ucs_status_t gpucx_amo_export_add(gpucx_amo_exports_t *x, uintptr_t key,
                                         uint64_t base, uint64_t size, int host)
{
    ucs_status_t status = UCS_OK;

    pthread_mutex_lock(&x->lock);
    if (x->count == x->cap) {
        size_t              cap = x->cap ? 2 * x->cap : 16;
        gpucx_amo_export_t *v   = (gpucx_amo_export_t *)realloc(
            x->v, cap * sizeof(*v));
        if (v == NULL) {
            status = UCS_ERR_NO_MEMORY;
        } else {
            x->v   = v;
            x->cap = cap;
        }
    }
    if (status == UCS_OK) {
        x->v[x->count].key  = key;
        x->v[x->count].base = base;
        x->v[x->count].size = size;
        x->v[x->count].host = host;
        x->count++;
    }
    pthread_mutex_unlock(&x->lock);
    return status;
}

/* The region is closing: no atomic reaches it once this returns (a handler
 * applying one holds the lock until it is done). */
static void gpucx_amo_export_remove(gpucx_amo_exports_t *x, uintptr_t key)
{
    size_t i;

    pthread_mutex_lock(&x->lock);
    for (i = 0; i < x->count; i++) {
        if (x->v[i].key == key) {
            x->v[i] = x->v[--x->count];
            break;
        }
    }
    pthread_mutex_unlock(&x->lock);
}

#define GPUCX_AMO_APPLY(_t, _p, _op, _operand, _swap, _old)                   \
    do {                                                                      \
        _t *p_ = (_t *)(_p);                                                  \
        _t  v_ = (_t)(_operand);                                              \
        switch (_op) {                                                        \
        case UCP_ATOMIC_OP_ADD:                                               \
            _old = __atomic_fetch_add(p_, v_, __ATOMIC_SEQ_CST);              \
            break;                                                            \
        case UCP_ATOMIC_OP_AND:                                               \
            _old = __atomic_fetch_and(p_, v_, __ATOMIC_SEQ_CST);              \
            break;                                                            \
        case UCP_ATOMIC_OP_OR:                                                \
            _old = __atomic_fetch_or(p_, v_, __ATOMIC_SEQ_CST);               \
            break;                                                            \
        case UCP_ATOMIC_OP_XOR:                                               \
            _old = __atomic_fetch_xor(p_, v_, __ATOMIC_SEQ_CST);              \
            break;                                                            \
        case UCP_ATOMIC_OP_SWAP:                                              \
            _old = __atomic_exchange_n(p_, v_, __ATOMIC_SEQ_CST);             \
            break;                                                            \
        default: { /* CSWAP: on failure the builtin stores the old value */  \
            _t e_ = v_;                                                       \
            __atomic_compare_exchange_n(p_, &e_, (_t)(_swap), 0,              \
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);  \
            _old = e_;                                                        \
        }                                                                     \
        }                                                                     \
    } while (0)

/* Check one request against the exports and apply it.  Every field comes
 * from the peer and is checked here, in C, before any memory is touched. */
static ucs_status_t gpucx__amo_serve(gpucx_amo_exports_t *x,
                                     const gpucx_amo_wire_req_t *rq,
                                     uint64_t *old)
{
    const gpucx_amo_export_t *e = NULL;
    ucs_status_t              status;
    size_t                    i;
    void                     *p;

    if (x == NULL || !x->serve) {
        return UCS_ERR_UNSUPPORTED; /* no "amo" feature: atomics not served */
    }
    switch (rq->opcode) {
    case UCP_ATOMIC_OP_ADD: case UCP_ATOMIC_OP_AND: case UCP_ATOMIC_OP_OR:
    case UCP_ATOMIC_OP_XOR: case UCP_ATOMIC_OP_SWAP: case UCP_ATOMIC_OP_CSWAP:
        break;
    default:
        return UCS_ERR_INVALID_PARAM;
    }
    if ((rq->nbytes != 4 && rq->nbytes != 8) || rq->offset % rq->nbytes ||
        rq->base % rq->nbytes) {
        return UCS_ERR_INVALID_PARAM; /* size or alignment */
    }
    pthread_mutex_lock(&x->lock);
    for (i = 0; i < x->count; i++) {
        if (x->v[i].base == rq->base && x->v[i].size == rq->size) {
            e = &x->v[i];
            break;
        }
    }
    if (e == NULL) {
        status = UCS_ERR_NO_ELEM; /* not an exported writable region */
    } else if (!e->host) {
        status = UCS_ERR_UNSUPPORTED; /* device memory: not reachable here */
    } else if (e->size < rq->nbytes || rq->offset > e->size - rq->nbytes) {
        status = UCS_ERR_OUT_OF_RANGE;
    } else {
        p = (void *)(uintptr_t)(e->base + rq->offset);
        if (rq->nbytes == 4) {
            uint32_t o;
            GPUCX_AMO_APPLY(uint32_t, p, rq->opcode, rq->operand, rq->swap, o);
            *old = o;
        } else {
            uint64_t o;
            GPUCX_AMO_APPLY(uint64_t, p, rq->opcode, rq->operand, rq->swap, o);
            *old = o;
        }
        status = UCS_OK;
    }
    pthread_mutex_unlock(&x->lock);
    return status;
}

/* ---- per-worker state -------------------------------------------------- */

/* Requests waiting for their reply, indexed by seq & mask: sequence
 * numbers are handed out in order, so a table twice the number in flight
 * rarely collides; it doubles when it does. */
typedef struct gpucx_amo_emu {
    pthread_mutex_t      lock;
    gpucx_amo_exports_t *exports; /* the context's, for the target side */
    uint64_t             next_seq;
    size_t               mask;
    size_t               inflight;
    gpucx_amo_t        **tab;
} gpucx_amo_emu_t;

static int gpucx__amo_tab_put(gpucx_amo_emu_t *e, gpucx_amo_t *a)
{
    size_t        i, cap;
    gpucx_amo_t **tab;

    for (cap = e->mask + 1;; cap *= 2) {
        if (e->tab[a->msg.seq & e->mask] == NULL) {
            e->tab[a->msg.seq & e->mask] = a;
            e->inflight++;
            return 0;
        }
        /* A collision: rehash into a table twice as large (again if the
         * old entries collide there too). */
        tab = (gpucx_amo_t **)calloc(2 * cap, sizeof(*tab));
        if (tab == NULL) {
            return -1;
        }
        for (i = 0; i <= e->mask; i++) {
            gpucx_amo_t *o = e->tab[i];
            if (o != NULL) {
                if (tab[o->msg.seq & (2 * cap - 1)] != NULL) {
                    break;
                }
                tab[o->msg.seq & (2 * cap - 1)] = o;
            }
        }
        if (i <= e->mask) {
            free(tab);
            continue;
        }
        free(e->tab);
        e->tab  = tab;
        e->mask = 2 * cap - 1;
    }
}

static gpucx_amo_t *gpucx__amo_tab_take(gpucx_amo_emu_t *e, uint64_t seq)
{
    gpucx_amo_t **at = &e->tab[seq & e->mask];
    gpucx_amo_t  *a  = *at;

    if (a == NULL || a->msg.seq != seq) {
        return NULL;
    }
    *at = NULL;
    e->inflight--;
    return a;
}

/* One of the operation's waits is over (emu lock held). */
static void gpucx__amo_settle(gpucx_amo_t *a, unsigned what,
                              ucs_status_t status)
{
    if (status != UCS_OK && a->error == UCS_OK) {
        a->error = status;
    }
    a->waits &= ~what;
    if (a->waits == 0) {
        __atomic_store_n(&a->slot.status, a->error, __ATOMIC_RELEASE);
    }
}

/* The request AM left (or failed): with an error, no reply will come. */
static void gpucx__amo_sent_cb(void *request, ucs_status_t status,
                               void *user_data)
{
    gpucx_amo_t     *a = (gpucx_amo_t *)user_data;
    gpucx_amo_emu_t *e = a->emu;

    ucp_request_free(request);
    pthread_mutex_lock(&e->lock);
    if (status != UCS_OK &&
        gpucx__amo_tab_take(e, a->msg.seq) == a) {
        gpucx__amo_settle(a, GPUCX_AMO_WAIT_REPLY, status);
    }
    gpucx__amo_settle(a, GPUCX_AMO_WAIT_SEND, status);
    pthread_mutex_unlock(&e->lock);
}

static void gpucx__amo_free_cb(void *request, ucs_status_t status,
                               void *user_data)
{
    (void)status;
    (void)user_data;
    ucp_request_free(request);
}

/* Target: a request arrived; answer it on the reply endpoint. */
static ucs_status_t gpucx__amo_req_cb(void *arg, const void *header,
                                      size_t header_length, void *data,
                                      size_t length,
                                      const ucp_am_recv_param_t *param)
{
    gpucx_amo_emu_t     *e = (gpucx_amo_emu_t *)arg;
    gpucx_amo_wire_req_t rq;
    gpucx_amo_wire_rep_t rp;
    ucp_request_param_t  p;
    ucs_status_ptr_t     r;

    (void)data;
    (void)length;
    if (header_length != sizeof(rq) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        return UCS_OK; /* not one of ours, or no way to answer: dropped */
    }
    memcpy(&rq, header, sizeof(rq));
    if (rq.magic != GPUCX_AMO_MAGIC) {
        return UCS_OK;
    }
    rp.magic  = GPUCX_AMO_MAGIC;
    rp.value  = 0;
    rp.seq    = rq.seq;
    rp.status = (int32_t)gpucx__amo_serve(e->exports, &rq, &rp.value);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
    p.flags        = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER |
                     UCP_AM_SEND_FLAG_REPLY;
    p.cb.send      = gpucx__amo_free_cb;
    r = ucp_am_send_nbx(param->reply_ep, GPUCX_AMO_REPLY_AM_ID, &rp,
                        sizeof(rp), NULL, 0, &p);
    (void)r; /* a reply UCX refuses: the peer's endpoint is failing */
    return UCS_OK;
}

/* Initiator: a reply arrived; complete the operation it names. */
static ucs_status_t gpucx__amo_reply_cb(void *arg, const void *header,
                                        size_t header_length, void *data,
                                        size_t length,
                                        const ucp_am_recv_param_t *param)
{
    gpucx_amo_emu_t     *e = (gpucx_amo_emu_t *)arg;
    gpucx_amo_wire_rep_t rp;
    gpucx_amo_t         *a;

    (void)data;
    (void)length;
    if (header_length != sizeof(rp)) {
        return UCS_OK;
    }
    memcpy(&rp, header, sizeof(rp));
    if (rp.magic != GPUCX_AMO_MAGIC) {
        return UCS_OK;
    }
    pthread_mutex_lock(&e->lock);
    a = e->tab[rp.seq & e->mask];
    /* Only the peer the request went to may answer it. */
    if (a != NULL && a->msg.seq == rp.seq &&
        (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
         param->reply_ep == a->ep)) {
        gpucx__amo_tab_take(e, rp.seq);
        if (rp.status == UCS_OK) {
            if (a->msg.nbytes == 4) {
                a->reply.u32 = (uint32_t)rp.value;
            } else {
                a->reply.u64 = rp.value;
            }
        }
        gpucx__amo_settle(a, GPUCX_AMO_WAIT_REPLY,
                          rp.status > 0 ? UCS_ERR_INVALID_PARAM
                                        : (ucs_status_t)rp.status);
    }
    pthread_mutex_unlock(&e->lock);
    return UCS_OK;
}

/* Install both handlers on a worker whose context has the "am" feature;
 * ws->amo stays NULL (emulation unavailable) otherwise. */
static ucs_status_t gpucx_amo_worker_init(gpucx_worker_state_t *ws,
                                          gpucx_amo_exports_t *exports)
{
    gpucx_amo_emu_t *e = (gpucx_amo_emu_t *)calloc(1, sizeof(*e));
    ucs_status_t     status;

    if (e == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    e->tab = (gpucx_amo_t **)calloc(64, sizeof(*e->tab));
    if (e->tab == NULL) {
        free(e);
        return UCS_ERR_NO_MEMORY;
    }
    e->mask     = 63;
    e->exports  = exports;
    /* A sequence start no peer can guess from the outside. */
    e->next_seq = gpucx__now_ns() ^ ((uint64_t)(uintptr_t)e << 16);
    pthread_mutex_init(&e->lock, NULL);
    status = gpucx__am_handler(ws->worker, GPUCX_AMO_REQ_AM_ID,
                               UCP_AM_FLAG_WHOLE_MSG, gpucx__amo_req_cb, e);
    if (status == UCS_OK) {
        status = gpucx__am_handler(ws->worker, GPUCX_AMO_REPLY_AM_ID,
                                   UCP_AM_FLAG_WHOLE_MSG, gpucx__amo_reply_cb, e);
    }
    if (status != UCS_OK) {
        pthread_mutex_destroy(&e->lock);
        free(e->tab);
        free(e);
        return status;
    }
    ws->amo = e;
    return UCS_OK;
}

/* Fail every operation still waiting for a reply over ep (ep NULL: all of
 * them), e.g. the endpoint failed or was closed. */
static void gpucx__amo_ep_failed(gpucx_amo_emu_t *e, ucp_ep_h ep,
                                 ucs_status_t status)
{
    size_t i;

    if (e == NULL) {
        return;
    }
    pthread_mutex_lock(&e->lock);
    for (i = 0; i <= e->mask && e->inflight; i++) {
        gpucx_amo_t *a = e->tab[i];
        if (a != NULL && (ep == NULL || a->ep == ep)) {
            gpucx__amo_tab_take(e, a->msg.seq);
            gpucx__amo_settle(a, GPUCX_AMO_WAIT_REPLY, status);
        }
    }
    pthread_mutex_unlock(&e->lock);
}

static void gpucx_amo_ep_closed(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                ucs_status_t status)
{
    gpucx__amo_ep_failed(ws->amo, ep, status);
}

/* After ucp_worker_destroy: nothing can answer any more. */
static void gpucx_amo_worker_free(gpucx_worker_state_t *ws)
{
    gpucx_amo_emu_t *e = ws->amo;

    if (e == NULL) {
        return;
    }
    ws->amo = NULL;
    gpucx__amo_ep_failed(e, NULL, UCS_ERR_CANCELED);
    pthread_mutex_destroy(&e->lock);
    free(e->tab);
    free(e);
}

/* Cancel: the reply is no longer awaited.  The request AM, if UCX still
 * holds it, is left to complete on its own (an eager message of a few
 * bytes; a force close of the endpoint completes it too): canceling it here
 * could run its callback, which takes the lock, from inside
 * ucp_request_cancel. */
static void gpucx__amo_emu_cancel(ucp_worker_h worker, gpucx_slot_t *slot)
{
    gpucx_amo_t     *a = (gpucx_amo_t *)slot;
    gpucx_amo_emu_t *e = a->emu;

    (void)worker;
    pthread_mutex_lock(&e->lock);
    if (gpucx__amo_tab_take(e, a->msg.seq) == a) {
        gpucx__amo_settle(a, GPUCX_AMO_WAIT_REPLY, UCS_ERR_CANCELED);
    }
    pthread_mutex_unlock(&e->lock);
}

static ucs_status_t gpucx__amo_emu_post(gpucx_amo_emu_t *e, ucp_ep_h ep,
                                        int opcode, int fetch, uint64_t operand,
                                        uint64_t swap, size_t nbytes,
                                        uint64_t offset, uint64_t base,
                                        uint64_t size, gpucx_amo_t *a)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;
    int                 full;

    a->slot.req    = NULL;
    a->slot.kind   = GPUCX_SLOT_AMO_EMU;
    a->emu         = e;
    a->ep          = ep;
    a->error       = UCS_OK;
    a->waits       = GPUCX_AMO_WAIT_SEND | GPUCX_AMO_WAIT_REPLY;
    a->msg.magic   = GPUCX_AMO_MAGIC;
    a->msg.opcode  = (uint8_t)opcode;
    a->msg.nbytes  = (uint8_t)nbytes;
    a->msg.fetch   = (uint8_t)fetch;
    a->msg.reserved = 0;
    a->msg.base    = base;
    a->msg.size    = size;
    a->msg.offset  = offset;
    a->msg.operand = operand;
    a->msg.swap    = swap;
    a->slot.status = UCS_INPROGRESS;
    pthread_mutex_lock(&e->lock);
    a->msg.seq = e->next_seq++;
    full       = gpucx__amo_tab_put(e, a);
    pthread_mutex_unlock(&e->lock);
    if (full) {
        a->slot.status = UCS_ERR_NO_MEMORY;
        return UCS_ERR_NO_MEMORY;
    }
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send      = gpucx__amo_sent_cb;
    p.user_data    = a;
    p.flags        = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    r = ucp_am_send_nbx(ep, GPUCX_AMO_REQ_AM_ID, &a->msg, sizeof(a->msg), NULL,
                        0, &p);
    pthread_mutex_lock(&e->lock);
    if (UCS_PTR_IS_ERR(r)) {
        if (gpucx__amo_tab_take(e, a->msg.seq) == a) {
            gpucx__amo_settle(a, GPUCX_AMO_WAIT_REPLY, UCS_PTR_STATUS(r));
        }
        gpucx__amo_settle(a, GPUCX_AMO_WAIT_SEND, UCS_PTR_STATUS(r));
    } else if (r == NULL) {
        gpucx__amo_settle(a, GPUCX_AMO_WAIT_SEND, UCS_OK);
    } /* else the callback settles the send (it may have run already) */
    pthread_mutex_unlock(&e->lock);
    return a->slot.status;
}

/* Post one atomic.  fetch: return the old value through the reply buffer.
 * For compare-and-swap, operand is the expected value and swap the new one.
 * emulate: run it over gpucx's active messages (ws->amo must be set),
 * where raddr - base is the word's offset in the region [base, base+size)
 * the token names; otherwise ucp_atomic_op_nbx with rkey (UCX reads the new
 * value of a compare-and-swap from the reply buffer and writes the old one
 * there). */
static ucs_status_t gpucx_atomic(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                 int emulate, int opcode, int fetch,
                                 uint64_t operand, uint64_t swap,
                                 size_t nbytes, uint64_t raddr,
                                 ucp_rkey_h rkey, uint64_t base, uint64_t size,
                                 gpucx_amo_t *amo)
{
    ucp_request_param_t p;

    if (emulate) {
        if (ws->amo == NULL) {
            amo->slot.req    = NULL;
            amo->slot.status = UCS_ERR_UNSUPPORTED;
            return UCS_ERR_UNSUPPORTED;
        }
        return gpucx__amo_emu_post(ws->amo, ep, opcode, fetch, operand, swap,
                                   nbytes, raddr - base, base, size, amo);
    }
    amo->slot.kind = GPUCX_SLOT_PLAIN;
    gpucx__param_init(&p, &amo->slot, -1);
    p.cb.send = gpucx__send_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_contig(nbytes);
    if (nbytes == 4) {
        amo->operand.u32 = (uint32_t)operand;
        amo->reply.u32   = (uint32_t)swap;
    } else {
        amo->operand.u64 = operand;
        amo->reply.u64   = swap;
    }
    if (fetch || opcode == UCP_ATOMIC_OP_CSWAP) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_REPLY_BUFFER;
        p.reply_buffer = &amo->reply;
    }
    return gpucx__posted(&amo->slot,
                         ucp_atomic_op_nbx(ep, (ucp_atomic_op_t)opcode,
                                           &amo->operand, 1, raddr, rkey, &p));
}

static ucs_status_t gpucx_atomic_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                      int emulate, int opcode, int fetch,
                                      uint64_t operand, uint64_t swap,
                                      size_t nbytes, uint64_t raddr,
                                      ucp_rkey_h rkey, uint64_t base,
                                      uint64_t size, gpucx_amo_t *amo,
                                      uint64_t spin_ns)
{
    return gpucx__wait_posted(ws, &amo->slot,
                              gpucx_atomic(ws, ep, emulate, opcode, fetch,
                                           operand, swap, nbytes, raddr, rkey,
                                           base, size, amo),
                              spin_ns);
}

static uint64_t gpucx_amo_result(const gpucx_amo_t *amo, size_t nbytes)
{
    return nbytes == 4 ? (uint64_t)amo->reply.u32 : amo->reply.u64;
}
