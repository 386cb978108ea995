/*
 * gpucx C helpers.
 *
 * The shared part: queue accounting, status names, completion callbacks,
 * slots, progress and waits, the context.  The records, slot kinds and
 * declarations every file shares are in _csrc/gpucx.h, included before
 * this file; the builder appends the per-area files after it
 * (_csrc/worker.c, ep.c, tag.c, am.c, ...: _build_ucx.C_SOURCES).
 * Everything that runs inside ucp_worker_progress() lives in these files:
 * completion callbacks record status, length and tag into a gpucx_slot_t,
 * the endpoint-error callback into the endpoint's state and the
 * connection-request callback into a small C ring.  Python reads those
 * records after progress returns; no Python code is ever called from UCX.
 *
 * Post helpers build ucp_request_param_t in C so that one Python->C crossing
 * posts an operation, and the fused *_wait helpers post and progress in one
 * crossing for the blocking API.
 */

/* ---- queue accounting --------------------------------------------------- */

/* Set the caps of s (0: no cap) and clear its counters. */
static void gpucx_qstat_init(gpucx_qstat_t *s, size_t max_count, size_t max_bytes)
{
    memset(s, 0, sizeof(*s));
    s->max_count = max_count ? max_count : SIZE_MAX;
    s->max_bytes = max_bytes ? max_bytes : SIZE_MAX;
}

/* Count a dropped message of nbytes in s and bump *drops (the worker-wide
 * counter the Python side watches to warn; NULL: none). */
static void gpucx__qstat_drop(gpucx_qstat_t *s, size_t nbytes, uint64_t *drops)
{
    s->dropped++;
    s->dropped_bytes += nbytes;
    if (drops != NULL) {
        __atomic_fetch_add(drops, 1, __ATOMIC_RELAXED);
    }
}

/* Charge a message of nbytes to s if it fits under both caps (returns 1);
 * otherwise count it as dropped (gpucx__qstat_drop) and return 0. */
static int gpucx__qstat_admit(gpucx_qstat_t *s, size_t nbytes, uint64_t *drops)
{
    if (s->count < s->max_count && nbytes <= s->max_bytes - s->bytes) {
        s->count++;
        s->bytes += nbytes;
        return 1;
    }
    gpucx__qstat_drop(s, nbytes, drops);
    return 0;
}

static inline void gpucx__qstat_leave(gpucx_qstat_t *s, size_t nbytes)
{
    s->count--;
    s->bytes -= nbytes;
}

static const char *gpucx_package_version(void) { return GPUCX_VERSION_STRING; }
static const char *gpucx_build_ucx_prefix(void) { return GPUCX_UCX_PREFIX_STRING; }


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

static void gpucx__ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    gpucx_ep_state_t     *st = (gpucx_ep_state_t *)arg;
    gpucx_worker_state_t *w  = st->worker;
    /* Emulated atomics still waiting for this peer's reply fail now. */
    gpucx__amo_ep_failed(w->amo, ep, status);
    /* Python reads it after progress (Endpoint.error, the endpoint's next
     * operation). */
    if (st->error == UCS_OK) {
        st->error = status;
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

/* Free the slot's UCX request once it completed; returns its status (so
 * that Python's completion reads it in the same call). */
static ucs_status_t gpucx_slot_release(gpucx_slot_t *slot)
{
    gpucx__release(slot);
    return slot->status;
}

static ucs_status_t gpucx_slot_cancel(ucp_worker_h worker, gpucx_slot_t *slot)
{
    if (slot->status == UCS_INPROGRESS && slot->req != NULL) {
        ucp_request_cancel(worker, slot->req);
    } else if (slot->status == UCS_INPROGRESS && slot->kind == GPUCX_SLOT_AM_POSTED) {
        /* A posted AM receive no message matched yet (am.c). */
        gpucx__am_unpost((struct gpucx_am_reg *)(uintptr_t)slot->value, slot);
    } else if (slot->status == UCS_INPROGRESS && slot->kind == GPUCX_SLOT_AM_GROUP) {
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

/* ---- active-message handlers ------------------------------------------- */

/* Install the receive callback cb (arg) for AM id on worker, or remove it
 * (cb == NULL).  flags: UCP_AM_FLAG_*. */
static ucs_status_t gpucx__am_handler(ucp_worker_h worker, unsigned id,
                                      uint32_t flags, ucp_am_recv_callback_t cb,
                                      void *arg)
{
    ucp_am_handler_param_t p;

    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id    = id;
    p.flags = flags;
    p.cb    = cb;
    p.arg   = arg;
    return ucp_worker_set_am_recv_handler(worker, &p);
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
