/*
 * Endpoints and listeners: creation (by worker address or sockaddr), the
 * peer-error callback, close, and connection requests.
 */

/* ---- endpoints --------------------------------------------------------- */

/* The parameters every endpoint shares; st belongs to worker w. */
static void gpucx__ep_params(ucp_ep_params_t *params, int err_mode_peer,
                             gpucx_worker_state_t *w, gpucx_ep_state_t *st)
{
    memset(params, 0, sizeof(*params));
    params->field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params->err_mode   = err_mode_peer ? UCP_ERR_HANDLING_MODE_PEER
                                       : UCP_ERR_HANDLING_MODE_NONE;
    params->err_handler.cb  = gpucx__ep_err_cb;
    params->err_handler.arg = st;
    st->error               = UCS_OK;
    st->worker              = w;
}

static ucs_status_t gpucx_ep_create_address(gpucx_worker_state_t *w,
                                            const void *address,
                                            int err_mode_peer,
                                            gpucx_ep_state_t *st)
{
    ucp_ep_params_t params;

    gpucx__ep_params(&params, err_mode_peer, w, st);
    params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)address;
    return ucp_ep_create(w->worker, &params, &st->ep);
}

/* The first address of host:port (a stream socket; flags: AI_PASSIVE for
 * a listener), to free with freeaddrinfo; NULL when it does not resolve. */
static struct addrinfo *gpucx__resolve(const char *host, uint16_t port,
                                       int flags)
{
    struct addrinfo  hints, *res = NULL;
    char             service[8];

    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags    = flags;
    snprintf(service, sizeof(service), "%u", (unsigned)port);
    if (getaddrinfo(host, service, &hints, &res) != 0) {
        return NULL;
    }
    return res;
}

static ucs_status_t gpucx_ep_create_sockaddr(gpucx_worker_state_t *w,
                                             const char *host, uint16_t port,
                                             int err_mode_peer,
                                             gpucx_ep_state_t *st)
{
    ucp_ep_params_t  params;
    struct addrinfo *res;
    ucs_status_t     status;

    if ((res = gpucx__resolve(host, port, 0)) == NULL) {
        return UCS_ERR_INVALID_ADDR;
    }
    gpucx__ep_params(&params, err_mode_peer, w, st);
    params.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    params.flags           = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr   = res->ai_addr;
    params.sockaddr.addrlen = res->ai_addrlen;
    status = ucp_ep_create(w->worker, &params, &st->ep);
    freeaddrinfo(res);
    return status;
}

static ucs_status_t gpucx_ep_create_conn(gpucx_worker_state_t *w,
                                         ucp_conn_request_h req,
                                         int err_mode_peer,
                                         gpucx_ep_state_t *st)
{
    ucp_ep_params_t params;

    gpucx__ep_params(&params, err_mode_peer, w, st);
    params.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = req;
    return ucp_ep_create(w->worker, &params, &st->ep);
}

static ucs_status_t gpucx_ep_close(ucp_ep_h ep, int force, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return gpucx__posted(slot, ucp_ep_close_nbx(ep, &p));
}

static ucs_status_t gpucx_ep_flush(ucp_ep_h ep, gpucx_slot_t *slot)
{
    ucp_request_param_t p;

    gpucx__param_init(&p, slot, -1);
    p.cb.send = gpucx__send_cb;
    return gpucx__posted(slot, ucp_ep_flush_nbx(ep, &p));
}

/* Fill names[2*i], names[2*i+1] with transport and device of each lane. */
static int gpucx_ep_transports(ucp_ep_h ep, const char **names, unsigned max)
{
    ucp_ep_attr_t          attr;
    ucp_transport_entry_t  entries[64];
    unsigned               i;

    if (max > 64) {
        max = 64;
    }
    attr.field_mask                = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries        = entries;
    attr.transports.num_entries    = max;
    attr.transports.entry_size     = sizeof(ucp_transport_entry_t);
    if (ucp_ep_query(ep, &attr) != UCS_OK) {
        return -1;
    }
    for (i = 0; i < attr.transports.num_entries; i++) {
        names[2 * i]     = entries[i].transport_name;
        names[2 * i + 1] = entries[i].device_name;
    }
    return (int)attr.transports.num_entries;
}

/* ---- listener ---------------------------------------------------------- */

static ucs_status_t gpucx_listener_create(ucp_worker_h worker, const char *host,
                                          uint16_t port,
                                          gpucx_listener_state_t *ls)
{
    ucp_listener_params_t params;
    struct addrinfo      *res;
    ucs_status_t          status;

    if ((res = gpucx__resolve(host, port, AI_PASSIVE)) == NULL) {
        return UCS_ERR_INVALID_ADDR;
    }
    memset(ls, 0, sizeof(*ls));
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                        UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr      = res->ai_addr;
    params.sockaddr.addrlen   = res->ai_addrlen;
    params.conn_handler.cb    = gpucx__conn_cb;
    params.conn_handler.arg   = ls;
    status = ucp_listener_create(worker, &params, &ls->listener);
    freeaddrinfo(res);
    return status;
}

static int gpucx_listener_port(ucp_listener_h listener)
{
    ucp_listener_attr_t attr;

    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(listener, &attr) != UCS_OK) {
        return -1;
    }
    if (attr.sockaddr.ss_family == AF_INET) {
        return ntohs(((struct sockaddr_in *)&attr.sockaddr)->sin_port);
    }
    if (attr.sockaddr.ss_family == AF_INET6) {
        return ntohs(((struct sockaddr_in6 *)&attr.sockaddr)->sin6_port);
    }
    return -1;
}

static ucp_conn_request_h gpucx_listener_pop(gpucx_listener_state_t *ls)
{
    ucp_conn_request_h req;
    unsigned           head = __atomic_load_n(&ls->head, __ATOMIC_ACQUIRE);

    /* Consumers may be several Python threads (cffi drops the GIL): the
     * entry read before a successful CAS was not reused meanwhile, since
     * the producer reuses it only after head moved past it. */
    do {
        if (head == __atomic_load_n(&ls->tail, __ATOMIC_ACQUIRE)) {
            return NULL;
        }
        req = ls->q[head % GPUCX_CONNQ_CAP];
    } while (!__atomic_compare_exchange_n(&ls->head, &head, head + 1, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return req;
}

/* Reject everything still queued (listener close). */
static void gpucx_listener_drain(gpucx_listener_state_t *ls)
{
    ucp_conn_request_h req;

    while ((req = gpucx_listener_pop(ls)) != NULL) {
        ucp_listener_reject(ls->listener, req);
    }
}
