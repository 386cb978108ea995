/* A fake libcuda for machines without a GPU (test double).
 *
 * It implements, with the CUDA driver API's C signatures, the calls
 * gpucx.mem.cuda.Driver makes, over host memory and a small in-process
 * model: two devices whose primary contexts are the handles 0xC0 and 0xC1, a
 * per-thread context stack, streams that report pending work unless a test
 * says they are idle, events that report CUDA_ERROR_NOT_READY a set
 * number of times, and a table of "device" pointers that tests fill with
 * fake_register().  It lets tests drive the real ctypes bindings (argument
 * types, pointer plumbing, error names) end to end.
 *
 * For gpucx.bench.limits it also has allocations (device and page-locked
 * memory are both malloc'd host memory; device allocations are entered in
 * the pointer table), streams, copies queued on a stream (done at once with
 * memmove), and timing events whose elapsed time a test sets.
 *
 * CUDA IPC between real processes: every cuMemAlloc allocation is a POSIX
 * shared-memory object ("/gpucxfake.<pid>.<n>", unlinked by cuMemFree), and
 * cuIpcGetMemHandle writes its name into the 64-byte handle, so that
 * cuIpcOpenMemHandle in another process maps the same bytes (entered in
 * that process's pointer table as device memory of the current context).
 * Opens and closes are counted, opens can be made to fail, and a close
 * while a recorded event has not completed is counted too (close order).
 * Calls of interest get a sequence number (stream order).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_MAP_FAILED 205
#define CUDA_ERROR_PEER_ACCESS_UNSUPPORTED 217
#define CUDA_ERROR_ALREADY_MAPPED 208
#define CUDA_ERROR_NOT_READY 600

static int initialized;
static __thread CUcontext stack[16];
static __thread int depth;  /* stack[depth - 1] is current */

#define MAX_PTRS 64
/* size: bytes of a cuMemAlloc or IPC mapping (0: fake_register'd memory);
 * shm: 1 for an allocation (its name in name), 2 for an IPC mapping. */
static struct {
    uintptr_t ptr; int dev; int managed; size_t size; int shm; char name[40];
} ptrs[MAX_PTRS];
static int nptrs;

#define MAX_EVENTS 64
static struct { int polls_left; uintptr_t stream; int recorded; int timed; int destroyed; } events[MAX_EVENTS];
static int nevents;
static int polls_per_event;
static int records;
static uintptr_t last_stream;
static int memcpys;
static int streams_idle;  /* what cuStreamQuery answers: 0 = work pending */
static int stream_queries;

static int nstreams;  /* streams made: handles 0x5000 + n */
static int streams_live;
static int allocs_live;      /* device + page-locked allocations not freed */
static int async_copies;
static size_t async_bytes;
static uintptr_t async_last_stream;
static float elapsed_ms = 1.0f;
static float slow_ms;        /* what the next slow_left elapsed times say */
static int slow_left;
static size_t alloc_limit;   /* 0: no limit; else larger requests fail */
static int ndevices = 2;     /* what cuDeviceGetCount answers (1 or 2) */
static int ptr_queries;      /* cuPointerGetAttributes calls */
static int ctx_queries;      /* cuCtxGetCurrent calls */
static int ipc_opens, ipc_closes, ipc_gets;
static int ipc_open_fail;    /* CUresult the next opens return (0: none) */
static unsigned ipc_open_flags;
static int close_pending;    /* closes while a recorded event was pending */
static int stream_waits;     /* cuStreamWaitEvent calls */
static uintptr_t wait_stream, wait_event;
static int seq, seq_wait, seq_copy, seq_record;
static int nallocs;          /* allocations made (names) */
static int host_allocs;      /* cuMemHostAlloc calls that succeeded */
static unsigned host_alloc_flags;
static int htod_copies;      /* cuMemcpyHtoDAsync calls that copied */
static size_t htod_bytes;
static uintptr_t htod_last_stream;
static int htod_fail;        /* CUresult the next copies return (0: none) */
static int seq_htod;

/* -- test controls ------------------------------------------------------ */
static void unlink_live(void);
void fake_reset(void)
{
    unlink_live();
    depth = 0;
    nptrs = 0;
    nevents = 0;
    polls_per_event = 0;
    records = 0;
    last_stream = 0;
    memcpys = 0;
    streams_idle = 0;
    stream_queries = 0;
    nstreams = 0;
    streams_live = 0;
    allocs_live = 0;
    async_copies = 0;
    async_bytes = 0;
    async_last_stream = 0;
    elapsed_ms = 1.0f;
    slow_ms = 0.0f;
    slow_left = 0;
    alloc_limit = 0;
    ndevices = 2;
    ptr_queries = 0;
    ctx_queries = 0;
    ipc_opens = ipc_closes = ipc_gets = 0;
    ipc_open_fail = 0;
    ipc_open_flags = 0;
    close_pending = 0;
    stream_waits = 0;
    wait_stream = wait_event = 0;
    seq = seq_wait = seq_copy = seq_record = 0;
    host_allocs = 0;
    host_alloc_flags = 0;
    htod_copies = 0;
    htod_bytes = 0;
    htod_last_stream = 0;
    htod_fail = 0;
    seq_htod = 0;
}
/* Shared-memory names of allocations still live: unlinked by a reset and
 * when the library is unloaded or the process exits (mappings stay). */
static void unlink_live(void)
{
    int k;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].shm == 1) {
            shm_unlink(ptrs[k].name);
            ptrs[k].shm = 3;  /* still mapped; no longer named */
        }
    }
}
__attribute__((destructor)) static void unlink_at_exit(void) { unlink_live(); }

void fake_register(uintptr_t ptr, int dev, int managed)
{
    ptrs[nptrs].ptr = ptr;
    ptrs[nptrs].dev = dev;
    ptrs[nptrs].managed = managed;
    ptrs[nptrs].size = 0;
    ptrs[nptrs].shm = 0;
    ptrs[nptrs].name[0] = 0;
    nptrs++;
}
int fake_ipc_opens(void) { return ipc_opens; }
int fake_ipc_closes(void) { return ipc_closes; }
int fake_ipc_gets(void) { return ipc_gets; }
unsigned fake_ipc_open_flags(void) { return ipc_open_flags; }
void fake_ipc_open_fail(int rc) { ipc_open_fail = rc; }
int fake_close_pending(void) { return close_pending; }
int fake_stream_waits(void) { return stream_waits; }
uintptr_t fake_wait_stream(void) { return wait_stream; }
uintptr_t fake_wait_event(void) { return wait_event; }
int fake_seq_wait(void) { return seq_wait; }
int fake_seq_copy(void) { return seq_copy; }
int fake_seq_record(void) { return seq_record; }
int fake_host_allocs(void) { return host_allocs; }
unsigned fake_host_alloc_flags(void) { return host_alloc_flags; }
int fake_htod_copies(void) { return htod_copies; }
size_t fake_htod_bytes(void) { return htod_bytes; }
uintptr_t fake_htod_last_stream(void) { return htod_last_stream; }
void fake_htod_fail(int rc) { htod_fail = rc; }
int fake_seq_htod(void) { return seq_htod; }
int fake_events_pending(void)
{
    int k, n = 0;
    for (k = 0; k < nevents; k++)
        n += events[k].recorded && !events[k].destroyed && events[k].polls_left > 0;
    return n;
}
void fake_set_polls(int n) { polls_per_event = n; }
int fake_records(void) { return records; }
uintptr_t fake_last_stream(void) { return last_stream; }
int fake_events(void) { return nevents; }
int fake_memcpys(void) { return memcpys; }
int fake_depth(void) { return depth; }
void fake_set_idle(int idle) { streams_idle = idle; }
int fake_stream_queries(void) { return stream_queries; }
void fake_set_elapsed(float ms) { elapsed_ms = ms; }
void fake_set_slow(float ms, int n) { slow_ms = ms; slow_left = n; }
void fake_set_alloc_limit(size_t n) { alloc_limit = n; }
int fake_allocs_live(void) { return allocs_live; }
void fake_set_devices(int n) { ndevices = n; }
int fake_pointer_queries(void) { return ptr_queries; }
int fake_ctx_queries(void) { return ctx_queries; }
int fake_streams_live(void) { return streams_live; }
int fake_async_copies(void) { return async_copies; }
size_t fake_async_bytes(void) { return async_bytes; }
uintptr_t fake_async_last_stream(void) { return async_last_stream; }
int fake_events_live(void)
{
    int k, n = 0;
    for (k = 0; k < nevents; k++) n += !events[k].destroyed;
    return n;
}

/* -- the driver API subset ------------------------------------------------ */
CUresult cuInit(unsigned flags) { (void)flags; initialized = 1; return CUDA_SUCCESS; }

CUresult cuDriverGetVersion(int *v) { *v = 12040; return CUDA_SUCCESS; }

CUresult cuDeviceGetCount(int *n)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *n = ndevices;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= ndevices) return CUDA_ERROR_INVALID_VALUE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    *ctx = (CUcontext)(uintptr_t)(0xC0 + d);
    return CUDA_SUCCESS;
}

/* Every primary context counts as active (the model has no other state). */
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active)
{
    if (d < 0 || d >= ndevices) return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    ctx_queries++;
    *ctx = depth ? stack[depth - 1] : NULL;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (depth == 0) depth = 1;
    stack[depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    stack[depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *out)
{
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    *out = stack[--depth];
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *d)
{
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *d = (int)((uintptr_t)stack[depth - 1] - 0xC0);
    return CUDA_SUCCESS;
}

CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p)
{
    int i, k, found = -1;

    ptr_queries++;

    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].ptr == (uintptr_t)p) found = k;
    }
    for (i = 0; i < (int)n; i++) {
        switch (attrs[i]) {
        case 1: /* CONTEXT */
            *(CUcontext *)data[i] =
                found < 0 ? NULL : (CUcontext)(uintptr_t)(0xC0 + ptrs[found].dev);
            break;
        case 2: /* MEMORY_TYPE: 2 = device */
            *(unsigned *)data[i] = found < 0 ? 0 : 2;
            break;
        case 8: /* IS_MANAGED (a bool) */
            *(unsigned char *)data[i] = found < 0 ? 0 : (unsigned char)ptrs[found].managed;
            break;
        case 9: /* DEVICE_ORDINAL */
            *(int *)data[i] = found < 0 ? -2 : ptrs[found].dev;
            break;
        default:
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream s)
{
    last_stream = (uintptr_t)s;
    stream_queries++;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    return streams_idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventCreate(CUevent *e, unsigned flags)
{
    /* CU_EVENT_DISABLE_TIMING (2) or CU_EVENT_DEFAULT (0, timed). */
    int k;
    if ((flags != 2 && flags != 0) || depth == 0) return CUDA_ERROR_INVALID_VALUE;
    for (k = 0; k < nevents; k++) {  /* a destroyed event's slot first */
        if (events[k].destroyed) {
            events[k].recorded = 0;
            events[k].timed = flags == 0;
            events[k].destroyed = 0;
            *e = (CUevent)(uintptr_t)(0x1000 + k);
            return CUDA_SUCCESS;
        }
    }
    if (nevents >= MAX_EVENTS) return CUDA_ERROR_OUT_OF_MEMORY;
    events[nevents].recorded = 0;
    events[nevents].timed = flags == 0;
    events[nevents].destroyed = 0;
    *e = (CUevent)(uintptr_t)(0x1000 + nevents);
    nevents++;
    return CUDA_SUCCESS;
}

static int event_index(CUevent e)
{
    intptr_t k = (intptr_t)(uintptr_t)e - 0x1000;
    return (k >= 0 && k < nevents && !events[k].destroyed) ? (int)k : -1;
}

CUresult cuEventRecord(CUevent e, CUstream s)
{
    int k = event_index(e);
    if (k < 0) return CUDA_ERROR_INVALID_VALUE;
    events[k].recorded = 1;
    events[k].polls_left = polls_per_event;
    events[k].stream = (uintptr_t)s;
    last_stream = (uintptr_t)s;
    records++;
    seq_record = ++seq;
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent e)
{
    int k = event_index(e);
    if (k < 0) return CUDA_ERROR_INVALID_VALUE;
    if (events[k].polls_left > 0) {
        events[k].polls_left--;
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent e)
{
    int k = event_index(e);
    if (k < 0) return CUDA_ERROR_INVALID_VALUE;
    events[k].polls_left = 0;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e)
{
    int k = event_index(e);
    if (k < 0) return CUDA_ERROR_INVALID_VALUE;
    events[k].destroyed = 1;
    return CUDA_SUCCESS;
}

/* Both events timed and recorded, as CUDA requires; the time is the one
 * the test set (fake_set_elapsed; fake_set_slow for the next few). */
CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    int a = event_index(start), b = event_index(end);
    if (a < 0 || b < 0) return CUDA_ERROR_INVALID_VALUE;
    if (!events[a].timed || !events[b].timed) return CUDA_ERROR_INVALID_HANDLE;
    if (!events[a].recorded || !events[b].recorded) return CUDA_ERROR_INVALID_HANDLE;
    if (slow_left > 0) {
        slow_left--;
        *ms = slow_ms;
    } else {
        *ms = elapsed_ms;
    }
    return CUDA_SUCCESS;
}

/* -- allocations, streams and queued copies (gpucx.bench.limits) ---------- */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    void *mem;
    char name[40];
    int fd;
    size_t len = n ? n : 1;
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if ((alloc_limit && n > alloc_limit) || nptrs >= MAX_PTRS) return CUDA_ERROR_OUT_OF_MEMORY;
    /* A shared-memory object, so that an IPC handle can name it. */
    /* pid, this library instance (tests load several copies) and count. */
    snprintf(name, sizeof name, "/gpucxfake.%d.%lx.%d", (int)getpid(),
             (unsigned long)(uintptr_t)&nallocs & 0xffffffffUL, nallocs++);
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        shm_unlink(name);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mem == MAP_FAILED) {
        shm_unlink(name);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fake_register((uintptr_t)mem, (int)((uintptr_t)stack[depth - 1] - 0xC0), 0);
    ptrs[nptrs - 1].size = len;
    ptrs[nptrs - 1].shm = 1;
    memcpy(ptrs[nptrs - 1].name, name, sizeof name);
    allocs_live++;
    *p = (CUdeviceptr)(uintptr_t)mem;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
    int k;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].ptr == (uintptr_t)p && ptrs[k].shm == 1) {
            munmap((void *)(uintptr_t)p, ptrs[k].size);
            shm_unlink(ptrs[k].name);
            ptrs[k] = ptrs[--nptrs];
            allocs_live--;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* The allocation holding p: its base and size (cuMemAlloc'd or mapped). */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    int k;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].size && ptrs[k].ptr <= (uintptr_t)p &&
            (uintptr_t)p < ptrs[k].ptr + ptrs[k].size) {
            if (base) *base = ptrs[k].ptr;
            if (size) *size = ptrs[k].size;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* -- CUDA IPC between processes (the handle names the shm object) -------- */
typedef struct { char reserved[64]; } CUipcMemHandle;
#define FAKE_IPC_MAGIC "FAKEIPC1"

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    int k;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].ptr == (uintptr_t)p && ptrs[k].shm == 1) {
            uint64_t size = ptrs[k].size;
            memset(h->reserved, 0, sizeof h->reserved);
            memcpy(h->reserved, FAKE_IPC_MAGIC, 8);
            memcpy(h->reserved + 8, &size, 8);
            memcpy(h->reserved + 16, ptrs[k].name, 40);
            ipc_gets++;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;  /* not the base of an allocation */
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags)
{
    uint64_t size;
    char name[41];
    int fd;
    void *mem;
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (ipc_open_fail) return ipc_open_fail;
    if (memcmp(h.reserved, FAKE_IPC_MAGIC, 8) != 0) return CUDA_ERROR_INVALID_VALUE;
    memcpy(&size, h.reserved + 8, 8);
    memcpy(name, h.reserved + 16, 40);
    name[40] = 0;
    if (size == 0 || nptrs >= MAX_PTRS) return CUDA_ERROR_INVALID_VALUE;
    fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;  /* gone, or never was */
    mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mem == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
    fake_register((uintptr_t)mem, (int)((uintptr_t)stack[depth - 1] - 0xC0), 0);
    ptrs[nptrs - 1].size = size;
    ptrs[nptrs - 1].shm = 2;
    ipc_opens++;
    ipc_open_flags = flags;
    *p = (CUdeviceptr)(uintptr_t)mem;
    return CUDA_SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    int k;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].ptr == (uintptr_t)p && ptrs[k].shm == 2) {
            if (fake_events_pending()) close_pending++;
            munmap((void *)(uintptr_t)p, ptrs[k].size);
            ptrs[k] = ptrs[--nptrs];
            ipc_closes++;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (flags != 0 || event_index(e) < 0) return CUDA_ERROR_INVALID_VALUE;
    stream_waits++;
    wait_stream = (uintptr_t)s;
    wait_event = (uintptr_t)e;
    seq_wait = ++seq;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void **p, size_t n)
{
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (alloc_limit && n > alloc_limit) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = malloc(n ? n : 1);
    if (*p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs_live++;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p)
{
    if (p == NULL) return CUDA_ERROR_INVALID_VALUE;
    free(p);
    allocs_live--;
    return CUDA_SUCCESS;
}

/* Page-locked host memory (malloc'd here), counted with the allocations. */
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (flags > 0xf) return CUDA_ERROR_INVALID_VALUE;
    if (alloc_limit && n > alloc_limit) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = malloc(n ? n : 1);
    if (*p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs_live++;
    host_allocs++;
    host_alloc_flags = flags;
    return CUDA_SUCCESS;
}

/* Host to "device": the destination must be device memory of the table. */
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    int k, found = 0;
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (htod_fail) return htod_fail;
    for (k = 0; k < nptrs; k++) {
        if (ptrs[k].ptr <= (uintptr_t)dst &&
            (uintptr_t)dst < ptrs[k].ptr + (ptrs[k].size ? ptrs[k].size : 1))
            found = 1;
    }
    if (!found) return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, src, n);
    htod_copies++;
    htod_bytes += n;
    htod_last_stream = (uintptr_t)s;
    seq_htod = ++seq;
    return CUDA_SUCCESS;
}

static int stream_index(CUstream s)
{
    intptr_t k = (intptr_t)(uintptr_t)s - 0x5000;
    return (k >= 0 && k < nstreams) ? (int)k : -1;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
    if (depth == 0 || stack[depth - 1] == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *s = (CUstream)(uintptr_t)(0x5000 + nstreams);
    nstreams++;
    streams_live++;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream s)
{
    if (stream_index(s) < 0) return CUDA_ERROR_INVALID_HANDLE;
    streams_live--;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s)
{
    (void)s;
    return depth == 0 ? CUDA_ERROR_INVALID_CONTEXT : CUDA_SUCCESS;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    async_copies++;
    async_bytes += n;
    async_last_stream = (uintptr_t)s;
    seq_copy = ++seq;
    return CUDA_SUCCESS;
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    memcpys++;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **name)
{
    switch (r) {
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    case CUDA_ERROR_MAP_FAILED: *name = "CUDA_ERROR_MAP_FAILED"; break;
    case CUDA_ERROR_ALREADY_MAPPED: *name = "CUDA_ERROR_ALREADY_MAPPED"; break;
    case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
        *name = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED";
        break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
