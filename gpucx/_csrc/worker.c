/*
 * Workers: create, query, progress and flush (ucp_worker_*).  Appended after
 * _ucx_helpers.c, whose records, slots and waits it uses.
 */

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

static ucs_status_t gpucx_worker_flush(ucp_worker_h worker, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, ucp_worker_flush_nbx(worker, &p));
}
