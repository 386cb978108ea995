"""gpucx/_csrc/engine.c: the progress engine's due bits, progress and waits."""

TYPES = """
static const unsigned GPUCX_DUE_AM;
static const unsigned GPUCX_DUE_NOTIFY;
static const unsigned GPUCX_DUE_DROPS;
static const unsigned GPUCX_DUE;
"""

FUNCTIONS = """
unsigned gpucx_progress(gpucx_worker_state_t *w);
unsigned gpucx_due(const gpucx_worker_state_t *w);
void gpucx_progress_watch(gpucx_worker_state_t *w, gpucx_am_state_t *am,
                          const gpucx_qstat_t *notify);
ucs_status_t gpucx_wait(ucp_worker_h worker, gpucx_slot_t *slot,
                        uint64_t spin_ns);
#define GPUCX_WAIT_DUE 3
ucs_status_t gpucx_wait_due(gpucx_worker_state_t *w, gpucx_slot_t *slot,
                            uint64_t spin_ns);
#define GPUCX_PEER_EXITED 2
int gpucx_worker_sleep(ucp_worker_h worker, int efd, int pfd, int timeout_ms);
ucs_status_t gpucx_wait_sleep(ucp_worker_h worker, int efd, int pfd,
                              gpucx_slot_t *slot, int timeout_ms);
"""
