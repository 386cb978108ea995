"""gpucx/_csrc/bench.c: the timing loops behind ``gpucx bench``."""

TYPES = """
"""

FUNCTIONS = """
ucs_status_t gpucx_bench_tag_stream(ucp_worker_h worker, ucp_ep_h ep, int send,
                                    void *buf, size_t len, int mt, uint64_t tag,
                                    uint64_t ack_tag, uint64_t iters,
                                    unsigned window, uint64_t timeout_ns,
                                    gpucx_slot_t *slots, uint64_t *ack,
                                    uint64_t *elapsed_ns);
ucs_status_t gpucx_bench_tag_pingpong(ucp_worker_h worker, ucp_ep_h ep,
                                      int initiator, void *sbuf, int smt,
                                      void *rbuf, int rmt, size_t len,
                                      uint64_t tag, uint64_t iters,
                                      uint64_t timeout_ns, gpucx_slot_t *slots,
                                      uint64_t *rtt_ns,
                                      uint64_t *elapsed_ns);
ucs_status_t gpucx_bench_am_stream(ucp_worker_h worker, ucp_ep_h ep, unsigned id,
                                   void *buf, size_t len, int mt,
                                   uint64_t ack_tag, uint64_t iters,
                                   unsigned window, uint64_t timeout_ns,
                                   gpucx_slot_t *slots, uint64_t *ack,
                                   uint64_t *elapsed_ns);
ucs_status_t gpucx_bench_am_pingpong(ucp_worker_h worker, ucp_ep_h ep,
                                     gpucx_am_reg_t *reg, unsigned id,
                                     int initiator, void *sbuf, int smt,
                                     void *rbuf, int rmt, size_t len,
                                     uint64_t iters,
                                     uint64_t timeout_ns, gpucx_slot_t *slots,
                                     uint64_t *rtt_ns, uint64_t *elapsed_ns);
ucs_status_t gpucx_bench_rma_stream(ucp_worker_h worker, ucp_ep_h ep, int get,
                                    void *buf, size_t len, int mt,
                                    uint64_t remote_addr, ucp_rkey_h rkey,
                                    uint64_t iters, unsigned window,
                                    uint64_t timeout_ns, gpucx_slot_t *slots,
                                    uint64_t *elapsed_ns);
"""
