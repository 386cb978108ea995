/*
 * A plain UCX tag-echo peer for gpucx's interoperability test.
 *
 * Prints its worker address (hex) on stdout, reads the peer's worker
 * address (hex) on stdin, then for each of argv[1] rounds: receives one
 * message with tag 42 (any size up to 1 MiB) and sends the same bytes back
 * with tag 43.  Peer error-handling mode, like gpucx's default.
 */
#include <ucp/api/ucp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void done_cb(void *req, ucs_status_t st, void *user)
{
    (void)req;
    *(ucs_status_t *)user = st;
}

static void recv_cb(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info,
                    void *user)
{
    (void)req;
    ((size_t *)user)[1] = info->length;
    *(ucs_status_t *)user = st;
}

static ucs_status_t wait_for(ucp_worker_h w, void *req, volatile ucs_status_t *st)
{
    if (req == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(req)) {
        return UCS_PTR_STATUS(req);
    }
    while (*st == UCS_INPROGRESS) {
        ucp_worker_progress(w);
    }
    ucp_request_free(req);
    return *st;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 1;
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                           .features = UCP_FEATURE_TAG};
    ucp_worker_params_t wparams = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                                   .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_address_t *addr;
    size_t alen, i;
    char hex[8192];
    unsigned char peer[4096];
    ucp_ep_h ep;
    static char buf[1 << 20];

    if (ucp_init(&params, NULL, &ctx) != UCS_OK ||
        ucp_worker_create(ctx, &wparams, &w) != UCS_OK ||
        ucp_worker_get_address(w, &addr, &alen) != UCS_OK) {
        return 2;
    }
    for (i = 0; i < alen; i++) {
        printf("%02x", ((unsigned char *)addr)[i]);
    }
    printf("\n");
    fflush(stdout);
    if (fgets(hex, sizeof(hex), stdin) == NULL) {
        return 3;
    }
    for (i = 0; 2 * i + 1 < strlen(hex) && hex[2 * i] != '\n'; i++) {
        sscanf(hex + 2 * i, "%2hhx", &peer[i]);
    }
    ucp_ep_params_t eparams = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (ucp_address_t *)peer,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER};
    if (ucp_ep_create(w, &eparams, &ep) != UCS_OK) {
        return 4;
    }
    for (int r = 0; r < rounds; r++) {
        size_t rstate[2] = {0, 0};
        volatile ucs_status_t sst = UCS_INPROGRESS;
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                  UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.recv = recv_cb, .user_data = rstate};
        ucp_tag_recv_info_t info;
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
        rp.recv_info.tag_info = &info;
        *(ucs_status_t *)rstate = UCS_INPROGRESS;
        void *req = ucp_tag_recv_nbx(w, buf, sizeof(buf), 42, (ucp_tag_t)-1, &rp);
        if (req == NULL) {
            rstate[1] = info.length;
        } else if (wait_for(w, req, (volatile ucs_status_t *)rstate) != UCS_OK) {
            return 5;
        }
        ucp_request_param_t sp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                  UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.send = done_cb, .user_data = (void *)&sst};
        req = ucp_tag_send_nbx(ep, buf, rstate[1], 43, &sp);
        if (wait_for(w, req, &sst) != UCS_OK) {
            return 6;
        }
    }
    /* Let the last reply reach the peer before tearing down. */
    volatile ucs_status_t fst = UCS_INPROGRESS;
    ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                              UCP_OP_ATTR_FIELD_USER_DATA,
                              .cb.send = done_cb, .user_data = (void *)&fst};
    wait_for(w, ucp_ep_flush_nbx(ep, &fp), &fst);
    printf("done\n");
    fflush(stdout);
    if (fgets(hex, sizeof(hex), stdin) == NULL) { /* wait for "bye" */
    }
    ucp_worker_release_address(w, addr);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    return 0;
}
