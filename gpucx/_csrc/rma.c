/*
 * gpucx C helpers: memory regions, remote keys, RMA and put-with-notify.
 *
 * Appended after _ucx_helpers.c in one translation unit (see
 * _build_ucx.py), so the slot helpers there are used directly.
 *
 * Put-with-notify: the initiator posts the put, an endpoint flush and, once
 * the flush completed, a small active message on the reserved id
 * GPUCX_NOTIFY_AM_ID.  The owner's worker
 * has a C handler for that id (installed when the worker is created) that
 * copies the notify bytes and the reply endpoint into a C queue; Python
 * drains the queue after progress returns (worker.notifications()).
 */

/* The top of UCX's 16-bit active-message id range is reserved for gpucx's
 * own notifications; user AM handlers must use ids below it. */
#define GPUCX_NOTIFY_AM_ID 0xFFFFu
/* Largest notify payload: it always travels eagerly in one message. */
#define GPUCX_NOTIFY_MAX 65536u

static const unsigned GPUCX_NOTIFY_ID      = GPUCX_NOTIFY_AM_ID;
static const unsigned GPUCX_NOTIFY_MAX_LEN = GPUCX_NOTIFY_MAX;

/* ---- memory regions ---------------------------------------------------- */

/* Map existing memory (allocate=0) or let UCX allocate (allocate=1).
 * readonly: map without remote write permission (UCP_MEM_MAP_PROT_*; what
 * each transport then enforces is in docs/rma.md).
 * On success *addr_out / *len_out / *memtype_out describe the region. */
static ucs_status_t gpucx_mem_map(ucp_context_h ctx, void *address,
                                  size_t length, int memory_type, int allocate,
                                  int readonly, ucp_mem_h *memh,
                                  uint64_t *addr_out,
                                  size_t *len_out, int *memtype_out)
{
    ucp_mem_map_params_t params;
    ucp_mem_attr_t       attr;
    ucs_status_t         status;

    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                        UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.address = allocate ? NULL : address;
    params.length  = length;
    params.flags   = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    if (readonly) {
        params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_PROT;
        params.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                      UCP_MEM_MAP_PROT_REMOTE_READ;
    }
    if (memory_type >= 0) {
        params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        params.memory_type = (ucs_memory_type_t)memory_type;
    }
    status = ucp_mem_map(ctx, &params, memh);
    if (status != UCS_OK) {
        return status;
    }
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH |
                      UCP_MEM_ATTR_FIELD_MEM_TYPE;
    status = ucp_mem_query(*memh, &attr);
    if (status != UCS_OK) {
        ucp_mem_unmap(ctx, *memh);
        return status;
    }
    *addr_out    = (uint64_t)(uintptr_t)attr.address;
    *len_out     = attr.length;
    *memtype_out = (int)attr.mem_type;
    return UCS_OK;
}

static ucs_status_t gpucx_mem_unmap(ucp_context_h ctx, ucp_mem_h memh)
{
    return ucp_mem_unmap(ctx, memh);
}

/* Pack the remote key of a region into a malloc'ed copy (gpucx_free).
 * ucp_rkey_pack is UCX's call for remote keys; ucp_memh_pack only packs
 * handles for export to peer processes' local use. */
static ucs_status_t gpucx_rkey_pack(ucp_context_h ctx, ucp_mem_h memh,
                                    void **out, size_t *len)
{
    void         *buf  = NULL;
    size_t        size = 0;
    ucs_status_t  status;

    status = ucp_rkey_pack(ctx, memh, &buf, &size);
    if (status != UCS_OK) {
        return status;
    }
    *out = malloc(size ? size : 1);
    if (*out == NULL) {
        ucp_rkey_buffer_release(buf);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(*out, buf, size);
    *len = size;
    ucp_rkey_buffer_release(buf);
    return UCS_OK;
}

static ucs_status_t gpucx_rkey_unpack(ucp_ep_h ep, const void *blob,
                                      ucp_rkey_h *rkey)
{
    return ucp_ep_rkey_unpack(ep, blob, rkey);
}

static void gpucx_rkey_destroy(ucp_rkey_h rkey)
{
    ucp_rkey_destroy(rkey);
}

/* ---- put / get --------------------------------------------------------- */

/* A put (get=0) or a get (get=1) into slot. */
static inline ucs_status_t gpucx__rma(ucp_ep_h ep, int get, void *buf,
                                      size_t len, uint64_t raddr,
                                      ucp_rkey_h rkey, int memory_type,
                                      gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, get ? ucp_get_nbx(ep, buf, len, raddr, rkey, &p)
                                   : ucp_put_nbx(ep, buf, len, raddr, rkey, &p));
}

static ucs_status_t gpucx_put(ucp_ep_h ep, const void *buf, size_t len,
                              uint64_t raddr, ucp_rkey_h rkey, int memory_type,
                              gpucx_slot_t *slot)
{
    return gpucx__rma(ep, 0, (void *)buf, len, raddr, rkey, memory_type, slot);
}

static ucs_status_t gpucx_get(ucp_ep_h ep, void *buf, size_t len,
                              uint64_t raddr, ucp_rkey_h rkey, int memory_type,
                              gpucx_slot_t *slot)
{
    return gpucx__rma(ep, 1, buf, len, raddr, rkey, memory_type, slot);
}

/* Blocking API: post and progress in one crossing. */
static ucs_status_t gpucx_put_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                   const void *buf, size_t len, uint64_t raddr,
                                   ucp_rkey_h rkey, int memory_type,
                                   gpucx_slot_t *slot, uint64_t spin_ns)
{
    return gpucx__wait_posted(
        ws, slot, gpucx_put(ep, buf, len, raddr, rkey, memory_type, slot),
        spin_ns);
}

static ucs_status_t gpucx_get_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                   void *buf, size_t len, uint64_t raddr,
                                   ucp_rkey_h rkey, int memory_type,
                                   gpucx_slot_t *slot, uint64_t spin_ns)
{
    return gpucx__wait_posted(
        ws, slot, gpucx_get(ep, buf, len, raddr, rkey, memory_type, slot),
        spin_ns);
}

/* ---- put with notify (initiator) --------------------------------------- */

/* Three UCX operations behind one slot: the put, an endpoint flush, and the
 * notify AM, which is posted only when the flush completed (so the data is
 * in the target memory before the notification leaves).  ucp_worker_fence
 * is not used: with UCX's default fence mode it blocks until the peer has
 * progressed, which a non-blocking call must not do.  The slot completes
 * when all three did, with the first error.  Each UCX request is freed in
 * its own callback; slot.req only names the pending AM (what a cancel can
 * reach). */
typedef struct gpucx_notify_op {
    gpucx_slot_t  slot;
    unsigned      pending;
    ucs_status_t  error;
    ucp_ep_h      ep;
    const void   *notify;
    size_t        notify_len;
} gpucx_notify_op_t;

static void gpucx__notify_op_cb(void *request, ucs_status_t status,
                                void *user_data)
{
    gpucx_notify_op_t *op = (gpucx_notify_op_t *)user_data;

    if (status != UCS_OK && op->error == UCS_OK) {
        op->error = status;
    }
    if (op->slot.req == request) {
        op->slot.req = NULL;
    }
    ucp_request_free(request);
    if (--op->pending == 0) {
        op->slot.status = op->error;
    }
}

static void gpucx__notify_send_am(gpucx_notify_op_t *op)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send   = gpucx__notify_op_cb;
    p.user_data = op;
    p.flags     = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    r = ucp_am_send_nbx(op->ep, GPUCX_NOTIFY_AM_ID, NULL, 0, op->notify,
                        op->notify_len, &p);
    if (UCS_PTR_IS_ERR(r)) {
        if (op->error == UCS_OK) {
            op->error = UCS_PTR_STATUS(r);
        }
    } else if (r != NULL) {
        op->pending++;
        op->slot.req = r;
    }
}

/* The flush completed: the put is in the target memory; notify. */
static void gpucx__notify_flush_cb(void *request, ucs_status_t status,
                                   void *user_data)
{
    gpucx_notify_op_t *op = (gpucx_notify_op_t *)user_data;

    ucp_request_free(request);
    if (status != UCS_OK) {
        if (op->error == UCS_OK) {
            op->error = status;
        }
    } else if (op->error == UCS_OK) {
        gpucx__notify_send_am(op);
    }
    if (--op->pending == 0) {
        op->slot.status = op->error;
    }
}

static void gpucx__notify_op_init(gpucx_notify_op_t *op, ucp_ep_h ep,
                                  const void *notify, size_t notify_len)
{
    op->pending     = 0;
    op->error       = UCS_OK;
    op->ep          = ep;
    op->notify      = notify;
    op->notify_len  = notify_len;
    op->slot.status = UCS_INPROGRESS;
    op->slot.req    = NULL;
}

/* After an op's operations are posted: with notify, post the endpoint
 * flush whose completion sends the notification; complete the slot if
 * nothing is pending. */
static ucs_status_t gpucx__notify_after(gpucx_notify_op_t *op, int notify)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    if (notify) {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send      = gpucx__notify_flush_cb;
        p.user_data    = op;
        r = ucp_ep_flush_nbx(op->ep, &p);
        if (UCS_PTR_IS_ERR(r)) {
            op->error = UCS_PTR_STATUS(r);
        } else if (r != NULL) {
            op->pending++;
        } else {
            gpucx__notify_send_am(op);
        }
    }
    if (op->pending == 0) {
        op->slot.status = op->error;
    }
    return op->slot.status;
}

static ucs_status_t gpucx_put_notify(ucp_ep_h ep, const void *buf, size_t len,
                                     uint64_t raddr, ucp_rkey_h rkey,
                                     int memory_type, const void *notify,
                                     size_t notify_len, gpucx_notify_op_t *op)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    gpucx__notify_op_init(op, ep, notify, notify_len);

    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send      = gpucx__notify_op_cb;
    p.user_data    = op;
    if (memory_type >= 0) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        p.memory_type   = (ucs_memory_type_t)memory_type;
    }
    r = ucp_put_nbx(ep, buf, len, raddr, rkey, &p);
    if (UCS_PTR_IS_ERR(r)) {
        op->slot.status = UCS_PTR_STATUS(r);
        return op->slot.status;
    }
    if (r != NULL) {
        op->pending++;
    }
    return gpucx__notify_after(op, 1);
}

/* ---- prepared transfers ------------------------------------------------ */

/* One entry of a prepared transfer: a local buffer and where it goes (put)
 * or comes from (get).  Python fills the array once, when the transfer is
 * prepared; every run posts all of it in one call. */
typedef struct gpucx_xfer_item {
    void       *buf;
    size_t      len;
    uint64_t    raddr;
    ucp_rkey_h  rkey;
    int         memory_type; /* -1: let UCX detect it */
} gpucx_xfer_item_t;

/* Post every put (is_get == 0) or get of items[0..count) on ep behind the
 * one slot of op, then, with do_notify, an endpoint flush whose completion
 * sends the notify AM (as gpucx_put_notify does for one put).  The slot
 * completes when every posted operation did, with the first error.  A post
 * UCX refuses at once stops the loop: the entries after it are not posted,
 * no notification is sent, and the slot fails once the ones already posted
 * completed.  The callbacks free their UCX requests; no request is left for
 * a cancel to reach (UCX cannot cancel RMA) until the notify AM is posted. */
static ucs_status_t gpucx_xfer_post(ucp_ep_h ep, int is_get,
                                    const gpucx_xfer_item_t *items,
                                    size_t count, int do_notify,
                                    const void *notify, size_t notify_len,
                                    gpucx_notify_op_t *op)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;
    size_t              i;

    gpucx__notify_op_init(op, ep, notify, notify_len);

    p.cb.send   = gpucx__notify_op_cb;
    p.user_data = op;
    for (i = 0; i < count; i++) {
        const gpucx_xfer_item_t *it = &items[i];

        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA;
        if (it->memory_type >= 0) {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            p.memory_type   = (ucs_memory_type_t)it->memory_type;
        }
        r = is_get ? ucp_get_nbx(ep, it->buf, it->len, it->raddr, it->rkey, &p)
                   : ucp_put_nbx(ep, it->buf, it->len, it->raddr, it->rkey, &p);
        if (UCS_PTR_IS_ERR(r)) {
            op->error = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL) {
            op->pending++;
        }
    }
    return gpucx__notify_after(op, do_notify && op->error == UCS_OK);
}

/* Post, then (spin_ns > 0) progress until done or spin_ns pass. */
static ucs_status_t gpucx_xfer_run(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                   int is_get, const gpucx_xfer_item_t *items,
                                   size_t count, int do_notify,
                                   const void *notify, size_t notify_len,
                                   gpucx_notify_op_t *op, uint64_t spin_ns)
{
    ucs_status_t st = gpucx_xfer_post(ep, is_get, items, count, do_notify,
                                      notify, notify_len, op);

    return spin_ns ? gpucx__wait_posted(ws, &op->slot, st, spin_ns)
                   : op->slot.status;
}

/* ---- notifications (owner) --------------------------------------------- */

typedef struct gpucx_notice {
    struct gpucx_notice *next;
    ucp_ep_h             ep;     /* reply endpoint of the sender, or NULL */
    size_t               length;
    char                 data[];
} gpucx_notice_t;

/* The owner's queue.  Push (inside progress, maybe a ProgressThread) and
 * pop (Python) may run in different threads of a "multi" worker: lock
 * guards the list and stat, as the AM state's lock does for its queues.
 * stat.count is also read without the lock as a cheap "anything there?". */
typedef struct gpucx_notify_q {
    gpucx_notice_t *head;
    gpucx_notice_t *tail;
    gpucx_qstat_t   stat;  /* caps; drops past them, out of memory, rndv */
    uint64_t       *drops; /* the worker-wide drop counter (AM state) */
    pthread_mutex_t lock;
} gpucx_notify_q_t;

static void gpucx__notify_drop(gpucx_notify_q_t *q, size_t length)
{
    gpucx__qstat_drop(&q->stat, length, q->drops);
}

static ucs_status_t gpucx__notify_am_cb(void *arg, const void *header,
                                        size_t header_length, void *data,
                                        size_t length,
                                        const ucp_am_recv_param_t *param)
{
    gpucx_notify_q_t *q = (gpucx_notify_q_t *)arg;
    gpucx_notice_t   *n;

    (void)header;
    (void)header_length;
    pthread_mutex_lock(&q->lock);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* gpucx always sends notifications eagerly; not one of ours (UCX
         * releases it unfetched). */
        gpucx__notify_drop(q, 0);
        pthread_mutex_unlock(&q->lock);
        return UCS_OK;
    }
    if (!gpucx__qstat_admit(&q->stat, length, q->drops)) {
        pthread_mutex_unlock(&q->lock);
        return UCS_OK;
    }
    n = (gpucx_notice_t *)malloc(sizeof(*n) + length);
    if (n == NULL) {
        gpucx__qstat_leave(&q->stat, length);
        gpucx__notify_drop(q, length);
        pthread_mutex_unlock(&q->lock);
        return UCS_OK;
    }
    n->next   = NULL;
    n->ep     = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
                    ? param->reply_ep : NULL;
    n->length = length;
    if (length) {
        memcpy(n->data, data, length);
    }
    if (q->tail != NULL) {
        q->tail->next = n;
    } else {
        q->head = n;
    }
    q->tail = n;
    pthread_mutex_unlock(&q->lock);
    return UCS_OK;
}

/* Set up q (every worker, with or without the "am" feature): caps are
 * count and bytes (0: no cap); drops is the worker-wide drop counter. */
static void gpucx_notify_setup(gpucx_notify_q_t *q, size_t max_count,
                               size_t max_bytes, uint64_t *drops)
{
    memset(q, 0, sizeof(*q));
    gpucx_qstat_init(&q->stat, max_count, max_bytes);
    q->drops = drops;
    pthread_mutex_init(&q->lock, NULL);
}

static void gpucx_notify_stats(gpucx_notify_q_t *q, gpucx_qstat_t *out)
{
    pthread_mutex_lock(&q->lock);
    *out = q->stat;
    pthread_mutex_unlock(&q->lock);
}

static ucs_status_t gpucx_notify_init(ucp_worker_h worker, gpucx_notify_q_t *q)
{
    return gpucx__am_handler(worker, GPUCX_NOTIFY_AM_ID, UCP_AM_FLAG_WHOLE_MSG,
                             gpucx__notify_am_cb, q);
}

/* Pop the oldest notification (the caller frees it with gpucx_free). */
static gpucx_notice_t *gpucx_notify_pop(gpucx_notify_q_t *q)
{
    gpucx_notice_t *n;

    pthread_mutex_lock(&q->lock);
    n = q->head;
    if (n != NULL) {
        q->head = n->next;
        if (q->head == NULL) {
            q->tail = NULL;
        }
        gpucx__qstat_leave(&q->stat, n->length);
    }
    pthread_mutex_unlock(&q->lock);
    return n;
}

static void gpucx_notify_clear(gpucx_notify_q_t *q)
{
    gpucx_notice_t *n;

    while ((n = gpucx_notify_pop(q)) != NULL) {
        free(n);
    }
}

/* Progress until a notification is queued or spin_ns pass (the Python side
 * then sleeps on the event fd). */
static size_t gpucx_notify_wait(ucp_worker_h worker, gpucx_notify_q_t *q,
                                uint64_t spin_ns)
{
    uint64_t deadline = gpucx__now_ns() + spin_ns;
    unsigned n        = 0;

    ucp_worker_progress(worker);
    while (__atomic_load_n(&q->stat.count, __ATOMIC_RELAXED) == 0) {
        ucp_worker_progress(worker);
        if ((++n & 63) == 0 && gpucx__now_ns() >= deadline) {
            break;
        }
    }
    return __atomic_load_n(&q->stat.count, __ATOMIC_RELAXED);
}
