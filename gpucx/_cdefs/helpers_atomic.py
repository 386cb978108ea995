"""gpucx/_csrc/atomic.c: atomics, native or emulated over active messages."""

TYPES = """
typedef struct gpucx_amo {
    gpucx_slot_t slot;
    ...;
} gpucx_amo_t;

typedef struct gpucx_amo_exports gpucx_amo_exports_t;

static const int GPUCX_AMO_ADD;
static const int GPUCX_AMO_SWAP;
static const int GPUCX_AMO_CSWAP;
static const int GPUCX_AMO_AND;
static const int GPUCX_AMO_OR;
static const int GPUCX_AMO_XOR;
static const unsigned GPUCX_AMO_REQ_ID;
"""

FUNCTIONS = """
ucs_status_t gpucx_atomic(gpucx_worker_state_t *ws, ucp_ep_h ep, int emulate,
                          int opcode, int fetch, uint64_t operand,
                          uint64_t swap, size_t nbytes, uint64_t raddr,
                          ucp_rkey_h rkey, uint64_t base, uint64_t size,
                          gpucx_amo_t *amo);
ucs_status_t gpucx_atomic_wait(gpucx_worker_state_t *ws, ucp_ep_h ep,
                               int emulate, int opcode, int fetch,
                               uint64_t operand, uint64_t swap, size_t nbytes,
                               uint64_t raddr, ucp_rkey_h rkey, uint64_t base,
                               uint64_t size, gpucx_amo_t *amo,
                               uint64_t spin_ns);
gpucx_amo_exports_t *gpucx_amo_exports_new(int serve);
void gpucx_amo_exports_free(gpucx_amo_exports_t *x);
ucs_status_t gpucx_amo_export_add(gpucx_amo_exports_t *x, uintptr_t key,
                                  uint64_t base, uint64_t size, int host);
void gpucx_amo_export_remove(gpucx_amo_exports_t *x, uintptr_t key);
ucs_status_t gpucx_amo_worker_init(gpucx_worker_state_t *ws,
                                   gpucx_amo_exports_t *exports);
void gpucx_amo_worker_free(gpucx_worker_state_t *ws);
void gpucx_amo_ep_closed(gpucx_worker_state_t *ws, ucp_ep_h ep,
                         ucs_status_t status);
uint64_t gpucx_amo_result(const gpucx_amo_t *amo, size_t nbytes);
"""
