/* The per-process shared-memory ring of the fast path: <job dir>/gpuprof-<job>-<pid>, in the
 * per-job directory /dev/shm/gpuprof-<job>@<node> the prolog makes for the job's uid (docs/probes.md).
 *
 * Producers are the application's threads (any number: a slot is claimed with one CAS on head);
 * the consumer is the collector, which reads slots in order while their seq says "written" and
 * then advances tail. A producer that finds the ring full counts a drop and returns: it never
 * waits. The collector never trusts head; it validates the header and reads seq only.
 */
#ifndef GPUPROF_RING_H
#define GPUPROF_RING_H

#include "../gpuprof_events.h"

#define GP_RING_MAGIC 0x31474e5246504750ULL /* "PGPFRNG1" little-endian */
#define GP_RING_VERSION 2 /* 2: 88-byte records (gp_fp_comm without the 128-byte uid) */
#define GP_RING_DEFAULT_RECORDS 65536 /* 5.6 MiB a process: bursts of small messages (NetPIPE: ~100k calls in a second) fit between two drains */

#define GP_REC_CALL 1
#define GP_REC_COMM 2
/* NCCL profiler plugin (gpuprof_nccl_profiler.c) and NVTX injection (gpuprof_nvtx.c): kinds added
 * to version 2 without changing the record size; a reader skips a kind it does not know. */
#define GP_REC_NCCL_OP 3
#define GP_REC_NCCL_DEV 4
#define GP_REC_NCCL_COMM 5
#define GP_REC_NVTX_RANGE 6
#define GP_REC_NVTX_STRING 7
/* CUPTI activity (gpuprof_cupti.c): kernels, and their names as strings (struct gp_nvtx_string) */
#define GP_REC_CUDA_KERNEL 8
#define GP_REC_CUDA_NAME 9
#define GP_REC_CUDA_LAUNCH 10

struct gp_ring_header {
    u64 magic;
    u32 version;
    u32 record_size;
    u64 capacity; /* records, a power of two */
    u32 pid;
    u32 header_size;
    /* $SLURMD_NODENAME of the writer: several virtual Slurm nodes can share one host and its
     * /dev/shm, and each node's collector drains only its own node's rings. */
    char node[32];
    u64 head; /* next slot to claim (producers): its own cache line */
    u64 pad1[7];
    u64 tail; /* next slot to read (collector) */
    u64 pad2[7];
    u64 dropped; /* records not written because the ring was full */
    u64 pad3[7];
};

/* gp_comm less its 128-byte ncclUniqueId copy: the interposer hashes the id itself (uid_hash),
 * which is all the collector uses, and the record shrinks from 216 to 88 bytes. The drain reads
 * every record the job writes, so its cost follows the bytes (docs/probes.md). */
struct gp_fp_comm {
    GP_COMM_FIELDS
};

/* One NCCL collective or point-to-point operation as the profiler plugin saw it on the host:
 * written at the plugin's stopEvent of the Coll/P2p event (the operation is then enqueued). */
struct gp_nccl_op {
    u64 t_start_ns; /* CLOCK_MONOTONIC at startEvent */
    u64 t_stop_ns;  /* CLOCK_MONOTONIC at stopEvent */
    u64 comm_hash;  /* NCCL's commHash: the same on every rank of the communicator */
    u64 seq;        /* collectives: per communicator 0,1,2...; p2p: per (communicator, peer, direction) */
    u64 count;      /* elements */
    u64 context;    /* the plugin's per-communicator context (the row's handle) */
    u32 tid;
    s32 peer; /* root of rooted collectives, peer of p2p, else -1 */
    s32 rank;
    s32 nranks; /* -1 when the interface version does not say (v1..v3) */
    u16 op;     /* GP_OP_* */
    u8 datatype; /* NCCL ncclDataType_t order, GP_NCCL_DT_UNKNOWN */
    u8 flags;    /* GP_NCCL_F_* */
    u32 nccl_seq; /* NCCL's own seqNumber (per communicator and function; collectives only) */
};
#define GP_NCCL_F_P2P 1
#define GP_NCCL_DT_UNKNOWN 12

/* The device-side times of one operation: written once its kernel channels (or proxy steps)
 * are all done. dev_* are in the domain `timing` names: GPU globaltimer ns for
 * kernel_channel_gpu_timer (mapped to CLOCK_MONOTONIC by the collector with the best pair),
 * CLOCK_MONOTONIC for the host-observed timings. */
struct gp_nccl_dev {
    u64 comm_hash;
    u64 seq; /* as gp_nccl_op.seq */
    u64 count;
    u64 dev_start;
    u64 dev_end;
    u64 pair_host;  /* CLOCK_MONOTONIC of the tightest (GPU timer, host) pair of this operation */
    u64 pair_delta; /* host observation - GPU timer of that pair (two's complement) */
    u16 op;
    u16 n_channels; /* channels whose times were seen */
    s32 peer;
    u8 timing; /* GP_NCCL_TIMING_* (schema DEVICE_TIMES timing enum) */
    u8 algorithm; /* schema enum: 0 unknown, 1 tree, 2 ring, ... */
    u8 protocol;  /* schema enum: 0 unknown, 1 ll, 2 ll128, 3 simple */
    u8 datatype;
};
#define GP_NCCL_TIMING_GPU_TIMER 1
#define GP_NCCL_TIMING_KERNEL_HOST 2
#define GP_NCCL_TIMING_PROXY_STEP_HOST 3

/* A communicator the plugin was initialized for (or, v1..v3, first saw an operation of). */
struct gp_nccl_comm {
    u64 t_ns;
    u64 comm_hash;
    u64 context;
    u32 pid;
    u32 tid;
    s32 rank;
    s32 nranks;
    s32 nnodes;
    u32 version; /* the ncclProfiler_vN NCCL chose */
    char name[24]; /* commName, truncated, NUL-padded */
};

/* One NVTX range, written when it ends (push/pop: at the pop; start/end: at the end). */
struct gp_nvtx_range {
    u64 t_start_ns;
    u64 t_end_ns; /* 0: still open when the process exited or the buffer was flushed */
    u32 tid;
    u32 domain_id; /* string id of the domain name, 0 = the default domain */
    u32 name_id;   /* string id of the message, 0 = no message */
    u32 category;
    u16 depth; /* push/pop nesting level at the push (0 = outermost) */
    u8 kind;   /* 0 push_pop, 1 start_end */
    u8 flags;
    u32 color;
};

/* A string once per process and id: domain names, registered strings and range messages.
 * A string longer than one record is sent as consecutive parts (part 0, 1, ...), at most
 * GP_NVTX_STRING_MAX bytes in all; longer ones are cut and flagged truncated. */
#define GP_NVTX_PART_BYTES 60
#define GP_NVTX_STRING_MAX 1020 /* 17 parts */
struct gp_nvtx_string {
    u32 string_id;
    u16 total_len; /* bytes of the (possibly truncated) string */
    u8 part;
    u8 flags; /* GP_NVTX_S_TRUNCATED */
    u32 pad;
    char text[GP_NVTX_PART_BYTES];
};
#define GP_NVTX_S_TRUNCATED 1

/* One CUDA kernel execution from CUPTI's activity buffers (times: CLOCK_MONOTONIC, through
 * CUPTI's timestamp callback, else converted from its CLOCK_REALTIME at the buffer's delivery). */
struct gp_cuda_kernel {
    u64 t_start_ns;
    u64 t_end_ns;
    u32 correlation_id; /* CUPTI's: the same id as the launch API call that enqueued it */
    u32 device;
    u32 stream;
    u32 name_id; /* string id (GP_REC_CUDA_NAME) of the (mangled) name, 0 = none */
    s32 grid[3];
    s32 block[3];
    s32 dynamic_shared;
    s32 static_shared;
    u16 registers;
    u8 flags; /* GP_CUDA_F_* */
    u8 pad;
};
#define GP_CUDA_F_REALTIME_CONVERTED 1

/* A kernel launch call as CUPTI's callback API saw it (at its entry, on the launching thread). */
struct gp_cuda_launch {
    u64 t_ns; /* CLOCK_MONOTONIC */
    u32 tid;
    u32 correlation_id; /* = gp_cuda_kernel.correlation_id of the kernel it enqueued */
    u32 cbid;           /* CUPTI's callback id of the API function */
    u8 domain;          /* 1 driver API, 2 runtime API */
    u8 pad[3];
};

struct gp_record {
    u64 seq; /* position + 1 once the record is complete */
    u32 kind; /* GP_REC_* */
    u32 pad;
    union {
        struct gp_call call;
        struct gp_fp_comm comm;
        struct gp_nccl_op nccl_op;
        struct gp_nccl_dev nccl_dev;
        struct gp_nccl_comm nccl_comm;
        struct gp_nvtx_range nvtx_range;
        struct gp_nvtx_string nvtx_string;
        struct gp_cuda_kernel cuda_kernel;
        struct gp_cuda_launch cuda_launch;
    } u;
};
_Static_assert(sizeof(struct gp_record) == 88, "ring record size is part of ring version 2");

#endif
