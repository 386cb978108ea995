"""gpucx/_csrc/am.c: the active-message queue and AM post helpers."""

TYPES = """
typedef struct gpucx_am_msg {
    unsigned id;
    int owned;
    uint64_t flags;
    void *data;
    size_t length;
    ucp_ep_h reply_ep;
    void *header;
    size_t header_length;
    int status;
    ...;
} gpucx_am_msg_t;

typedef struct gpucx_am_state {
    ucp_worker_h worker;
    unsigned head;
    unsigned tail;
    unsigned cap;
    uint64_t drops;
    uint64_t drops_seen;
    ...;
} gpucx_am_state_t;

typedef struct gpucx_am_reg {
    gpucx_am_state_t *state;
    unsigned id;
    ...;
} gpucx_am_reg_t;

typedef struct gpucx_am_pool gpucx_am_pool_t;

typedef struct gpucx_am_group {
    gpucx_slot_t slot;
    ...;
} gpucx_am_group_t;

static const unsigned GPUCX_AM_FLAG_RNDV;
static const uint64_t GPUCX_AM_FLAG_POOLED;
static const uint64_t GPUCX_AM_FLAG_FAILED;
static const unsigned GPUCX_AM_SEND_REPLY;
static const unsigned GPUCX_AM_SEND_EAGER;
static const unsigned GPUCX_AM_SEND_RNDV;
static const int GPUCX_AM_COPY_IN;
static const unsigned GPUCX_PING_AM_ID;
static const unsigned GPUCX_PONG_AM_ID;
static const size_t GPUCX_PING_TOKEN;
"""

FUNCTIONS = """
ucs_status_t gpucx_am_set_handler(gpucx_am_reg_t *reg, int install);
ucs_status_t gpucx_am_answer_pings(ucp_worker_h worker);
void gpucx_am_init(gpucx_am_state_t *st, ucp_worker_h worker,
                   const size_t *caps);
void gpucx_am_stats(gpucx_am_state_t *st, gpucx_qstat_t *kept,
                    gpucx_qstat_t *queue);
int gpucx_am_pop(gpucx_am_state_t *st, gpucx_am_msg_t *out);
void gpucx_am_release(ucp_worker_h worker, gpucx_am_msg_t *m);
void gpucx_am_release_queued(gpucx_am_state_t *st);
void gpucx_am_drain(gpucx_am_state_t *st);
size_t gpucx_am_max_header(ucp_worker_h worker);
ucs_status_t gpucx_am_send(ucp_ep_h ep, unsigned id, const void *header,
                           size_t header_length, const void *buf, size_t len,
                           int memory_type, unsigned flags, gpucx_slot_t *slot);
ucs_status_t gpucx_am_send_wait(gpucx_worker_state_t *ws, ucp_ep_h ep, unsigned id,
                                const void *header, size_t header_length,
                                const void *buf, size_t len, int memory_type,
                                unsigned flags, gpucx_slot_t *slot,
                                uint64_t spin_ns);
ucs_status_t gpucx_am_post(gpucx_am_reg_t *reg, void *buf, size_t len,
                           gpucx_slot_t *slot);
void gpucx_am_group_lengths(const gpucx_slot_t *members, size_t n, size_t *out);
ucs_status_t gpucx_am_post_mt(gpucx_am_reg_t *reg, void *buf, size_t len,
                              int mt, gpucx_slot_t *slot, gpucx_am_msg_t *out);
void gpucx_am_member_finish(gpucx_am_group_t *g, gpucx_slot_t *m,
                            ucs_status_t status, size_t length);
ucs_status_t gpucx_am_post_group(gpucx_am_reg_t *reg, gpucx_am_group_t *g,
                                 void **bufs, const size_t *lens,
                                 const int *mts, size_t nbufs,
                                 gpucx_slot_t *members, size_t n, size_t *at,
                                 gpucx_am_msg_t *out);
void gpucx_am_unpost_all(gpucx_am_reg_t *reg);
void gpucx_am_set_keep(gpucx_am_reg_t *reg, int keep);
ucs_status_t gpucx_am_recv_wait(gpucx_worker_state_t *ws, gpucx_am_reg_t *reg,
                                void *buf, size_t len, int mt,
                                gpucx_slot_t *slot, gpucx_am_msg_t *out,
                                uint64_t spin_ns);
unsigned gpucx_am_kept(gpucx_am_reg_t *reg);
gpucx_am_pool_t *gpucx_am_pool_new(gpucx_am_state_t *st, void **bufs,
                                   const size_t *lens, unsigned n);
void gpucx_am_pool_free(gpucx_am_pool_t *pool);
void gpucx_am_set_pool(gpucx_am_reg_t *reg, gpucx_am_pool_t *pool);
unsigned gpucx_am_pool_busy(gpucx_am_pool_t *pool);
void gpucx_am_pool_close(gpucx_am_pool_t *pool);
ucs_status_t gpucx_am_recv_msg(ucp_worker_h worker, gpucx_am_msg_t *m, void *buf,
                               int memory_type, gpucx_slot_t *slot);
"""
