"""ucp/api/ucp.h: workers and listeners."""

INCLUDES = ""

TYPES = """
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_listener *ucp_listener_h;
typedef struct ucp_conn_request *ucp_conn_request_h;
"""

FUNCTIONS = """
void ucp_worker_destroy(ucp_worker_h worker);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);
ucs_status_t ucp_worker_fence(ucp_worker_h worker);
void ucp_listener_destroy(ucp_listener_h listener);
"""
