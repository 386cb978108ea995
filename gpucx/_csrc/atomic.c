/*
 * gpucx C helpers: remote atomics (ucp_atomic_op_nbx) on 4- and 8-byte
 * words.  The operand and the reply buffer live in a gpucx_amo_t next to
 * the slot, so both stay valid until UCX completes the operation even if
 * the blocking caller stops waiting.
 */

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
} gpucx_amo_t;

static const int GPUCX_AMO_ADD   = UCP_ATOMIC_OP_ADD;
static const int GPUCX_AMO_SWAP  = UCP_ATOMIC_OP_SWAP;
static const int GPUCX_AMO_CSWAP = UCP_ATOMIC_OP_CSWAP;
static const int GPUCX_AMO_AND   = UCP_ATOMIC_OP_AND;
static const int GPUCX_AMO_OR    = UCP_ATOMIC_OP_OR;
static const int GPUCX_AMO_XOR   = UCP_ATOMIC_OP_XOR;

/* Post one atomic.  fetch: return the old value through the reply buffer.
 * For compare-and-swap, operand is the expected value and swap the new one
 * (UCX reads the new value from the reply buffer and writes the old one
 * there). */
static ucs_status_t gpucx_atomic(ucp_ep_h ep, int opcode, int fetch,
                                 uint64_t operand, uint64_t swap,
                                 size_t nbytes, uint64_t raddr,
                                 ucp_rkey_h rkey, gpucx_amo_t *amo)
{
    ucp_request_param_t p;

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

static ucs_status_t gpucx_atomic_wait(ucp_worker_h worker, ucp_ep_h ep,
                                      int opcode, int fetch, uint64_t operand,
                                      uint64_t swap, size_t nbytes,
                                      uint64_t raddr, ucp_rkey_h rkey,
                                      gpucx_amo_t *amo, uint64_t spin_ns)
{
    if (gpucx_atomic(ep, opcode, fetch, operand, swap, nbytes, raddr, rkey,
                     amo) != UCS_INPROGRESS) {
        return amo->slot.status;
    }
    return gpucx_wait(worker, &amo->slot, spin_ns);
}

static uint64_t gpucx_amo_result(const gpucx_amo_t *amo, size_t nbytes)
{
    return nbytes == 4 ? (uint64_t)amo->reply.u32 : amo->reply.u64;
}
