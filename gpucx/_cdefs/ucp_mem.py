"""ucp/api/ucp.h: memory mapping and remote keys."""

INCLUDES = ""

TYPES = """
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
"""

FUNCTIONS = """
"""
