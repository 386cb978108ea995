"""gpucx/_csrc/am_batch.c: prepared batches of active messages."""

TYPES = """
typedef struct gpucx_am_item {
    const void *buf;
    size_t len;
    int memory_type;
} gpucx_am_item_t;
"""

FUNCTIONS = """
ucs_status_t gpucx_am_batch_run(gpucx_worker_state_t *ws, ucp_ep_h ep, unsigned id,
                                const void *header, size_t header_length,
                                const gpucx_am_item_t *items, size_t count,
                                unsigned flags, gpucx_notify_op_t *op,
                                uint64_t spin_ns);
"""
