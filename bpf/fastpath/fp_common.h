/* What the MPI and NCCL interposers share: the ring, the clock, per-communicator counters. */
#ifndef GPUPROF_FP_COMMON_H
#define GPUPROF_FP_COMMON_H

#include <stddef.h>

#include "gpuprof_ring.h"
#include "../gpuprof_ops.h"

#define GP_SEQ_COLL 0
#define GP_SEQ_SEND 1
#define GP_SEQ_RECV 2
#define GP_SEQ_CREATE 3
#define GP_SEQ_SEEN 4

u64 gp_now(void);
/* Claim a record; NULL when the ring is full or unavailable (the drop is counted). */
struct gp_record *gp_claim(u32 kind, u64 *pos);
void gp_publish(struct gp_record *rec, u64 pos);
/* A string of n bytes (already cut to GP_NVTX_STRING_MAX, `truncated` when it was longer) as
 * records of `kind` (struct gp_nvtx_string parts of GP_NVTX_PART_BYTES) under `id`; a part that does
 * not fit the ring is dropped and counted by gp_claim (the collector sees the string incomplete). */
void gp_send_string(u32 kind, u32 id, const char *s, size_t n, int truncated);
/* Count a record not written for a reason of the writer's own (a full table): the ring's drops. */
void gp_count_drop(void);
void gp_count_drops(u64 n);
/* One call record (claim, fill, publish); the exit time is taken here. Nothing if the ring is full. */
void gp_emit_call(u8 library, u16 op, u64 t0, u64 handle, u64 seq, u64 bytes, s32 peer, s32 tag, int rc, u64 aux,
                  u8 flags);
/* The same with the exit time given (t1). */
void gp_emit_call_span(u8 library, u16 op, u64 t0, u64 t1, u64 handle, u64 seq, u64 bytes, s32 peer, s32 tag, int rc,
                       u64 aux, u8 flags);
/* The next number of a counter (GP_SEQ_NONE when the table is full). */
u64 gp_next(u32 kind, u64 handle, s32 peer, s32 tag);
void gp_reset(u32 kind, u64 handle);
u32 gp_tid(void);
u32 gp_pid(void);
/* FNV-1a 64, the NCCL unique id hash (collector/sources/bpf_collectives.fnv1a64). */
u64 gp_fnv1a64(const void *data, unsigned long len);

/* Remember and take back what a non-blocking call started (MPI_Wait names its initiation).
 * Several requests outstanding at once can have one handle: Open MPI returns its one
 * ompi_request_empty for every MPI_Isend it completed at once (a small message), MPICH one builtin
 * request; so a request is kept under its handle and `where`, the address of the caller's variable
 * the handle was written to, and taken back by both, or by the handle alone when the caller waits
 * on a copy (then the latest of that handle). */
struct gp_req_info {
    u64 req;
    u64 handle;
    u64 seq;
    u64 bytes;
    s32 peer;
    s32 tag;
    u64 where;
    u64 order; /* set by gp_req_put: the later of two requests of one handle has the higher */
};
void gp_req_put(const struct gp_req_info *info);
int gp_req_take(u64 req, u64 where, struct gp_req_info *out);
/* Whether several threads may call MPI at once (given MPI_THREAD_MULTIPLE): the table is then
 * written and read under a compare-and-swap per slot. */
void gp_req_set_concurrent(int concurrent);
/* A persistent request's definition (MPI_Send_init / MPI_Recv_init; seq holds GP_SEQ_SEND or
 * GP_SEQ_RECV): read at every MPI_Start, dropped by MPI_Request_free. */
void gp_preq_put(const struct gp_req_info *info);
int gp_preq_get(u64 req, struct gp_req_info *out);
void gp_preq_drop(u64 req);

#endif
