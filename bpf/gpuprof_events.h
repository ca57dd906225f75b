/* Records of the collectives sources, shared by the BPF programs (bpf/collectives.c) and the
 * user-space fast path (bpf/fastpath/). One definition: BCC decodes the BPF ring buffers from these
 * structs, and bpf/fastpath/layout.c prints their offsets for collector/sources/fastpath.py, so the
 * Python side never writes the layout a second time.
 */
#ifndef GPUPROF_EVENTS_H
#define GPUPROF_EVENTS_H

#ifndef GP_BPF
#include <stdint.h>
typedef uint64_t u64;
typedef uint32_t u32;
typedef uint16_t u16;
typedef uint8_t u8;
typedef int32_t s32;
#endif

/* bytes could not be determined (derived MPI datatype unknown to the probe, v-variant counts of a
 * communicator whose size was not seen): never stored as 0, which is a real size. */
#define GP_BYTES_UNKNOWN 0xffffffffffffffffULL
/* a row that is not an instance on a communicator (MPI_Waitall over several requests...). */
#define GP_SEQ_NONE 0xffffffffffffffffULL
#define GP_NO_PEER (-1)

#define GP_LIB_MPI 0
#define GP_LIB_NCCL 1

/* gp_call.flags */
#define GP_F_SENDRECV_RECV 1 /* the receive half of an MPI_Sendrecv */
#define GP_F_NESTED 2        /* called from inside another probed call of the same thread */

/* One collective, point-to-point or completion call, written at its return. */
struct gp_call {
    u64 t_enter_ns;
    u64 t_exit_ns;
    u64 handle; /* communicator handle in the process: MPI_Comm value or ncclComm_t */
    u64 seq;    /* per (process, handle): collectives 0,1,2...; p2p per (peer, tag, direction) */
    u64 bytes;  /* count x datatype size, GP_BYTES_UNKNOWN when not known */
    u64 aux;    /* NCCL: cudaStream_t; MPI non-blocking: the request handle */
    u32 pid;
    u32 tid;
    s32 peer; /* root of rooted collectives, peer of point to point, else -1 */
    s32 tag;  /* MPI tag of point to point, else -1 */
    s32 ret;
    u16 op; /* index into collector.schema.COLLECTIVE_OPS (gpuprof_ops.h) */
    u8 library;
    u8 flags;
};

/* Communicator life cycle and attributes: creation, free, rank and size queries. */
struct gp_comm {
    u64 t_ns;
    u64 handle; /* the communicator created, freed or queried */
    u64 parent; /* parent handle of split/dup/create */
    u64 index;  /* creation index under the parent in this process (0, 1, ...) */
    u64 uid_hash; /* NCCL: FNV-1a 64 of the ncclUniqueId (fast path; the BPF path sends uid) */
    u32 pid;
    u32 tid;
    s32 color;
    s32 key;
    s32 rank;
    s32 size;
    s32 ret;
    u16 op; /* GP_COP_* (gpuprof_ops.h) */
    u8 library;
    u8 flags;
    u8 uid[128]; /* NCCL: the ncclUniqueId passed by value (BPF path only) */
};

#endif
