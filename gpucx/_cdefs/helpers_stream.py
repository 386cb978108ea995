"""gpucx/_csrc/stream.c: stream send/receive helpers."""

TYPES = ""

FUNCTIONS = """
ucs_status_t gpucx_stream_send(ucp_ep_h ep, const void *buf, size_t len,
                               int memory_type, gpucx_slot_t *slot);
ucs_status_t gpucx_stream_recv(ucp_ep_h ep, void *buf, size_t len,
                               int memory_type, gpucx_slot_t *slot);
ucs_status_t gpucx_stream_send_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                    const void *buf, size_t len,
                                    int memory_type, gpucx_slot_t *slot,
                                    uint64_t spin_ns);
ucs_status_t gpucx_stream_recv_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                    void *buf, size_t len, int memory_type,
                                    gpucx_slot_t *slot, uint64_t spin_ns);
"""
