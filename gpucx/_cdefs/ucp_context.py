"""ucp/api/ucp.h: configuration and context."""

INCLUDES = """
#include <ucp/api/ucp.h>
"""

TYPES = """
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_config ucp_config_t;

static const uint64_t UCP_FEATURE_TAG;
static const uint64_t UCP_FEATURE_RMA;
static const uint64_t UCP_FEATURE_AMO32;
static const uint64_t UCP_FEATURE_AMO64;
static const uint64_t UCP_FEATURE_WAKEUP;
static const uint64_t UCP_FEATURE_STREAM;
static const uint64_t UCP_FEATURE_AM;
"""

FUNCTIONS = """
void ucp_get_version(unsigned *major_version, unsigned *minor_version,
                     unsigned *release_number);
ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name,
                               const char *value);
void ucp_config_release(ucp_config_t *config);
void ucp_cleanup(ucp_context_h context_p);
"""
