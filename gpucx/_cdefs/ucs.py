"""ucs/type/status.h, ucs/memory/memory_type.h, ucs/type/thread_mode.h."""

INCLUDES = """
#include <ucs/type/status.h>
#include <ucs/memory/memory_type.h>
#include <ucs/type/thread_mode.h>
"""

TYPES = """
typedef int... ucs_status_t;
typedef void *ucs_status_ptr_t;

static const int UCS_OK;
static const int UCS_INPROGRESS;
static const int UCS_ERR_IO_ERROR;
static const int UCS_ERR_NO_MEMORY;
static const int UCS_ERR_SHMEM_SEGMENT;
static const int UCS_ERR_INVALID_PARAM;
static const int UCS_ERR_UNREACHABLE;
static const int UCS_ERR_INVALID_ADDR;
static const int UCS_ERR_NOT_IMPLEMENTED;
static const int UCS_ERR_MESSAGE_TRUNCATED;
static const int UCS_ERR_NO_ELEM;
static const int UCS_ERR_BUSY;
static const int UCS_ERR_CANCELED;
static const int UCS_ERR_OUT_OF_RANGE;
static const int UCS_ERR_TIMED_OUT;
static const int UCS_ERR_UNSUPPORTED;
static const int UCS_ERR_REJECTED;
static const int UCS_ERR_NOT_CONNECTED;
static const int UCS_ERR_CONNECTION_RESET;
static const int UCS_ERR_FIRST_LINK_FAILURE;
static const int UCS_ERR_LAST_LINK_FAILURE;
static const int UCS_ERR_FIRST_ENDPOINT_FAILURE;
static const int UCS_ERR_ENDPOINT_TIMEOUT;
static const int UCS_ERR_LAST_ENDPOINT_FAILURE;

static const int UCS_MEMORY_TYPE_HOST;
static const int UCS_MEMORY_TYPE_CUDA;
static const int UCS_MEMORY_TYPE_CUDA_MANAGED;
static const int UCS_MEMORY_TYPE_ROCM;
static const int UCS_MEMORY_TYPE_ROCM_MANAGED;
static const int UCS_MEMORY_TYPE_RDMA;
static const int UCS_MEMORY_TYPE_ZE_HOST;
static const int UCS_MEMORY_TYPE_ZE_DEVICE;
static const int UCS_MEMORY_TYPE_ZE_MANAGED;
static const int UCS_MEMORY_TYPE_UNKNOWN;

static const int UCS_THREAD_MODE_SINGLE;
static const int UCS_THREAD_MODE_SERIALIZED;
static const int UCS_THREAD_MODE_MULTI;
"""

FUNCTIONS = """
const char *ucs_status_string(ucs_status_t status);
"""
