/*
 * Which protocol UCX picked (gpucx/protocols.py parses what these return).
 *
 * UCX's own reports, nothing inferred here: ucp_ep_print_info and
 * ucp_worker_print_info written into memory (open_memstream), and
 * ucp_request_query's info string of a request still in flight.  None of
 * these runs on a per-message path: Python calls them once per endpoint,
 * operation and memory type, or when asked.
 */

/* Write what print(handle, FILE *) prints into a malloc'ed string
 * (gpucx_free); NULL when no memory stream could be opened. */
static char *gpucx__print_to_string(void (*print)(void *, FILE *),
                                    void *handle, size_t *len)
{
    char   *text = NULL;
    size_t  size = 0;
    FILE   *fp   = open_memstream(&text, &size);

    if (fp == NULL) {
        return NULL;
    }
    print(handle, fp);
    if (fclose(fp) != 0) {
        free(text);
        return NULL;
    }
    *len = size;
    return text;
}

static void gpucx__ep_print(void *ep, FILE *fp)
{
    ucp_ep_print_info((ucp_ep_h)ep, fp);
}

static void gpucx__worker_print(void *worker, FILE *fp)
{
    ucp_worker_print_info((ucp_worker_h)worker, fp);
}

/* ucp_ep_print_info: the lanes and, with UCX's protocols v2, the selection
 * tables made so far for this endpoint's configuration (operations without
 * a remote key). */
static char *gpucx_ep_info(ucp_ep_h ep, size_t *len)
{
    return gpucx__print_to_string(gpucx__ep_print, ep, len);
}

/* ucp_worker_print_info: the worker and the selection tables of its remote
 * key configurations (put, get, atomics, rendezvous data send/fetch),
 * which UCX prints only where PROTO_INFO enables them. */
static char *gpucx_worker_info(ucp_worker_h worker, size_t *len)
{
    return gpucx__print_to_string(gpucx__worker_print, worker, len);
}

/* The request's info string into out: 0, or -1 when the slot holds no UCX
 * request in flight (the operation completed when posted, or already). */
static int gpucx__request_info(void *req, char *out, size_t outlen)
{
    ucp_request_attr_t attr;

    if (req == NULL || UCS_PTR_IS_ERR(req) || outlen == 0) {
        return -1;
    }
    memset(&attr, 0, sizeof(attr));
    attr.field_mask        = UCP_REQUEST_ATTR_FIELD_INFO_STRING |
                             UCP_REQUEST_ATTR_FIELD_INFO_STRING_SIZE;
    attr.debug_string      = out;
    attr.debug_string_size = outlen;
    out[0] = '\0';
    if (ucp_request_query(req, &attr) != UCS_OK) {
        return -1;
    }
    out[outlen - 1] = '\0';
    return 0;
}

static int gpucx_slot_proto_info(gpucx_slot_t *slot, char *out, size_t outlen)
{
    if (slot->status != UCS_INPROGRESS) {
        return -1; /* its request, if any, is freed */
    }
    return gpucx__request_info(slot->req, out, outlen);
}

/* A put (get=0) or get (get=1) like gpucx_put/gpucx_get, posted with
 * UCP_OP_ATTR_FLAG_NO_IMM_CMPL so that UCX hands back a request even for
 * an operation it could finish at once; its info string (the protocol UCX
 * selected for this length and these memory types) goes into out ("" when
 * UCX gave none).  The slot completes like any other. */
static ucs_status_t gpucx_rma_probe(ucp_ep_h ep, int get, void *buf,
                                    size_t len, uint64_t raddr,
                                    ucp_rkey_h rkey, int memory_type,
                                    gpucx_slot_t *slot, char *out,
                                    size_t outlen)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    gpucx__param_init(&p, slot, memory_type);
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.send       = gpucx__send_cb;
    r = get ? ucp_get_nbx(ep, buf, len, raddr, rkey, &p)
            : ucp_put_nbx(ep, buf, len, raddr, rkey, &p);
    if (gpucx__request_info(r, out, outlen) != 0 && outlen > 0) {
        out[0] = '\0';
    }
    return gpucx__posted(slot, r);
}
