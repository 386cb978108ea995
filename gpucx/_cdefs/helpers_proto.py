"""gpucx/_csrc/proto.c: UCX's protocol reports (ucp_ep_print_info,
ucp_worker_print_info, ucp_request_query's info string)."""

TYPES = ""

FUNCTIONS = """
char *gpucx_ep_info(ucp_ep_h ep, size_t *len);
char *gpucx_worker_info(ucp_worker_h worker, size_t *len);
int gpucx_slot_proto_info(gpucx_slot_t *slot, char *out, size_t outlen);
ucs_status_t gpucx_rma_probe(ucp_ep_h ep, int get, void *buf, size_t len,
                             uint64_t raddr, ucp_rkey_h rkey, int memory_type,
                             gpucx_slot_t *slot, char *out, size_t outlen);
"""
