/*
 * Stream API: an ordered byte stream per endpoint (ucp_stream_send_nbx /
 * ucp_stream_recv_nbx).  Receives use UCP_STREAM_RECV_FLAG_WAITALL: they
 * complete only when the whole buffer is filled.
 */

static void gpucx__stream_recv_cb(void *request, ucs_status_t status,
                                  size_t length, void *user_data)
{
    gpucx_slot_t *slot = (gpucx_slot_t *)user_data;
    (void)request;
    slot->length = length;
    slot->status = status;
}

static ucs_status_t gpucx_stream_send(ucp_ep_h ep, const void *buf, size_t len,
                                      int memory_type, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, ucp_stream_send_nbx(ep, buf, len, &p));
}

static ucs_status_t gpucx_stream_recv(ucp_ep_h ep, void *buf, size_t len,
                                      int memory_type, gpucx_slot_t *slot)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;

    gpucx__param_init(&p, slot, memory_type);
    p.cb.recv_stream = gpucx__stream_recv_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags      = UCP_STREAM_RECV_FLAG_WAITALL;
    slot->length = 0;
    r = ucp_stream_recv_nbx(ep, buf, len, &slot->length, &p);
    return gpucx__posted(slot, r);
}

static ucs_status_t gpucx_stream_send_wait(gpucx_worker_state_t *ws,
                                           ucp_ep_h ep, const void *buf,
                                           size_t len, int memory_type,
                                           gpucx_slot_t *slot, uint64_t spin_ns)
{
    return gpucx__wait_posted(
        ws, slot, gpucx_stream_send(ep, buf, len, memory_type, slot),
        spin_ns);
}

static ucs_status_t gpucx_stream_recv_wait(gpucx_worker_state_t *ws,
                                           ucp_ep_h ep, void *buf, size_t len,
                                           int memory_type, gpucx_slot_t *slot,
                                           uint64_t spin_ns)
{
    return gpucx__wait_posted(
        ws, slot, gpucx_stream_recv(ep, buf, len, memory_type, slot),
        spin_ns);
}
