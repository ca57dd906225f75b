/* NCCL interposer of the fast path (LD_PRELOAD): the nccl* entry points of the uprobe path's probe
 * table, forwarded to the real libnccl, with a record in this process's shared-memory ring.
 *
 * It sees the calls an application resolves through the dynamic linker (PyTorch and most programs
 * link libnccl.so.2); a program that dlsym()s NCCL from its own handle, or links it statically,
 * is seen by the uprobe path only (docs/probes.md).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "fp_common.h"
#include "fp_resolve.h"

typedef void *Comm;
typedef void *Stream;
typedef struct {
    char internal[128];
} UniqueId;

#define LIB "libnccl"
#define REAL(name, type) GP_REAL(LIB, name, type)

static u64 dt_size(int dt)
{
    switch (dt) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

static u64 nbytes(size_t count, int dt)
{
    u64 s = dt_size(dt);
    return s ? (u64)count * s : GP_BYTES_UNKNOWN;
}

static void emit_call(u16 op, u64 t0, Comm comm, u64 seq, u64 bytes, s32 peer, int rc, Stream stream)
{
    gp_emit_call(GP_LIB_NCCL, op, t0, (u64)(uintptr_t)comm, seq, bytes, peer, -1, rc, (u64)(uintptr_t)stream, 0);
}

static void coll(u16 op, u64 t0, Comm comm, u64 bytes, s32 peer, int rc, Stream stream, u32 dir)
{
    u64 h = (u64)(uintptr_t)comm;
    emit_call(op, t0, comm, gp_next(dir, h, dir == GP_SEQ_COLL ? 0 : peer, dir == GP_SEQ_COLL ? 0 : -1),
              bytes, peer, rc, stream);
}

static struct gp_fp_comm *comm_event(u16 op, u64 *pos, struct gp_record **rec)
{
    struct gp_record *r = gp_claim(GP_REC_COMM, pos);
    if (!r)
        return NULL;
    struct gp_fp_comm *c = &r->u.comm;
    memset(c, 0, sizeof(*c));
    c->t_ns = gp_now();
    c->pid = gp_pid();
    c->tid = gp_tid();
    c->op = op;
    c->library = GP_LIB_NCCL;
    c->rank = -1;
    c->size = -1;
    *rec = r;
    return c;
}

GP_EXPORT int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, Comm comm, Stream st)
{
    REAL(ncclAllReduce, int (*)(const void *, void *, size_t, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclAllReduce(s, r, n, dt, op, comm, st);
    coll(GP_OP_ncclAllReduce, t0, comm, nbytes(n, dt), -1, rc, st, GP_SEQ_COLL);
    return rc;
}

GP_EXPORT int ncclAllGather(const void *s, void *r, size_t n, int dt, Comm comm, Stream st)
{
    REAL(ncclAllGather, int (*)(const void *, void *, size_t, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclAllGather(s, r, n, dt, comm, st);
    coll(GP_OP_ncclAllGather, t0, comm, nbytes(n, dt), -1, rc, st, GP_SEQ_COLL);
    return rc;
}

GP_EXPORT int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, Comm comm, Stream st)
{
    REAL(ncclReduceScatter, int (*)(const void *, void *, size_t, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclReduceScatter(s, r, n, dt, op, comm, st);
    coll(GP_OP_ncclReduceScatter, t0, comm, nbytes(n, dt), -1, rc, st, GP_SEQ_COLL);
    return rc;
}

GP_EXPORT int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, Comm comm, Stream st)
{
    REAL(ncclBroadcast, int (*)(const void *, void *, size_t, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclBroadcast(s, r, n, dt, root, comm, st);
    coll(GP_OP_ncclBroadcast, t0, comm, nbytes(n, dt), root, rc, st, GP_SEQ_COLL);
    return rc;
}

GP_EXPORT int ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, Comm comm, Stream st)
{
    REAL(ncclReduce, int (*)(const void *, void *, size_t, int, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclReduce(s, r, n, dt, op, root, comm, st);
    coll(GP_OP_ncclReduce, t0, comm, nbytes(n, dt), root, rc, st, GP_SEQ_COLL);
    return rc;
}

GP_EXPORT int ncclSend(const void *s, size_t n, int dt, int peer, Comm comm, Stream st)
{
    REAL(ncclSend, int (*)(const void *, size_t, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclSend(s, n, dt, peer, comm, st);
    coll(GP_OP_ncclSend, t0, comm, nbytes(n, dt), peer, rc, st, GP_SEQ_SEND);
    return rc;
}

GP_EXPORT int ncclRecv(void *r, size_t n, int dt, int peer, Comm comm, Stream st)
{
    REAL(ncclRecv, int (*)(void *, size_t, int, int, Comm, Stream));
    u64 t0 = gp_now();
    int rc = real_ncclRecv(r, n, dt, peer, comm, st);
    coll(GP_OP_ncclRecv, t0, comm, nbytes(n, dt), peer, rc, st, GP_SEQ_RECV);
    return rc;
}

GP_EXPORT int ncclGroupStart(void)
{
    REAL(ncclGroupStart, int (*)(void));
    u64 t0 = gp_now();
    int rc = real_ncclGroupStart();
    emit_call(GP_OP_ncclGroupStart, t0, NULL, GP_SEQ_NONE, 0, -1, rc, NULL);
    return rc;
}

GP_EXPORT int ncclGroupEnd(void)
{
    REAL(ncclGroupEnd, int (*)(void));
    u64 t0 = gp_now();
    int rc = real_ncclGroupEnd();
    emit_call(GP_OP_ncclGroupEnd, t0, NULL, GP_SEQ_NONE, 0, -1, rc, NULL);
    return rc;
}

static void inited(u16 op, int rc, Comm *comm, int nranks, const UniqueId *id, int rank)
{
    u64 pos;
    struct gp_record *rec;
    struct gp_fp_comm *c = comm_event(op, &pos, &rec);
    if (!c)
        return;
    c->handle = comm ? (u64)(uintptr_t)*comm : 0;
    c->size = nranks;
    c->rank = rank;
    c->ret = rc;
    c->uid_hash = gp_fnv1a64(id->internal, sizeof(id->internal));
    gp_publish(rec, pos);
}

GP_EXPORT int ncclCommInitRank(Comm *comm, int nranks, UniqueId id, int rank)
{
    REAL(ncclCommInitRank, int (*)(Comm *, int, UniqueId, int));
    int rc = real_ncclCommInitRank(comm, nranks, id, rank);
    inited(GP_COP_ncclCommInitRank, rc, comm, nranks, &id, rank);
    return rc;
}

GP_EXPORT int ncclCommInitRankConfig(Comm *comm, int nranks, UniqueId id, int rank, void *config)
{
    REAL(ncclCommInitRankConfig, int (*)(Comm *, int, UniqueId, int, void *));
    int rc = real_ncclCommInitRankConfig(comm, nranks, id, rank, config);
    inited(GP_COP_ncclCommInitRankConfig, rc, comm, nranks, &id, rank);
    return rc;
}

GP_EXPORT int ncclCommInitAll(Comm *comms, int ndev, const int *devlist)
{
    REAL(ncclCommInitAll, int (*)(Comm *, int, const int *));
    int rc = real_ncclCommInitAll(comms, ndev, devlist);
    u64 t = gp_now();
    for (int i = 0; i < ndev && i < 8; i++) {
        u64 pos;
        struct gp_record *rec;
        struct gp_fp_comm *c = comm_event(GP_COP_ncclCommInitAll, &pos, &rec);
        if (!c)
            return rc;
        c->t_ns = t; /* one time for all: the collector derives the shared id from it */
        c->handle = comms ? (u64)(uintptr_t)comms[i] : 0;
        c->rank = i;
        c->size = ndev;
        c->index = (u64)i;
        c->ret = rc;
        gp_publish(rec, pos);
    }
    return rc;
}

GP_EXPORT int ncclCommSplit(Comm comm, int color, int key, Comm *newcomm, void *config)
{
    REAL(ncclCommSplit, int (*)(Comm, int, int, Comm *, void *));
    REAL(ncclCommCount, int (*)(Comm, int *));
    REAL(ncclCommUserRank, int (*)(Comm, int *));
    int rc = real_ncclCommSplit(comm, color, key, newcomm, config);
    u64 pos;
    struct gp_record *rec;
    struct gp_fp_comm *c = comm_event(GP_COP_ncclCommSplit, &pos, &rec);
    if (!c)
        return rc;
    c->parent = (u64)(uintptr_t)comm;
    c->index = gp_next(GP_SEQ_CREATE, c->parent, 0, 0);
    c->handle = (rc == 0 && newcomm) ? (u64)(uintptr_t)*newcomm : 0;
    c->color = color;
    c->key = key;
    c->ret = rc;
    int v;
    if (c->handle && real_ncclCommCount((Comm)(uintptr_t)c->handle, &v) == 0)
        c->size = v;
    if (c->handle && real_ncclCommUserRank((Comm)(uintptr_t)c->handle, &v) == 0)
        c->rank = v;
    gp_publish(rec, pos);
    return rc;
}

static void gone(u16 op, Comm comm, int rc)
{
    u64 h = (u64)(uintptr_t)comm;
    gp_reset(GP_SEQ_COLL, h);
    gp_reset(GP_SEQ_CREATE, h);
    u64 pos;
    struct gp_record *rec;
    struct gp_fp_comm *c = comm_event(op, &pos, &rec);
    if (!c)
        return;
    c->handle = h;
    c->ret = rc;
    gp_publish(rec, pos);
}

GP_EXPORT int ncclCommDestroy(Comm comm)
{
    REAL(ncclCommDestroy, int (*)(Comm));
    int rc = real_ncclCommDestroy(comm);
    gone(GP_COP_ncclCommDestroy, comm, rc);
    return rc;
}

GP_EXPORT int ncclCommAbort(Comm comm)
{
    REAL(ncclCommAbort, int (*)(Comm));
    int rc = real_ncclCommAbort(comm);
    gone(GP_COP_ncclCommAbort, comm, rc);
    return rc;
}
