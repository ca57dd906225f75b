/* The fast path's drain (collector/sources/fastpath.py), in C: records read from a process's
 * ring -> /collectives/calls rows.
 *
 * Why C: at 10,000 calls/s per rank the numpy version walked every 216-byte record once per
 * column (a dozen passes over data just written by another core) and was most of the
 * collector's CPU time while draining, which a busy job on a full node pays for. Here each
 * record is touched once. The communicator columns (comm_id, comm_rank, comm_size) are left for
 * the caller, which resolves them per (process, handle) group, not per row.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../bpf/fastpath/gpuprof_ring.h"

#define EXPORT __attribute__((visibility("default")))

/* One row of /collectives/calls as collector/schema.py lays it out (packed, little-endian). */
struct gp_call_row {
    u64 t_enter_ns;
    u64 t_exit_ns;
    u32 pid;
    u32 tid;
    u8 library;
    u8 op;
    u64 comm_id;
    u64 seq;
    s32 comm_rank;
    s32 comm_size;
    u64 bytes;
    s32 root_or_peer;
    s32 tag;
    s32 ret;
    u8 path;
    u64 handle;
} __attribute__((packed));

/* records: `count` whole gp_record slots (already checked complete by their seq). Writes the
 * call records as rows (in order) and the slot indexes of communicator records into comm_slots;
 * returns the number of rows; *n_comm gets the number of communicator records. */
EXPORT long gp_records_to_rows(const struct gp_record *records, long count, u8 path, u8 recv_op,
                               struct gp_call_row *rows, long *comm_slots, long *n_comm)
{
    long n = 0, c = 0;
    for (long i = 0; i < count; i++) {
        const struct gp_record *r = &records[i];
        if (r->kind == GP_REC_COMM) {
            comm_slots[c++] = i;
            continue;
        }
        if (r->kind != GP_REC_CALL)
            continue;
        const struct gp_call *k = &r->u.call;
        struct gp_call_row *o = &rows[n++];
        o->t_enter_ns = k->t_enter_ns;
        o->t_exit_ns = k->t_exit_ns;
        o->pid = k->pid;
        o->tid = k->tid;
        o->library = k->library;
        /* the receive half of MPI_Sendrecv is a receive (docs/probes.md) */
        o->op = (k->flags & GP_F_SENDRECV_RECV) ? recv_op : (u8)k->op;
        o->comm_id = 0;
        o->seq = k->seq;
        o->comm_rank = -1;
        o->comm_size = -1;
        o->bytes = k->bytes;
        o->root_or_peer = k->peer;
        o->tag = k->tag;
        o->ret = k->ret;
        o->path = path;
        o->handle = k->handle;
    }
    *n_comm = c;
    return n;
}

EXPORT int gp_ring_layout(int *record_size, int *row_size)
{
    *record_size = (int)sizeof(struct gp_record);
    *row_size = (int)sizeof(struct gp_call_row);
    return 0;
}
