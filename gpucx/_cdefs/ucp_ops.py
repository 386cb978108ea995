"""ucp/api/ucp.h: requests, tags and datatypes."""

INCLUDES = ""

TYPES = """
typedef uint64_t ucp_tag_t;
typedef struct ucp_recv_desc *ucp_tag_message_h;

typedef struct ucp_tag_recv_info {
    ucp_tag_t sender_tag;
    size_t length;
    ...;
} ucp_tag_recv_info_t;

typedef struct ucp_dt_iov {
    void *buffer;
    size_t length;
    ...;
} ucp_dt_iov_t;
"""

FUNCTIONS = """
"""
