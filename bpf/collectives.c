/* Collectives of MPI and NCCL through uprobes and uretprobes (mode `collectives`).
 *
 * One entry program per probed symbol (it only names the probe) and one return program shared by
 * all. What each argument means is not written here: the collector fills gp_descs from the probe
 * table in collector/sources/bpf_collectives.py (argument positions, datatypes, what to read), so
 * one generic decoder serves every entry point. Arguments are numbered as in the C prototype;
 * System V x86-64 passes 1..6 in registers and 7.. on the stack at SP+8, SP+16, ... at entry.
 *
 * Sequence numbers live here, in kernel maps, so that a record lost in the ring leaves a gap
 * instead of shifting every later number on that communicator.
 */
#include "gpuprof_events.h"
#include "gpuprof_ops.h"

#define GP_K_CALL 0
#define GP_K_COMM 1

#define GP_SEQ_COLL 0
#define GP_SEQ_SEND 1
#define GP_SEQ_RECV 2
#define GP_SEQ_CREATE 3

#define GP_MAX_ALL_REQUESTS 16 /* MPI_Waitall/Testall/Waitany/Waitsome: the first requests of the array */
#define GP_MPI_UNDEFINED (-32766) /* the index MPI_Waitany writes when no request was active (both ABIs) */
#define GP_MAX_V_RANKS 64      /* v-variants: counts summed over at most this many ranks */
#define GP_MAX_INITALL 8       /* ncclCommInitAll: communicators reported */

struct gp_desc {
    u16 op;          /* GP_OP_* for calls, GP_COP_* for communicator events */
    u8 kind;         /* GP_K_CALL or GP_K_COMM */
    u8 library;      /* GP_LIB_MPI or GP_LIB_NCCL */
    u8 comm;         /* arg with the communicator, 0: none */
    u8 comm_ptr;     /* 1: that arg points to the handle (MPI_Comm_free) */
    u8 count;        /* arg with the element count, 0: none */
    u8 count_array;  /* 1: the count arg is an int array, summed over the communicator size */
    u8 dtype;        /* arg with the datatype */
    u8 peer;         /* arg with the root or the peer */
    u8 tag;          /* arg with the tag */
    u8 request;      /* arg: MPI_Request* (out for initiations, in for completions) */
    u8 stream;       /* arg with the cudaStream_t */
    u8 p2p;          /* 0 collective, 1 send, 2 receive, 3 sendrecv */
    u8 count2;       /* receive half of MPI_Sendrecv: count, datatype, source, tag */
    u8 dtype2;
    u8 peer2;
    u8 tag2;
    u8 completion;   /* 1 wait (request), 2 test (request, flag), 3 waitall, 4 testall, 5 waitany, 6 waitsome */
    u8 flag;         /* arg: int* flag of the test forms */
    u8 index;        /* arg: int* index (waitany) or outcount (waitsome) the call writes */
    u8 indices;      /* arg: int* array of the indices waitsome completed */
    u8 newcomm;      /* arg: pointer that receives the created handle */
    u8 color;        /* communicator events: args with color, key, rank, size */
    u8 key;
    u8 rank;
    u8 size;
    u8 out_int;      /* arg: int* written by the call (rank or size queries) */
    u8 uid;          /* 1: ncclUniqueId by value in the first stack slot */
    u8 ndev;         /* arg with the device count of ncclCommInitAll */
    u8 noseq;        /* 1: not an instance on a communicator (ncclGroupStart/End) */
    u8 pad[2];
};

struct gp_saved {
    u64 t_enter;
    u64 a[6];
    u64 s[8];  /* args 7..14 */
    u64 pre;   /* read at entry: the request of a completion, the handle MPI_Comm_free frees */
    u32 probe;
    u32 narrow; /* MPI handles are 32-bit integers (MPICH ABI) */
    u8 buf[128]; /* the ncclUniqueId, or the request array of MPI_Waitall/Testall/Waitany/Waitsome */
};

struct gp_frame_key {
    u64 pid_tgid;
    u64 depth;
};

struct gp_seq_key {
    u32 tgid;
    u32 kind;
    u64 handle;
    s32 peer;
    s32 tag;
};

struct gp_hkey {
    u32 tgid;
    u32 what;
    u64 handle;
};

struct gp_req {
    u64 handle;
    u64 seq;
    u64 bytes;
    s32 peer;
    s32 tag;
    u64 where; /* the address of the caller's variable the request was written to */
    u64 order; /* when it was put: the later of two requests of one handle has the higher */
};

struct gp_counts {
    u32 v[GP_MAX_V_RANKS];
};

BPF_ARRAY(gp_descs, struct gp_desc, 128);
BPF_PERCPU_ARRAY(gp_counts_scratch, struct gp_counts, 1);
BPF_PERCPU_ARRAY(gp_scratch, struct gp_saved, 1);
BPF_TABLE("lru_hash", struct gp_frame_key, struct gp_saved, gp_inflight, 16384);
BPF_TABLE("lru_hash", u64, u32, gp_depth, 16384);
BPF_HASH(gp_seq, struct gp_seq_key, u64, 65536);
BPF_TABLE("lru_hash", struct gp_hkey, struct gp_req, gp_reqs, 65536);
BPF_HASH(gp_commsz, struct gp_hkey, s32, 16384);   /* (tgid, handle) -> size, for v-variants */
BPF_HASH(gp_seen, struct gp_hkey, s32, 16384);     /* last rank/size value reported */
BPF_HASH(gp_mpich, u32, u8, 65536);                /* tgid -> 1 when its MPI uses 32-bit handles */
BPF_PERCPU_ARRAY(gp_coll_drops, u64, 2);           /* [0] calls ring full, [1] comms ring full */
BPF_RINGBUF_OUTPUT(gp_calls, GP_CALLS_PAGES);
BPF_RINGBUF_OUTPUT(gp_comms, 16);

static __always_inline u64 gp_arg(struct gp_saved *s, u32 n)
{
    if (n >= 1 && n <= 6)
        return s->a[(n - 1) & 7];
    if (n >= 7 && n <= 14)
        return s->s[(n - 7) & 7];
    return 0;
}

static __always_inline u64 gp_handle(u64 v, u32 narrow)
{
    return narrow ? (v & 0xffffffffULL) : v;
}

static __always_inline u64 gp_read_handle(u64 ptr, u32 narrow)
{
    u64 v = 0;
    if (narrow) {
        u32 w = 0;
        bpf_probe_read_user(&w, sizeof(w), (void *)ptr);
        return w;
    }
    bpf_probe_read_user(&v, sizeof(v), (void *)ptr);
    return v;
}

static __always_inline void gp_drop(u32 which)
{
    u64 *c = gp_coll_drops.lookup(&which);
    if (c)
        (*c)++;
}

static __always_inline u64 gp_next(u32 tgid, u32 kind, u64 handle, s32 peer, s32 tag)
{
    struct gp_seq_key k = {};
    u64 zero = 0;
    k.tgid = tgid;
    k.kind = kind;
    k.handle = handle;
    k.peer = peer;
    k.tag = tag;
    u64 *v = gp_seq.lookup_or_try_init(&k, &zero);
    if (!v)
        return GP_SEQ_NONE;
    return __sync_fetch_and_add(v, 1);
}

static __always_inline void gp_forget(u32 tgid, u64 handle)
{
    struct gp_seq_key k = {};
    k.tgid = tgid;
    k.handle = handle;
    k.kind = GP_SEQ_COLL;
    gp_seq.delete(&k);
    k.kind = GP_SEQ_CREATE;
    gp_seq.delete(&k);
    struct gp_hkey h = {};
    h.tgid = tgid;
    h.handle = handle;
    gp_commsz.delete(&h);
    h.what = GP_COP_MPI_Comm_rank;
    gp_seen.delete(&h);
    h.what = GP_COP_MPI_Comm_size;
    gp_seen.delete(&h);
    h.what = GP_COP_ncclCommCount;
    gp_seen.delete(&h);
    h.what = GP_COP_ncclCommUserRank;
    gp_seen.delete(&h);
}

/* Size in bytes of one element; 0 when unknown. */
static __always_inline u64 gp_dt_size(u32 library, u64 dt, u32 narrow)
{
    if (library == GP_LIB_NCCL) {
        switch ((u32)dt) {
        case 0: case 1: case 10: case 11: return 1; /* int8, uint8, fp8 e4m3, fp8 e5m2 */
        case 6: case 9: return 2;                   /* float16, bfloat16 */
        case 2: case 3: case 7: return 4;           /* int32, uint32, float32 */
        case 4: case 5: case 8: return 8;           /* int64, uint64, float64 */
        default: return 0;
        }
    }
    if (narrow) {
        /* MPICH: a builtin datatype handle encodes its size in bits 8..15. */
        u32 h = (u32)dt;
        if ((h >> 30) == 1)
            return (h >> 8) & 0xff;
        return 0;
    }
    /* Open MPI: MPI_Datatype points to ompi_datatype_t, whose opal_datatype_t starts with
     * opal_object_t (16 bytes in release builds), u16 flags, u16 id, u32 bdt_used, size_t size. */
    u64 size = 0;
    if (dt == 0 || bpf_probe_read_user(&size, sizeof(size), (void *)(dt + 24)) != 0)
        return 0;
    if (size > (1ULL << 32))
        return 0;
    return size;
}

static __always_inline u64 gp_bytes(struct gp_saved *s, struct gp_desc *d, u32 tgid, u64 handle,
                                    u32 count_arg, u32 dtype_arg, u32 narrow)
{
    if (count_arg == 0)
        return 0; /* MPI_Barrier: really no payload */
    u64 dts = gp_dt_size(d->library, gp_arg(s, dtype_arg), narrow);
    if (dts == 0)
        return GP_BYTES_UNKNOWN;
    u64 raw = gp_arg(s, count_arg);
    if (!d->count_array) {
        u64 count = d->library == GP_LIB_NCCL ? raw : (u64)(u32)raw;
        return count * dts;
    }
    struct gp_hkey h = {};
    h.tgid = tgid;
    h.handle = handle;
    s32 *sz = gp_commsz.lookup(&h);
    if (!sz || *sz <= 0 || *sz > GP_MAX_V_RANKS)
        return GP_BYTES_UNKNOWN;
    u32 n = (u32)*sz;
    u32 zero = 0;
    struct gp_counts *c = gp_counts_scratch.lookup(&zero);
    if (!c)
        return GP_BYTES_UNKNOWN;
    /* One read of the whole array (the ranks past n are not read: the size is checked above). */
    u32 len = (((n - 1) & (GP_MAX_V_RANKS - 1)) + 1) * sizeof(u32); /* n in 1..64, bounded for the verifier */
    if (bpf_probe_read_user(c->v, len, (void *)raw) != 0)
        return GP_BYTES_UNKNOWN;
    u64 total = 0;
#pragma unroll
    for (int i = 0; i < GP_MAX_V_RANKS; i++) {
        if (i < n)
            total += (u64)c->v[i];
    }
    return total * dts;
}

static __always_inline int gp_enter(struct pt_regs *ctx, u32 probe)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!gp_in_job(tgid))
        return 0;
    struct gp_desc *d = gp_descs.lookup(&probe);
    if (!d)
        return 0;
    u32 zero = 0;
    struct gp_saved *s = gp_scratch.lookup(&zero);
    if (!s)
        return 0;
    s->t_enter = bpf_ktime_get_ns();
    s->probe = probe;
    s->a[0] = PT_REGS_PARM1(ctx);
    s->a[1] = PT_REGS_PARM2(ctx);
    s->a[2] = PT_REGS_PARM3(ctx);
    s->a[3] = PT_REGS_PARM4(ctx);
    s->a[4] = PT_REGS_PARM5(ctx);
    s->a[5] = PT_REGS_PARM6(ctx);
    bpf_probe_read_user(s->s, sizeof(s->s), (void *)(PT_REGS_SP(ctx) + 8));
    u8 *m = gp_mpich.lookup(&tgid);
    s->narrow = (d->library == GP_LIB_MPI && m && *m) ? 1 : 0;
    s->pre = 0;
    if ((d->completion == 1 || d->completion == 2) && d->request)
        s->pre = gp_read_handle(gp_arg(s, d->request), s->narrow);
    else if (d->completion >= 3 && d->request)
        bpf_probe_read_user(s->buf, sizeof(s->buf), (void *)gp_arg(s, d->request));
    else if (d->kind == GP_K_COMM && d->comm_ptr && d->comm)
        s->pre = gp_read_handle(gp_arg(s, d->comm), s->narrow);
    if (d->uid)
        bpf_probe_read_user(s->buf, sizeof(s->buf), (void *)(PT_REGS_SP(ctx) + 8));

    u32 *dp = gp_depth.lookup(&id);
    u32 depth = dp ? *dp : 0;
    struct gp_frame_key k = {};
    k.pid_tgid = id;
    k.depth = depth;
    gp_inflight.update(&k, s);
    depth++;
    gp_depth.update(&id, &depth);
    return 0;
}

/* Several requests outstanding at once can have one handle (Open MPI returns its one
 * ompi_request_empty for every MPI_Isend it completed at once, a small message; MPICH a builtin
 * request): a request is kept under (tgid, what, handle), `what` one of GP_REQ_SAME_HANDLE, with the
 * address of the variable it was written to, and taken back by handle and that address, or by the
 * handle alone when the caller waits on a copy (mpi4py copies its requests into an array for
 * MPI_Waitall), then the latest of that handle. A request completed where no probe saw it (by
 * MPI_Testany, which this path does not probe, or freed) stays behind: a later request written to
 * the same variable replaces it, and when the handle's slots are all taken the oldest goes; so it
 * never takes the place of a request still outstanding (tests/test_bpf_collectives.py runs both
 * kinds of completion in one job). The fast path keeps them so too (bpf/fastpath/fp_common.c). */
#define GP_REQ_SAME_HANDLE 8

static __always_inline void gp_req_put(struct gp_hkey *rk, struct gp_req *r)
{
    u32 oldest_what = 0;
    u64 oldest = ~0ULL;
    for (int w = 0; w < GP_REQ_SAME_HANDLE; w++) {
        rk->what = w;
        struct gp_req *cur = gp_reqs.lookup(rk);
        if (!cur || cur->where == r->where) {
            gp_reqs.update(rk, r);
            return;
        }
        if (cur->order < oldest) {
            oldest = cur->order;
            oldest_what = w;
        }
    }
    rk->what = oldest_what;
    gp_reqs.update(rk, r);
}

/* The request of rk's handle written to `where`, else the latest of that handle (rk->what set to
 * the one found, for the delete); NULL if none. */
static __always_inline struct gp_req *gp_req_find(struct gp_hkey *rk, u64 where)
{
    s32 found = -1;
    u64 latest = 0;
    for (int w = 0; w < GP_REQ_SAME_HANDLE; w++) {
        rk->what = w;
        struct gp_req *cur = gp_reqs.lookup(rk);
        if (!cur)
            continue;
        if (cur->where == where) {
            found = w;
            break;
        }
        if (found < 0 || cur->order > latest) {
            found = w;
            latest = cur->order;
        }
    }
    if (found < 0)
        return NULL;
    rk->what = (u32)found;
    return gp_reqs.lookup(rk);
}

/* Request i of the array a completion of several saved at its entry (MPI sets the completed ones to
 * MPI_REQUEST_NULL before it returns). */
static __always_inline u64 gp_saved_request(struct gp_saved *s, int i)
{
    return s->narrow ? ((u32 *)s->buf)[i & 31] : ((u64 *)s->buf)[i & (GP_MAX_ALL_REQUESTS - 1)];
}

/* The address of element i of the request array of a completion of several. */
static __always_inline u64 gp_request_address(struct gp_saved *s, struct gp_desc *d, int i)
{
    return gp_arg(s, d->request) + (u64)i * (s->narrow ? 4 : 8);
}

/* One call record into the calls ring (counted as dropped when the ring is full). */
static __always_inline void gp_submit_call(struct gp_saved *s, struct gp_desc *d, u64 id, u64 now, s64 rc, u8 flags,
                                           u64 handle, u64 seq, u64 bytes, u64 aux, s32 peer, s32 tag)
{
    struct gp_call *e = gp_calls.ringbuf_reserve(sizeof(struct gp_call));
    if (!e) {
        gp_drop(0);
        return;
    }
    e->t_enter_ns = s->t_enter;
    e->t_exit_ns = now;
    e->handle = handle;
    e->seq = seq;
    e->bytes = bytes;
    e->aux = aux;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->peer = peer;
    e->tag = tag;
    e->ret = (s32)rc;
    e->op = d->op;
    e->library = d->library;
    e->flags = flags;
    gp_calls.ringbuf_submit(e, 0);
}

/* One completion row of a call that completes several requests, naming the initiation of element
 * i of its array. */
static __always_inline void gp_emit_completion(struct gp_saved *s, struct gp_desc *d, u64 id, u64 now, s64 rc,
                                               u32 nested, int i)
{
    u64 req = gp_saved_request(s, i);
    struct gp_hkey rk = {};
    rk.tgid = id >> 32;
    rk.handle = req;
    struct gp_req *r = gp_req_find(&rk, gp_request_address(s, d, i));
    u8 flags = nested ? GP_F_NESTED : 0;
    if (!r) {
        gp_submit_call(s, d, id, now, rc, flags, 0, GP_SEQ_NONE, GP_BYTES_UNKNOWN, req, GP_NO_PEER, -1);
        return;
    }
    struct gp_req found = *r;
    gp_reqs.delete(&rk);
    gp_submit_call(s, d, id, now, rc, flags, found.handle, found.seq, found.bytes, req, found.peer, found.tag);
}

static __always_inline void gp_emit_call(struct gp_saved *s, struct gp_desc *d, u64 id, u64 now,
                                         s64 rc, u32 nested)
{
    u32 tgid = id >> 32;
    u32 narrow = s->narrow;
    u64 handle = 0;
    if (d->comm)
        handle = gp_handle(gp_arg(s, d->comm), narrow);
    s32 peer = d->peer ? (s32)gp_arg(s, d->peer) : GP_NO_PEER;
    s32 tag = d->tag ? (s32)gp_arg(s, d->tag) : -1;
    u64 seq = GP_SEQ_NONE;
    u64 bytes = 0;
    u64 aux = d->stream ? gp_arg(s, d->stream) : 0;

    if (d->completion == 2 || d->completion == 4) {
        s32 flag = 0;
        bpf_probe_read_user(&flag, sizeof(flag), (void *)gp_arg(s, d->flag));
        if (!flag)
            return; /* a test that found nothing complete is polling, not an event */
    }
    if (d->completion == 1 || d->completion == 2) {
        struct gp_hkey rk = {};
        rk.tgid = tgid;
        rk.handle = s->pre;
        struct gp_req *r = gp_req_find(&rk, gp_arg(s, d->request));
        aux = s->pre;
        if (r) {
            handle = r->handle;
            seq = r->seq;
            peer = r->peer;
            tag = r->tag;
            bytes = r->bytes;
            gp_reqs.delete(&rk);
        } else {
            bytes = GP_BYTES_UNKNOWN;
        }
    } else if (d->completion == 3 || d->completion == 4) {
        /* One row per request (at most GP_MAX_ALL_REQUESTS), each naming its initiation. */
        u32 n = (u32)gp_arg(s, d->count);
        for (int i = 0; i < GP_MAX_ALL_REQUESTS; i++) {
            if (i >= n)
                break;
            gp_emit_completion(s, d, id, now, rc, nested, i);
        }
        return;
    } else if (d->completion == 5) {
        /* MPI_Waitany: the request at the index it wrote (MPI_UNDEFINED: none was active) */
        s32 index = GP_MPI_UNDEFINED;
        bpf_probe_read_user(&index, sizeof(index), (void *)gp_arg(s, d->index));
        if (index >= 0 && index < GP_MAX_ALL_REQUESTS && index < (s32)gp_arg(s, d->count))
            gp_emit_completion(s, d, id, now, rc, nested, index);
        return;
    } else if (d->completion == 6) {
        /* MPI_Waitsome: a row per index it wrote, of the requests among the array's first
         * GP_MAX_ALL_REQUESTS (outcount MPI_UNDEFINED: none was active) */
        s32 out = 0;
        bpf_probe_read_user(&out, sizeof(out), (void *)gp_arg(s, d->index));
        s32 n = (s32)gp_arg(s, d->count);
        u64 indices = gp_arg(s, d->indices);
        for (int i = 0; i < GP_MAX_ALL_REQUESTS; i++) {
            if (i >= out)
                break;
            s32 k = -1;
            bpf_probe_read_user(&k, sizeof(k), (void *)(indices + i * sizeof(s32)));
            if (k >= 0 && k < GP_MAX_ALL_REQUESTS && k < n)
                gp_emit_completion(s, d, id, now, rc, nested, k);
        }
        return;
    } else {
        bytes = gp_bytes(s, d, tgid, handle, d->count, d->dtype, narrow);
        if (d->p2p == 1 || d->p2p == 3)
            seq = gp_next(tgid, GP_SEQ_SEND, handle, peer, tag);
        else if (d->p2p == 2)
            seq = gp_next(tgid, GP_SEQ_RECV, handle, peer, tag);
        else if (!d->noseq)
            seq = gp_next(tgid, GP_SEQ_COLL, handle, 0, 0);
        if (d->request) {
            struct gp_hkey rk = {};
            rk.tgid = tgid;
            rk.handle = gp_read_handle(gp_arg(s, d->request), narrow);
            struct gp_req r = {};
            r.handle = handle;
            r.seq = seq;
            r.peer = peer;
            r.tag = tag;
            r.bytes = bytes;
            r.where = gp_arg(s, d->request);
            r.order = s->t_enter;
            gp_req_put(&rk, &r);
            aux = rk.handle;
        }
    }

    gp_submit_call(s, d, id, now, rc, nested ? GP_F_NESTED : 0, handle, seq, bytes, aux, peer, tag);
    if (d->p2p == 3) {
        /* The receive half of MPI_Sendrecv: its own source, tag, size and receive sequence. */
        s32 peer2 = (s32)gp_arg(s, d->peer2);
        s32 tag2 = (s32)gp_arg(s, d->tag2);
        gp_submit_call(s, d, id, now, rc, GP_F_SENDRECV_RECV | (nested ? GP_F_NESTED : 0), handle,
                       gp_next(tgid, GP_SEQ_RECV, handle, peer2, tag2),
                       gp_bytes(s, d, tgid, handle, d->count2, d->dtype2, narrow), 0, peer2, tag2);
    }
}

static __always_inline struct gp_comm *gp_comm_event(struct gp_saved *s, struct gp_desc *d, u64 id,
                                                     u64 now, s64 rc)
{
    struct gp_comm *e = gp_comms.ringbuf_reserve(sizeof(struct gp_comm));
    if (!e) {
        gp_drop(1);
        return NULL;
    }
    e->t_ns = now;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->op = d->op;
    e->library = d->library;
    e->flags = 0;
    e->ret = (s32)rc;
    e->handle = 0;
    e->parent = 0;
    e->index = 0;
    e->uid_hash = 0;
    e->color = d->color ? (s32)gp_arg(s, d->color) : 0;
    e->key = d->key ? (s32)gp_arg(s, d->key) : 0;
    e->rank = d->rank ? (s32)gp_arg(s, d->rank) : -1;
    e->size = d->size ? (s32)gp_arg(s, d->size) : -1;
    return e;
}

static __always_inline void gp_emit_comm(struct gp_saved *s, struct gp_desc *d, u64 id, u64 now, s64 rc)
{
    u32 tgid = id >> 32;
    u32 narrow = s->narrow;

    if (d->out_int) {
        /* rank or size query: report a value once per communicator (they are called in loops). */
        s32 v = 0;
        if (bpf_probe_read_user(&v, sizeof(v), (void *)gp_arg(s, d->out_int)) != 0)
            return;
        struct gp_hkey h = {};
        h.tgid = tgid;
        h.what = d->op;
        h.handle = gp_handle(gp_arg(s, d->comm), narrow);
        s32 *old = gp_seen.lookup(&h);
        if (old && *old == v)
            return;
        gp_seen.update(&h, &v);
        if (d->op == GP_COP_MPI_Comm_size || d->op == GP_COP_ncclCommCount) {
            struct gp_hkey z = {};
            z.tgid = tgid;
            z.handle = h.handle;
            gp_commsz.update(&z, &v);
        }
        struct gp_comm *e = gp_comm_event(s, d, id, now, rc);
        if (!e)
            return;
        e->handle = h.handle;
        if (d->op == GP_COP_MPI_Comm_rank || d->op == GP_COP_ncclCommUserRank)
            e->rank = v;
        else
            e->size = v;
        gp_comms.ringbuf_submit(e, 0);
        return;
    }

    if (d->ndev) {
        /* ncclCommInitAll: one communicator per device, rank i of ndev. */
        s32 ndev = (s32)gp_arg(s, d->ndev);
        u64 comms = gp_arg(s, d->newcomm);
        for (int i = 0; i < GP_MAX_INITALL; i++) {
            if (i >= ndev)
                break;
            struct gp_comm *e = gp_comm_event(s, d, id, now, rc);
            if (!e)
                return;
            e->handle = gp_read_handle(comms + 8 * i, 0);
            e->rank = i;
            e->size = ndev;
            e->index = i;
            gp_comms.ringbuf_submit(e, 0);
        }
        return;
    }

    struct gp_comm *e = gp_comm_event(s, d, id, now, rc);
    if (!e)
        return;
    if (d->newcomm) {
        e->handle = gp_read_handle(gp_arg(s, d->newcomm), narrow);
        if (d->comm) {
            e->parent = gp_handle(gp_arg(s, d->comm), narrow);
            e->index = gp_next(tgid, GP_SEQ_CREATE, e->parent, 0, 0);
        }
    } else if (d->comm) {
        /* free, destroy, abort: the handle may be reused by a later communicator */
        e->handle = d->comm_ptr ? s->pre : gp_handle(gp_arg(s, d->comm), narrow);
        gp_forget(tgid, e->handle);
    }
    if (d->uid)
        __builtin_memcpy(e->uid, s->buf, sizeof(e->uid));
    gp_comms.ringbuf_submit(e, 0);
}

int gp_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!gp_in_job(tgid))
        return 0;
    u32 *dp = gp_depth.lookup(&id);
    if (!dp || *dp == 0)
        return 0;
    u32 depth = *dp - 1;
    if (depth == 0)
        gp_depth.delete(&id);
    else
        gp_depth.update(&id, &depth);
    struct gp_frame_key k = {};
    k.pid_tgid = id;
    k.depth = depth;
    struct gp_saved *s = gp_inflight.lookup(&k);
    if (!s)
        return 0;
    u32 probe = s->probe;
    struct gp_desc *d = gp_descs.lookup(&probe);
    if (d) {
        u64 now = bpf_ktime_get_ns();
        s64 rc = PT_REGS_RC(ctx);
        if (d->kind == GP_K_CALL)
            gp_emit_call(s, d, id, now, rc, depth);
        else
            gp_emit_comm(s, d, id, now, rc);
    }
    gp_inflight.delete(&k);
    return 0;
}

/* One entry program per symbol; GP_PROBE_<symbol> numbers come from the collector's probe table. */
#define GP_ENTRY(sym) \
    int gp_enter_##sym(struct pt_regs *ctx) { return gp_enter(ctx, GP_PROBE_##sym); }

GP_PROBE_LIST
