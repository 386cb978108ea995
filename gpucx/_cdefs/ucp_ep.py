"""ucp/api/ucp.h: endpoints."""

INCLUDES = ""

TYPES = """
typedef struct ucp_ep *ucp_ep_h;
"""

FUNCTIONS = """
"""
