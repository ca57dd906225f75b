/* NCCL's profiler plugin interface (ncclProfiler_v1 .. v7), re-declared in C from NCCL's
 * documentation of it (plugins/profiler/README.md and the versioned profiler_vN.h of NCCL 2.23 ..
 * 2.32; v7 checked against the strings of the nvidia-nccl-cu12 2.32.3 wheel): only the layout of what NCCL passes, one struct per version. NCCL dlopens the plugin and
 * looks up the newest `ncclProfiler_vN` it knows, then older ones; the plugin exports every
 * version below (gpuprof_nccl_profiler.c), so each NCCL gets the newest both sides know.
 *
 * bool in NCCL's C++ headers is one byte, as _Bool is here; the layouts are the C ABI's.
 */
#ifndef GPUPROF_NCCL_PROFILER_ABI_H
#define GPUPROF_NCCL_PROFILER_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int ncclResult_t; /* 0 = ncclSuccess; any other value from init disables the plugin */
#define GP_NCCL_SUCCESS 0
#define GP_NCCL_INTERNAL_ERROR 3
typedef void *ncclDebugLogger_t; /* a printf-like logger; not used */

/* event types (eDescr->type) */
enum {
    ncclProfileGroup = 1 << 0,
    ncclProfileColl = 1 << 1,
    ncclProfileP2p = 1 << 2,
    ncclProfileProxyOp = 1 << 3,
    ncclProfileProxyStep = 1 << 4,
    ncclProfileProxyCtrl = 1 << 5,
    ncclProfileKernelCh = 1 << 6, /* v3 and later */
    ncclProfileNetPlugin = 1 << 7,
    ncclProfileGroupApi = 1 << 8, /* v5 and later */
    ncclProfileCollApi = 1 << 9,
    ncclProfileP2pApi = 1 << 10,
    ncclProfileKernelLaunch = 1 << 11,
    ncclProfileCeColl = 1 << 12, /* v6 */
    ncclProfileCeSync = 1 << 13,
    ncclProfileCeBatch = 1 << 14,
    ncclProfileKernelPhase = 1 << 15, /* v7: a kernel's barrier phases (not asked for here) */
};

/* event states (recordEventState), one enum for every version */
enum {
    ncclProfilerProxyStepSendGPUWait = 8,
    ncclProfilerProxyStepSendWait = 9,
    ncclProfilerProxyStepRecvWait = 10,
    ncclProfilerKernelChStop = 22, /* v4 and later: with the kernel's stop timestamp */
    ncclProfilerKernelPhaseStop = 31, /* v7 */
};

/* --- v1 (NCCL 2.23): function, datatype, algorithm and protocol as enum values ------------------- */
typedef struct {
    uint8_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            const char *name;
            uint64_t commHash;
            uint64_t seqNumber;
            uint8_t func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            uint8_t datatype;
            uint32_t op;
            size_t trafficBytes;
            uint8_t nMaxChannels;
            uint8_t nWarps;
            uint8_t algo;
            uint8_t proto;
            int isCollnet;
            int isNvls;
        } coll;
        struct {
            const char *name;
            uint64_t commHash;
            uint8_t func;
            void *buff;
            uint8_t datatype;
            size_t count;
            int peer;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
    };
} gp_ncclProfilerEventDescr_v1_t;

typedef union {
    struct {
        size_t transSize;
        int steps;
    } proxyOp;
    struct {
        int appendedProxyOps;
    } proxyCtrl;
} gp_ncclProfilerEventStateArgs_v1_t;

/* --- v2 (2.24): strings instead of enum values ------------------------------------------------- */
typedef struct {
    uint8_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            const char *name;
            uint64_t commHash;
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            size_t trafficBytes;
            uint8_t nMaxChannels;
            uint8_t nWarps;
            const char *algo;
            const char *proto;
        } coll;
        struct {
            const char *name;
            uint64_t commHash;
            const char *func;
            void *buff;
            const char *datatype;
            size_t count;
            int peer;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
    };
} gp_ncclProfilerEventDescr_v2_t;
typedef gp_ncclProfilerEventStateArgs_v1_t gp_ncclProfilerEventStateArgs_v2_t;

/* --- v3 (2.25): kernel channel events (host-observed, no GPU timestamp) -------------------------- */
typedef struct {
    uint8_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            const char *name;
            uint64_t commHash;
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            uint8_t nMaxChannels;
            uint8_t nWarps;
            const char *algo;
            const char *proto;
        } coll;
        struct {
            const char *name;
            uint64_t commHash;
            const char *func;
            void *buff;
            const char *datatype;
            size_t count;
            int peer;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
        } kernelCh;
        struct {
            int64_t id;
            void *data;
        } netPlugin;
    };
} gp_ncclProfilerEventDescr_v3_t;
typedef gp_ncclProfilerEventStateArgs_v1_t gp_ncclProfilerEventStateArgs_v3_t;

/* --- v4 (2.26): commHash and sizes in init, GPU timer (pTimer) at kernel channel start/stop ------ */
typedef struct {
    uint8_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            uint8_t nChannels;
            uint8_t nWarps;
            const char *algo;
            const char *proto;
        } coll;
        struct {
            const char *func;
            void *buff;
            const char *datatype;
            size_t count;
            int peer;
            uint8_t nChannels;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
            uint64_t pTimer;
        } kernelCh;
        struct {
            int64_t id;
            void *data;
        } netPlugin;
    };
} gp_ncclProfilerEventDescr_v4_t;

typedef union {
    struct {
        size_t transSize;
    } proxyStep;
    struct {
        int appendedProxyOps;
    } proxyCtrl;
    struct {
        void *data;
    } netPlugin;
    struct {
        uint64_t pTimer;
    } kernelCh;
} gp_ncclProfilerEventStateArgs_v4_t;

/* --- v5 (2.28): 64-bit type, API events (GroupApi, CollApi, P2pApi, KernelLaunch) ---------------- */
typedef struct {
    uint64_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            _Bool graphCaptured;
            int groupDepth;
        } groupApi;
        struct {
            const char *func;
            size_t count;
            const char *datatype;
            int root;
            void *stream;
            _Bool graphCaptured;
        } collApi;
        struct {
            const char *func;
            size_t count;
            const char *datatype;
            void *stream;
            _Bool graphCaptured;
        } p2pApi;
        struct {
            void *stream;
        } kernelLaunch;
        struct {
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            uint8_t nChannels;
            uint8_t nWarps;
            const char *algo;
            const char *proto;
            void *parentGroup;
        } coll;
        struct {
            const char *func;
            void *buff;
            const char *datatype;
            size_t count;
            int peer;
            uint8_t nChannels;
            void *parentGroup;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
            uint64_t pTimer;
        } kernelCh;
        struct {
            int64_t id;
            void *data;
        } netPlugin;
        /* v6 adds copy-engine descriptors to this union; they are larger than the others, so the
         * v6 struct below is the same with them (this plugin does not read them). */
        struct {
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            const char *syncStrategy;
            _Bool intraBatchSync;
            uint32_t batchSize;
            uint32_t numBatches;
            uint32_t ceSeqNum;
            void *stream;
        } ceColl;
    };
} gp_ncclProfilerEventDescr_v6_t;
/* v5's union is v6's without ceColl: every member read here is at the same offset in both. */
typedef gp_ncclProfilerEventDescr_v6_t gp_ncclProfilerEventDescr_v5_t;
typedef gp_ncclProfilerEventStateArgs_v4_t gp_ncclProfilerEventStateArgs_v5_t;
typedef gp_ncclProfilerEventStateArgs_v4_t gp_ncclProfilerEventStateArgs_v6_t;

/* --- v7 (2.32): a user tag appended to the API, Coll, P2p and CE descriptors, kernel phases -------- */
typedef struct {
    uint64_t type;
    void *parentObj;
    int rank;
    union {
        struct {
            _Bool graphCaptured;
            int groupDepth;
        } groupApi;
        struct {
            const char *func;
            size_t count;
            const char *datatype;
            int root;
            void *stream;
            _Bool graphCaptured;
            uint64_t userTag;
        } collApi;
        struct {
            const char *func;
            size_t count;
            const char *datatype;
            void *stream;
            _Bool graphCaptured;
            uint64_t userTag;
        } p2pApi;
        struct {
            void *stream;
        } kernelLaunch;
        struct {
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            uint8_t nChannels;
            uint8_t nWarps;
            const char *algo;
            const char *proto;
            void *parentGroup;
            const char *kernelVariant;
            _Bool isSymColl;
            uint64_t userTag; /* 0: untagged */
        } coll;
        struct {
            const char *func;
            void *buff;
            const char *datatype;
            size_t count;
            int peer;
            uint8_t nChannels;
            void *parentGroup;
            uint64_t userTag;
        } p2p;
        struct {
            pid_t pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
            uint64_t pTimer;
        } kernelCh;
        struct {
            int64_t id;
            void *data;
        } netPlugin;
        struct {
            uint64_t seqNumber;
            const char *func;
            const void *sendBuff;
            void *recvBuff;
            size_t count;
            int root;
            const char *datatype;
            const char *syncStrategy;
            _Bool intraBatchSync;
            uint32_t batchSize;
            uint32_t numBatches;
            uint32_t ceSeqNum;
            void *stream;
            uint64_t userTag;
        } ceColl;
        struct {
            _Bool isComplete;
            int nRanks;
        } ceCollSync;
        struct {
            int numOps;
            size_t totalBytes;
            _Bool useIntraSync;
        } ceCollBatch;
        struct {
            uint8_t channelId;
            uint8_t phaseId; /* 0 initial_sync, 1 compute, 2 final_sync */
            const char *phaseName;
            uint64_t pTimer;
        } kernelPhase;
    };
} gp_ncclProfilerEventDescr_v7_t;
/* v7's state arguments are v4's (a kernel phase's stop reuses kernelCh.pTimer) */
typedef gp_ncclProfilerEventStateArgs_v4_t gp_ncclProfilerEventStateArgs_v7_t;

/* The exported structs: init's signature changed in v4 and v5, the rest only in its types. */
typedef struct {
    const char *name;
    ncclResult_t (*init)(void **context, int *eActivationMask);
    ncclResult_t (*startEvent)(void *context, void **eHandle, void *eDescr);
    ncclResult_t (*stopEvent)(void *eHandle);
    ncclResult_t (*recordEventState)(void *eHandle, int eState, void *eStateArgs);
    ncclResult_t (*finalize)(void *context);
} gp_ncclProfiler_v1_t; /* also v2 and v3 */

typedef struct {
    const char *name;
    ncclResult_t (*init)(void **context, int *eActivationMask, const char *commName, uint64_t commHash, int nNodes,
                         int nranks, int rank, ncclDebugLogger_t logfn);
    ncclResult_t (*startEvent)(void *context, void **eHandle, void *eDescr);
    ncclResult_t (*stopEvent)(void *eHandle);
    ncclResult_t (*recordEventState)(void *eHandle, int eState, void *eStateArgs);
    ncclResult_t (*finalize)(void *context);
} gp_ncclProfiler_v4_t;

typedef struct {
    const char *name;
    ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName, int nNodes,
                         int nranks, int rank, ncclDebugLogger_t logfn);
    ncclResult_t (*startEvent)(void *context, void **eHandle, void *eDescr);
    ncclResult_t (*stopEvent)(void *eHandle);
    ncclResult_t (*recordEventState)(void *eHandle, int eState, void *eStateArgs);
    ncclResult_t (*finalize)(void *context);
} gp_ncclProfiler_v5_t; /* also v6 and v7 (their init is v5's) */

#endif
