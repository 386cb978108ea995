"""gpucx/_ucx_helpers.c: records shared with Python and the gpucx_* helpers."""

INCLUDES = ""

TYPES = """
typedef struct gpucx_slot {
    ucs_status_t status;
    int kind;
    void *req;
    ucp_tag_recv_info_t info;
    uint64_t tag;
    size_t length;
    uint64_t value;
    ...;
} gpucx_slot_t;

typedef struct gpucx_worker_state gpucx_worker_state_t;

typedef struct gpucx_ep_state {
    ucs_status_t error;
    ucp_ep_h ep;
    ...;
} gpucx_ep_state_t;

struct gpucx_worker_state {
    ucp_worker_h worker;
    int efd;
    ...;
};

typedef struct gpucx_listener_state {
    ucp_listener_h listener;
    unsigned head;
    unsigned tail;
    ...;
} gpucx_listener_state_t;

typedef struct gpucx_qstat {
    size_t count;
    size_t bytes;
    size_t max_count;
    size_t max_bytes;
    uint64_t dropped;
    uint64_t dropped_bytes;
} gpucx_qstat_t;

"""

FUNCTIONS = """
const char *gpucx_status_name(ucs_status_t st);
const char *gpucx_package_version(void);
const char *gpucx_build_ucx_prefix(void);

ucs_status_t gpucx_slot_release(gpucx_slot_t *slot);
ucs_status_t gpucx_slot_cancel(ucp_worker_h worker, gpucx_slot_t *slot);

ucs_status_t gpucx_config_create(ucp_config_t **out);
ucs_status_t gpucx_context_create(ucp_config_t *config, uint64_t features,
                                  const char *name, ucp_context_h *out);
uint64_t gpucx_context_memory_types(ucp_context_h ctx);

ucs_status_t gpucx_worker_create(ucp_context_h ctx, int thread_mode,
                                 int want_efd, gpucx_worker_state_t *st);
ucs_status_t gpucx_worker_address(ucp_worker_h worker, void **out, size_t *len);
void gpucx_free(void *p);
ucs_status_t gpucx_worker_flush(ucp_worker_h worker, gpucx_slot_t *slot);

ucs_status_t gpucx_ep_create_address(gpucx_worker_state_t *w,
                                     const void *address, int err_mode_peer,
                                     gpucx_ep_state_t *st);
ucs_status_t gpucx_ep_create_sockaddr(gpucx_worker_state_t *w, const char *host,
                                      uint16_t port, int err_mode_peer,
                                      gpucx_ep_state_t *st);
ucs_status_t gpucx_ep_create_conn(gpucx_worker_state_t *w,
                                  ucp_conn_request_h req, int err_mode_peer,
                                  gpucx_ep_state_t *st);
ucs_status_t gpucx_ep_close(ucp_ep_h ep, int force, gpucx_slot_t *slot);
ucs_status_t gpucx_ep_flush(ucp_ep_h ep, gpucx_slot_t *slot);
int gpucx_ep_transports(ucp_ep_h ep, const char **names, unsigned max);

ucs_status_t gpucx_listener_create(ucp_worker_h worker, const char *host,
                                   uint16_t port, gpucx_listener_state_t *ls);
int gpucx_listener_port(ucp_listener_h listener);
ucp_conn_request_h gpucx_listener_pop(gpucx_listener_state_t *ls);
void gpucx_listener_drain(gpucx_listener_state_t *ls);

ucs_status_t gpucx_tag_send(ucp_ep_h ep, const void *buf, size_t len,
                            uint64_t tag, int memory_type, int sync,
                            gpucx_slot_t *slot);
ucs_status_t gpucx_tag_send_iov(ucp_ep_h ep, const ucp_dt_iov_t *iov,
                                size_t count, uint64_t tag, int memory_type,
                                int sync, gpucx_slot_t *slot);
ucs_status_t gpucx_tag_recv(ucp_worker_h worker, void *buf, size_t len,
                            uint64_t tag, uint64_t mask, int memory_type,
                            gpucx_slot_t *slot);
ucs_status_t gpucx_tag_recv_iov(ucp_worker_h worker, ucp_dt_iov_t *iov,
                                size_t count, uint64_t tag, uint64_t mask,
                                int memory_type, gpucx_slot_t *slot);
ucs_status_t gpucx_tag_send_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                                 const void *buf, size_t len, uint64_t tag,
                                 int memory_type, gpucx_slot_t *slot,
                                 uint64_t spin_ns);
ucs_status_t gpucx_tag_recv_wait(gpucx_worker_state_t *ws, void *buf, size_t len,
                                 uint64_t tag, uint64_t mask, int memory_type,
                                 gpucx_slot_t *slot, uint64_t spin_ns);
int gpucx_tag_probe(ucp_worker_h worker, uint64_t tag, uint64_t mask,
                    int remove, ucp_tag_recv_info_t *info,
                    ucp_tag_message_h *msg);
ucs_status_t gpucx_tag_msg_recv(ucp_worker_h worker, void *buf, size_t len,
                                ucp_tag_message_h msg, int memory_type,
                                gpucx_slot_t *slot);
"""
