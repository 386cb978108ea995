/*
 * Active messages.
 *
 * The UCX receive callback (gpucx__am_recv_cb) runs inside
 * ucp_worker_progress: it copies the header, records the data pointer,
 * length, receive flags and reply endpoint into the worker's C queue and
 * returns UCS_INPROGRESS so that eager data (persistent, the handler is
 * registered with UCP_AM_FLAG_PERSISTENT_DATA) and rendezvous descriptors stay
 * valid until Python is done with them.  Python pops the queue after
 * progress returns and releases each descriptor once with gpucx_am_release
 * (ucp_am_data_release) or hands it to ucp_am_recv_data_nbx.
 */

#define GPUCX_AMQ_MIN 64

typedef struct gpucx_am_msg {
    unsigned  id;
    int       owned;         /* 1: data is a malloc'ed copy, not a UCX desc;
                              * 2: a buffer of the id's receive pool */
    uint64_t  flags;         /* ucp_am_recv_param_t.recv_attr */
    void     *data;          /* eager data or rendezvous descriptor */
    size_t    length;
    ucp_ep_h  reply_ep;      /* NULL unless the sender asked for a reply ep */
    void     *header;        /* malloc'ed copy, NULL when header_length == 0 */
    size_t    header_length;
    int       status;        /* of the receive into a pool buffer (owned 2) */
    struct gpucx_am_pool *pool; /* owned 2: data is pool->bufs[index] */
    unsigned  index;
} gpucx_am_msg_t;

struct gpucx_am_reg;

/* Receives posted together (worker.am_recv_many_nb): one slot for all of
 * them.  Each member has its own slot (status and length); the group slot
 * completes when every member did, with the first error.  pending and
 * error are guarded by the AM state lock. */
typedef struct gpucx_am_group {
    gpucx_slot_t         slot;
    struct gpucx_am_reg *reg;
    size_t               pending;
    ucs_status_t         error;
} gpucx_am_group_t;

/* A receive buffer posted for the next message of one AM id.
 *
 * memory_type is the buffer's ucs_memory_type_t.  Host buffers take eager
 * payloads by memcpy.  Device buffers (CUDA) are never touched by the CPU:
 * every payload goes through ucp_am_recv_data_nbx with the memory type, a
 * rendezvous one zero copy, an eager one unpacked by UCX's memory-type copy
 * (ucp.h allows it on a persistent data pointer, UCP_AM_RECV_ATTR_FLAG_DATA,
 * from inside the AM callback).  The one case C leaves to Python is an
 * eager message kept before a device buffer was posted: outside the
 * callback, UCX releases a multi-fragment eager descriptor to the wrong
 * allocator (it was malloc'ed) when ucp_am_recv_data_nbx unpacks it, so
 * gpucx_am_post_mt / gpucx_am_post_group hand such a message to Python
 * (GPUCX_AM_COPY_IN), which copies it with the CUDA driver and releases it
 * with gpucx_am_release. */
typedef struct gpucx_am_post {
    void             *buf;
    size_t            len;
    int               memory_type;
    gpucx_slot_t     *slot;
    gpucx_am_group_t *group; /* NULL for a receive posted alone */
} gpucx_am_post_t;

/* The buffers an id's handler receives rendezvous payloads into
 * (set_am_handler(..., into=bufs)).  The UCX callback takes the first free
 * buffer the payload fits and starts the receive at once, or, when every
 * such buffer is busy, keeps the message in wq until Python gives one back
 * (gpucx_am_release), which starts it then.  A message goes to the
 * dispatch queue when its payload is in, and its buffer is free again when
 * Python releases it.  busy, nfree, closed and wq are guarded by
 * state->lock; pend[i] is the record of the receive into bufs[i] while it
 * runs. */
typedef struct gpucx_am_pool {
    gpucx_am_state_t *state;
    unsigned          n;
    unsigned          nfree;
    int               closed;    /* the worker is closing: queue nothing */
    size_t            max_len;   /* of the largest buffer */
    void            **bufs;
    size_t           *lens;
    unsigned char    *busy;
    gpucx_am_msg_t   *pend;
    /* Messages waiting for a free buffer they fit, oldest first; never
     * longer than max_len.  Empty while every buffer is free. */
    gpucx_am_msg_t   *wq;
    unsigned          whead;
    unsigned          wtail;
    unsigned          wcap;
} gpucx_am_pool_t;

/* One per registered AM id: the callback does not get the id from UCX.
 * posts[phead, ptail) are the receives posted for the id, oldest first
 * (guarded by state->lock). */
typedef struct gpucx_am_reg {
    gpucx_am_state_t *state;
    unsigned          id;
    gpucx_am_post_t  *posts;
    unsigned          phead;
    unsigned          ptail;
    unsigned          pcap;
    /* keep: the id is used with posted receives and has no Python handler.
     * A message then finding no posted receive waits in kq[khead, ktail)
     * for the next one posted (oldest first) instead of going to the
     * dispatch queue.  kq is non-empty only while no receive is posted. */
    int               keep;
    gpucx_am_msg_t   *kq;
    unsigned          khead;
    unsigned          ktail;
    unsigned          kcap;
    gpucx_am_pool_t  *pool;  /* NULL: rendezvous payloads wait at the sender */
} gpucx_am_reg_t;

/* Whether a message may be received into memory of type mt in C now:
 * always for host memory; for device memory, a rendezvous payload or
 * persistent eager data (always the case with UCP_AM_FLAG_PERSISTENT_DATA),
 * which ucp_am_recv_data_nbx unpacks. */
#define GPUCX__AM_HOST(mt) ((mt) == UCS_MEMORY_TYPE_HOST)

/* A member of g finished with status (state lock held). */
static void gpucx__am_member_done(gpucx_am_group_t *g, gpucx_slot_t *m,
                                  ucs_status_t status)
{
    m->status = status;
    if (status != UCS_OK && g->error == UCS_OK) {
        g->error       = status;
        g->slot.length = m->length; /* the message size of a truncation */
    }
    if (--g->pending == 0) {
        g->slot.kind   = GPUCX_SLOT_PLAIN;
        g->slot.status = g->error;
    }
}

static const unsigned GPUCX_AM_FLAG_RNDV = UCP_AM_RECV_ATTR_FLAG_RNDV;
/* Flags of a message received into a pool buffer (its RNDV flag cleared:
 * the payload is here), and of one whose receive failed (status says why).
 * UCX's receive attributes use the low bits only. */
static const uint64_t GPUCX_AM_FLAG_POOLED = 1ull << 62;
static const uint64_t GPUCX_AM_FLAG_FAILED = 1ull << 63;

/* The bytes a queued message holds here, for the byte caps: its header
 * copy and eager data (a rendezvous payload stays at the sender, a pooled
 * one is in the user's buffer). */
static inline size_t gpucx__am_charge(uint64_t attr, size_t length,
                                      size_t header_length)
{
    return header_length +
           ((attr & (UCP_AM_RECV_ATTR_FLAG_RNDV | GPUCX_AM_FLAG_POOLED)) ? 0
                                                                        : length);
}

static inline size_t gpucx__am_msg_charge(const gpucx_am_msg_t *m)
{
    return gpucx__am_charge(m->flags, m->length, m->header_length);
}

/* Make room for one more entry of a message queue: compact, then grow. */
static int gpucx__msgq_reserve(gpucx_am_msg_t **qp, unsigned *head,
                               unsigned *tail, unsigned *capp)
{
    gpucx_am_msg_t *q;
    unsigned        cap;

    if (*tail < *capp) {
        return 1;
    }
    if (*head > 0) {
        memmove(*qp, *qp + *head, (*tail - *head) * sizeof(gpucx_am_msg_t));
        *tail -= *head;
        *head  = 0;
        return 1;
    }
    cap = *capp ? 2 * *capp : GPUCX_AMQ_MIN;
    q   = (gpucx_am_msg_t *)realloc(*qp, cap * sizeof(gpucx_am_msg_t));
    if (q == NULL) {
        return 0;
    }
    *qp   = q;
    *capp = cap;
    return 1;
}

static int gpucx__amq_reserve(gpucx_am_state_t *st)
{
    return gpucx__msgq_reserve(&st->q, &st->head, &st->tail, &st->cap);
}

static ucs_status_t gpucx_am_recv_data(ucp_worker_h worker, void *desc,
                                       void *buf, size_t len, int memory_type,
                                       gpucx_slot_t *slot);

static void gpucx__am_member_cb(void *request, ucs_status_t status,
                                size_t length, void *user_data)
{
    gpucx_slot_t     *m = (gpucx_slot_t *)user_data;
    gpucx_am_group_t *g = (gpucx_am_group_t *)(uintptr_t)m->value;
    gpucx_am_state_t *st = g->reg->state;

    ucp_request_free(request);
    pthread_mutex_lock(&st->lock);
    m->length = length;
    gpucx__am_member_done(g, m, status);
    pthread_mutex_unlock(&st->lock);
}

/* Receive a message (data/length/attr as the callback got them) into
 * member m of g, whose buffer is buf/len (state lock not held).  Returns
 * whether the data was consumed: 0 for eager data (and a truncated
 * message), which the caller gives back. */
static int gpucx__am_member_recv(gpucx_am_state_t *st, gpucx_am_group_t *g,
                                 gpucx_slot_t *m, void *buf, size_t len,
                                 int mt, void *data, size_t length,
                                 uint64_t attr)
{
    ucp_request_param_t rp;
    ucs_status_ptr_t    r;
    ucs_status_t        status = UCS_OK;

    m->length = length;
    if (length > len) {
        status = UCS_ERR_MESSAGE_TRUNCATED; /* dropped; a sender completes */
    } else if (!(attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && GPUCX__AM_HOST(mt)) {
        if (length != 0) {
            memcpy(buf, data, length);
        }
    } else if (!(attr & (UCP_AM_RECV_ATTR_FLAG_RNDV |
                         UCP_AM_RECV_ATTR_FLAG_DATA))) {
        /* Eager data valid only during a callback, for device memory: not
         * expected with UCP_AM_FLAG_PERSISTENT_DATA; refused, not copied. */
        status = UCS_ERR_UNSUPPORTED;
    } else {
        m->value        = (uint64_t)(uintptr_t)g;
        rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                          UCP_OP_ATTR_FIELD_USER_DATA |
                          UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        rp.cb.recv_am   = gpucx__am_member_cb;
        rp.user_data    = m;
        rp.memory_type  = (ucs_memory_type_t)mt;
        r = ucp_am_recv_data_nbx(st->worker, data, buf, length, &rp);
        if (r != NULL && !UCS_PTR_IS_ERR(r)) {
            return 1; /* gpucx__am_member_cb completes the member */
        }
        pthread_mutex_lock(&st->lock);
        gpucx__am_member_done(g, m, r == NULL ? UCS_OK : UCS_PTR_STATUS(r));
        pthread_mutex_unlock(&st->lock);
        return 1;
    }
    pthread_mutex_lock(&st->lock);
    gpucx__am_member_done(g, m, status);
    pthread_mutex_unlock(&st->lock);
    return 0;
}

/* gpucx__am_deliver for a member of a group (state lock held; released).
 * Eager data that fits is copied and counted under the lock the caller
 * took (one lock hold per message: the group's count is shared with
 * other threads' cancels); a rendezvous fetch, which may complete inside
 * UCX and take the lock in its callback, and a truncation go through
 * gpucx__am_member_recv unlocked. */
static ucs_status_t gpucx__am_deliver_member(gpucx_am_state_t *st,
                                             const gpucx_am_post_t *p,
                                             void *data, size_t length,
                                             uint64_t attr)
{
    if (!(attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && length <= p->len &&
        GPUCX__AM_HOST(p->memory_type)) {
        if (length != 0) {
            memcpy(p->buf, data, length);
        }
        p->slot->length = length;
        gpucx__am_member_done(p->group, p->slot, UCS_OK);
        pthread_mutex_unlock(&st->lock);
        return UCS_OK;
    }
    pthread_mutex_unlock(&st->lock);
    return gpucx__am_member_recv(st, p->group, p->slot, p->buf, p->len,
                                 p->memory_type, data, length, attr)
               ? UCS_INPROGRESS /* the descriptor now belongs to the receive */
               : UCS_OK;
}

/* Hand an arriving message to the oldest posted receive (called with the
 * state lock held; releases it).  A rendezvous payload is fetched straight
 * into the posted buffer; an eager one is copied.  A message larger than
 * the buffer fails the receive and is dropped. */
static ucs_status_t gpucx__am_deliver(gpucx_am_reg_t *reg, void *data,
                                      size_t length, uint64_t attr)
{
    gpucx_am_state_t *st = reg->state;
    gpucx_am_post_t   p  = reg->posts[reg->phead++];

    if (reg->phead == reg->ptail) {
        reg->phead = reg->ptail = 0;
    }
    p.slot->kind = GPUCX_SLOT_PLAIN;
    if (p.group != NULL) {
        return gpucx__am_deliver_member(st, &p, data, length, attr);
    }
    pthread_mutex_unlock(&st->lock);
    if (length > p.len) {
        p.slot->length = length;
        p.slot->status = UCS_ERR_MESSAGE_TRUNCATED;
        return UCS_OK; /* dropped: a rendezvous sender completes */
    }
    if ((attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        (!GPUCX__AM_HOST(p.memory_type) &&
         (attr & UCP_AM_RECV_ATTR_FLAG_DATA))) {
        /* Zero copy, or (device memory) UCX unpacks the eager data; an
         * eager receive completes before this returns. */
        gpucx_am_recv_data(st->worker, data, p.buf, length, p.memory_type,
                           p.slot);
        return UCS_INPROGRESS; /* the descriptor now belongs to the receive */
    }
    if (!GPUCX__AM_HOST(p.memory_type)) {
        p.slot->length = length; /* see gpucx__am_member_recv */
        p.slot->status = UCS_ERR_UNSUPPORTED;
        return UCS_OK;
    }
    if (length != 0) {
        memcpy(p.buf, data, length);
    }
    p.slot->length = length;
    p.slot->status = UCS_OK;
    return UCS_OK;
}

/* The receive of m (a pool's pend[m->index]) ended with status: queue the
 * message for its handler, or, while the worker closes, free the buffer. */
static void gpucx__am_pool_done(gpucx_am_msg_t *m, ucs_status_t status)
{
    gpucx_am_pool_t  *pool = m->pool;
    gpucx_am_state_t *st   = pool->state;

    m->status = status;
    if (status != UCS_OK) {
        m->flags |= GPUCX_AM_FLAG_FAILED;
    }
    pthread_mutex_lock(&st->lock);
    if (!pool->closed && gpucx__amq_reserve(st)) {
        st->q[st->tail++] = *m;
        pthread_mutex_unlock(&st->lock);
        return;
    }
    /* Admitted at arrival: it leaves the queue's counters unqueued. */
    gpucx__qstat_leave(&st->queue, m->header_length);
    if (!pool->closed) {
        gpucx__qstat_drop(&st->queue, m->header_length, &st->drops);
    }
    pool->busy[m->index] = 0;
    pool->nfree++;
    pthread_mutex_unlock(&st->lock);
    free(m->header);
    m->header = NULL;
}

static void gpucx__am_pool_cb(void *request, ucs_status_t status,
                              size_t length, void *user_data)
{
    (void)length;
    ucp_request_free(request);
    gpucx__am_pool_done((gpucx_am_msg_t *)user_data, status);
}

/* Receive the rendezvous message w (w->data its descriptor) into pool
 * buffer i, which the caller marked busy (lock not held). */
static void gpucx__am_pool_start(gpucx_am_pool_t *pool, unsigned i,
                                 const gpucx_am_msg_t *w)
{
    gpucx_am_msg_t     *m = &pool->pend[i];
    ucp_request_param_t rp;
    ucs_status_ptr_t    r;

    *m              = *w;
    m->owned        = 2;
    m->flags        = (w->flags & ~(uint64_t)UCP_AM_RECV_ATTR_FLAG_RNDV) |
                      GPUCX_AM_FLAG_POOLED;
    m->data         = pool->bufs[i];
    m->status       = UCS_INPROGRESS;
    m->pool         = pool;
    m->index        = i;
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    rp.cb.recv_am   = gpucx__am_pool_cb;
    rp.user_data    = m;
    rp.memory_type  = UCS_MEMORY_TYPE_HOST;
    r = ucp_am_recv_data_nbx(pool->state->worker, w->data, m->data, w->length,
                             &rp);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        gpucx__am_pool_done(m, r == NULL ? UCS_OK : UCS_PTR_STATUS(r));
    }
}

/* The first free buffer of pool that length fits (lock held); pool->n when
 * none is free. */
static unsigned gpucx__am_pool_find(const gpucx_am_pool_t *pool, size_t length)
{
    unsigned i;

    for (i = 0; pool->nfree != 0 && i < pool->n; i++) {
        if (!pool->busy[i] && pool->lens[i] >= length) {
            return i;
        }
    }
    return pool->n;
}

/* A rendezvous message of an id with a receive pool: receive it into the
 * first free buffer it fits, or, when they are all busy, keep it waiting
 * (in arrival order) for one to be given back.  Returns
 * UCS_ERR_NO_RESOURCE when the pool cannot take it (no buffer is large
 * enough, the pool was just replaced, or no memory for the header copy):
 * the message is then queued as without a pool.  Else returns what the
 * UCX callback returns. */
static ucs_status_t gpucx__am_pool_recv(gpucx_am_reg_t *reg, gpucx_am_pool_t *pool,
                                        const void *header, size_t header_length,
                                        void *data, size_t length,
                                        const ucp_am_recv_param_t *param)
{
    gpucx_am_state_t *st = reg->state;
    gpucx_am_msg_t    w;
    unsigned          i;

    memset(&w, 0, sizeof(w));
    w.id            = reg->id;
    w.flags         = param->recv_attr;
    w.data          = data;
    w.length        = length;
    w.reply_ep      = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
                          ? param->reply_ep
                          : NULL;
    w.header_length = header_length;
    if (header_length != 0) {
        if ((w.header = malloc(header_length)) == NULL) {
            return UCS_ERR_NO_RESOURCE; /* the usual path drops it, counted */
        }
        memcpy(w.header, header, header_length);
    }
    pthread_mutex_lock(&st->lock);
    /* Nothing of pool is read before this check, under the lock: once
     * set_pool replaced it, the old pool may be freed (the caller read
     * reg->pool unlocked). */
    if (reg->pool != pool || length > pool->max_len) {
        pthread_mutex_unlock(&st->lock);
        free(w.header);
        return UCS_ERR_NO_RESOURCE;
    }
    /* It counts as queued from now: the queue's caps bound the receives
     * waiting and in flight too (the payload is in the user's memory). */
    if (!gpucx__qstat_admit(&st->queue, header_length, &st->drops)) {
        pthread_mutex_unlock(&st->lock);
        free(w.header);
        return UCS_OK; /* never fetched: the sender completes */
    }
    i = gpucx__am_pool_find(pool, length);
    if (i == pool->n) {
        if (!gpucx__msgq_reserve(&pool->wq, &pool->whead, &pool->wtail,
                                 &pool->wcap)) {
            gpucx__qstat_leave(&st->queue, header_length);
            gpucx__qstat_drop(&st->queue, header_length, &st->drops);
            pthread_mutex_unlock(&st->lock);
            free(w.header);
            return UCS_ERR_NO_MEMORY; /* fails the sender */
        }
        pool->wq[pool->wtail++] = w;
        pthread_mutex_unlock(&st->lock);
        return UCS_INPROGRESS; /* the descriptor waits for a buffer */
    }
    pool->busy[i] = 1;
    pool->nfree--;
    pthread_mutex_unlock(&st->lock);
    gpucx__am_pool_start(pool, i, &w);
    return UCS_INPROGRESS; /* the descriptor now belongs to the receive */
}

/* Give pool buffer i back: the oldest waiting message it fits is received
 * into it at once (worker NULL: the worker is gone, nothing starts). */
static void gpucx__am_pool_put(ucp_worker_h worker, gpucx_am_pool_t *pool,
                               unsigned i)
{
    gpucx_am_state_t *st = pool->state;
    gpucx_am_msg_t    w;
    unsigned          k;

    pthread_mutex_lock(&st->lock);
    if (worker != NULL && !pool->closed) {
        for (k = pool->whead; k < pool->wtail; k++) {
            if (pool->wq[k].length <= pool->lens[i]) {
                w = pool->wq[k];
                memmove(pool->wq + k, pool->wq + k + 1,
                        (pool->wtail - k - 1) * sizeof(gpucx_am_msg_t));
                if (--pool->wtail == pool->whead) {
                    pool->whead = pool->wtail = 0;
                }
                pthread_mutex_unlock(&st->lock);
                gpucx__am_pool_start(pool, i, &w); /* stays busy */
                return;
            }
        }
    }
    pool->busy[i] = 0;
    pool->nfree++;
    pthread_mutex_unlock(&st->lock);
}

static ucs_status_t gpucx__am_recv_cb(void *arg, const void *header,
                                      size_t header_length, void *data,
                                      size_t length,
                                      const ucp_am_recv_param_t *param)
{
    gpucx_am_reg_t   *reg = (gpucx_am_reg_t *)arg;
    gpucx_am_state_t *st  = reg->state;
    gpucx_am_msg_t   *m;
    uint64_t          attr = param->recv_attr;
    int               keep = (attr & (UCP_AM_RECV_ATTR_FLAG_DATA |
                                      UCP_AM_RECV_ATTR_FLAG_RNDV)) != 0;
    void             *hdr  = NULL;
    void             *copy = NULL;
    size_t            charge = gpucx__am_charge(attr, length, header_length);
    gpucx_qstat_t    *qs;

    if (reg->ptail != reg->phead) { /* unlocked peek; checked again below */
        pthread_mutex_lock(&st->lock);
        if (reg->ptail != reg->phead) {
            return gpucx__am_deliver(reg, data, length, attr);
        }
        pthread_mutex_unlock(&st->lock);
    }
    if ((attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && reg->pool != NULL) {
        /* Unlocked read: set_pool's change reaches the next message. */
        ucs_status_t s = gpucx__am_pool_recv(reg, reg->pool, header,
                                             header_length, data, length,
                                             param);
        if (s != UCS_ERR_NO_RESOURCE) {
            return s;
        }
    }
    if (header_length != 0) {
        hdr = malloc(header_length);
    }
    if (!keep && length != 0) {
        /* Data valid only during the callback: copy it (not expected with
         * UCP_AM_FLAG_PERSISTENT_DATA, kept for safety). */
        copy = malloc(length);
    }
    pthread_mutex_lock(&st->lock);
    if (reg->keep && reg->ptail != reg->phead) {
        /* A receive was posted meanwhile (another thread). */
        free(hdr);
        free(copy);
        return gpucx__am_deliver(reg, data, length, attr);
    }
    qs = reg->keep ? &st->kept : &st->queue;
    if (!gpucx__qstat_admit(qs, charge, &st->drops)) {
        /* Past a cap: eager data is given back to UCX, a rendezvous
         * payload is never fetched (UCX releases its descriptor and the
         * sender completes). */
        pthread_mutex_unlock(&st->lock);
        free(hdr);
        free(copy);
        return UCS_OK;
    }
    if ((header_length != 0 && hdr == NULL) ||
        (!keep && length != 0 && copy == NULL) ||
        !(reg->keep ? gpucx__msgq_reserve(&reg->kq, &reg->khead, &reg->ktail,
                                          &reg->kcap)
                    : gpucx__amq_reserve(st))) {
        gpucx__qstat_leave(qs, charge);
        gpucx__qstat_drop(qs, charge, &st->drops);
        pthread_mutex_unlock(&st->lock);
        free(hdr);
        free(copy);
        /* Rendezvous: fail the sender; eager: UCX frees the data. */
        return (attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_NO_MEMORY : UCS_OK;
    }
    if (hdr != NULL) {
        memcpy(hdr, header, header_length);
    }
    if (copy != NULL) {
        memcpy(copy, data, length);
    }
    m                = reg->keep ? &reg->kq[reg->ktail++] : &st->q[st->tail++];
    m->id            = reg->id;
    m->owned         = !keep;
    m->flags         = attr;
    m->data          = keep ? data : copy;
    m->length        = length;
    m->reply_ep      = (attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep
                                                                : NULL;
    m->header        = hdr;
    m->header_length = header_length;
    pthread_mutex_unlock(&st->lock);
    return keep ? UCS_INPROGRESS : UCS_OK;
}

/* Install (cb != 0) or remove the C receive callback for reg->id. */
static ucs_status_t gpucx_am_set_handler(gpucx_am_reg_t *reg, int install)
{
    return gpucx__am_handler(reg->state->worker, reg->id,
                             UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA,
                             install ? gpucx__am_recv_cb : NULL,
                             install ? reg : NULL);
}

/* ---- the heartbeat's answer (gpucx/_heartbeat.py) ----------------------- */

/* The reserved ids of the heartbeat: a ping asks the peer for a pong that
 * carries the ping's header back (a token of GPUCX_PING_TOKEN bytes naming
 * the pinging side's endpoint). */
static const unsigned GPUCX_PING_AM_ID = 0xFF31;
static const unsigned GPUCX_PONG_AM_ID = 0xFF32;
static const size_t   GPUCX_PING_TOKEN = 8;

/* The receive callback of GPUCX_PING_AM_ID: answer the pong here, inside
 * ucp_worker_progress, so that whatever progresses the worker answers (a
 * ProgressThread, a blocking wait spinning in C, a progress() call), not
 * only Python dispatching its active messages.
 *
 * UCX allows it: the callback must not progress the worker (ucp_def.h), and
 * ucp_am_send_nbx does not; it takes the worker's lock, which
 * ucp_worker_progress holds in "multi" mode, and that lock is recursive
 * (UCS_ASYNC_BLOCK); UCX's own test_ucp_am sends on reply_ep from its AM
 * callback.  The reply endpoint is one UCX found valid for this message
 * (ucp_am_handler_reply drops a message whose endpoint is closed: a gpucx
 * close or force close); on a failed one the send fails, and the ping is
 * dropped.  The header is copied by UCX (COPY_HEADER: it is valid only
 * during this callback); the request, when UCX keeps one, is freed at once
 * (ucp_request_free: the send goes on, nobody is told of its end).
 *
 * A ping of another header length, or one sent without a reply endpoint,
 * is dropped unanswered.  Always UCS_OK: eager data is given back, a
 * rendezvous payload is never fetched (no gpucx sends one). */
static ucs_status_t gpucx__am_ping_cb(void *arg, const void *header,
                                      size_t header_length, void *data,
                                      size_t length,
                                      const ucp_am_recv_param_t *param)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    (void)arg;
    (void)data;
    (void)length;
    if (header_length != GPUCX_PING_TOKEN ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        param->reply_ep == NULL) {
        return UCS_OK;
    }
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags        = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER;
    r = ucp_am_send_nbx(param->reply_ep, GPUCX_PONG_AM_ID, header,
                        header_length, NULL, 0, &p);
    if (r != NULL && !UCS_PTR_IS_ERR(r)) {
        ucp_request_free(r);
    }
    return UCS_OK;
}

/* Answer the heartbeat's pings to worker in C from now on. */
static ucs_status_t gpucx_am_answer_pings(ucp_worker_h worker)
{
    return gpucx__am_handler(worker, GPUCX_PING_AM_ID, UCP_AM_FLAG_WHOLE_MSG,
                             gpucx__am_ping_cb, NULL);
}

/* Make room for k more posted receives (state lock held). */
static int gpucx__am_posts_reserve(gpucx_am_reg_t *reg, size_t k)
{
    gpucx_am_post_t *q;
    size_t           cap;

    if (reg->ptail + k <= reg->pcap) {
        return 1;
    }
    if (reg->phead > 0) {
        memmove(reg->posts, reg->posts + reg->phead,
                (reg->ptail - reg->phead) * sizeof(gpucx_am_post_t));
        reg->ptail -= reg->phead;
        reg->phead  = 0;
        if (reg->ptail + k <= reg->pcap) {
            return 1;
        }
    }
    cap = reg->pcap ? reg->pcap : 16;
    while (cap < reg->ptail + k) {
        cap *= 2;
    }
    if (cap > UINT_MAX) {
        return 0;
    }
    q = (gpucx_am_post_t *)realloc(reg->posts, cap * sizeof(*q));
    if (q == NULL) {
        return 0;
    }
    reg->posts = q;
    reg->pcap  = (unsigned)cap;
    return 1;
}

static void gpucx__am_posts_push(gpucx_am_reg_t *reg, void *buf, size_t len,
                                 int mt, gpucx_slot_t *slot,
                                 gpucx_am_group_t *g)
{
    slot->status = UCS_INPROGRESS;
    slot->req    = NULL;
    slot->length = 0;
    slot->kind   = GPUCX_SLOT_AM_POSTED;
    slot->value  = (uint64_t)(uintptr_t)reg;
    reg->posts[reg->ptail].buf   = buf;
    reg->posts[reg->ptail].len   = len;
    reg->posts[reg->ptail].memory_type = mt;
    reg->posts[reg->ptail].slot  = slot;
    reg->posts[reg->ptail].group = g;
    reg->ptail++;
}

static void gpucx_am_release(ucp_worker_h worker, gpucx_am_msg_t *m);
static void gpucx_am_pool_free(gpucx_am_pool_t *pool);

static ucs_status_t gpucx_am_post_mt(gpucx_am_reg_t *reg, void *buf,
                                     size_t len, int mt, gpucx_slot_t *slot,
                                     gpucx_am_msg_t *out);

/* Blocking receive: post, then progress until done or spin_ns pass.
 * Returns GPUCX_AM_COPY_IN as gpucx_am_post_mt does. */
static ucs_status_t gpucx_am_recv_wait(gpucx_worker_state_t *ws,
                                       gpucx_am_reg_t *reg, void *buf,
                                       size_t len, int mt, gpucx_slot_t *slot,
                                       gpucx_am_msg_t *out, uint64_t spin_ns)
{
    ucs_status_t st = gpucx_am_post_mt(reg, buf, len, mt, slot, out);

    if (st == (ucs_status_t)GPUCX_AM_COPY_IN) {
        return st;
    }
    return gpucx__wait_posted(ws, slot, st, spin_ns);
}

/* Take the oldest kept message of reg into *out (state lock held); 0 when
 * none waits. */
static int gpucx__am_kept_pop(gpucx_am_reg_t *reg, gpucx_am_msg_t *out)
{
    if (reg->khead == reg->ktail) {
        return 0;
    }
    *out = reg->kq[reg->khead++];
    if (reg->khead == reg->ktail) {
        reg->khead = reg->ktail = 0;
    }
    gpucx__qstat_leave(&reg->state->kept, gpucx__am_msg_charge(out));
    free(out->header); /* posted receives do not keep headers */
    out->header        = NULL;
    out->header_length = 0;
    return 1;
}

/* Receive a kept message into a receive posted alone (lock not held):
 * eager data is copied and given back, a rendezvous fetch starts. */
static ucs_status_t gpucx__am_take(gpucx_am_state_t *st, gpucx_am_msg_t *m,
                                   void *buf, size_t len, int mt,
                                   gpucx_slot_t *slot)
{
    void *desc;

    slot->kind   = GPUCX_SLOT_PLAIN;
    slot->req    = NULL;
    slot->length = m->length;
    if (m->length > len) {
        gpucx_am_release(st->worker, m); /* dropped; a sender completes */
        slot->status = UCS_ERR_MESSAGE_TRUNCATED;
        return slot->status;
    }
    if (m->flags & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        desc    = m->data;
        m->data = NULL;
        return gpucx_am_recv_data(st->worker, desc, buf, m->length, mt, slot);
    }
    if (m->length != 0) {
        memcpy(buf, m->data, m->length);
    }
    gpucx_am_release(st->worker, m);
    slot->status = UCS_OK;
    return UCS_OK;
}

/* Whether a kept message m goes to Python for a buffer of type mt (see
 * gpucx_am_post_t): eager data into device memory that fits. */
static inline int gpucx__am_to_python(const gpucx_am_msg_t *m, size_t len,
                                      int mt)
{
    return !GPUCX__AM_HOST(mt) && !(m->flags & UCP_AM_RECV_ATTR_FLAG_RNDV) &&
           m->length <= len;
}

/* Post buf (memory type mt) for the next message of reg's id; a kept
 * message is received at once.  Returns UCS_INPROGRESS, the status of a
 * receive that finished at once (UCS_OK, UCS_ERR_MESSAGE_TRUNCATED),
 * UCS_ERR_NO_MEMORY, or GPUCX_AM_COPY_IN: a kept eager message for a
 * device buffer, moved to *out (nothing posted; the slot untouched):
 * Python copies its data and gives it back with gpucx_am_release. */
static ucs_status_t gpucx_am_post_mt(gpucx_am_reg_t *reg, void *buf,
                                     size_t len, int mt, gpucx_slot_t *slot,
                                     gpucx_am_msg_t *out)
{
    gpucx_am_state_t *st = reg->state;
    gpucx_am_msg_t    m;

    pthread_mutex_lock(&st->lock);
    if (gpucx__am_kept_pop(reg, &m)) {
        pthread_mutex_unlock(&st->lock);
        if (gpucx__am_to_python(&m, len, mt)) {
            *out = m;
            return (ucs_status_t)GPUCX_AM_COPY_IN;
        }
        return gpucx__am_take(st, &m, buf, len, mt, slot);
    }
    if (!gpucx__am_posts_reserve(reg, 1)) {
        pthread_mutex_unlock(&st->lock);
        return UCS_ERR_NO_MEMORY;
    }
    gpucx__am_posts_push(reg, buf, len, mt, slot, NULL);
    pthread_mutex_unlock(&st->lock);
    return UCS_INPROGRESS;
}

/* gpucx_am_post_mt for host memory (the bench loops use it). */
static ucs_status_t gpucx_am_post(gpucx_am_reg_t *reg, void *buf, size_t len,
                                  gpucx_slot_t *slot)
{
    return gpucx_am_post_mt(reg, buf, len, UCS_MEMORY_TYPE_HOST, slot, NULL);
}

/* Finish member i of g with status and length (Python, after copying a
 * message gpucx_am_post_group handed over). */
static void gpucx_am_member_finish(gpucx_am_group_t *g, gpucx_slot_t *m,
                                   ucs_status_t status, size_t length)
{
    gpucx_am_state_t *st = g->reg->state;

    pthread_mutex_lock(&st->lock);
    m->kind   = GPUCX_SLOT_PLAIN;
    m->length = length;
    gpucx__am_member_done(g, m, status);
    pthread_mutex_unlock(&st->lock);
}

/* The payload sizes of a group's n member slots, into out[0..n): the
 * result of am_recv_many_nb's request, built in one call instead of one
 * cffi field read per message. */
static void gpucx_am_group_lengths(const gpucx_slot_t *members, size_t n,
                                   size_t *out)
{
    size_t i;

    for (i = 0; i < n; i++) {
        out[i] = members[i].length;
    }
}

/* Post bufs[0..n) (sizes lens[], memory types mts[] or NULL for host
 * memory, member slots members[]) for the next n messages of reg's id, in
 * order, behind g's one slot.  nbufs is n, or 1: then bufs[0] (lens[0],
 * mts[0]) is posted n times, which spares the caller building n-entry
 * arrays for a stream of messages into one buffer.  Posting starts at
 * member *at (0 on the first call, which sets g up).  Returns
 * UCS_INPROGRESS, UCS_OK for n == 0, UCS_ERR_NO_MEMORY (nothing more
 * posted), or GPUCX_AM_COPY_IN: member *at takes a kept eager message for
 * device memory, moved to *out; Python copies it, finishes the member
 * with gpucx_am_member_finish and calls again from *at + 1. */
static ucs_status_t gpucx_am_post_group(gpucx_am_reg_t *reg,
                                        gpucx_am_group_t *g, void **bufs,
                                        const size_t *lens, const int *mts,
                                        size_t nbufs, gpucx_slot_t *members,
                                        size_t n, size_t *at,
                                        gpucx_am_msg_t *out)
{
    gpucx_am_state_t *st   = reg->state;
    size_t            step = (nbufs == 1) ? 0 : 1;
    size_t            i    = *at;

    if (i == 0) {
        g->reg         = reg;
        g->pending     = n;
        g->error       = UCS_OK;
        g->slot.req    = NULL;
        g->slot.length = 0;
        if (n == 0) {
            g->slot.kind   = GPUCX_SLOT_PLAIN;
            g->slot.status = UCS_OK;
            return UCS_OK;
        }
    }
    pthread_mutex_lock(&st->lock);
    if (!gpucx__am_posts_reserve(reg, n - i)) {
        if (i == 0) {
            pthread_mutex_unlock(&st->lock);
            g->slot.kind   = GPUCX_SLOT_PLAIN;
            g->slot.status = UCS_ERR_NO_MEMORY;
            return UCS_ERR_NO_MEMORY;
        }
        /* The members left fail; the group completes once the others do. */
        for (; i < n; i++) {
            members[i].req  = NULL;
            members[i].kind = GPUCX_SLOT_PLAIN;
            gpucx__am_member_done(g, &members[i], UCS_ERR_NO_MEMORY);
        }
        pthread_mutex_unlock(&st->lock);
        return UCS_ERR_NO_MEMORY;
    }
    if (i == 0) {
        g->slot.kind   = GPUCX_SLOT_AM_GROUP;
        g->slot.status = UCS_INPROGRESS;
    }
    for (; i < n; i++) {
        gpucx_am_msg_t m;
        int            mt = mts != NULL ? mts[i * step] : UCS_MEMORY_TYPE_HOST;

        if (!gpucx__am_kept_pop(reg, &m)) {
            gpucx__am_posts_push(reg, bufs[i * step], lens[i * step], mt,
                                 &members[i], g);
            continue;
        }
        /* A kept message: this member receives it now. */
        members[i].status = UCS_INPROGRESS;
        members[i].req    = NULL;
        members[i].kind   = GPUCX_SLOT_PLAIN;
        pthread_mutex_unlock(&st->lock);
        if (gpucx__am_to_python(&m, lens[i * step], mt)) {
            *at  = i;
            *out = m;
            return (ucs_status_t)GPUCX_AM_COPY_IN;
        }
        if (!gpucx__am_member_recv(st, g, &members[i], bufs[i * step],
                                   lens[i * step], mt, m.data, m.length,
                                   m.flags)) {
            gpucx_am_release(st->worker, &m);
        }
        pthread_mutex_lock(&st->lock);
    }
    pthread_mutex_unlock(&st->lock);
    *at = n;
    return UCS_INPROGRESS;
}

/* Withdraw the members of g no message matched yet: they complete with
 * UCS_ERR_CANCELED (matched ones finish their receive). */
static void gpucx__am_unpost_group(gpucx_am_group_t *g)
{
    gpucx_am_reg_t   *reg = g->reg;
    gpucx_am_state_t *st  = reg->state;
    unsigned          i, j;

    pthread_mutex_lock(&st->lock);
    for (i = j = reg->phead; i < reg->ptail; i++) {
        gpucx_am_post_t *p = &reg->posts[i];

        if (p->group == g) {
            p->slot->kind = GPUCX_SLOT_PLAIN;
            gpucx__am_member_done(g, p->slot, UCS_ERR_CANCELED);
        } else {
            reg->posts[j++] = *p;
        }
    }
    reg->ptail = j;
    pthread_mutex_unlock(&st->lock);
}

/* Withdraw a posted receive that no message matched yet: it completes with
 * UCS_ERR_CANCELED.  Returns 1 if it was still posted. */
static int gpucx__am_unpost(gpucx_am_reg_t *reg, gpucx_slot_t *slot)
{
    gpucx_am_state_t *st    = reg->state;
    int               found = 0;
    unsigned          i;

    pthread_mutex_lock(&st->lock);
    for (i = reg->phead; i < reg->ptail; i++) {
        if (reg->posts[i].slot == slot) {
            memmove(reg->posts + i, reg->posts + i + 1,
                    (reg->ptail - i - 1) * sizeof(gpucx_am_post_t));
            reg->ptail--;
            slot->kind   = GPUCX_SLOT_PLAIN;
            slot->status = UCS_ERR_CANCELED;
            found        = 1;
            break;
        }
    }
    pthread_mutex_unlock(&st->lock);
    return found;
}

/* Keep (keep != 0) messages that find no posted receive for the next one,
 * or stop keeping them: kept messages then move to the dispatch queue, in
 * order, for the id's handler. */
static void gpucx_am_set_keep(gpucx_am_reg_t *reg, int keep)
{
    gpucx_am_state_t *st = reg->state;
    unsigned          i;

    pthread_mutex_lock(&st->lock);
    if (!keep) {
        for (i = reg->khead; i < reg->ktail; i++) {
            size_t charge = gpucx__am_msg_charge(&reg->kq[i]);

            gpucx__qstat_leave(&st->kept, charge);
            if (gpucx__qstat_admit(&st->queue, charge, &st->drops)) {
                if (gpucx__amq_reserve(st)) {
                    st->q[st->tail++] = reg->kq[i];
                    continue;
                }
                gpucx__qstat_leave(&st->queue, charge);
                gpucx__qstat_drop(&st->queue, charge, &st->drops);
            }
            gpucx_am_release(st->worker, &reg->kq[i]);
        }
        reg->khead = reg->ktail = 0;
    }
    reg->keep = keep;
    pthread_mutex_unlock(&st->lock);
}

/* Messages kept for reg's id (waiting for a posted receive). */
static unsigned gpucx_am_kept(gpucx_am_reg_t *reg)
{
    return reg->ktail - reg->khead;
}

/* A receive pool of n buffers (bufs, lens copied) for st's ids; NULL when
 * out of memory.  Freed with gpucx_am_pool_free. */
static gpucx_am_pool_t *gpucx_am_pool_new(gpucx_am_state_t *st, void **bufs,
                                          const size_t *lens, unsigned n)
{
    gpucx_am_pool_t *pool = (gpucx_am_pool_t *)calloc(1, sizeof(*pool));
    unsigned         i;

    if (pool == NULL) {
        return NULL;
    }
    pool->bufs = (void **)malloc(n * sizeof(void *));
    pool->lens = (size_t *)malloc(n * sizeof(size_t));
    pool->busy = (unsigned char *)calloc(n, 1);
    pool->pend = (gpucx_am_msg_t *)calloc(n, sizeof(gpucx_am_msg_t));
    if (pool->bufs == NULL || pool->lens == NULL || pool->busy == NULL ||
        pool->pend == NULL) {
        gpucx_am_pool_free(pool);
        return NULL;
    }
    memcpy(pool->bufs, bufs, n * sizeof(void *));
    memcpy(pool->lens, lens, n * sizeof(size_t));
    for (i = 0; i < n; i++) {
        if (lens[i] > pool->max_len) {
            pool->max_len = lens[i];
        }
    }
    pool->state = st;
    pool->n     = n;
    pool->nfree = n;
    return pool;
}

static void gpucx_am_pool_free(gpucx_am_pool_t *pool)
{
    if (pool != NULL) {
        free(pool->bufs);
        free(pool->lens);
        free(pool->busy);
        free(pool->pend);
        free(pool->wq);
        free(pool);
    }
}

/* Receive reg's rendezvous messages into pool from the next one on (NULL:
 * leave them at the sender for receive_into). */
static void gpucx_am_set_pool(gpucx_am_reg_t *reg, gpucx_am_pool_t *pool)
{
    pthread_mutex_lock(&reg->state->lock);
    reg->pool = pool;
    pthread_mutex_unlock(&reg->state->lock);
}

/* Buffers of pool holding a message (receiving, queued or held). */
static unsigned gpucx_am_pool_busy(gpucx_am_pool_t *pool)
{
    unsigned n;

    pthread_mutex_lock(&pool->state->lock);
    n = pool->n - pool->nfree;
    pthread_mutex_unlock(&pool->state->lock);
    return n;
}

/* The worker closes (before ucp_worker_destroy): messages waiting for a
 * buffer are dropped, and receives into pool that end from now on
 * (cancelled by ucp_worker_destroy) free their buffer instead of
 * queueing. */
static void gpucx_am_pool_close(gpucx_am_pool_t *pool)
{
    gpucx_am_state_t *st = pool->state;
    unsigned          k;

    pthread_mutex_lock(&st->lock);
    pool->closed = 1;
    for (k = pool->whead; k < pool->wtail; k++) {
        gpucx__qstat_leave(&st->queue, pool->wq[k].header_length);
        pool->wq[k].owned = 0;
        gpucx_am_release(st->worker, &pool->wq[k]);
    }
    pool->whead = pool->wtail = 0;
    pthread_mutex_unlock(&st->lock);
}

/* Cancel every receive still posted for reg's id, drop the kept messages
 * and free both lists (worker close). */
static void gpucx_am_unpost_all(gpucx_am_reg_t *reg)
{
    gpucx_am_state_t *st = reg->state;
    unsigned          i;

    pthread_mutex_lock(&st->lock);
    for (i = reg->khead; i < reg->ktail; i++) {
        gpucx__qstat_leave(&st->kept, gpucx__am_msg_charge(&reg->kq[i]));
        gpucx_am_release(st->worker, &reg->kq[i]);
    }
    free(reg->kq);
    reg->kq    = NULL;
    reg->khead = reg->ktail = reg->kcap = 0;
    for (i = reg->phead; i < reg->ptail; i++) {
        reg->posts[i].slot->kind = GPUCX_SLOT_PLAIN;
        if (reg->posts[i].group != NULL) {
            gpucx__am_member_done(reg->posts[i].group, reg->posts[i].slot,
                                  UCS_ERR_CANCELED);
        } else {
            reg->posts[i].slot->status = UCS_ERR_CANCELED;
        }
    }
    free(reg->posts);
    reg->posts = NULL;
    reg->phead = reg->ptail = reg->pcap = 0;
    pthread_mutex_unlock(&st->lock);
}

/* Move the oldest message into *out (the caller now owns its header and
 * data); returns 0 when the queue is empty. */
static int gpucx_am_pop(gpucx_am_state_t *st, gpucx_am_msg_t *out)
{
    int found = 0;

    pthread_mutex_lock(&st->lock);
    if (st->head != st->tail) {
        *out = st->q[st->head++];
        if (st->head == st->tail) {
            st->head = st->tail = 0;
        }
        gpucx__qstat_leave(&st->queue, gpucx__am_msg_charge(out));
        found = 1;
    }
    pthread_mutex_unlock(&st->lock);
    return found;
}

/* caps: kept count, kept bytes, queue count, queue bytes (0: no cap). */
static void gpucx_am_init(gpucx_am_state_t *st, ucp_worker_h worker,
                          const size_t *caps)
{
    memset(st, 0, sizeof(*st));
    st->worker = worker;
    gpucx_qstat_init(&st->kept, caps[0], caps[1]);
    gpucx_qstat_init(&st->queue, caps[2], caps[3]);
    pthread_mutex_init(&st->lock, NULL);
}

/* A consistent copy of the counters of both queues. */
static void gpucx_am_stats(gpucx_am_state_t *st, gpucx_qstat_t *kept,
                           gpucx_qstat_t *queue)
{
    pthread_mutex_lock(&st->lock);
    *kept  = st->kept;
    *queue = st->queue;
    pthread_mutex_unlock(&st->lock);
}

/* Release the data of a popped message exactly once (eager data or an
 * unreceived rendezvous descriptor; the latter completes the sender). */
static void gpucx_am_release(ucp_worker_h worker, gpucx_am_msg_t *m)
{
    if (m->data != NULL) {
        if (m->owned == 2) {
            gpucx__am_pool_put(worker, m->pool, m->index);
        } else if (m->owned) {
            free(m->data);
        } else if (worker != NULL) {
            ucp_am_data_release(worker, m->data);
        }
        m->data = NULL;
    }
    free(m->header);
    m->header        = NULL;
    m->header_length = 0;
}

/* Release every message queued for a handler; the queue stays usable (a
 * progress thread may be adding to it meanwhile). */
static void gpucx_am_release_queued(gpucx_am_state_t *st)
{
    gpucx_am_msg_t m;

    while (gpucx_am_pop(st, &m)) {
        gpucx_am_release(st->worker, &m);
    }
}

/* Drop everything still queued (worker close, before ucp_worker_destroy). */
static void gpucx_am_drain(gpucx_am_state_t *st)
{
    gpucx_am_release_queued(st);
    free(st->q);
    st->q   = NULL;
    st->cap = 0;
    /* The lock stays valid (never destroyed): it lives as long as st. */
}

static size_t gpucx_am_max_header(ucp_worker_h worker)
{
    ucp_worker_attr_t attr;

    attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    if (ucp_worker_query(worker, &attr) != UCS_OK) {
        return 0;
    }
    return attr.max_am_header;
}

static ucs_status_t gpucx_am_send(ucp_ep_h ep, unsigned id, const void *header,
                                  size_t header_length, const void *buf,
                                  size_t len, int memory_type, unsigned flags,
                                  gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.send = gpucx__send_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    /* The header is copied by UCX so Python need not hold it. */
    p.flags = flags | UCP_AM_SEND_FLAG_COPY_HEADER;
    return gpucx__posted(slot, ucp_am_send_nbx(ep, id, header, header_length,
                                               buf, len, &p));
}

static ucs_status_t gpucx_am_send_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                       unsigned id, const void *header,
                                       size_t header_length, const void *buf,
                                       size_t len, int memory_type,
                                       unsigned flags, gpucx_slot_t *slot,
                                       uint64_t spin_ns)
{
    ucs_status_t st = gpucx_am_send(ep, id, header, header_length, buf, len,
                                    memory_type, flags, slot);

    return gpucx__wait_posted(ws, slot, st, spin_ns);
}

static void gpucx__am_recv_data_cb(void *request, ucs_status_t status,
                                   size_t length, void *user_data)
{
    gpucx_slot_t *slot = (gpucx_slot_t *)user_data;
    (void)request;
    slot->length = length;
    slot->status = status;
}

/* Receive a rendezvous message into buf, zero copy. */
static ucs_status_t gpucx_am_recv_data(ucp_worker_h worker, void *desc,
                                       void *buf, size_t len, int memory_type,
                                       gpucx_slot_t *slot)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.recv_am = gpucx__am_recv_data_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    p.recv_info.length = &slot->length;
    slot->length       = 0;
    r = ucp_am_recv_data_nbx(worker, desc, buf, len, &p);
    return gpucx__posted(slot, r);
}

/* Receive the payload of a popped rendezvous message into buf, zero copy:
 * the descriptor moves from the message to the receive, and the header
 * (Python copied it when it popped the message) is freed, so the record
 * holds nothing gpucx_am_release would give back. */
static ucs_status_t gpucx_am_recv_msg(ucp_worker_h worker, gpucx_am_msg_t *m,
                                      void *buf, int memory_type,
                                      gpucx_slot_t *slot)
{
    void *desc = m->data;

    m->data = NULL;
    free(m->header);
    m->header        = NULL;
    m->header_length = 0;
    return gpucx_am_recv_data(worker, desc, buf, m->length, memory_type, slot);
}

static const unsigned GPUCX_AM_SEND_REPLY = UCP_AM_SEND_FLAG_REPLY;
static const unsigned GPUCX_AM_SEND_EAGER = UCP_AM_SEND_FLAG_EAGER;
static const unsigned GPUCX_AM_SEND_RNDV  = UCP_AM_SEND_FLAG_RNDV;
