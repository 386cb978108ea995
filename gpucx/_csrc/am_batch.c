/*
 * gpucx C helpers: prepared batches of active messages (ep.prepare_am).
 *
 * Appended after rma.c (one translation unit): a batch completes through
 * the same counted operation as a prepared transfer (gpucx_notify_op_t,
 * without a notification).  Python checks every entry once, when the batch
 * is prepared; every run posts all of them with one call.  Messages UCX
 * sends inside the call (short and eager copies, the common case for small
 * messages) allocate no request and run no callback: completion is
 * implicit, the run's slot is done when the loop ends.
 */

/* One message of a batch: its payload (the batch's header goes with each). */
typedef struct gpucx_am_item {
    const void *buf;
    size_t      len;
    int         memory_type; /* -1: let UCX detect it */
} gpucx_am_item_t;

/* Post one active message per item, in order, on ep with id, header and
 * send flags (UCP_AM_SEND_FLAG_*), behind the one slot of op.  The slot
 * completes when every posted message did, with the first error.  A send
 * UCX refuses at once stops the loop: the items after it are not posted,
 * and the slot fails once the ones already posted completed. */
static ucs_status_t gpucx_am_batch_post(ucp_ep_h ep, unsigned id,
                                        const void *header,
                                        size_t header_length,
                                        const gpucx_am_item_t *items,
                                        size_t count, unsigned flags,
                                        gpucx_notify_op_t *op)
{
    ucp_request_param_t p;
    ucs_status_ptr_t    r;
    size_t              i;

    gpucx__notify_op_init(op, ep, NULL, 0);
    p.cb.send   = gpucx__notify_op_cb;
    p.user_data = op;
    /* The header is copied by UCX, so a pending send does not need it. */
    p.flags     = flags | UCP_AM_SEND_FLAG_COPY_HEADER;
    for (i = 0; i < count; i++) {
        const gpucx_am_item_t *it = &items[i];

        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        if (it->memory_type >= 0) {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            p.memory_type   = (ucs_memory_type_t)it->memory_type;
        }
        r = ucp_am_send_nbx(ep, id, header, header_length, it->buf, it->len,
                            &p);
        if (UCS_PTR_IS_ERR(r)) {
            op->error = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL) {
            op->pending++;
        }
    }
    return gpucx__notify_after(op, 0);
}

/* Post, then (spin_ns > 0) progress until done or spin_ns pass. */
static ucs_status_t gpucx_am_batch_run(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                       unsigned id, const void *header,
                                       size_t header_length,
                                       const gpucx_am_item_t *items,
                                       size_t count, unsigned flags,
                                       gpucx_notify_op_t *op, uint64_t spin_ns)
{
    ucs_status_t st = gpucx_am_batch_post(ep, id, header, header_length,
                                          items, count, flags, op);

    return spin_ns ? gpucx__wait_posted(ws, &op->slot, st, spin_ns)
                   : op->slot.status;
}
