/* Native user stacks without frame pointers, walked by CFI tables in the BPF program (x86-64).
 *
 * The collector (collector/cfiunwind.py) compiles each mapped ELF file's .eh_frame/.debug_frame into
 * sorted rows (collector/cfitables.py: pc -> CFA = rsp+N | rbp+N | the PLT rule | stop | end; the
 * caller's rbp unchanged or at CFA+M; the return address at CFA-8), written once per build id into
 * gp_cfi_rows (a range [first, first+count) per table, shared by every process mapping the file),
 * and per registered process its executable mappings, sorted by start, into gp_cfi_mappings (a
 * range per process, gp_cfi_procs). At a sample (bpf/stacks.c), or at a blocked switch-out
 * (bpf/offcpu.c), the walk starts from the user registers (the perf event's when the sample is in
 * user mode, else those saved at the kernel entry: gp_cfi_begin_in_kernel), and for up
 * to GP_CFI_MAX_FRAMES frames finds the mapping (binary search), the row (binary search among the
 * rows of the pc's 4 KB page of code: gp_cfi_pages), computes the CFA and reads the return address
 * and the saved rbp with bpf_probe_read_user. Code in a mapping
 * without a table or a pc no FDE covers takes the frame-pointer rule (CFA = rbp+16). The pc list is
 * stored once per distinct content in gp_cfi_stacks (keyed by a 64-bit FNV hash of pid and pcs,
 * seeded per source: bpf/common.h GP_IDS_*) and
 * its key goes into the sample's count key; 0 (not registered, or the leaf is in no registered
 * mapping) leaves the sample its frame-pointer stack. A caller in no mapping (the frame-pointer
 * guess through code without CFI) is not kept: the stack ends at the last frame found.
 */
#ifndef GPUPROF_CFIUNWIND_H
#define GPUPROF_CFIUNWIND_H

#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>

#ifndef GP_CFI_ROWS
#define GP_CFI_ROWS (1 << 20) /* 12 bytes each, laid out 8-byte aligned (16), preallocated: 16 MB of kernel memory */
#endif
#ifndef GP_CFI_MAPPINGS
#define GP_CFI_MAPPINGS 65536 /* x 48 bytes: 3 MB */
#endif
#ifndef GP_CFI_PAGES
#define GP_CFI_PAGES (1 << 18) /* x 4 bytes: 1 MB; a table's index takes one a 4 KB page of its code, plus one */
#endif
#define GP_CFI_PAGE_SHIFT 12
/* per CPU, a power of two: x 24 bytes, 12 KB a CPU. Small on purpose: on GROMACS a sample cost
 * 13.9 and 13.5 us with 512 slots, 17.3 and 19.0 with 4096 (96 KB: its pages and cache lines are
 * misses of their own beside the job's working set, at 98 % hits), 15.9 with 128 */
#define GP_CFI_RULE_SLOTS 512
#define GP_CFI_MAX_FRAMES 128 /* a power of two; 127 pcs kept, as the kernel's stack maps */
#define GP_CFI_STACK_ENTRIES 4096 /* x 1032 bytes, preallocated: 4 MB */
#define GP_CFI_ROW_STEPS 20       /* binary search steps: tables of up to 2^20 rows */
#define GP_CFI_MAP_STEPS 12       /* ... of up to 4096 mappings per process */
#ifndef GP_CFI_STEPS
#define GP_CFI_STEPS 8 /* frames per program: the walk goes on in a tail call (gp_cfi_cont) */
#endif

#define GP_CFA_NONE 0
#define GP_CFA_RSP 1
#define GP_CFA_RBP 2
#define GP_CFA_PLT 3
#define GP_CFA_STOP 4
#define GP_CFA_END 5
#define GP_RBP_SAME 0
#define GP_RBP_AT_CFA 1
#define GP_RBP_UNDEF 2

/* how a walk ended (gp_cfi_stack.end; counters gp_cfi_counters[GP_CFI_C_END + end]) */
#define GP_CFI_END_OK 0        /* the outermost frame (return address undefined, or 0) */
#define GP_CFI_END_NO_MAPPING 1 /* a pc in no registered mapping */
#define GP_CFI_END_STOP 2      /* a "stop" row (expression, signal frame) */
#define GP_CFI_END_READ 3      /* the return address or saved rbp could not be read */
#define GP_CFI_END_BAD_CFA 4   /* the CFA was not above the stack pointer (a wrong rule or rbp) */
#define GP_CFI_END_TRUNCATED 5 /* GP_CFI_MAX_FRAMES frames */
#define GP_CFI_END_NO_FP 6     /* no CFI for the pc and no frame pointer (rbp 0 or below sp) */

/* counters: [0] walks, [1] stored, [2] not stored (map full), [3] no user registers, [4] left to the
 * frame-pointer stack (the leaf in no registered mapping), [5] frames by the frame-pointer rule, [6..12] ends */
#define GP_CFI_C_END 6
#define GP_CFI_NCOUNTERS 13

struct gp_cfi_row {
    u32 pc; /* ELF virtual address of the file */
    s32 cfa_off;
    s16 rbp_off;
    u8 cfa_type;
    u8 rbp_type;
};

/* gp_cfi_mapping.first of a mapping whose file has a table that is not loaded yet (count 0): a
 * walk through it takes the frame-pointer rule and asks for the table (gp_cfi_wanted) */
#define GP_CFI_LAZY 0xFFFFFFFFu

struct gp_cfi_mapping {
    u64 start;
    u64 end;
    u64 bias;  /* runtime address - ELF virtual address */
    u32 first; /* rows of its table in gp_cfi_rows; GP_CFI_LAZY: not loaded yet */
    u32 count; /* 0: no table (the frame-pointer rule) */
    /* its table's page index in gp_cfi_pages: page_count + 1 entries from page_first, entry k the
     * number of rows whose pc is at most the start of page page_base + k (pc >> GP_CFI_PAGE_SHIFT),
     * so that the rows of a pc in that page lie between entries k and k + 1. page_count 0: none
     * (the search goes over all the rows) */
    u32 page_first;
    u32 page_count;
    u32 page_base;
    u32 pad;
};

struct gp_cfi_proc {
    u32 first; /* its mappings in gp_cfi_mappings, sorted by start */
    u32 count;
};

struct gp_cfi_stack {
    u32 depth;
    u32 end; /* GP_CFI_END_* */
    u64 pc[GP_CFI_MAX_FRAMES];
};

struct gp_cfi_walk {
    u64 pc;
    u64 sp;
    u64 bp;
    u64 hash;
    u32 pfirst;
    u32 pcount;
    u32 n;
    u32 end;
    u32 fp_frames;
    u32 tgid;
    u32 leaf_mapped; /* the first pc is in a registered mapping */
    u32 guessed;     /* the last step was the frame-pointer rule's: its return address is a guess */
    u32 gen;         /* gp_cfi_gen when the walk began: the rule cache's entries of that generation */
    u32 last_at;     /* the mapping of the last frame (index in gp_cfi_mappings), or GP_CFI_LAZY: none */
};

/* A rule looked up before, per CPU: slot by a hash of the key. Why: even among a page's rows the
 * search cost about 0.5 us a frame on GROMACS (the index entry and the rows each a cache miss,
 * at every frame), and most frames of a sample are return addresses that its earlier samples
 * walked through. Per CPU, so no other CPU writes an entry while it is read; a walk is never
 * interrupted by another on its CPU (the sampler runs in interrupt context, the off-CPU walk
 * with interrupts off). */
struct gp_cfi_rule_entry {
    u64 key; /* (the table's first row << 32) | the pc relative to its file */
    u32 gen; /* gp_cfi_gen[0] when stored: an entry of an older generation is a miss */
    struct gp_cfi_row row; /* the rule (cfa_type GP_CFA_NONE: no row covers the pc) */
};

#ifdef GP_CFI_ROWS_MMAPABLE
/* mapped by the collector (kernel 5.5+): a table's rows are written with one memory copy instead of
 * one map update a row (BPF_MAP_UPDATE_BATCH's copy per element cost hpcc's 161 tables 0.1-0.2 s of
 * CPU at the job's start) */
BPF_F_TABLE("array", int, struct gp_cfi_row, gp_cfi_rows, GP_CFI_ROWS, BPF_F_MMAPABLE);
#else
BPF_ARRAY(gp_cfi_rows, struct gp_cfi_row, GP_CFI_ROWS);
#endif
/* Why a page index: a binary search over a large table (libgromacs: over 100 000 rows) touched a
 * new cache line at most of its 17 steps, at every frame; GROMACS's samples (15 frames on average)
 * took 23.5 us each in this program. Within a page the rows are a few cache lines. */
BPF_ARRAY(gp_cfi_pages, u32, GP_CFI_PAGES);
BPF_ARRAY(gp_cfi_mappings, struct gp_cfi_mapping, GP_CFI_MAPPINGS);
BPF_PERCPU_ARRAY(gp_cfi_rule_cache, struct gp_cfi_rule_entry, GP_CFI_RULE_SLOTS);
/* [0]: the rule cache's generation, raised by the collector whenever it frees a table's rows (their
 * range may then hold another table's: an entry keyed by it would be that table's no more) */
BPF_ARRAY(gp_cfi_gen, u32, 1);
BPF_HASH(gp_cfi_procs, u32, struct gp_cfi_proc, 4096);
BPF_HASH(gp_cfi_stacks, u64, struct gp_cfi_stack, GP_CFI_STACK_ENTRIES);
BPF_PERCPU_ARRAY(gp_cfi_counters, u64, GP_CFI_NCOUNTERS);
/* pid -> 1: a walk of it met a pc outside its registered mappings (a dlopen since): the collector
 * reads its mappings again at the next drain and deletes the entry */
BPF_HASH(gp_cfi_stale, u32, u8, 4096);
/* mapping index in gp_cfi_mappings -> 1: a walk met a pc in a mapping whose table is not loaded
 * (GP_CFI_LAZY); the collector loads it, points every mapping of that file at it and deletes the
 * entry. Why not load every table at registration: a job maps far more code than it runs (hpcc's
 * job maps 161 files with tables, 673 000 rows, mostly Open MPI's plugins; its walks needed 25),
 * and loading them all cost the job's cores about 0.25 s at its start and most of the rows map. */
BPF_HASH(gp_cfi_wanted, u32, u8, 4096);
/* [0] = 1 while the collector's CFI unwinder runs: a job process without tables is then marked
 * stale too (a fork, an exec, a new rank), so that it is registered within 0.1 s */
BPF_ARRAY(gp_cfi_on, u32, 1);

/* [0]: how many requests were made (an entry put in gp_cfi_stale or gp_cfi_wanted), each after
 * its entry. The collector's native watch (collector/native/mapwatch.c) reads it every 100 ms to
 * know whether to wake the registration thread: one array lookup, where asking a hash for its
 * first key walks all its buckets (4096 here: an eighth of the 100 ms tick's time, perf). */
BPF_ARRAY(gp_cfi_asks, u64, 1);

static __always_inline void gp_cfi_asked(void)
{
    int zero = 0;
    u64 *n = gp_cfi_asks.lookup(&zero);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* An exec replaces every mapping: the process's tables go until the collector registers it again
 * (its next drain), so that no sample is walked with the old image's mappings. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (gp_cfi_procs.lookup(&tgid)) {
        u8 one = 1;
        gp_cfi_procs.delete(&tgid);
        gp_cfi_stale.update(&tgid, &one);
        gp_cfi_asked();
    }
    return 0;
}

static __always_inline void gp_cfi_count(int i)
{
    u64 *c = gp_cfi_counters.lookup(&i);
    if (c)
        (*c)++;
}

/* The mapping holding pc among the process's, its index in gp_cfi_mappings into *at; or 0. */
static __always_inline struct gp_cfi_mapping *gp_cfi_find_mapping(struct gp_cfi_walk *w, u64 pc, u32 *at)
{
    if (w->last_at != GP_CFI_LAZY) { /* a caller is most often in its callee's file */
        u32 last = w->last_at;
        struct gp_cfi_mapping *m = gp_cfi_mappings.lookup(&last);
        if (m && m->start <= pc && pc < m->end) {
            *at = last;
            return m;
        }
    }
    u32 lo = 0, hi = w->pcount;
    for (int k = 0; k < GP_CFI_MAP_STEPS; k++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        u32 idx = w->pfirst + mid;
        struct gp_cfi_mapping *m = gp_cfi_mappings.lookup(&idx);
        if (!m)
            return 0;
        if (m->start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return 0;
    u32 idx = w->pfirst + lo - 1;
    struct gp_cfi_mapping *m = gp_cfi_mappings.lookup(&idx);
    if (!m || pc >= m->end)
        return 0;
    *at = idx;
    w->last_at = idx;
    return m;
}

static __always_inline struct gp_cfi_row *gp_cfi_find_row(struct gp_cfi_mapping *m, u64 pc)
{
    u64 rel = pc - m->bias;
    if (rel > 0xFFFFFFFFULL)
        return 0;
    u32 want = (u32)rel;
    u32 first = m->first;
    u32 lo = 0, hi = m->count;
    if (m->page_count) {
        u32 page = want >> GP_CFI_PAGE_SHIFT;
        if (page < m->page_base)
            return 0; /* below the table's first row */
        page -= m->page_base;
        if (page >= m->page_count) {
            lo = hi; /* past its last row's page: that row */
        } else {
            u32 i = m->page_first + page;
            u32 *a = gp_cfi_pages.lookup(&i);
            i++;
            u32 *b = gp_cfi_pages.lookup(&i);
            if (a && b && *a <= *b && *b <= hi) {
                lo = *a;
                hi = *b;
            }
        }
    }
    for (int k = 0; k < GP_CFI_ROW_STEPS; k++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) / 2;
        u32 idx = first + mid;
        struct gp_cfi_row *r = gp_cfi_rows.lookup(&idx);
        if (!r)
            return 0;
        if (r->pc <= want)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return 0;
    u32 idx = first + lo - 1;
    return gp_cfi_rows.lookup(&idx);
}

/* The rule of pc in a mapping with a table (m->count > 0): from the CPU's rule cache, else searched
 * and cached. */
static __always_inline void gp_cfi_rule(struct gp_cfi_walk *w, struct gp_cfi_mapping *m, u64 pc, struct gp_cfi_row *out)
{
    u64 rel = pc - m->bias;
    if (rel > 0xFFFFFFFFULL)
        return; /* no row: *out stays GP_CFA_NONE */
    u64 key = ((u64)m->first << 32) | rel;
    u32 slot = (u32)((key * 0x9E3779B97F4A7C15ULL) >> 32) & (GP_CFI_RULE_SLOTS - 1);
    struct gp_cfi_rule_entry *e = gp_cfi_rule_cache.lookup(&slot);
    if (e && e->key == key && e->gen == w->gen) {
        __builtin_memcpy(out, &e->row, sizeof(*out));
        return;
    }
    struct gp_cfi_row *r = gp_cfi_find_row(m, pc);
    if (r)
        __builtin_memcpy(out, r, sizeof(*out));
    if (e) {
        e->key = key;
        e->gen = w->gen;
        __builtin_memcpy(&e->row, out, sizeof(*out));
    }
}

/* One frame: record w->pc, then step to the caller. Returns 1 when the walk is over. */
static __always_inline int gp_cfi_step(struct gp_cfi_walk *w, struct gp_cfi_stack *st)
{
    u32 i = w->n;
    u64 pc = w->pc;
    u64 look = i ? pc - 1 : pc; /* a return address points past its call */
    u32 at = 0;
    struct gp_cfi_mapping *m = gp_cfi_find_mapping(w, look, &at);
    if (!m && i > 0) {
        /* a caller in no executable mapping (anonymous code is registered too): the guess of a
         * frame-pointer step through code without CFI, or a library mapped since the registration
         * (marked stale below): not kept as a frame */
        w->end = GP_CFI_END_NO_MAPPING;
        return 1;
    }
    st->pc[i & (GP_CFI_MAX_FRAMES - 1)] = pc;
    w->n = i + 1;
    w->hash = (w->hash ^ pc) * 0x100000001b3ULL;
    if (!m) {
        w->end = GP_CFI_END_NO_MAPPING;
        return 1;
    }
    if (i == 0)
        w->leaf_mapped = 1;
    if (i + 1 >= GP_CFI_MAX_FRAMES - 1) {
        w->end = GP_CFI_END_TRUNCATED;
        return 1;
    }
    u8 cfa_type = GP_CFA_NONE, rbp_type = GP_RBP_SAME;
    u32 guessed = 0;
    s32 cfa_off = 0;
    s16 rbp_off = 0;
    if (m->count == 0 && m->first == GP_CFI_LAZY) {
        u8 one = 1;
        gp_cfi_wanted.update(&at, &one); /* this frame by the frame-pointer rule, the next walks by CFI */
        gp_cfi_asked();
    }
    if (m->count) {
        struct gp_cfi_row r = {}; /* GP_CFA_NONE, GP_RBP_SAME: no row covers the pc */
        gp_cfi_rule(w, m, look, &r);
        cfa_type = r.cfa_type;
        cfa_off = r.cfa_off;
        rbp_type = r.rbp_type;
        rbp_off = r.rbp_off;
    }
    u64 cfa;
    if (cfa_type == GP_CFA_RSP) {
        cfa = w->sp + (s64)cfa_off;
    } else if (cfa_type == GP_CFA_RBP) {
        cfa = w->bp + (s64)cfa_off;
    } else if (cfa_type == GP_CFA_PLT) {
        cfa = w->sp + 8 + (((pc & 15) >= (u64)cfa_off) ? 8 : 0);
    } else if (cfa_type == GP_CFA_END) {
        w->end = GP_CFI_END_OK;
        return 1;
    } else if (cfa_type == GP_CFA_STOP) {
        w->end = GP_CFI_END_STOP;
        return 1;
    } else {
        /* no CFI here: the frame-pointer rule, if rbp can be a frame pointer */
        if (w->bp == 0 || w->bp < w->sp) {
            w->end = GP_CFI_END_NO_FP;
            return 1;
        }
        cfa = w->bp + 16;
        rbp_type = GP_RBP_AT_CFA;
        rbp_off = -16;
        w->fp_frames++;
        guessed = 1;
    }
    if (cfa <= w->sp) {
        w->end = GP_CFI_END_BAD_CFA;
        return 1;
    }
    u64 ra = 0;
    if (bpf_probe_read_user(&ra, sizeof(ra), (void *)(cfa - 8)) != 0) {
        w->end = GP_CFI_END_READ;
        return 1;
    }
    if (rbp_type == GP_RBP_AT_CFA) {
        u64 bp = 0;
        if (bpf_probe_read_user(&bp, sizeof(bp), (void *)(cfa + (s64)rbp_off)) != 0) {
            w->end = GP_CFI_END_READ;
            return 1;
        }
        w->bp = bp;
    } else if (rbp_type == GP_RBP_UNDEF) {
        w->bp = 0;
    }
    w->sp = cfa;
    w->guessed = guessed;
    if (ra == 0) {
        w->end = GP_CFI_END_OK;
        return 1;
    }
    w->pc = ra;
    return 0;
}

/* The walk's state, per CPU, across the tail calls of one walk. The CPU sampler's (here) and
 * off-CPU's (bpf/offcpu.c) are separate arrays, so that neither walk can overwrite the other's. */
struct gp_cfi_state {
    struct gp_cfi_walk w;
    struct gp_cfi_stack st;
};
BPF_PERCPU_ARRAY(gp_cfi_scratch_state, struct gp_cfi_state, 1);

/* The process's registered mappings, or 0: not registered (marked stale while the collector's
 * unwinder runs, so that it is registered within 0.1 s) or registered without any mapping. */
static __always_inline struct gp_cfi_proc *gp_cfi_registered(u32 tgid)
{
    struct gp_cfi_proc *p = gp_cfi_procs.lookup(&tgid);
    if (!p) {
        int zero = 0;
        u32 *on = gp_cfi_on.lookup(&zero);
        if (on && *on) {
            u8 one = 1;
            gp_cfi_stale.update(&tgid, &one);
            gp_cfi_asked();
        }
        return 0;
    }
    if (p->count == 0)
        return 0;
    return p;
}

/* A walk of the process's mappings [pfirst, pfirst+pcount) starting from the user registers
 * (pc, sp, bp); its id in the id space `ids` (GP_IDS_CPU, GP_IDS_OFFCPU: bpf/common.h). */
static __always_inline void gp_cfi_init(struct gp_cfi_state *s, u32 pfirst, u32 pcount, u32 tgid, u32 ids,
                                        u64 pc, u64 sp, u64 bp)
{
    struct gp_cfi_walk *w = &s->w;
    w->pc = pc;
    w->sp = sp;
    w->bp = bp;
    w->pfirst = pfirst;
    w->pcount = pcount;
    w->hash = gp_ids_hash_start(tgid, ids);
    w->n = 0;
    w->end = GP_CFI_END_TRUNCATED;
    w->fp_frames = 0;
    w->tgid = tgid;
    w->leaf_mapped = 0;
    w->guessed = 0;
    w->last_at = GP_CFI_LAZY;
    int zero = 0;
    u32 *gen = gp_cfi_gen.lookup(&zero);
    w->gen = gen ? *gen : 0;
}

/* gp_cfi_init from the user registers of the current task while it is in the kernel (a system
 * call, a page fault, or switched out by the scheduler: those saved at its kernel entry).
 * 0: none (a kernel thread, an io_uring worker: no user-mode registers at the top of its stack). */
static __always_inline int gp_cfi_begin_in_kernel(struct gp_cfi_state *s, u32 pfirst, u32 pcount, u32 tgid, u32 ids)
{
    struct pt_regs *saved = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    struct pt_regs user;
    if (!saved || bpf_probe_read_kernel(&user, sizeof(user), saved) != 0 || (user.cs & 3) != 3) {
        gp_cfi_count(3);
        return 0;
    }
    gp_cfi_init(s, pfirst, pcount, tgid, ids, user.ip, user.sp, user.bp);
    return 1;
}

/* The CPU sampler's start of a walk when the process has tables: its state (the user registers:
 * the perf event's when the sample is in user mode, else those saved at the kernel entry) in
 * gp_cfi_scratch_state. 0: not registered, or no user registers. */
static __always_inline int gp_cfi_begin(struct bpf_perf_event_data *ctx, u32 tgid)
{
    struct gp_cfi_proc *p = gp_cfi_registered(tgid);
    if (!p)
        return 0;
    int zero = 0;
    struct gp_cfi_state *s = gp_cfi_scratch_state.lookup(&zero);
    if (!s)
        return 0;
    gp_cfi_count(0);
    if ((ctx->regs.cs & 3) == 3) {
        gp_cfi_init(s, p->first, p->count, tgid, GP_IDS_CPU, ctx->regs.ip, ctx->regs.sp, ctx->regs.bp);
        return 1;
    }
    return gp_cfi_begin_in_kernel(s, p->first, p->count, tgid, GP_IDS_CPU);
}

/* Up to GP_CFI_STEPS frames of the walk in progress; 1 when it is over. */
static __always_inline int gp_cfi_steps(struct gp_cfi_state *s)
{
    for (int k = 0; k < GP_CFI_STEPS; k++) {
        if (gp_cfi_step(&s->w, &s->st))
            return 1;
    }
    return 0;
}

/* The finished walk's id in gp_cfi_stacks (0: its leaf is in no registered mapping: the frame-pointer stack). */
static __always_inline u64 gp_cfi_store(struct gp_cfi_state *s)
{
    struct gp_cfi_walk *w = &s->w;
    u32 end = w->end;
    if (end <= GP_CFI_END_NO_FP) {
        int c = GP_CFI_C_END + end;
        gp_cfi_count(c);
    }
    if (w->fp_frames) {
        int c = 5;
        u64 *v = gp_cfi_counters.lookup(&c);
        if (v)
            *v += w->fp_frames;
    }
    u32 tgid = w->tgid;
    /* A pc in no registered mapping asks for the process's mappings to be read again (a dlopen
     * since), unless a frame-pointer step guessed it: in code without CFI and without frame
     * pointers (hand-written assembly, JIT code) rbp is any value, and such a process asked at
     * every such sample, which woke the registration thread to read unchanged maps at 10 Hz. */
    if (end == GP_CFI_END_NO_MAPPING && !w->guessed) {
        u8 one = 1;
        gp_cfi_stale.update(&tgid, &one);
        gp_cfi_asked();
    }
    if (!w->leaf_mapped) { /* JIT code without a mapping registered yet, an exec's first moments */
        gp_cfi_count(4);
        return 0;
    }
    s->st.depth = w->n;
    s->st.end = end;
    u64 hash = w->hash ^ end;
    if (hash == 0)
        hash = 1;
    int err = gp_cfi_stacks.insert(&hash, &s->st); /* BPF_NOEXIST: one map operation when stored */
    if (err != 0 && err != -EEXIST) {
        gp_cfi_count(2);
        return 0;
    }
    gp_cfi_count(1);
    return hash;
}

#endif
