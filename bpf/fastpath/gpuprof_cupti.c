/* CUDA kernel times through CUPTI's activity API (libgpuprof_cupti.so; CUDA_INJECTION64_PATH=<its
 * path>, set by the TaskProlog in mode `kernels`): the CUDA driver loads it at cuInit and calls
 * InitializeInjection; it loads libcupti, enables CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL and writes
 * each kernel's start, end, device, stream, grid, block and correlation id (the id of the launch
 * call) into this process's shared-memory ring (fp_common.c); names go once per process as
 * string records. docs/probes.md, "CUDA kernel times (CUPTI)".
 *
 * Bounded: CUPTI fills buffers this library hands out from a fixed pool (BUFFERS x BUFFER_BYTES,
 * mapped once at init); when none is free CUPTI is given none and drops the records itself, which
 * cuptiActivityGetNumDroppedRecords counts and this library adds to the ring's drop counter, as it
 * does for records the ring could not take. Times: CLOCK_MONOTONIC through CUPTI's timestamp
 * callback (CUDA 11.6+); a CUPTI without it gives CLOCK_REALTIME, converted with the offset of the
 * two clocks read when the buffer is delivered (flag GP_CUDA_F_REALTIME_CONVERTED).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cupti_abi.h"
#include "fp_common.h"
#include "fp_resolve.h"

typedef int64_t s64;

#define BUFFERS 16
#define BUFFER_BYTES (512 * 1024) /* CUPTI's own default is 8 MiB; ~3000 kernel records each */
#define NAMES 8192                /* distinct kernel names of a process */

static u8 *pool;                /* BUFFERS x BUFFER_BYTES */
static u32 in_use[BUFFERS];     /* 1 while CUPTI holds it */
static int monotonic_clock;     /* CUPTI calls our timestamp callback */
static struct {
    const char *ptr; /* CUPTI's name pointers are stable for the process's life */
    u32 id;
} names[NAMES];
static u32 next_name_id = 1;
static gp_cuptiActivityGetNextRecord_t next_record;
static gp_cuptiActivityGetNumDroppedRecords_t dropped_records;
static gp_cuptiActivityFlushAll_t flush_all;

static u64 realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (u64)ts.tv_sec * 1000000000ULL + (u64)ts.tv_nsec;
}

static uint64_t timestamp(void)
{
    return gp_now();
}

static void buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    *buffer = NULL;
    *size = 0;
    *max_records = 0;
    for (u32 i = 0; i < BUFFERS; i++) {
        u32 zero = 0;
        if (__atomic_compare_exchange_n(&in_use[i], &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *buffer = pool + (size_t)i * BUFFER_BYTES;
            *size = BUFFER_BYTES;
            return;
        }
    }
    /* none free (the process makes kernels faster than CUPTI delivers): CUPTI drops and counts */
}

static void send_name(u32 id, const char *s)
{
    size_t n = strnlen(s, GP_NVTX_STRING_MAX + 1);
    int truncated = n > GP_NVTX_STRING_MAX;
    gp_send_string(GP_REC_CUDA_NAME, id, s, truncated ? GP_NVTX_STRING_MAX : n, truncated);
}

/* Called on CUPTI's delivery thread only: no lock needed for the name table. */
static u32 name_id(const char *s)
{
    if (!s)
        return 0;
    u64 h = (u64)(uintptr_t)s * 0x9E3779B97F4A7C15ULL;
    for (u32 i = 0; i < 64; i++) {
        u32 slot = (u32)((h >> 32) + i) & (NAMES - 1);
        if (names[slot].ptr == s)
            return names[slot].id;
        if (!names[slot].ptr) {
            names[slot].ptr = s;
            names[slot].id = next_name_id++;
            send_name(names[slot].id, s);
            return names[slot].id;
        }
    }
    gp_count_drop();
    return 0;
}

static void buffer_completed(void *context, uint32_t stream, uint8_t *buffer, size_t size, size_t valid)
{
    s64 rt_offset = monotonic_clock ? 0 : (s64)(realtime_ns() - gp_now());
    void *rec = NULL;
    while (buffer && next_record(buffer, valid, &rec) == GP_CUPTI_SUCCESS && rec) {
        const gp_CUpti_ActivityKernelPrefix *k = rec;
        if (k->kind != GP_CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && k->kind != GP_CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        u64 pos;
        u32 nid = name_id(k->name); /* before the claim: its parts go first */
        struct gp_record *r = gp_claim(GP_REC_CUDA_KERNEL, &pos);
        if (!r)
            continue;
        struct gp_cuda_kernel *g = &r->u.cuda_kernel;
        g->t_start_ns = k->start - (u64)rt_offset;
        g->t_end_ns = k->end - (u64)rt_offset;
        g->correlation_id = k->correlationId;
        g->device = k->deviceId;
        g->stream = k->streamId;
        g->name_id = nid;
        g->grid[0] = k->gridX;
        g->grid[1] = k->gridY;
        g->grid[2] = k->gridZ;
        g->block[0] = k->blockX;
        g->block[1] = k->blockY;
        g->block[2] = k->blockZ;
        g->dynamic_shared = k->dynamicSharedMemory;
        g->static_shared = k->staticSharedMemory;
        g->registers = k->registersPerThread;
        g->flags = monotonic_clock ? 0 : GP_CUDA_F_REALTIME_CONVERTED;
        g->pad = 0;
        gp_publish(r, pos);
    }
    size_t lost = 0;
    if (dropped_records && dropped_records(context, stream, &lost) == GP_CUPTI_SUCCESS)
        gp_count_drops(lost);
    if (buffer >= pool && buffer < pool + (size_t)BUFFERS * BUFFER_BYTES)
        __atomic_store_n(&in_use[(size_t)(buffer - pool) / BUFFER_BYTES], 0, __ATOMIC_RELEASE);
}

/* A launch call's entry: its correlation id and thread, to find its CPU stack (the uprobe of the
 * same call in /kernels/launches, same thread, microseconds apart) and its kernel. */
static void on_launch(void *userdata, uint32_t domain, uint32_t cbid, const void *cbdata)
{
    const gp_CUpti_CallbackData *d = cbdata;
    if (!d || d->callbackSite != GP_CUPTI_API_ENTER)
        return;
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_CUDA_LAUNCH, &pos);
    if (!r)
        return;
    struct gp_cuda_launch *l = &r->u.cuda_launch;
    l->t_ns = gp_now();
    l->tid = gp_tid();
    l->correlation_id = d->correlationId;
    l->cbid = cbid;
    l->domain = (u8)domain;
    memset(l->pad, 0, sizeof(l->pad));
    gp_publish(r, pos);
}

/* CUPTI's callback ids of the kernel launch calls (cupti_driver_cbid.h, cupti_runtime_cbid.h). */
static const u32 driver_launches[] = {307 /* cuLaunchKernel */, 442 /* _ptsz */, 477 /* cuLaunchCooperativeKernel */,
                                      478, 652 /* cuLaunchKernelEx */, 653};
static const u32 runtime_launches[] = {211 /* cudaLaunchKernel_v7000 */, 214 /* _ptsz */,
                                       269 /* cudaLaunchCooperativeKernel */, 430 /* cudaLaunchKernelExC */, 431,
                                       505 /* __cudaLaunchKernel_v13000 */, 506};

static void subscribe_launches(void *lib)
{
    gp_cuptiSubscribe_t subscribe = (gp_cuptiSubscribe_t)dlsym(lib, "cuptiSubscribe");
    gp_cuptiEnableCallback_t enable = (gp_cuptiEnableCallback_t)dlsym(lib, "cuptiEnableCallback");
    void *sub = NULL;
    /* one subscriber per process in CUPTI: another tool's (or a failure) leaves kernels without
     * their launch rows, not without their times */
    if (!subscribe || !enable || subscribe(&sub, on_launch, NULL) != GP_CUPTI_SUCCESS)
        return;
    for (unsigned i = 0; i < sizeof(driver_launches) / sizeof(driver_launches[0]); i++)
        enable(1, sub, GP_CUPTI_CB_DOMAIN_DRIVER_API, driver_launches[i]);
    for (unsigned i = 0; i < sizeof(runtime_launches) / sizeof(runtime_launches[0]); i++)
        enable(1, sub, GP_CUPTI_CB_DOMAIN_RUNTIME_API, runtime_launches[i]);
}

/* Kernels still in CUPTI's buffers when the process exits. */
static void flush_at_exit(void)
{
    if (flush_all)
        flush_all(GP_CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

static void *open_cupti(void)
{
    const char *explicit_path = getenv("GPUPROF_CUPTI_LIBRARY");
    if (explicit_path && *explicit_path)
        return dlopen(explicit_path, RTLD_NOW | RTLD_LOCAL);
    static const char *candidates[] = {"libcupti.so", "libcupti.so.13", "libcupti.so.12", "libcupti.so.11.8"};
    for (unsigned i = 0; i < sizeof(candidates) / sizeof(candidates[0]); i++) {
        void *h = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
    }
    return NULL;
}

/* The CUDA driver's injection entry point: 1 = loaded. Declining (0) leaves CUDA as it was. */
GP_EXPORT int InitializeInjection(void)
{
    const char *dir = getenv("GPUPROF_FASTPATH_DIR");
    if (!dir || !*dir)
        return 0; /* not a profiled job step */
    void *lib = open_cupti();
    if (!lib)
        return 0;
    gp_cuptiActivityRegisterCallbacks_t reg = (gp_cuptiActivityRegisterCallbacks_t)dlsym(lib, "cuptiActivityRegisterCallbacks");
    gp_cuptiActivityRegisterTimestampCallback_t reg_ts =
        (gp_cuptiActivityRegisterTimestampCallback_t)dlsym(lib, "cuptiActivityRegisterTimestampCallback");
    gp_cuptiActivityEnable_t enable = (gp_cuptiActivityEnable_t)dlsym(lib, "cuptiActivityEnable");
    next_record = (gp_cuptiActivityGetNextRecord_t)dlsym(lib, "cuptiActivityGetNextRecord");
    dropped_records = (gp_cuptiActivityGetNumDroppedRecords_t)dlsym(lib, "cuptiActivityGetNumDroppedRecords");
    flush_all = (gp_cuptiActivityFlushAll_t)dlsym(lib, "cuptiActivityFlushAll");
    if (!reg || !enable || !next_record)
        return 0;
    void *p = mmap(NULL, (size_t)BUFFERS * BUFFER_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return 0;
    pool = p;
    /* before any kind is enabled, so that every record is on this clock */
    monotonic_clock = reg_ts && reg_ts(timestamp) == GP_CUPTI_SUCCESS;
    if (reg(buffer_requested, buffer_completed) != GP_CUPTI_SUCCESS ||
        enable(GP_CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != GP_CUPTI_SUCCESS)
        return 0;
    subscribe_launches(lib);
    atexit(flush_at_exit);
    return 1;
}
