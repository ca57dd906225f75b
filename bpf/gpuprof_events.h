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

/* Communicator life cycle and attributes: creation, free, rank and size queries. The fields
 * without the id are a macro because the fast path's ring record (gpuprof_ring.h, gp_fp_comm)
 * has the same ones, in the same order, without the 128-byte copy of the id. */
#define GP_COMM_FIELDS                                                                          \
    u64 t_ns;                                                                                   \
    u64 handle;   /* the communicator created, freed or queried */                              \
    u64 parent;   /* parent handle of split/dup/create; fast path MPI_Init: MPI_COMM_SELF */    \
    u64 index;    /* creation index under the parent (0, 1, ...); fast path MPI_Init: NULL */   \
    u64 uid_hash; /* NCCL: FNV-1a 64 of the ncclUniqueId (fast path; the BPF path sends uid) */ \
    u32 pid;                                                                                    \
    u32 tid;                                                                                    \
    s32 color;                                                                                  \
    s32 key;                                                                                    \
    s32 rank;                                                                                   \
    s32 size;                                                                                   \
    s32 ret;                                                                                    \
    u16 op; /* GP_COP_* (gpuprof_ops.h) */                                                      \
    u8 library;                                                                                 \
    u8 flags;

struct gp_comm {
    GP_COMM_FIELDS
    u8 uid[128]; /* NCCL: the ncclUniqueId passed by value (BPF path only) */
};

/* --- stacks, off-CPU, CUDA launches (bpf/stacks.c, offcpu.c, kernels.c) ------------------------ */

/* Aggregation key of CPU samples and off-CPU episodes. gen is the window half (0/1) the collector
 * flips at each drain; stack ids are ids in the program's stack trace map (negative: not captured,
 * -EFAULT for the kernel stack of a sample taken in user mode). */
struct gp_stack_key {
    u32 gen;
    u32 pid;
    u32 tid;
    u32 cpu; /* CPU samples only; 0 for off-CPU */
    s32 user_stack;
    s32 kernel_stack;
};

/* Blocked episodes of a (window, thread, stacks); the run-queue time is read from /proc */
struct gp_off_value {
    u64 blocked_ns;
    u64 count;
};

#define GP_API_CU_LAUNCH_KERNEL 0
#define GP_API_CU_LAUNCH_KERNEL_EX 1
#define GP_API_CUDA_LAUNCH_KERNEL 2
#define GP_API_CUDA_LAUNCH_KERNEL_EXC 3

/* One CUDA kernel launch, written at entry of the launch call. */
struct gp_launch {
    u64 t_ns;
    u64 function; /* CUfunction, or the host stub address of the runtime API */
    u64 stream;
    u64 ret_addr; /* the return address at entry (SP): the caller, which the frame-pointer walk
                     of user_stack skips because the probed function has no frame yet */
    u32 pid;
    u32 tid;
    u32 grid[3];
    u32 block[3];
    u32 shared_mem;
    s32 user_stack;
    u32 api; /* GP_API_* */
    u32 pad;
};

#define GP_KF_MODULE_GET_FUNCTION 0 /* cuModuleGetFunction: handle = CUfunction */
#define GP_KF_LIBRARY_GET_KERNEL 1  /* cuLibraryGetKernel: handle = CUkernel */
#define GP_KF_KERNEL_GET_FUNCTION 2 /* cuKernelGetFunction: handle = CUfunction, parent = CUkernel */
#define GP_KF_NAME_LEN 128

/* A kernel handle and its name, written at return of a successful lookup call. */
struct gp_kfunc {
    u64 t_ns;
    u64 handle;
    u64 parent;
    u32 pid;
    u32 kind; /* GP_KF_* */
    s32 ret;
    u32 pad;
    char name[GP_KF_NAME_LEN];
};

#endif
