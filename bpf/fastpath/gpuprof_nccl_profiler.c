/* NCCL profiler plugin (libnccl-profiler-gpuprof.so, NCCL_PROFILER_PLUGIN=<its path>, set by the
 * TaskProlog in mode `collectives`): NCCL's own events of every collective and point-to-point
 * operation into this process's shared-memory ring, the one the interposers write
 * (fp_common.c), so the collector drains them with the rest (collector/sources/fastpath.py).
 *
 * Per operation two records: GP_REC_NCCL_OP at the Coll/P2p event's stop (host enqueue times,
 * communicator hash, sequence, op, count, datatype, root/peer) and GP_REC_NCCL_DEV once its kernel
 * channels (v3+) or proxy steps (v1, v2) are done: the device-side start and end, which event gave
 * them (`timing`), algorithm, protocol, channels. docs/probes.md, "NCCL profiler plugin".
 *
 * Never blocking NCCL: operations live in a fixed pool reused in claim order (no allocation after
 * load); a record that does not fit the ring is dropped and counted by gp_claim; the only lock is
 * a per-operation spin flag held for a few stores, between NCCL's threads of one operation.
 * PXN: a proxy event whose originator pid is another process's has a parent pointer of that
 * process: it is never dereferenced, and no parent pointer is used unless it is one of ours.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp_common.h"
#include "fp_resolve.h"
#include "nccl_profiler_abi.h"

#define POOL 8192        /* operations in flight (enqueued, kernels not done): reused in claim order */
#define CHILD_POOL 16384 /* kernel channel, proxy op and proxy step events in flight */
#define CONTEXTS 256     /* communicators of one process */
typedef int64_t s64;

struct np_ctx {
    u64 comm_hash;
    u64 coll_seq; /* next collective's sequence number on this communicator */
    s32 rank;
    s32 nranks;
    s32 nnodes;
    u32 version;
    int announced; /* v1..v3: the communicator record waits for the first operation (its hash) */
    char name[24];
};

struct np_op {
    u32 lock;
    u32 gen; /* bumped at every reuse: a late child of an earlier operation is ignored */
    u32 live; /* 1 from claim to completion */
    u32 stopped;
    u32 children; /* children started and not yet stopped */
    u32 channels_seen; /* children that gave times */
    u32 channels_expected; /* v4+: nChannels kernel channels; 0: complete when no child is left */
    struct np_ctx *ctx;
    u64 seq, count, t_start;
    u32 nccl_seq;
    s32 peer;
    u16 op;
    u8 datatype, algorithm, protocol, p2p, timing;
    u64 dev_start, dev_end, pair_host;
    s64 pair_delta;
    int have_pair;
};

struct np_child {
    u32 op_gen;
    struct np_op *op; /* NULL: not ours (PXN) or its parent was not tracked */
    u64 host_start;
    u64 gpu_start;
    u8 type;
};

static struct np_op ops[POOL];
static struct np_child children[CHILD_POOL];
static struct np_ctx contexts[CONTEXTS];
static u64 op_cursor, child_cursor;
static u32 ctx_count;
static int group_sentinel; /* the handle of the events we do not track (Group, API events...) */
static pid_t my_pid;

static void lock(struct np_op *o)
{
    while (__atomic_exchange_n(&o->lock, 1, __ATOMIC_ACQUIRE))
        __builtin_ia32_pause();
}

static void unlock(struct np_op *o)
{
    __atomic_store_n(&o->lock, 0, __ATOMIC_RELEASE);
}

static struct np_op *as_op(void *h)
{
    char *p = h, *base = (char *)ops;
    if (p < base || p >= base + sizeof(ops) || (size_t)(p - base) % sizeof(struct np_op))
        return NULL;
    return (struct np_op *)p;
}

static struct np_child *as_child(void *h)
{
    char *p = h, *base = (char *)children;
    if (p < base || p >= base + sizeof(children) || (size_t)(p - base) % sizeof(struct np_child))
        return NULL;
    return (struct np_child *)p;
}

/* --- names NCCL gives as strings -> our enums ---------------------------------------------------- */
static int streq(const char *a, const char *b)
{
    return a && strcmp(a, b) == 0;
}

/* 0xffff: not an operation of /collectives/calls (NCCL's one-sided PutSignal, Signal...) */
static u16 op_of(const char *func)
{
    if (!func)
        return 0xffff;
    static const struct {
        const char *name;
        u16 op;
    } t[] = {{"AllReduce", GP_OP_ncclAllReduce}, {"AllGather", GP_OP_ncclAllGather},
             {"ReduceScatter", GP_OP_ncclReduceScatter}, {"Broadcast", GP_OP_ncclBroadcast},
             {"Reduce", GP_OP_ncclReduce}, {"Send", GP_OP_ncclSend}, {"Recv", GP_OP_ncclRecv},
             {"AlltoAll", GP_OP_ncclAlltoAll}, {"Gather", GP_OP_ncclGather}, {"Scatter", GP_OP_ncclScatter}};
    for (unsigned i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        if (strcmp(func, t[i].name) == 0)
            return t[i].op;
    return 0xffff;
}

/* v1's ncclFunc_t values (NCCL 2.23) */
static const char *func_v1(u8 f)
{
    static const char *names[] = {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce", "SendRecv",
                                  "Send", "Recv"};
    return f < 8 ? names[f] : NULL;
}

/* ncclDataType_t order; "ncclFloat32"... as NCCL's strings */
static u8 datatype_of(const char *s)
{
    static const char *names[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                  "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3",
                                  "ncclFloat8e5m2"};
    for (u8 i = 0; s && i < 12; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return GP_NCCL_DT_UNKNOWN;
}

static u8 algorithm_of(const char *s)
{
    static const char *names[] = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"};
    for (u8 i = 0; s && i < 7; i++)
        if (strcmp(s, names[i]) == 0)
            return (u8)(i + 1);
    return 0;
}

static u8 protocol_of(const char *s)
{
    if (streq(s, "LL"))
        return 1;
    if (streq(s, "LL128"))
        return 2;
    if (streq(s, "SIMPLE"))
        return 3;
    return 0;
}

/* --- records ---------------------------------------------------------------------------------------- */
static void announce(struct np_ctx *c)
{
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_NCCL_COMM, &pos);
    if (!r)
        return;
    struct gp_nccl_comm *m = &r->u.nccl_comm;
    memset(m, 0, sizeof(*m));
    m->t_ns = gp_now();
    m->comm_hash = c->comm_hash;
    m->context = (u64)(uintptr_t)c;
    m->pid = gp_pid();
    m->tid = gp_tid();
    m->rank = c->rank;
    m->nranks = c->nranks;
    m->nnodes = c->nnodes;
    m->version = c->version;
    memcpy(m->name, c->name, sizeof(m->name));
    gp_publish(r, pos);
    c->announced = 1;
}

static void emit_op(struct np_op *o, u64 t_stop)
{
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_NCCL_OP, &pos);
    if (!r)
        return;
    struct gp_nccl_op *k = &r->u.nccl_op;
    k->t_start_ns = o->t_start;
    k->t_stop_ns = t_stop;
    k->comm_hash = o->ctx->comm_hash;
    k->seq = o->seq;
    k->count = o->count;
    k->context = (u64)(uintptr_t)o->ctx;
    k->tid = gp_tid();
    k->peer = o->peer;
    k->rank = o->ctx->rank;
    k->nranks = o->ctx->nranks;
    k->op = o->op;
    k->datatype = o->datatype;
    k->flags = o->p2p ? GP_NCCL_F_P2P : 0;
    k->nccl_seq = o->nccl_seq;
    gp_publish(r, pos);
}

/* Called with the operation locked. */
static void emit_dev(struct np_op *o)
{
    if (!o->channels_seen)
        return; /* no child gave a time: the calls row alone says what is known */
    u64 pos;
    struct gp_record *r = gp_claim(GP_REC_NCCL_DEV, &pos);
    if (!r)
        return;
    struct gp_nccl_dev *d = &r->u.nccl_dev;
    d->comm_hash = o->ctx->comm_hash;
    d->seq = o->seq;
    d->count = o->count;
    d->dev_start = o->dev_start;
    d->dev_end = o->dev_end;
    d->pair_host = o->have_pair ? o->pair_host : 0;
    d->pair_delta = o->have_pair ? (u64)o->pair_delta : 0;
    d->op = o->op;
    d->n_channels = (u16)o->channels_seen;
    d->peer = o->peer;
    d->timing = o->timing;
    d->algorithm = o->algorithm;
    d->protocol = o->protocol;
    d->datatype = o->datatype;
    gp_publish(r, pos);
}

/* Locked: the operation is complete when NCCL stopped it (enqueued) and its device work is done. */
static void maybe_complete(struct np_op *o)
{
    if (!o->live || !o->stopped || o->children)
        return;
    if (o->channels_expected ? o->channels_seen < o->channels_expected : !o->channels_seen)
        return;
    emit_dev(o);
    o->live = 0;
    o->gen++;
}

static struct np_op *claim_op(void)
{
    struct np_op *o = &ops[__atomic_fetch_add(&op_cursor, 1, __ATOMIC_RELAXED) % POOL];
    lock(o);
    if (o->live)
        emit_dev(o); /* POOL operations later and still not complete: retired with what it has */
    u32 gen = o->gen + 1;
    memset((char *)o + offsetof(struct np_op, live), 0, sizeof(*o) - offsetof(struct np_op, live));
    o->gen = gen;
    o->live = 1;
    o->dev_start = ~0ULL;
    unlock(o);
    return o;
}

static u32 version_mask(u32 version)
{
    u32 m = ncclProfileGroup | ncclProfileColl | ncclProfileP2p;
    if (version >= 3)
        return m | ncclProfileKernelCh;
    return m | ncclProfileProxyOp | ncclProfileProxyStep;
}

/* --- the interface, version-neutral ------------------------------------------------------------------- */
static ncclResult_t do_init(void **context, int *mask, u32 version, u64 comm_hash, const char *name, int nnodes,
                            int nranks, int rank)
{
    *context = NULL;
    /* Not a profiled job step (no ring directory named): decline, NCCL goes on without a plugin. */
    const char *dir = getenv("GPUPROF_FASTPATH_DIR");
    if (!dir || !*dir)
        return GP_NCCL_INTERNAL_ERROR;
    u32 i = __atomic_fetch_add(&ctx_count, 1, __ATOMIC_RELAXED);
    if (i >= CONTEXTS)
        return GP_NCCL_INTERNAL_ERROR;
    if (!my_pid)
        my_pid = getpid();
    struct np_ctx *c = &contexts[i];
    memset(c, 0, sizeof(*c));
    c->comm_hash = comm_hash;
    c->rank = rank;
    c->nranks = nranks;
    c->nnodes = nnodes;
    c->version = version;
    if (name)
        strncpy(c->name, name, sizeof(c->name) - 1);
    __atomic_store_n(mask, (int)version_mask(version), __ATOMIC_RELAXED);
    *context = c;
    if (version >= 4)
        announce(c);
    return GP_NCCL_SUCCESS;
}

/* What a start event says, whatever the version. */
struct np_desc {
    u64 type;
    void *parent;
    int rank;
    const char *func;
    size_t count;
    const char *datatype;
    int root_or_peer;
    u8 n_channels;
    const char *algo, *proto;
    u64 seq_number;
    u64 comm_hash; /* v1..v3: in the descriptor */
    const char *comm_name;
    pid_t proxy_pid;
    u64 ptimer; /* v4+: kernel channel start on the GPU timer */
    int has_ptimer;
};

static void start_operation(struct np_ctx *c, void **handle, const struct np_desc *d)
{
    u16 op = op_of(d->func);
    if (op == 0xffff) {
        *handle = &group_sentinel;
        return;
    }
    if (!c->announced) {
        c->comm_hash = d->comm_hash;
        if (d->comm_name)
            strncpy(c->name, d->comm_name, sizeof(c->name) - 1);
        c->rank = d->rank;
        announce(c);
    }
    struct np_op *o = claim_op();
    o->t_start = gp_now();
    o->ctx = c;
    o->op = op;
    o->count = d->count;
    o->datatype = datatype_of(d->datatype);
    o->algorithm = algorithm_of(d->algo);
    o->protocol = protocol_of(d->proto);
    o->p2p = d->type == ncclProfileP2p;
    o->peer = o->p2p || op == GP_OP_ncclBroadcast || op == GP_OP_ncclReduce || op == GP_OP_ncclGather ||
                      op == GP_OP_ncclScatter
                  ? d->root_or_peer
                  : -1;
    o->nccl_seq = (u32)d->seq_number;
    if (o->p2p)
        o->seq = gp_next(op == GP_OP_ncclSend ? GP_SEQ_SEND : GP_SEQ_RECV, (u64)(uintptr_t)c, o->peer, -1);
    else
        o->seq = __atomic_fetch_add(&c->coll_seq, 1, __ATOMIC_RELAXED);
    o->channels_expected = c->version >= 4 ? d->n_channels : 0;
    o->timing = c->version >= 4 ? GP_NCCL_TIMING_GPU_TIMER
                : c->version == 3 ? GP_NCCL_TIMING_KERNEL_HOST
                                  : GP_NCCL_TIMING_PROXY_STEP_HOST;
    *handle = o;
}

/* A child of an operation: a kernel channel (v3+) or, v1 and v2, a proxy op (parent) or step. */
static void start_child(void **handle, const struct np_desc *d)
{
    struct np_child *ch = &children[__atomic_fetch_add(&child_cursor, 1, __ATOMIC_RELAXED) % CHILD_POOL];
    struct np_op *o = NULL;
    u32 op_gen = 0;
    if (d->type == ncclProfileProxyStep) {
        struct np_child *up = as_child(d->parent); /* a step's parent is its proxy op */
        if (up && up->op && up->type == ncclProfileProxyOp) {
            o = up->op;
            op_gen = up->op_gen;
        }
    } else if (!(d->type == ncclProfileProxyOp && d->proxy_pid != my_pid)) {
        /* a PXN proxy op (another process's operation) has a parent we must not dereference */
        o = as_op(d->parent);
        if (o)
            op_gen = __atomic_load_n(&o->gen, __ATOMIC_RELAXED);
    }
    ch->type = (u8)d->type;
    ch->host_start = gp_now();
    ch->gpu_start = d->has_ptimer ? d->ptimer : 0;
    ch->op = NULL;
    if (o) {
        /* a proxy op counts as a child too (without times of its own): the operation is not
         * complete while one of its proxy ops may still start steps */
        lock(o);
        if (o->live && o->gen == op_gen) {
            o->children++;
            ch->op = o;
            ch->op_gen = op_gen;
        }
        unlock(o);
    }
    *handle = ch;
}

static void pair(struct np_op *o, u64 host, u64 gpu)
{
    s64 delta = (s64)(host - gpu);
    if (!o->have_pair || delta < o->pair_delta) {
        o->pair_delta = delta;
        o->pair_host = host;
        o->have_pair = 1;
    }
}

/* A kernel channel or proxy step ended: its times into its operation. gpu_stop: v4+'s timer. */
static void stop_child(struct np_child *ch, u64 gpu_stop, int has_gpu_stop)
{
    struct np_op *o = ch->op;
    if (!o)
        return;
    u64 now = gp_now();
    lock(o);
    if (o->live && o->gen == ch->op_gen && ch->type == ncclProfileProxyOp) {
        if (o->children)
            o->children--;
        maybe_complete(o);
    } else if (o->live && o->gen == ch->op_gen) {
        u64 start = ch->host_start, end = now;
        if (o->timing == GP_NCCL_TIMING_GPU_TIMER) {
            if (ch->gpu_start && has_gpu_stop && gpu_stop >= ch->gpu_start) {
                start = ch->gpu_start;
                end = gpu_stop;
                pair(o, ch->host_start, ch->gpu_start);
                pair(o, now, gpu_stop);
            } else if (!o->channels_seen) {
                o->timing = GP_NCCL_TIMING_KERNEL_HOST; /* this NCCL gave no timer: host-observed times */
            } else {
                start = end = 0; /* mixed: this channel's host times are not on the GPU timer */
            }
        }
        if (start && start < o->dev_start)
            o->dev_start = start;
        if (end > o->dev_end)
            o->dev_end = end;
        if (start)
            o->channels_seen++;
        if (o->children)
            o->children--;
        maybe_complete(o);
    }
    unlock(o);
    ch->op = NULL;
}

static ncclResult_t do_start(void *context, void **handle, const struct np_desc *d)
{
    *handle = NULL;
    struct np_ctx *c = context;
    if (!c)
        return GP_NCCL_SUCCESS;
    switch (d->type) {
    case ncclProfileColl:
    case ncclProfileP2p:
        start_operation(c, handle, d);
        break;
    case ncclProfileKernelCh:
    case ncclProfileProxyOp:
    case ncclProfileProxyStep:
        start_child(handle, d);
        break;
    default:
        *handle = &group_sentinel; /* groups and API events: parents only */
        break;
    }
    return GP_NCCL_SUCCESS;
}

static ncclResult_t do_stop(void *handle)
{
    struct np_op *o = as_op(handle);
    if (o) {
        u64 now = gp_now();
        emit_op(o, now);
        lock(o);
        o->stopped = 1;
        maybe_complete(o);
        unlock(o);
        return GP_NCCL_SUCCESS;
    }
    struct np_child *ch = as_child(handle);
    if (ch && ch->op) {
        /* v4+ kernel channels record their stop (with the GPU time) just before stopEvent; a
         * channel stopped without it, and a v1..v3 child, ends here on host time. */
        stop_child(ch, 0, 0);
    }
    return GP_NCCL_SUCCESS;
}

static ncclResult_t do_record(void *handle, int state, u64 ptimer, int has_ptimer)
{
    struct np_child *ch = as_child(handle);
    if (ch && ch->op && state == ncclProfilerKernelChStop && ch->type == ncclProfileKernelCh)
        stop_child(ch, ptimer, has_ptimer);
    return GP_NCCL_SUCCESS;
}

static ncclResult_t do_finalize(void *context)
{
    return GP_NCCL_SUCCESS; /* contexts stay until the process exits: late events may name them */
}

/* --- per-version entry points -------------------------------------------------------------------------- */
#define COMMON_DESC(e)            \
    d.type = (e)->type;           \
    d.parent = (e)->parentObj;    \
    d.rank = (e)->rank;           \
    d.proxy_pid = (e)->proxyOp.pid

static ncclResult_t init_v1(void **c, int *m) { return do_init(c, m, 1, 0, NULL, -1, -1, -1); }
static ncclResult_t init_v2(void **c, int *m) { return do_init(c, m, 2, 0, NULL, -1, -1, -1); }
static ncclResult_t init_v3(void **c, int *m) { return do_init(c, m, 3, 0, NULL, -1, -1, -1); }

static ncclResult_t init_v4(void **c, int *m, const char *name, uint64_t hash, int nnodes, int nranks, int rank,
                            ncclDebugLogger_t log)
{
    return do_init(c, m, 4, hash, name, nnodes, nranks, rank);
}

/* v5..v7 take the same arguments (the communicator's id where v4 had its hash) */
#define GP_INIT_V5_LIKE(v)                                                                                    \
    static ncclResult_t init_v##v(void **c, uint64_t id, int *m, const char *name, int nnodes, int nranks,   \
                                  int rank, ncclDebugLogger_t log)                                          \
    {                                                                                                         \
        return do_init(c, m, v, id, name, nnodes, nranks, rank);                                              \
    }
GP_INIT_V5_LIKE(5)
GP_INIT_V5_LIKE(6)
GP_INIT_V5_LIKE(7)

static ncclResult_t start_v1(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v1_t *e = descr;
    struct np_desc d = {0};
    COMMON_DESC(e);
    if (e->type == ncclProfileColl) {
        d.func = func_v1(e->coll.func);
        d.count = e->coll.count;
        static const char *dts[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                    "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
        d.datatype = e->coll.datatype < 10 ? dts[e->coll.datatype] : NULL;
        static const char *algos[] = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE"};
        static const char *protos[] = {"LL", "LL128", "SIMPLE"};
        d.algo = e->coll.algo < 6 ? algos[e->coll.algo] : NULL;
        d.proto = e->coll.proto < 3 ? protos[e->coll.proto] : NULL;
        d.root_or_peer = e->coll.root;
        d.seq_number = e->coll.seqNumber;
        d.comm_hash = e->coll.commHash;
        d.comm_name = e->coll.name;
    } else if (e->type == ncclProfileP2p) {
        d.func = func_v1(e->p2p.func);
        d.count = e->p2p.count;
        d.root_or_peer = e->p2p.peer;
        d.comm_hash = e->p2p.commHash;
        d.comm_name = e->p2p.name;
        static const char *dts[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                    "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
        d.datatype = e->p2p.datatype < 10 ? dts[e->p2p.datatype] : NULL;
    }
    return do_start(c, h, &d);
}

static ncclResult_t start_v2(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v2_t *e = descr;
    struct np_desc d = {0};
    COMMON_DESC(e);
    if (e->type == ncclProfileColl) {
        d.func = e->coll.func;
        d.count = e->coll.count;
        d.datatype = e->coll.datatype;
        d.algo = e->coll.algo;
        d.proto = e->coll.proto;
        d.root_or_peer = e->coll.root;
        d.seq_number = e->coll.seqNumber;
        d.comm_hash = e->coll.commHash;
        d.comm_name = e->coll.name;
    } else if (e->type == ncclProfileP2p) {
        d.func = e->p2p.func;
        d.count = e->p2p.count;
        d.datatype = e->p2p.datatype;
        d.root_or_peer = e->p2p.peer;
        d.comm_hash = e->p2p.commHash;
        d.comm_name = e->p2p.name;
    }
    return do_start(c, h, &d);
}

static ncclResult_t start_v3(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v3_t *e = descr;
    struct np_desc d = {0};
    COMMON_DESC(e);
    if (e->type == ncclProfileColl) {
        d.func = e->coll.func;
        d.count = e->coll.count;
        d.datatype = e->coll.datatype;
        d.algo = e->coll.algo;
        d.proto = e->coll.proto;
        d.root_or_peer = e->coll.root;
        d.seq_number = e->coll.seqNumber;
        d.comm_hash = e->coll.commHash;
        d.comm_name = e->coll.name;
    } else if (e->type == ncclProfileP2p) {
        d.func = e->p2p.func;
        d.count = e->p2p.count;
        d.datatype = e->p2p.datatype;
        d.root_or_peer = e->p2p.peer;
        d.comm_hash = e->p2p.commHash;
        d.comm_name = e->p2p.name;
    }
    return do_start(c, h, &d);
}

/* v4..v7 descriptors agree on every member read here (type widened to 64 bits in v5; v7 appends its
 * user tag after them): the offsets are asserted in tests/doubles/nccl_profiler_host.c. */
#define START_V4PLUS(e)                                \
    struct np_desc d = {0};                            \
    COMMON_DESC(e);                                    \
    if (d.type == ncclProfileColl) {                   \
        d.func = (e)->coll.func;                       \
        d.count = (e)->coll.count;                     \
        d.datatype = (e)->coll.datatype;               \
        d.algo = (e)->coll.algo;                       \
        d.proto = (e)->coll.proto;                     \
        d.root_or_peer = (e)->coll.root;               \
        d.seq_number = (e)->coll.seqNumber;            \
        d.n_channels = (e)->coll.nChannels;            \
    } else if (d.type == ncclProfileP2p) {             \
        d.func = (e)->p2p.func;                        \
        d.count = (e)->p2p.count;                      \
        d.datatype = (e)->p2p.datatype;                \
        d.root_or_peer = (e)->p2p.peer;                \
        d.n_channels = (e)->p2p.nChannels;             \
    } else if (d.type == ncclProfileKernelCh) {        \
        d.ptimer = (e)->kernelCh.pTimer;               \
        d.has_ptimer = 1;                              \
    }                                                  \
    return do_start(c, h, &d)

static ncclResult_t start_v4(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v4_t *e = descr;
    START_V4PLUS(e);
}

static ncclResult_t start_v5(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v5_t *e = descr;
    START_V4PLUS(e);
}

/* v7: the same members at the same offsets (asserted below); a user tag is not recorded yet. */
_Static_assert(offsetof(gp_ncclProfilerEventDescr_v7_t, coll.nChannels) ==
                   offsetof(gp_ncclProfilerEventDescr_v6_t, coll.nChannels) &&
               offsetof(gp_ncclProfilerEventDescr_v7_t, coll.parentGroup) ==
                   offsetof(gp_ncclProfilerEventDescr_v6_t, coll.parentGroup) &&
               offsetof(gp_ncclProfilerEventDescr_v7_t, p2p.nChannels) ==
                   offsetof(gp_ncclProfilerEventDescr_v6_t, p2p.nChannels) &&
               offsetof(gp_ncclProfilerEventDescr_v7_t, kernelCh.pTimer) ==
                   offsetof(gp_ncclProfilerEventDescr_v6_t, kernelCh.pTimer),
               "v7 reads v6's members");
static ncclResult_t start_v7(void *c, void **h, void *descr)
{
    gp_ncclProfilerEventDescr_v7_t *e = descr;
    START_V4PLUS(e);
}

static ncclResult_t record_v1(void *h, int state, void *args)
{
    return do_record(h, state, 0, 0);
}

static ncclResult_t record_v4(void *h, int state, void *args)
{
    gp_ncclProfilerEventStateArgs_v4_t *a = args;
    return do_record(h, state, a ? a->kernelCh.pTimer : 0, a != NULL);
}

#define NAME "gpuprof"
GP_EXPORT gp_ncclProfiler_v1_t ncclProfiler_v1 = {NAME, init_v1, start_v1, do_stop, record_v1, do_finalize};
GP_EXPORT gp_ncclProfiler_v1_t ncclProfiler_v2 = {NAME, init_v2, start_v2, do_stop, record_v1, do_finalize};
GP_EXPORT gp_ncclProfiler_v1_t ncclProfiler_v3 = {NAME, init_v3, start_v3, do_stop, record_v1, do_finalize};
GP_EXPORT gp_ncclProfiler_v4_t ncclProfiler_v4 = {NAME, init_v4, start_v4, do_stop, record_v4, do_finalize};
GP_EXPORT gp_ncclProfiler_v5_t ncclProfiler_v5 = {NAME, init_v5, start_v5, do_stop, record_v4, do_finalize};
GP_EXPORT gp_ncclProfiler_v5_t ncclProfiler_v6 = {NAME, init_v6, start_v5, do_stop, record_v4, do_finalize};
GP_EXPORT gp_ncclProfiler_v5_t ncclProfiler_v7 = {NAME, init_v7, start_v7, do_stop, record_v4, do_finalize};
