/* What gpuprof_cupti.c uses of CUPTI's activity API, re-declared from CUPTI's documentation
 * (cupti_activity.h of CUDA 12 and 13): the functions, looked up at run time in libcupti, and the
 * leading members of the kernel activity record, which have kept their offsets from
 * CUpti_ActivityKernel4 to CUpti_ActivityKernel10 (the record's later members, which differ per
 * version, are not read; CUPTI hands out records, it never asks their size of the tool).
 */
#ifndef GPUPROF_CUPTI_ABI_H
#define GPUPROF_CUPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int gp_CUptiResult; /* 0 = CUPTI_SUCCESS */
#define GP_CUPTI_SUCCESS 0
#define GP_CUPTI_ACTIVITY_KIND_KERNEL 3
#define GP_CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL 10
#define GP_CUPTI_ACTIVITY_FLAG_FLUSH_FORCED 1

typedef struct {
    uint32_t kind;
    uint8_t cacheConfig;
    uint8_t sharedMemoryConfig;
    uint16_t registersPerThread;
    int32_t partitionedGlobalCacheRequested;
    int32_t partitionedGlobalCacheExecuted;
    uint64_t start;
    uint64_t end;
    uint64_t completed;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    int32_t gridX, gridY, gridZ;
    int32_t blockX, blockY, blockZ;
    int32_t staticSharedMemory;
    int32_t dynamicSharedMemory;
    uint32_t localMemoryPerThread;
    uint32_t localMemoryTotal;
    uint32_t correlationId;
    int64_t gridId;
    const char *name;
} gp_CUpti_ActivityKernelPrefix; /* offsets: start 16, deviceId 40, correlationId 92, name 104 */

typedef void (*gp_BufferRequested)(uint8_t **buffer, size_t *size, size_t *maxNumRecords);
typedef void (*gp_BufferCompleted)(void *context, uint32_t streamId, uint8_t *buffer, size_t size,
                                   size_t validSize);
typedef uint64_t (*gp_TimestampCallback)(void);

typedef gp_CUptiResult (*gp_cuptiActivityRegisterCallbacks_t)(gp_BufferRequested, gp_BufferCompleted);
typedef gp_CUptiResult (*gp_cuptiActivityRegisterTimestampCallback_t)(gp_TimestampCallback);
typedef gp_CUptiResult (*gp_cuptiActivityEnable_t)(uint32_t kind);
typedef gp_CUptiResult (*gp_cuptiActivityGetNextRecord_t)(uint8_t *buffer, size_t validBufferSizeBytes, void **record);
typedef gp_CUptiResult (*gp_cuptiActivityGetNumDroppedRecords_t)(void *context, uint32_t streamId, size_t *dropped);
typedef gp_CUptiResult (*gp_cuptiActivityFlushAll_t)(uint32_t flag);

/* The callback API: which launch calls enqueued which kernel. CUPTI gives the callback the same
 * correlation id as the kernel's activity record (runtime or driver API, whichever launched it). */
#define GP_CUPTI_API_ENTER 0
#define GP_CUPTI_CB_DOMAIN_DRIVER_API 1
#define GP_CUPTI_CB_DOMAIN_RUNTIME_API 2

typedef struct {
    int32_t callbackSite; /* GP_CUPTI_API_ENTER or exit */
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    void *context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} gp_CUpti_CallbackData; /* offsets: functionName 8, symbolName 32, correlationId 64 */

typedef void (*gp_CUpti_CallbackFunc)(void *userdata, uint32_t domain, uint32_t cbid, const void *cbdata);
typedef gp_CUptiResult (*gp_cuptiSubscribe_t)(void **subscriber, gp_CUpti_CallbackFunc callback, void *userdata);
typedef gp_CUptiResult (*gp_cuptiEnableCallback_t)(uint32_t enable, void *subscriber, uint32_t domain, uint32_t cbid);

#endif
