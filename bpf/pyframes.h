/* Python frames of a sampled thread, read from the interpreter's own structures (CPython 3.10-3.13).
 *
 * The collector (collector/pyframes.py) finds _PyRuntime in a job process's executable or libpython,
 * and writes one gp_py_proc per pid: the address of _PyRuntime.interpreters.head and the offsets of
 * the few fields walked here, taken from a table per CPython version (3.13: from the process's own
 * _Py_DebugOffsets). At a sample, gp_py_walk finds the thread's PyThreadState (gp_py_find_tstate:
 * cached per tid and checked against the thread id it holds in a process of one interpreter; else
 * the interpreters' thread lists are searched, bounded) and copies (code object address, instruction) of its frames, innermost first, into a record
 * stored once per distinct content (gp_py_stacks, keyed by a 64-bit hash). An entry with code == 0
 * (3.12+: the loop's entry frame) or with GP_PY_LAST_OF_CALL (3.11: is_entry; 3.10: every frame)
 * marks where one C-level call of the evaluation loop (_PyEval_EvalFrameDefault) ends, so user
 * space can put each run of Python frames in place of its native evaluation frame. Names
 * (function, file, line) are read by the collector from the process's memory, once per code object.
 * The record also says whether the thread held the GIL at the sample (gp_py_gil).
 * Every read is bpf_probe_read_user: a wrong offset or a freed frame gives a short or empty record,
 * never a fault.
 */
#ifndef GPUPROF_PYFRAMES_H
#define GPUPROF_PYFRAMES_H

#include <linux/sched.h>

#ifndef GP_PY_MAX_FRAMES
#define GP_PY_MAX_FRAMES 64 /* entries (frames + boundaries) kept, innermost first */
#endif
#ifndef GP_PY_MAX_THREADS
#define GP_PY_MAX_THREADS 64 /* thread states searched per interpreter */
#endif
#define GP_PY_MAX_INTERPS 4 /* interpreters searched (subinterpreters) */
#define GP_PY_STACK_ENTRIES 4096 /* x 1032 bytes, preallocated: 4 MB of kernel memory */
#define GP_PY_NONE 0xFFFF /* an offset the version does not have */
#define GP_PY_FRAME_READ 104 /* bytes read of one frame from its first field used (a constant size:
                              * a variable one costs the same and needs bounds the verifier sees) */

struct gp_py_proc {
    u64 interp_head_addr; /* &_PyRuntime.interpreters.head in the process */
    u16 interp_next;
    u16 interp_threads_head;
    u16 tstate_next;
    u16 tstate_thread_id;  /* native_thread_id (3.11+) or thread_id (pthread_t, 3.10) */
    u16 tstate_frame;      /* 3.10: frame; 3.11/3.12: cframe; 3.13: current_frame */
    u16 cframe_frame;      /* 3.11/3.12: _PyCFrame.current_frame; else GP_PY_NONE */
    u16 frame_code;
    u16 frame_previous;
    u16 frame_instr;
    u16 frame_owner;       /* 3.12+: owner; an entry frame (FRAME_OWNED_BY_CSTACK) is a boundary */
    u16 frame_is_entry;    /* 3.11: is_entry; the frame is the last of its C-level call */
    u8 thread_id_is_pthread; /* 3.10: match thread_id against the thread's pthread_self (fs base) */
    u8 instr_is_index;     /* 3.10: f_lasti (int, code units); else a pointer into the bytecode */
    u8 boundary_each_frame; /* 3.10: every Python frame has a C-level call of its own */
    u8 owner_cstack;       /* the owner value of entry frames (3 in 3.12/3.13) */
    u16 frame_read_from;   /* a frame is read from its first field used ... */
    u16 frame_read_len;    /* ... to its last (at most GP_PY_FRAME_READ bytes) */
    u32 task_fsbase;       /* 3.10: offsetof(struct task_struct, thread.fsbase) in the running
                            * kernel, from its BTF (the headers BCC compiles with may be another
                            * build's); 0 otherwise */
    /* The GIL (struct _gil_runtime_state) the sampled thread runs under: at gil_addr (3.10/3.11:
     * &_PyRuntime.ceval.gil, one per process), or, where gil_addr is 0 (3.12+: one per
     * interpreter), through the thread's own interpreter: tstate->interp->ceval.gil. The thread
     * holds it when it is locked and its last holder is the thread's state. gil_holder ==
     * GP_PY_NONE: no GIL is read (GP_PY_GIL_UNKNOWN). */
    u64 gil_addr;
    u16 tstate_interp;
    u16 interp_ceval_gil;
    u16 gil_holder;        /* offsetof(struct _gil_runtime_state, last_holder) */
    u16 gil_locked;        /* offsetof(struct _gil_runtime_state, locked): an int */
};

#define GP_PY_LAST_OF_CALL (1ULL << 63) /* in instr: the last frame of its C-level call */

struct gp_py_entry {
    u64 code;  /* PyCodeObject* (0: the evaluation loop's entry frame, the end of one C-level call) */
    u64 instr; /* pointer into the bytecode, or an instruction index (instr_is_index); bit 63:
                * GP_PY_LAST_OF_CALL */
};

#define GP_PY_GIL_UNKNOWN 0 /* the layout reads no GIL, or its reads failed */
#define GP_PY_GIL_HELD 1
#define GP_PY_GIL_NOT_HELD 2

struct gp_py_stack {
    u32 depth;     /* entries used (one per frame) */
    u16 truncated; /* 1: the interpreter's stack went on past GP_PY_MAX_FRAMES entries */
    u16 gil;       /* GP_PY_GIL_*: whether the thread held the GIL at the sample (part of the
                    * record's hash: the same frames with and without the GIL are two records) */
    struct gp_py_entry e[GP_PY_MAX_FRAMES];
};

BPF_HASH(gp_py_procs, u32, struct gp_py_proc, 4096);
BPF_TABLE("lru_hash", u32, u64, gp_py_tstates, 65536); /* tid -> its PyThreadState, checked at each use */
/* tid -> when its last search found no thread state: a native thread of a Python process is
 * searched again at most every GP_PY_MISS_RETRY_NS, not at each of its samples */
BPF_TABLE("lru_hash", u32, u64, gp_py_misses, 65536);
#define GP_PY_MISS_RETRY_NS 500000000ULL
BPF_HASH(gp_py_stacks, u64, struct gp_py_stack, GP_PY_STACK_ENTRIES);
/* [ids]: one record being built per id space (GP_IDS_CPU, GP_IDS_OFFCPU), so that the sampler's
 * walk and the scheduler tracepoint's never build theirs in the same buffer */
BPF_PERCPU_ARRAY(gp_py_scratch, struct gp_py_stack, 2);
/* [0] records walked, [1] thread state not found, [2] record not stored (map full), [3] truncated */
BPF_PERCPU_ARRAY(gp_py_counters, u64, 4);

static __always_inline void gp_py_count(int i)
{
    u64 *c = gp_py_counters.lookup(&i);
    if (c)
        (*c)++;
}

static __always_inline u64 gp_py_read_u64(u64 addr)
{
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr) != 0)
        return 0;
    return v;
}

/* The value the thread's PyThreadState holds for it (native tid, or pthread_self on 3.10: the
 * thread pointer, the fs base on x86-64, which the kernel keeps in task->thread.fsbase from the
 * thread's clone or arch_prctl on; read at the offset the collector took from the kernel's BTF). */
static __always_inline u64 gp_py_thread_key(const struct gp_py_proc *p, u32 tid)
{
    if (!p->thread_id_is_pthread)
        return tid;
#if defined(__x86_64__)
    u64 fsbase = 0;
    if (p->task_fsbase == 0 || p->task_fsbase > 65536)
        return 0;
    if (bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (u8 *)bpf_get_current_task() + p->task_fsbase) != 0)
        return 0;
    return fsbase;
#else
    return 0;
#endif
}

/* The innermost frame of a thread state (0: it runs no Python code now) */
static __always_inline u64 gp_py_frame_of(const struct gp_py_proc *p, u64 ts)
{
    u64 frame = gp_py_read_u64(ts + p->tstate_frame);
    if (frame && p->cframe_frame != GP_PY_NONE)
        frame = gp_py_read_u64(frame + p->cframe_frame);
    return frame;
}

/* GP_PY_GIL_*: whether the thread whose state is ts holds the GIL it runs under (two or four
 * reads; a failed read says unknown, never held). */
static __always_inline u16 gp_py_gil(const struct gp_py_proc *p, u64 ts)
{
    if (p->gil_holder == GP_PY_NONE || p->gil_locked == GP_PY_NONE)
        return GP_PY_GIL_UNKNOWN;
    u64 gil = p->gil_addr;
    if (!gil && p->tstate_interp != GP_PY_NONE && p->interp_ceval_gil != GP_PY_NONE) {
        u64 interp = gp_py_read_u64(ts + p->tstate_interp);
        gil = interp ? gp_py_read_u64(interp + p->interp_ceval_gil) : 0;
    }
    if (!gil)
        return GP_PY_GIL_UNKNOWN;
    u64 holder = 0;
    int locked = 0;
    if (bpf_probe_read_user(&holder, sizeof(holder), (void *)(gil + p->gil_holder)) != 0
        || bpf_probe_read_user(&locked, sizeof(locked), (void *)(gil + p->gil_locked)) != 0)
        return GP_PY_GIL_UNKNOWN;
    return locked && holder == ts ? GP_PY_GIL_HELD : GP_PY_GIL_NOT_HELD;
}

/* The thread's PyThreadState, and in *frame its innermost frame. A thread that ran in several
 * interpreters (a subinterpreter's run_string) has a state in each, all with its thread id; so in
 * a process with more than one interpreter the states are searched at each sample, and the one
 * that holds its interpreter's GIL is taken, else one with a frame, else the first found. With
 * one interpreter the state is cached per thread (checked against the thread id it holds), and a
 * thread with none is searched again at most every GP_PY_MISS_RETRY_NS. */
static __always_inline u64 gp_py_find_tstate(const struct gp_py_proc *p, u32 tid, u64 *frame)
{
    *frame = 0;
    u64 want = gp_py_thread_key(p, tid);
    if (want == 0)
        return 0;
    u64 interp = gp_py_read_u64(p->interp_head_addr);
    int several = interp && gp_py_read_u64(interp + p->interp_next) != 0;
    u64 *cached = gp_py_tstates.lookup(&tid);
    if (!several && cached && *cached && gp_py_read_u64(*cached + p->tstate_thread_id) == want) {
        *frame = gp_py_frame_of(p, *cached);
        return *cached;
    }
    u64 now = bpf_ktime_get_ns();
    u64 *missed = gp_py_misses.lookup(&tid);
    if (!several && missed && now - *missed < GP_PY_MISS_RETRY_NS)
        return 0;
    u64 best = 0, best_frame = 0;
    int best_rank = 0;
    for (int i = 0; i < GP_PY_MAX_INTERPS && interp && best_rank < 3; i++) {
        u64 ts = gp_py_read_u64(interp + p->interp_threads_head);
        for (int j = 0; j < GP_PY_MAX_THREADS && ts; j++) {
            if (gp_py_read_u64(ts + p->tstate_thread_id) == want) {
                u64 f = gp_py_frame_of(p, ts);
                int rank = !f ? 1 : (several && gp_py_gil(p, ts) == GP_PY_GIL_HELD) ? 3 : 2;
                if (rank > best_rank) {
                    best = ts;
                    best_frame = f;
                    best_rank = rank;
                }
                break; /* one state per thread in an interpreter */
            }
            ts = gp_py_read_u64(ts + p->tstate_next);
        }
        interp = gp_py_read_u64(interp + p->interp_next);
    }
    if (best)
        gp_py_tstates.update(&tid, &best);
    else
        gp_py_misses.update(&tid, &now);
    *frame = best_frame;
    return best;
}

/* A field at off in the span read (an offset the version lacks, GP_PY_NONE - from, reads 0) */
static __always_inline u64 gp_py_field(const u8 *buf, u32 off, int size)
{
    u64 v = 0;
    if (off > GP_PY_FRAME_READ - 8)
        return 0;
    if (size == 8)
        __builtin_memcpy(&v, buf + (off & 0x7F), 8);
    else if (size == 4)
        __builtin_memcpy(&v, buf + (off & 0x7F), 4);
    else
        v = buf[off & 0x7F];
    return v;
}

/* The id of the thread's Python stack in gp_py_stacks (0: not a Python thread, or no frame); ids:
 * GP_IDS_CPU or GP_IDS_OFFCPU (bpf/common.h), the id space of the source that walks. */
static __always_inline u64 gp_py_walk(u32 tgid, u32 tid, u32 ids)
{
    struct gp_py_proc *p = gp_py_procs.lookup(&tgid);
    if (!p)
        return 0;
    u64 frame = 0;
    u64 ts = gp_py_find_tstate(p, tid, &frame);
    if (!ts) {
        gp_py_count(1);
        return 0;
    }
    if (!frame)
        return 0;
    int slot = ids & 1;
    struct gp_py_stack *st = gp_py_scratch.lookup(&slot);
    if (!st)
        return 0;
    u8 buf[128];
    u32 from = p->frame_read_from;
    if (p->frame_read_len > GP_PY_FRAME_READ || from > 4096)
        return 0; /* a layout whose fields do not fit one read */
    u32 n = 0;
    u64 hash = gp_ids_hash_start(tgid, ids);
    /* One entry per frame, so that every path through an iteration leaves n = i + 1: the verifier
     * then sees one state per iteration, not one per combination of branches taken before. */
    for (int i = 0; i < GP_PY_MAX_FRAMES; i++) {
        if (!frame || bpf_probe_read_user(buf, GP_PY_FRAME_READ, (void *)(frame + from)) != 0)
            break;
        u64 code = gp_py_field(buf, p->frame_code - from, 8);
        u64 instr = gp_py_field(buf, p->frame_instr - from, p->instr_is_index ? 4 : 8);
        if (p->frame_owner != GP_PY_NONE && gp_py_field(buf, p->frame_owner - from, 1) == p->owner_cstack)
            code = 0; /* the evaluation loop's own entry frame: the end of one C-level call */
        else if (p->boundary_each_frame
                 || (p->frame_is_entry != GP_PY_NONE && gp_py_field(buf, p->frame_is_entry - from, 1)))
            instr |= GP_PY_LAST_OF_CALL;
        st->e[i & (GP_PY_MAX_FRAMES - 1)].code = code;
        st->e[i & (GP_PY_MAX_FRAMES - 1)].instr = instr;
        hash = (hash ^ code) * 0x100000001b3ULL;
        hash = (hash ^ instr) * 0x100000001b3ULL;
        n = i + 1;
        frame = gp_py_field(buf, p->frame_previous - from, 8);
    }
    if (n == 0)
        return 0;
    st->depth = n;
    st->truncated = frame != 0;
    st->gil = gp_py_gil(p, ts);
    hash = (hash ^ st->gil) * 0x100000001b3ULL;
    if (st->truncated)
        gp_py_count(3);
    gp_py_count(0);
    if (hash == 0)
        hash = 1;
    int err = gp_py_stacks.insert(&hash, st); /* BPF_NOEXIST: one map operation when already stored */
    if (err != 0 && err != -EEXIST) {
        gp_py_count(2);
        return 0;
    }
    return hash;
}

#endif
