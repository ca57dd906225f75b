/* TEST DOUBLE of libcupti's activity API (built as a shared library and named to the CUPTI
 * injection by GPUPROF_CUPTI_LIBRARY): the functions bpf/fastpath/gpuprof_cupti.c calls, with
 * CUPTI's semantics as documented (the tool hands out buffers, CUPTI fills them with activity
 * records and gives them back complete; no buffer = records dropped and counted), and a "driver"
 * entry point, gp_double_kernel(), that the CUDA driver double (cuda_driver_double.c) calls for
 * each kernel that "ran". Not CUPTI, no GPU: the kernels' times are the caller's.
 * GP_DOUBLE_NO_TIMESTAMP_CALLBACK=1: behave as a CUPTI without cuptiActivityRegisterTimestampCallback
 * (records on CLOCK_REALTIME). GP_DOUBLE_HOLD_BUFFERS=1: give no buffer back until the flush (a tool
 * whose buffers run out).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../bpf/fastpath/cupti_abi.h"

#define API __attribute__((visibility("default")))
#define RECORD_BYTES 160 /* a CUpti_ActivityKernel-sized slot; the tool reads only the prefix */

static gp_CUpti_CallbackFunc subscriber;
static uint32_t callbacks_on[2][1024]; /* [domain-1][cbid] enabled */
static gp_BufferRequested requested;
static gp_BufferCompleted completed;
static gp_TimestampCallback ts_callback;
static int enabled;
static uint8_t *cur;
static size_t cur_size, cur_used;
static size_t dropped;
static uint8_t *held[4096];
static int n_held;

API gp_CUptiResult cuptiActivityRegisterCallbacks(gp_BufferRequested req, gp_BufferCompleted comp)
{
    requested = req;
    completed = comp;
    return 0;
}

API gp_CUptiResult cuptiActivityRegisterTimestampCallback(gp_TimestampCallback cb)
{
    const char *no = getenv("GP_DOUBLE_NO_TIMESTAMP_CALLBACK");
    if (no && *no == '1')
        return 38; /* CUPTI_ERROR_NOT_SUPPORTED, as an older CUPTI would have no such call */
    ts_callback = cb;
    return 0;
}

API gp_CUptiResult cuptiSubscribe(void **sub, gp_CUpti_CallbackFunc cb, void *userdata)
{
    if (subscriber)
        return 39; /* CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED */
    subscriber = cb;
    *sub = (void *)&subscriber;
    return 0;
}

API gp_CUptiResult cuptiEnableCallback(uint32_t enable, void *sub, uint32_t domain, uint32_t cbid)
{
    if (domain < 1 || domain > 2 || cbid >= 1024)
        return 1;
    callbacks_on[domain - 1][cbid] = enable;
    return 0;
}

/* The driver double's launch call: CUPTI's callback at its entry and exit, if enabled. */
API void gp_double_launch(uint32_t domain, uint32_t cbid, uint32_t correlation, const char *function)
{
    if (!subscriber || domain < 1 || domain > 2 || cbid >= 1024 || !callbacks_on[domain - 1][cbid])
        return;
    gp_CUpti_CallbackData d = {0};
    d.functionName = function;
    d.correlationId = correlation;
    d.callbackSite = 0;
    subscriber(NULL, domain, cbid, &d);
    d.callbackSite = 1;
    subscriber(NULL, domain, cbid, &d);
}

API gp_CUptiResult cuptiActivityEnable(uint32_t kind)
{
    if (kind == GP_CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
        enabled = 1;
    return 0;
}

API gp_CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record)
{
    uint8_t *next = *record ? (uint8_t *)*record + RECORD_BYTES : buffer;
    if (next + RECORD_BYTES > buffer + valid) {
        *record = NULL;
        return 12; /* CUPTI_ERROR_MAX_LIMIT_REACHED: no more records */
    }
    *record = next;
    return 0;
}

API gp_CUptiResult cuptiActivityGetNumDroppedRecords(void *context, uint32_t stream, size_t *out)
{
    *out = dropped;
    dropped = 0;
    return 0;
}

static void deliver(void)
{
    if (!cur)
        return;
    const char *hold = getenv("GP_DOUBLE_HOLD_BUFFERS");
    if (hold && *hold == '1' && n_held < 4096) {
        held[n_held++] = cur;
        held[n_held++] = (uint8_t *)(uintptr_t)cur_used;
    } else {
        completed(NULL, 0, cur, cur_size, cur_used);
    }
    cur = NULL;
}

API gp_CUptiResult cuptiActivityFlushAll(uint32_t flag)
{
    deliver();
    for (int i = 0; i + 1 < n_held; i += 2)
        completed(NULL, 0, held[i], RECORD_BYTES, (size_t)(uintptr_t)held[i + 1]);
    n_held = 0;
    if (dropped)
        completed(NULL, 0, NULL, 0, 0); /* CUPTI reports drops with the next delivery */
    return 0;
}

static uint64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A kernel ran from start_mono to end_mono (CLOCK_MONOTONIC ns): its activity record. */
API void gp_double_kernel(const char *name, uint32_t correlation, uint32_t stream, int grid, int block,
                          uint64_t start_mono, uint64_t end_mono)
{
    if (!enabled)
        return;
    if (cur && cur_used + RECORD_BYTES > cur_size)
        deliver();
    if (!cur) {
        size_t max = 0;
        requested(&cur, &cur_size, &max);
        cur_used = 0;
        if (!cur || cur_size < RECORD_BYTES) {
            cur = NULL;
            dropped++;
            return;
        }
    }
    gp_CUpti_ActivityKernelPrefix *k = (gp_CUpti_ActivityKernelPrefix *)(cur + cur_used);
    memset(k, 0, RECORD_BYTES);
    k->kind = GP_CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    /* CUPTI converts GPU times with the tool's clock when it has one, else gives CLOCK_REALTIME */
    int64_t shift = ts_callback ? (int64_t)ts_callback() - (int64_t)clock_ns(CLOCK_MONOTONIC)
                                : (int64_t)clock_ns(CLOCK_REALTIME) - (int64_t)clock_ns(CLOCK_MONOTONIC);
    k->start = start_mono + (uint64_t)shift;
    k->end = end_mono + (uint64_t)shift;
    k->deviceId = 0;
    k->streamId = stream;
    k->gridX = grid;
    k->gridY = k->gridZ = 1;
    k->blockX = block;
    k->blockY = k->blockZ = 1;
    k->registersPerThread = 32;
    k->dynamicSharedMemory = 1024;
    k->correlationId = correlation;
    k->name = name;
    cur_used += RECORD_BYTES;
}
