/*
 * Tag matching: send, receive, probe and the fused post-and-wait helpers of
 * the blocking API (ucp_tag_*_nbx).
 */

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
static ucs_status_t gpucx_tag_send_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                        const void *buf, size_t len,
                                        uint64_t tag, int memory_type,
                                        gpucx_slot_t *slot, uint64_t spin_ns)
{
    return gpucx__wait_posted(
        ws, slot, gpucx_tag_send(ep, buf, len, tag, memory_type, 0, slot),
        spin_ns);
}

static ucs_status_t gpucx_tag_recv_wait(gpucx_worker_state_t *ws, void *buf,
                                        size_t len, uint64_t tag, uint64_t mask,
                                        int memory_type, gpucx_slot_t *slot,
                                        uint64_t spin_ns)
{
    ucs_status_t st = gpucx_tag_recv(ws->worker, buf, len, tag, mask,
                                     memory_type, slot);

    return gpucx__wait_posted(ws, slot, st, spin_ns);
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
