/* PMPI wrapper of the fast path (LD_PRELOAD): every MPI entry point of the uprobe path's probe
 * table, forwarded to its PMPI_ twin, with a record in this process's shared-memory ring.
 *
 * Built without MPI headers on purpose: handles are opaque register-sized values, so one library
 * serves Open MPI (pointer handles) and MPICH (32-bit integer handles); the ABI is told apart at
 * run time by the presence of ompi_mpi_comm_world. Arguments are passed through untouched and the
 * real return value is returned.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp_common.h"
#include "fp_resolve.h"

typedef void *H; /* MPI_Comm, MPI_Datatype, MPI_Op, MPI_Group, MPI_Request: opaque */

#define MPI_UNDEFINED_COLOR (-32766)
#define LIB "libmpi"

static int narrow = -1; /* 1: MPICH ABI (32-bit handles) */
static u64 world, comm_self, comm_null;

/* The ABI, looked up once (at MPI_Init's wrapper, or at the first call before it). The check is
 * inlined into every wrapper: a test that completes nothing is one of hpcc's millions of polls, and
 * a call there cost more than the rest of the wrapper (bench_probes.py, fastpath_ns_per_poll). */
static void gp_flavor_init(void)
{
    void *w = dlsym(RTLD_DEFAULT, "ompi_mpi_comm_world");
    if (w) {
        world = (u64)(uintptr_t)w;
        comm_self = (u64)(uintptr_t)dlsym(RTLD_DEFAULT, "ompi_mpi_comm_self");
        comm_null = (u64)(uintptr_t)dlsym(RTLD_DEFAULT, "ompi_mpi_comm_null");
        narrow = 0;
    } else {
        world = 0x44000000;
        comm_self = 0x44000001;
        comm_null = 0x04000000;
        narrow = 1;
    }
}

static inline __attribute__((always_inline)) void gp_flavor(void)
{
    if (__builtin_expect(narrow < 0, 0))
        gp_flavor_init();
}

static u64 hv(H h)
{
    gp_flavor();
    return narrow ? (u64)(u32)(uintptr_t)h : (u64)(uintptr_t)h;
}

static u64 hread(const void *p)
{
    gp_flavor();
    if (!p)
        return 0;
    return narrow ? (u64) * (const u32 *)p : *(const u64 *)p;
}

static H hmake(u64 v)
{
    return (H)(uintptr_t)v;
}

static void comm_attrs(u64 h, s32 *rank, s32 *size)
{
    GP_REAL(LIB, PMPI_Comm_rank, int (*)(H, int *));
    GP_REAL(LIB, PMPI_Comm_size, int (*)(H, int *));
    int r = -1, s = -1;
    if (h == 0 || h == comm_null || real_PMPI_Comm_rank(hmake(h), &r) != 0)
        r = -1;
    if (h == 0 || h == comm_null || real_PMPI_Comm_size(hmake(h), &s) != 0)
        s = -1;
    *rank = r;
    *size = s;
}

/* The launch that started this rank, the same string on every rank of one mpirun/srun (hashed,
 * as collector/sources/bpf_collectives.mpi_world_identity does from the rank's environment). */
static u64 launch_hash(void)
{
    static const char *vars[] = {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME"};
    char buf[256];
    for (unsigned i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        if (v && *v)
            return gp_fnv1a64(v, strlen(v));
    }
    const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
    if (job && *job) {
        int n = snprintf(buf, sizeof(buf), "slurm-%s.%s", job, step ? step : "");
        return gp_fnv1a64(buf, n > 0 && (size_t)n < sizeof(buf) ? (unsigned long)n : 0);
    }
    return gp_fnv1a64("", 0);
}

static void emit_comm(u16 op, u64 handle, u64 parent, u64 index, s32 color, s32 key, s32 rank, s32 size,
                      int rc)
{
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_COMM, &pos);
    if (!r)
        return;
    struct gp_fp_comm *c = &r->u.comm;
    memset(c, 0, sizeof(*c));
    c->t_ns = gp_now();
    c->handle = handle;
    c->parent = parent;
    c->index = index;
    c->pid = gp_pid();
    c->tid = gp_tid();
    c->color = color;
    c->key = key;
    c->rank = rank;
    c->size = size;
    c->ret = rc;
    c->op = op;
    c->library = GP_LIB_MPI;
    if (op == GP_COP_MPI_Init)
        c->uid_hash = launch_hash(); /* stands for the launch namespace */
    gp_publish(r, pos);
}

/* Rank and size of a communicator the first time this process uses it. */
static void seen(u64 h)
{
    if (gp_next(GP_SEQ_SEEN, h, 0, 0) != 0)
        return;
    s32 rank, size;
    comm_attrs(h, &rank, &size);
    emit_comm(GP_COP_MPI_Comm_rank, h, 0, 0, 0, 0, rank, -1, 0);
    emit_comm(GP_COP_MPI_Comm_size, h, 0, 0, 0, 0, -1, size, 0);
}

static void emit_call(u16 op, u64 t0, u64 handle, u64 seq, u64 bytes, s32 peer, s32 tag, int rc, u64 aux,
                      u8 flags)
{
    gp_emit_call(GP_LIB_MPI, op, t0, handle, seq, bytes, peer, tag, rc, aux, flags);
}

static u64 type_bytes(long count, H dt)
{
    GP_REAL(LIB, PMPI_Type_size, int (*)(H, int *));
    int sz = 0;
    if (real_PMPI_Type_size(dt, &sz) != 0 || sz <= 0)
        return GP_BYTES_UNKNOWN;
    return (u64)count * (u64)sz;
}

static u64 v_bytes(const int *counts, H dt, H comm)
{
    GP_REAL(LIB, PMPI_Comm_size, int (*)(H, int *));
    int n = 0;
    if (!counts || real_PMPI_Comm_size(comm, &n) != 0 || n <= 0)
        return GP_BYTES_UNKNOWN;
    long total = 0;
    for (int i = 0; i < n; i++)
        total += counts[i];
    return type_bytes(total, dt);
}

/* A collective: count < 0 means no payload (MPI_Barrier). */
static void coll(u16 op, u64 t0, int rc, H comm, u64 bytes, s32 root, H *req)
{
    u64 h = hv(comm);
    seen(h);
    u64 seq = gp_next(GP_SEQ_COLL, h, 0, 0);
    u64 aux = 0;
    if (req) {
        struct gp_req_info ri = {.req = hread(req), .handle = h, .seq = seq, .bytes = bytes, .peer = root, .tag = -1,
                                 .where = (u64)(uintptr_t)req};
        gp_req_put(&ri);
        aux = ri.req;
    }
    emit_call(op, t0, h, seq, bytes, root, -1, rc, aux, 0);
}

static void p2p(u16 op, u32 dir, u64 t0, int rc, H comm, u64 bytes, s32 peer, s32 tag, H *req, u8 flags)
{
    u64 h = hv(comm);
    seen(h);
    u64 seq = gp_next(dir, h, peer, tag);
    u64 aux = 0;
    if (req) {
        struct gp_req_info ri = {.req = hread(req), .handle = h, .seq = seq, .bytes = bytes, .peer = peer, .tag = tag,
                                 .where = (u64)(uintptr_t)req};
        gp_req_put(&ri);
        aux = ri.req;
    }
    emit_call(op, t0, h, seq, bytes, peer, tag, rc, aux, flags);
}

/* A request's completion row, from t0 to t1 (one exit time for all the requests a call completed).
 * The MPI_Test family reads no clock before the call: a test returns at once, and most tests of a
 * polling loop complete nothing (hpcc's RandomAccess polls MPI_Testany millions of times), so one
 * that completed is recorded at its return, t0 = t1: a test never waits (docs/probes.md). `where` is
 * the address of the caller's variable that held the request (fp_common.h). */
static void completion(u16 op, u64 t0, u64 t1, int rc, u64 req, u64 where)
{
    struct gp_req_info ri;
    if (gp_req_take(req, where, &ri))
        gp_emit_call_span(GP_LIB_MPI, op, t0, t1, ri.handle, ri.seq, ri.bytes, ri.peer, ri.tag, rc, req, 0);
    else
        gp_emit_call_span(GP_LIB_MPI, op, t0, t1, 0, GP_SEQ_NONE, GP_BYTES_UNKNOWN, GP_NO_PEER, -1, rc, req, 0);
}

#define REAL(name, type) GP_REAL(LIB, P##name, type)

/* --- blocking collectives ------------------------------------------------------------------- */
GP_EXPORT int MPI_Allreduce(const void *s, void *r, int n, H dt, H op, H comm)
{
    REAL(MPI_Allreduce, int (*)(const void *, void *, int, H, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Allreduce(s, r, n, dt, op, comm);
    coll(GP_OP_MPI_Allreduce, t0, rc, comm, type_bytes(n, dt), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Reduce(const void *s, void *r, int n, H dt, H op, int root, H comm)
{
    REAL(MPI_Reduce, int (*)(const void *, void *, int, H, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Reduce(s, r, n, dt, op, root, comm);
    coll(GP_OP_MPI_Reduce, t0, rc, comm, type_bytes(n, dt), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Bcast(void *b, int n, H dt, int root, H comm)
{
    REAL(MPI_Bcast, int (*)(void *, int, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Bcast(b, n, dt, root, comm);
    coll(GP_OP_MPI_Bcast, t0, rc, comm, type_bytes(n, dt), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Barrier(H comm)
{
    REAL(MPI_Barrier, int (*)(H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Barrier(comm);
    coll(GP_OP_MPI_Barrier, t0, rc, comm, 0, -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Allgather(const void *s, int sn, H st, void *r, int rn, H rt, H comm)
{
    REAL(MPI_Allgather, int (*)(const void *, int, H, void *, int, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Allgather(s, sn, st, r, rn, rt, comm);
    coll(GP_OP_MPI_Allgather, t0, rc, comm, type_bytes(sn, st), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Allgatherv(const void *s, int sn, H st, void *r, const int *rn, const int *d, H rt, H comm)
{
    REAL(MPI_Allgatherv, int (*)(const void *, int, H, void *, const int *, const int *, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Allgatherv(s, sn, st, r, rn, d, rt, comm);
    coll(GP_OP_MPI_Allgatherv, t0, rc, comm, type_bytes(sn, st), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Alltoall(const void *s, int sn, H st, void *r, int rn, H rt, H comm)
{
    REAL(MPI_Alltoall, int (*)(const void *, int, H, void *, int, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Alltoall(s, sn, st, r, rn, rt, comm);
    coll(GP_OP_MPI_Alltoall, t0, rc, comm, type_bytes(sn, st), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Alltoallv(const void *s, const int *sn, const int *sd, H st, void *r, const int *rn, const int *rd,
                  H rt, H comm)
{
    REAL(MPI_Alltoallv, int (*)(const void *, const int *, const int *, H, void *, const int *, const int *,
                                H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Alltoallv(s, sn, sd, st, r, rn, rd, rt, comm);
    coll(GP_OP_MPI_Alltoallv, t0, rc, comm, v_bytes(sn, st, comm), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Reduce_scatter(const void *s, void *r, const int *rn, H dt, H op, H comm)
{
    REAL(MPI_Reduce_scatter, int (*)(const void *, void *, const int *, H, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Reduce_scatter(s, r, rn, dt, op, comm);
    coll(GP_OP_MPI_Reduce_scatter, t0, rc, comm, v_bytes(rn, dt, comm), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Reduce_scatter_block(const void *s, void *r, int rn, H dt, H op, H comm)
{
    REAL(MPI_Reduce_scatter_block, int (*)(const void *, void *, int, H, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Reduce_scatter_block(s, r, rn, dt, op, comm);
    coll(GP_OP_MPI_Reduce_scatter_block, t0, rc, comm, type_bytes(rn, dt), -1, NULL);
    return rc;
}

GP_EXPORT int MPI_Gather(const void *s, int sn, H st, void *r, int rn, H rt, int root, H comm)
{
    REAL(MPI_Gather, int (*)(const void *, int, H, void *, int, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Gather(s, sn, st, r, rn, rt, root, comm);
    coll(GP_OP_MPI_Gather, t0, rc, comm, type_bytes(sn, st), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Gatherv(const void *s, int sn, H st, void *r, const int *rn, const int *d, H rt, int root, H comm)
{
    REAL(MPI_Gatherv, int (*)(const void *, int, H, void *, const int *, const int *, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Gatherv(s, sn, st, r, rn, d, rt, root, comm);
    coll(GP_OP_MPI_Gatherv, t0, rc, comm, type_bytes(sn, st), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Scatter(const void *s, int sn, H st, void *r, int rn, H rt, int root, H comm)
{
    REAL(MPI_Scatter, int (*)(const void *, int, H, void *, int, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Scatter(s, sn, st, r, rn, rt, root, comm);
    coll(GP_OP_MPI_Scatter, t0, rc, comm, type_bytes(rn, rt), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Scatterv(const void *s, const int *sn, const int *d, H st, void *r, int rn, H rt, int root, H comm)
{
    REAL(MPI_Scatterv, int (*)(const void *, const int *, const int *, H, void *, int, H, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Scatterv(s, sn, d, st, r, rn, rt, root, comm);
    coll(GP_OP_MPI_Scatterv, t0, rc, comm, type_bytes(rn, rt), root, NULL);
    return rc;
}

GP_EXPORT int MPI_Scan(const void *s, void *r, int n, H dt, H op, H comm)
{
    REAL(MPI_Scan, int (*)(const void *, void *, int, H, H, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Scan(s, r, n, dt, op, comm);
    coll(GP_OP_MPI_Scan, t0, rc, comm, type_bytes(n, dt), -1, NULL);
    return rc;
}

/* --- non-blocking collectives ---------------------------------------------------------------- */
GP_EXPORT int MPI_Iallreduce(const void *s, void *r, int n, H dt, H op, H comm, H *req)
{
    REAL(MPI_Iallreduce, int (*)(const void *, void *, int, H, H, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Iallreduce(s, r, n, dt, op, comm, req);
    coll(GP_OP_MPI_Iallreduce, t0, rc, comm, type_bytes(n, dt), -1, req);
    return rc;
}

GP_EXPORT int MPI_Ireduce(const void *s, void *r, int n, H dt, H op, int root, H comm, H *req)
{
    REAL(MPI_Ireduce, int (*)(const void *, void *, int, H, H, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Ireduce(s, r, n, dt, op, root, comm, req);
    coll(GP_OP_MPI_Ireduce, t0, rc, comm, type_bytes(n, dt), root, req);
    return rc;
}

GP_EXPORT int MPI_Ibcast(void *b, int n, H dt, int root, H comm, H *req)
{
    REAL(MPI_Ibcast, int (*)(void *, int, H, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Ibcast(b, n, dt, root, comm, req);
    coll(GP_OP_MPI_Ibcast, t0, rc, comm, type_bytes(n, dt), root, req);
    return rc;
}

GP_EXPORT int MPI_Ibarrier(H comm, H *req)
{
    REAL(MPI_Ibarrier, int (*)(H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Ibarrier(comm, req);
    coll(GP_OP_MPI_Ibarrier, t0, rc, comm, 0, -1, req);
    return rc;
}

GP_EXPORT int MPI_Iallgather(const void *s, int sn, H st, void *r, int rn, H rt, H comm, H *req)
{
    REAL(MPI_Iallgather, int (*)(const void *, int, H, void *, int, H, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Iallgather(s, sn, st, r, rn, rt, comm, req);
    coll(GP_OP_MPI_Iallgather, t0, rc, comm, type_bytes(sn, st), -1, req);
    return rc;
}

GP_EXPORT int MPI_Ialltoall(const void *s, int sn, H st, void *r, int rn, H rt, H comm, H *req)
{
    REAL(MPI_Ialltoall, int (*)(const void *, int, H, void *, int, H, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Ialltoall(s, sn, st, r, rn, rt, comm, req);
    coll(GP_OP_MPI_Ialltoall, t0, rc, comm, type_bytes(sn, st), -1, req);
    return rc;
}

GP_EXPORT int MPI_Ireduce_scatter(const void *s, void *r, const int *rn, H dt, H op, H comm, H *req)
{
    REAL(MPI_Ireduce_scatter, int (*)(const void *, void *, const int *, H, H, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Ireduce_scatter(s, r, rn, dt, op, comm, req);
    coll(GP_OP_MPI_Ireduce_scatter, t0, rc, comm, v_bytes(rn, dt, comm), -1, req);
    return rc;
}

GP_EXPORT int MPI_Igather(const void *s, int sn, H st, void *r, int rn, H rt, int root, H comm, H *req)
{
    REAL(MPI_Igather, int (*)(const void *, int, H, void *, int, H, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Igather(s, sn, st, r, rn, rt, root, comm, req);
    coll(GP_OP_MPI_Igather, t0, rc, comm, type_bytes(sn, st), root, req);
    return rc;
}

GP_EXPORT int MPI_Iscatter(const void *s, int sn, H st, void *r, int rn, H rt, int root, H comm, H *req)
{
    REAL(MPI_Iscatter, int (*)(const void *, int, H, void *, int, H, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Iscatter(s, sn, st, r, rn, rt, root, comm, req);
    coll(GP_OP_MPI_Iscatter, t0, rc, comm, type_bytes(rn, rt), root, req);
    return rc;
}

GP_EXPORT int MPI_Iscan(const void *s, void *r, int n, H dt, H op, H comm, H *req)
{
    REAL(MPI_Iscan, int (*)(const void *, void *, int, H, H, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Iscan(s, r, n, dt, op, comm, req);
    coll(GP_OP_MPI_Iscan, t0, rc, comm, type_bytes(n, dt), -1, req);
    return rc;
}

/* --- point to point and completions ---------------------------------------------------------- */
GP_EXPORT int MPI_Send(const void *b, int n, H dt, int dest, int tag, H comm)
{
    REAL(MPI_Send, int (*)(const void *, int, H, int, int, H));
    u64 t0 = gp_now();
    int rc = real_PMPI_Send(b, n, dt, dest, tag, comm);
    p2p(GP_OP_MPI_Send, GP_SEQ_SEND, t0, rc, comm, type_bytes(n, dt), dest, tag, NULL, 0);
    return rc;
}

GP_EXPORT int MPI_Recv(void *b, int n, H dt, int src, int tag, H comm, void *status)
{
    REAL(MPI_Recv, int (*)(void *, int, H, int, int, H, void *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Recv(b, n, dt, src, tag, comm, status);
    p2p(GP_OP_MPI_Recv, GP_SEQ_RECV, t0, rc, comm, type_bytes(n, dt), src, tag, NULL, 0);
    return rc;
}

GP_EXPORT int MPI_Isend(const void *b, int n, H dt, int dest, int tag, H comm, H *req)
{
    REAL(MPI_Isend, int (*)(const void *, int, H, int, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Isend(b, n, dt, dest, tag, comm, req);
    p2p(GP_OP_MPI_Isend, GP_SEQ_SEND, t0, rc, comm, type_bytes(n, dt), dest, tag, req, 0);
    return rc;
}

GP_EXPORT int MPI_Irecv(void *b, int n, H dt, int src, int tag, H comm, H *req)
{
    REAL(MPI_Irecv, int (*)(void *, int, H, int, int, H, H *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Irecv(b, n, dt, src, tag, comm, req);
    p2p(GP_OP_MPI_Irecv, GP_SEQ_RECV, t0, rc, comm, type_bytes(n, dt), src, tag, req, 0);
    return rc;
}

GP_EXPORT int MPI_Sendrecv(const void *sb, int sn, H st, int dest, int stag, void *rb, int rn, H rt, int src, int rtag,
                 H comm, void *status)
{
    REAL(MPI_Sendrecv, int (*)(const void *, int, H, int, int, void *, int, H, int, int, H, void *));
    u64 t0 = gp_now();
    int rc = real_PMPI_Sendrecv(sb, sn, st, dest, stag, rb, rn, rt, src, rtag, comm, status);
    p2p(GP_OP_MPI_Sendrecv, GP_SEQ_SEND, t0, rc, comm, type_bytes(sn, st), dest, stag, NULL, 0);
    p2p(GP_OP_MPI_Sendrecv, GP_SEQ_RECV, t0, rc, comm, type_bytes(rn, rt), src, rtag, NULL, GP_F_SENDRECV_RECV);
    return rc;
}

GP_EXPORT int MPI_Wait(H *req, void *status)
{
    REAL(MPI_Wait, int (*)(H *, void *));
    u64 r = hread(req);
    u64 t0 = gp_now();
    int rc = real_PMPI_Wait(req, status);
    completion(GP_OP_MPI_Wait, t0, gp_now(), rc, r, (u64)(uintptr_t)req);
    return rc;
}

GP_EXPORT int MPI_Test(H *req, int *flag, void *status)
{
    REAL(MPI_Test, int (*)(H *, int *, void *));
    u64 r = hread(req);
    int rc = real_PMPI_Test(req, flag, status);
    if (flag && *flag) {
        u64 t = gp_now();
        completion(GP_OP_MPI_Test, t, t, rc, r, (u64)(uintptr_t)req);
    }
    return rc;
}

#define GP_MAX_ALL 256
static void read_reqs(int n, const void *reqs, u64 *out)
{
    for (int i = 0; i < n && i < GP_MAX_ALL; i++)
        out[i] = narrow ? (u64)((const u32 *)reqs)[i] : ((const u64 *)reqs)[i];
}

/* The address of reqs[i], the `where` of its request. */
static u64 slot_of(const void *reqs, int i)
{
    return (u64)(uintptr_t)reqs + (u64)i * (narrow ? sizeof(u32) : sizeof(u64));
}

/* Persistent requests: MPI_Send_init / MPI_Recv_init define a message, each MPI_Start starts one.
 * A start is recorded as the MPI_Isend / MPI_Irecv it is (the next number of its channel, the
 * request remembered for its completion), so the merge matches and times it like any other. */
static void persistent(u32 dir, int rc, H comm, u64 bytes, s32 peer, s32 tag, H *req)
{
    if (rc != 0 || !req)
        return;
    struct gp_req_info pi = {.req = hread(req), .handle = hv(comm), .seq = dir, .bytes = bytes, .peer = peer, .tag = tag};
    gp_preq_put(&pi);
}

static void started(u64 t0, int rc, u64 req, u64 where)
{
    struct gp_req_info pi;
    if (!gp_preq_get(req, &pi))
        return;
    u32 dir = (u32)pi.seq;
    seen(pi.handle);
    struct gp_req_info ri = {.req = req, .handle = pi.handle, .seq = gp_next(dir, pi.handle, pi.peer, pi.tag),
                             .bytes = pi.bytes, .peer = pi.peer, .tag = pi.tag, .where = where};
    gp_req_put(&ri);
    emit_call(dir == GP_SEQ_SEND ? GP_OP_MPI_Isend : GP_OP_MPI_Irecv, t0, ri.handle, ri.seq, ri.bytes, ri.peer,
              ri.tag, rc, req, 0);
}

GP_EXPORT int MPI_Send_init(const void *b, int n, H dt, int dest, int tag, H comm, H *req)
{
    REAL(MPI_Send_init, int (*)(const void *, int, H, int, int, H, H *));
    int rc = real_PMPI_Send_init(b, n, dt, dest, tag, comm, req);
    persistent(GP_SEQ_SEND, rc, comm, type_bytes(n, dt), dest, tag, req);
    return rc;
}

GP_EXPORT int MPI_Recv_init(void *b, int n, H dt, int src, int tag, H comm, H *req)
{
    REAL(MPI_Recv_init, int (*)(void *, int, H, int, int, H, H *));
    int rc = real_PMPI_Recv_init(b, n, dt, src, tag, comm, req);
    persistent(GP_SEQ_RECV, rc, comm, type_bytes(n, dt), src, tag, req);
    return rc;
}

GP_EXPORT int MPI_Start(H *req)
{
    REAL(MPI_Start, int (*)(H *));
    u64 r = hread(req);
    u64 t0 = gp_now();
    int rc = real_PMPI_Start(req);
    started(t0, rc, r, (u64)(uintptr_t)req);
    return rc;
}

GP_EXPORT int MPI_Startall(int n, H *reqs)
{
    REAL(MPI_Startall, int (*)(int, H *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    u64 t0 = gp_now();
    int rc = real_PMPI_Startall(n, reqs);
    for (int i = 0; i < n && i < GP_MAX_ALL; i++)
        started(t0, rc, saved[i], slot_of(reqs, i));
    return rc;
}

GP_EXPORT int MPI_Request_free(H *req)
{
    REAL(MPI_Request_free, int (*)(H *));
    gp_preq_drop(hread(req));
    return real_PMPI_Request_free(req);
}

GP_EXPORT int MPI_Waitall(int n, H *reqs, void *statuses)
{
    REAL(MPI_Waitall, int (*)(int, H *, void *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    u64 t0 = gp_now();
    int rc = real_PMPI_Waitall(n, reqs, statuses);
    u64 t1 = gp_now();
    for (int i = 0; i < n && i < GP_MAX_ALL; i++)
        completion(GP_OP_MPI_Waitall, t0, t1, rc, saved[i], slot_of(reqs, i));
    return rc;
}

GP_EXPORT int MPI_Testall(int n, H *reqs, int *flag, void *statuses)
{
    REAL(MPI_Testall, int (*)(int, H *, int *, void *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    int rc = real_PMPI_Testall(n, reqs, flag, statuses);
    if (flag && *flag) {
        u64 t = gp_now();
        for (int i = 0; i < n && i < GP_MAX_ALL; i++)
            completion(GP_OP_MPI_Testall, t, t, rc, saved[i], slot_of(reqs, i));
    }
    return rc;
}

/* Some of many: one completion row per request the call completed, named by the returned indices
 * (requests beyond GP_MAX_ALL are not saved, as for Waitall). MPI_UNDEFINED (no active request) is
 * negative in Open MPI and MPICH alike, so a count or index < 0 completes nothing. */
static void completed_some(int op, u64 t0, u64 t1, int rc, int n, const void *reqs, const u64 *saved, int count,
                           const int *indices)
{
    for (int i = 0; indices && i < count; i++)
        if (indices[i] >= 0 && indices[i] < n && indices[i] < GP_MAX_ALL)
            completion(op, t0, t1, rc, saved[indices[i]], slot_of(reqs, indices[i]));
}

/* A test of some of many completed `count` (> 0) requests: recorded at its return. */
static void tested_some(int op, int rc, int n, const void *reqs, const u64 *saved, int count, const int *indices)
{
    if (count <= 0 || !indices)
        return;
    u64 t = gp_now();
    completed_some(op, t, t, rc, n, reqs, saved, count, indices);
}

GP_EXPORT int MPI_Waitany(int n, H *reqs, int *index, void *status)
{
    REAL(MPI_Waitany, int (*)(int, H *, int *, void *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    u64 t0 = gp_now();
    int rc = real_PMPI_Waitany(n, reqs, index, status);
    if (index)
        completed_some(GP_OP_MPI_Waitany, t0, gp_now(), rc, n, reqs, saved, 1, index);
    return rc;
}

/* Many requests: their handles kept in an array (its own function, so that the one-request path
 * below sets up no 2 kB frame). */
static __attribute__((noinline)) int testany_many(int n, H *reqs, int *index, int *flag, void *status)
{
    REAL(MPI_Testany, int (*)(int, H *, int *, int *, void *));
    u64 saved[GP_MAX_ALL];
    read_reqs(n, reqs, saved);
    int rc = real_PMPI_Testany(n, reqs, index, flag, status);
    if (flag && *flag)
        tested_some(GP_OP_MPI_Testany, rc, n, reqs, saved, 1, index);
    return rc;
}

GP_EXPORT int MPI_Testany(int n, H *reqs, int *index, int *flag, void *status)
{
    REAL(MPI_Testany, int (*)(int, H *, int *, int *, void *));
    gp_flavor();
    if (__builtin_expect(n != 1, 0))
        return testany_many(n, reqs, index, flag, status);
    /* one request (hpcc's RandomAccess polls so, millions of times, most completing nothing) */
    u64 r = hread(reqs);
    int rc = real_PMPI_Testany(1, reqs, index, flag, status);
    if (flag && *flag && index && *index == 0) {
        u64 t = gp_now();
        completion(GP_OP_MPI_Testany, t, t, rc, r, (u64)(uintptr_t)reqs);
    }
    return rc;
}

GP_EXPORT int MPI_Waitsome(int n, H *reqs, int *outcount, int *indices, void *statuses)
{
    REAL(MPI_Waitsome, int (*)(int, H *, int *, int *, void *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    u64 t0 = gp_now();
    int rc = real_PMPI_Waitsome(n, reqs, outcount, indices, statuses);
    if (outcount)
        completed_some(GP_OP_MPI_Waitsome, t0, gp_now(), rc, n, reqs, saved, *outcount, indices);
    return rc;
}

GP_EXPORT int MPI_Testsome(int n, H *reqs, int *outcount, int *indices, void *statuses)
{
    REAL(MPI_Testsome, int (*)(int, H *, int *, int *, void *));
    u64 saved[GP_MAX_ALL];
    gp_flavor();
    read_reqs(n, reqs, saved);
    int rc = real_PMPI_Testsome(n, reqs, outcount, indices, statuses);
    if (outcount)
        tested_some(GP_OP_MPI_Testsome, rc, n, reqs, saved, *outcount, indices);
    return rc;
}

/* --- communicators --------------------------------------------------------------------------- */
static void after_init(int rc)
{
    gp_flavor();
    s32 rank, size;
    comm_attrs(world, &rank, &size);
    gp_next(GP_SEQ_SEEN, world, 0, 0);
    /* MPI_Init has no parent: its record carries MPI_COMM_SELF in `parent` and MPI_COMM_NULL in
     * `index`, which this process knows for free; the collector would otherwise read them from
     * the MPI library's symbol table (tens of ms of CPU per rank, at the job's start). */
    emit_comm(GP_COP_MPI_Init, world, comm_self, comm_null, 0, 0, rank, size, rc);
}

GP_EXPORT int MPI_Init(int *argc, char ***argv)
{
    REAL(MPI_Init, int (*)(int *, char ***));
    int rc = real_PMPI_Init(argc, argv);
    after_init(rc);
    return rc;
}

GP_EXPORT int MPI_Init_thread(int *argc, char ***argv, int required, int *provided)
{
    REAL(MPI_Init_thread, int (*)(int *, char ***, int, int *));
    int rc = real_PMPI_Init_thread(argc, argv, required, provided);
    /* MPI_THREAD_MULTIPLE is 3 in both ABIs (Open MPI's enum, MPICH's define) */
    gp_req_set_concurrent(rc == 0 && provided && *provided == 3);
    after_init(rc);
    return rc;
}

static void created(u16 op, int rc, H parent, H *newcomm, s32 color, s32 key)
{
    u64 p = hv(parent);
    u64 index = gp_next(GP_SEQ_CREATE, p, 0, 0);
    u64 h = rc == 0 ? hread(newcomm) : 0;
    s32 rank = -1, size = -1;
    if (h && h != comm_null) {
        comm_attrs(h, &rank, &size);
        gp_next(GP_SEQ_SEEN, h, 0, 0);
    }
    emit_comm(op, h, p, index, color, key, rank, size, rc);
}

GP_EXPORT int MPI_Comm_split(H comm, int color, int key, H *newcomm)
{
    REAL(MPI_Comm_split, int (*)(H, int, int, H *));
    int rc = real_PMPI_Comm_split(comm, color, key, newcomm);
    created(GP_COP_MPI_Comm_split, rc, comm, newcomm, color, key);
    return rc;
}

GP_EXPORT int MPI_Comm_dup(H comm, H *newcomm)
{
    REAL(MPI_Comm_dup, int (*)(H, H *));
    int rc = real_PMPI_Comm_dup(comm, newcomm);
    created(GP_COP_MPI_Comm_dup, rc, comm, newcomm, 0, 0);
    return rc;
}

/* MPI_Comm_create on disjoint groups makes one communicator per group from one call: the parent
 * rank of the group's first member (the same on every member, distinct across disjoint groups) is
 * recorded as the color, so that the collector gives each its own id. -1 when it cannot be read. */
static s32 group_leader(H parent, H group)
{
    GP_REAL(LIB, PMPI_Comm_group, int (*)(H, H *));
    GP_REAL(LIB, PMPI_Group_translate_ranks, int (*)(H, int, const int *, H, int *));
    GP_REAL(LIB, PMPI_Group_free, int (*)(H *));
    u64 parent_group = 0; /* wide enough for either ABI's handle */
    int first = 0, leader = -1;
    if (real_PMPI_Comm_group(parent, (H *)&parent_group) != 0)
        return -1;
    if (real_PMPI_Group_translate_ranks(group, 1, &first, hmake(hread(&parent_group)), &leader) != 0)
        leader = -1;
    real_PMPI_Group_free((H *)&parent_group);
    return leader;
}

GP_EXPORT int MPI_Comm_create(H comm, H group, H *newcomm)
{
    REAL(MPI_Comm_create, int (*)(H, H, H *));
    int rc = real_PMPI_Comm_create(comm, group, newcomm);
    created(GP_COP_MPI_Comm_create, rc, comm, newcomm, rc == 0 ? group_leader(comm, group) : -1, 0);
    return rc;
}

GP_EXPORT int MPI_Comm_free(H *comm)
{
    REAL(MPI_Comm_free, int (*)(H *));
    u64 h = hread(comm);
    int rc = real_PMPI_Comm_free(comm);
    /* the handle may come back for a later communicator: its counters start again */
    gp_reset(GP_SEQ_COLL, h);
    gp_reset(GP_SEQ_CREATE, h);
    gp_reset(GP_SEQ_SEEN, h);
    emit_comm(GP_COP_MPI_Comm_free, h, 0, 0, 0, 0, -1, -1, rc);
    return rc;
}
