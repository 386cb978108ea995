"""gpucx/_csrc/rma.c: regions, remote keys, RMA (atomics: helpers_atomic.py)."""

TYPES = """
typedef struct gpucx_notify_op {
    gpucx_slot_t slot;
    ...;
} gpucx_notify_op_t;

typedef struct gpucx_xfer_item {
    void *buf;
    size_t len;
    uint64_t raddr;
    ucp_rkey_h rkey;
    int memory_type;
} gpucx_xfer_item_t;

typedef struct gpucx_notice {
    ucp_ep_h ep;
    size_t length;
    char data[];
    ...;
} gpucx_notice_t;

typedef struct gpucx_notify_q {
    gpucx_qstat_t stat;
    ...;
} gpucx_notify_q_t;

static const unsigned GPUCX_NOTIFY_ID;
static const unsigned GPUCX_NOTIFY_MAX_LEN;
"""

FUNCTIONS = """
ucs_status_t gpucx_mem_map(ucp_context_h ctx, void *address, size_t length,
                           int memory_type, int allocate, int readonly,
                           ucp_mem_h *memh,
                           uint64_t *addr_out, size_t *len_out,
                           int *memtype_out);
ucs_status_t gpucx_mem_unmap(ucp_context_h ctx, ucp_mem_h memh);
ucs_status_t gpucx_rkey_pack(ucp_context_h ctx, ucp_mem_h memh, void **out,
                             size_t *len);
ucs_status_t gpucx_rkey_unpack(ucp_ep_h ep, const void *blob, ucp_rkey_h *rkey);
void gpucx_rkey_destroy(ucp_rkey_h rkey);

ucs_status_t gpucx_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr,
                       ucp_rkey_h rkey, int memory_type, gpucx_slot_t *slot);
ucs_status_t gpucx_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr,
                       ucp_rkey_h rkey, int memory_type, gpucx_slot_t *slot);
ucs_status_t gpucx_put_wait(gpucx_worker_state_t *ws, ucp_ep_h ep, const void *buf,
                            size_t len, uint64_t raddr, ucp_rkey_h rkey,
                            int memory_type, gpucx_slot_t *slot,
                            uint64_t spin_ns);
ucs_status_t gpucx_get_wait(gpucx_worker_state_t *ws, ucp_ep_h ep, void *buf,
                            size_t len, uint64_t raddr, ucp_rkey_h rkey,
                            int memory_type, gpucx_slot_t *slot,
                            uint64_t spin_ns);
ucs_status_t gpucx_put_notify(ucp_ep_h ep, const void *buf, size_t len,
                              uint64_t raddr, ucp_rkey_h rkey, int memory_type,
                              const void *notify, size_t notify_len,
                              gpucx_notify_op_t *op);
ucs_status_t gpucx_xfer_run(gpucx_worker_state_t *ws, ucp_ep_h ep, int is_get,
                            const gpucx_xfer_item_t *items, size_t count,
                            int do_notify, const void *notify,
                            size_t notify_len, gpucx_notify_op_t *op,
                            uint64_t spin_ns);

ucs_status_t gpucx_notify_init(ucp_worker_h worker, gpucx_notify_q_t *q);
gpucx_notice_t *gpucx_notify_pop(gpucx_notify_q_t *q);
void gpucx_notify_clear(gpucx_notify_q_t *q);
void gpucx_notify_setup(gpucx_notify_q_t *q, size_t max_count, size_t max_bytes,
                        uint64_t *drops);
void gpucx_notify_stats(gpucx_notify_q_t *q, gpucx_qstat_t *out);
size_t gpucx_notify_wait(ucp_worker_h worker, gpucx_notify_q_t *q,
                         uint64_t spin_ns);
"""
