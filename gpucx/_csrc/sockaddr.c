/* ---- endpoint socket addresses (ucp_ep_query) --------------------------- */

/* Numeric host and port of one socket address; 0, or -1 for a family other
 * than IPv4/IPv6. */
static int gpucx__sockaddr_name(const struct sockaddr_storage *ss, char *host,
                                size_t n, int *port)
{
    char      serv[16];
    socklen_t len;

    if (ss->ss_family == AF_INET) {
        len = sizeof(struct sockaddr_in);
    } else if (ss->ss_family == AF_INET6) {
        len = sizeof(struct sockaddr_in6);
    } else {
        return -1;
    }
    if (getnameinfo((const struct sockaddr *)ss, len, host, (socklen_t)n, serv,
                    sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        return -1;
    }
    *port = atoi(serv);
    return 0;
}

/* Local and remote socket address of an endpoint made by a (host, port)
 * connect or a listener: 0, or -1 when UCX does not know them (an endpoint
 * made from a worker address). */
static int gpucx_ep_sockaddrs(ucp_ep_h ep, char *local, char *remote, size_t n,
                              int *local_port, int *remote_port)
{
    ucp_ep_attr_t attr;

    attr.field_mask = UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR |
                      UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR;
    if (ucp_ep_query(ep, &attr) != UCS_OK) {
        return -1;
    }
    if (gpucx__sockaddr_name(&attr.local_sockaddr, local, n, local_port) != 0 ||
        gpucx__sockaddr_name(&attr.remote_sockaddr, remote, n, remote_port) != 0) {
        return -1;
    }
    return 0;
}
