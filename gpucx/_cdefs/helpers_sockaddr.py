"""gpucx/_csrc/sockaddr.c: endpoint socket addresses (``ucp_ep_query``)."""

TYPES = ""

FUNCTIONS = """
int gpucx_ep_sockaddrs(ucp_ep_h ep, char *local, char *remote, size_t n,
                       int *local_port, int *remote_port);
"""
