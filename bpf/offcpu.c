/* Off-CPU time of the job's threads (mode `stacks`), from the scheduler's tracepoints.
 *
 * At a blocked switch-out of a job thread (it leaves the CPU in a sleeping state): its time and its
 * stacks, in gp_off_start[tid]. At its wakeup: blocked = wakeup - switch-out, added to gp_off_counts
 * under (window, pid, tid, stacks) and drained by collector/sources/bpf_offcpu.py every
 * sources.offcpu.flush_interval_s. An episode is counted in the window in which the thread is woken.
 *
 * A runnable switch-out (preempted, or yielded) is not recorded: it returns before any lookup or
 * clock read. MPI libraries poll with sched_yield on a node with more ranks than cores, 250,000
 * switches a second under hpcc on two cores, and recording each (an entry stored at the switch-out,
 * looked up, deleted and summed at the switch-in) made the job 10 to 14 % slower on top of the rest
 * (docs/collector.md, job_slowdown). The time a thread waits for a CPU, after a wakeup or a
 * preemption, is the kernel's own per-thread run_delay (/proc/PID/task/TID/schedstat), which the
 * source reads at each drain: exact, and free per switch.
 *
 * The stacks of a blocked switch-out are those of a CPU sample (bpf/stacks.c): the kernel stack;
 * the Python stack of a registered Python process (bpf/pyframes.h); the user stack walked by the
 * CFI tables (bpf/cfiunwind.h, with GP_WITH_CFI) from the user registers saved at the thread's
 * kernel entry (it is in the kernel: the tracepoint runs in its context), continued by tail calls
 * of gp_off_cfi_cont, which has its own program array and per-CPU state; else (no tables
 * registered for the process, or the leaf in no registered mapping) the kernel's frame-pointer
 * walk. The CFI and Python ids are in the off-CPU id space (GP_IDS_OFFCPU, bpf/common.h).
 */
#include "gpuprof_events.h"
#include "pyframes.h"
#ifdef GP_WITH_CFI
#include "cfiunwind.h"
#endif

#ifndef GP_OFF_STACK_ENTRIES
#define GP_OFF_STACK_ENTRIES 4096
#endif
#ifndef GP_OFF_COUNT_ENTRIES
#define GP_OFF_COUNT_ENTRIES 16384
#endif
/* The raw task state the kernel passes sched_switch (its 4th argument, Linux 5.18 and later):
 * TASK_RUNNING (0) when the task yielded or was preempted, TASK_DEAD at an exiting task's last
 * switch, else a sleeping state. */
#define GP_TASK_DEAD 0x0080

/* A blocked switch-out waiting for its wakeup */
struct gp_off_start {
    u64 t_out;
    u32 pid;
    s32 user_stack;   /* in gp_off_stacks (-EFAULT: none, or the CFI stack replaces it) */
    s32 kernel_stack; /* in gp_off_stacks */
    u32 pad;
    u64 py_stack;  /* in gp_py_stacks (0: none) */
    u64 cfi_stack; /* in gp_cfi_stacks (0: none) */
};

/* struct gp_stack_key (cpu always 0), then the Python stack and the CFI stack, as the CPU
 * sampler's struct gp_cpu_key: WindowedCounts and the user-stack decoding read both alike */
struct gp_off_key {
    u32 gen;
    u32 pid;
    u32 tid;
    u32 cpu;
    s32 user_stack;
    s32 kernel_stack;
    u64 py_stack;
    u64 cfi_stack;
};

BPF_STACK_TRACE(gp_off_stacks, GP_OFF_STACK_ENTRIES);
BPF_HASH(gp_off_start, u32, struct gp_off_start, 65536);
BPF_HASH(gp_off_counts, struct gp_off_key, struct gp_off_value, GP_OFF_COUNT_ENTRIES);
BPF_ARRAY(gp_off_gen, u32, 1);
/* [0] counts map full, [1] start map full, [2] exits map full */
BPF_PERCPU_ARRAY(gp_off_drops, u64, 3);

/* A job thread's run-queue counters at its last switch-out, as it exits: the drain adds what it
 * waited since the drain's last read of /proc, where the thread is gone by then */
struct gp_off_exit {
    u32 pid;
    u32 pad;
    u64 run_delay; /* ns, task->sched_info.run_delay: schedstat's second field */
    u64 pcount;    /* switch-ins, its third */
};
BPF_HASH(gp_off_exited, u32, struct gp_off_exit, 4096);

/* The wakeup of a thread asleep since a recorded switch-out: its blocked time, in the window */
static __always_inline void gp_off_account(u32 tid)
{
    struct gp_off_start *s = gp_off_start.lookup(&tid);
    if (!s)
        return; /* every wakeup of the system passes here: the clock is read on a hit only */
    u64 now = bpf_ktime_get_ns();
    int zero = 0;
    u32 *gen = gp_off_gen.lookup(&zero);
    struct gp_off_key key = {};
    key.gen = gen ? *gen : 0;
    key.pid = s->pid;
    key.tid = tid;
    key.user_stack = s->user_stack;
    key.kernel_stack = s->kernel_stack;
    key.py_stack = s->py_stack;
    key.cfi_stack = s->cfi_stack;
    u64 blocked = now > s->t_out ? now - s->t_out : 0;
    gp_off_start.delete(&tid);
    struct gp_off_value init = {};
    struct gp_off_value *v = gp_off_counts.lookup_or_try_init(&key, &init);
    if (!v) {
        u64 *d = gp_off_drops.lookup(&zero);
        if (d)
            (*d)++;
        return;
    }
    __sync_fetch_and_add(&v->blocked_ns, blocked);
    __sync_fetch_and_add(&v->count, 1);
}

static __always_inline void gp_off_save(u32 tid, struct gp_off_start *s)
{
    if (gp_off_start.update(&tid, s) != 0) {
        int one = 1;
        u64 *d = gp_off_drops.lookup(&one);
        if (d)
            (*d)++;
    }
}

#ifdef GP_WITH_CFI
/* The switch-out whose CFI walk is in progress, per CPU (gp_off_cfi_cont finishes it) */
struct gp_off_pending {
    u32 tid;
    u32 pad;
    struct gp_off_start s;
};
BPF_PERCPU_ARRAY(gp_off_cfi_pending, struct gp_off_pending, 1);
/* The walk's own state: not the CPU sampler's gp_cfi_scratch_state */
BPF_PERCPU_ARRAY(gp_off_cfi_state, struct gp_cfi_state, 1);
/* [0]: gp_off_cfi_cont, loaded by the off-CPU source when the CFI unwinder runs */
BPF_PROG_ARRAY(gp_off_cfi_progs, 1);

/* Starts the CFI walk of a blocked switch-out when the process has tables, and goes on in
 * gp_off_cfi_cont, which stores the switch-out: does not return then. Returns when the process
 * has no tables, no user registers, or the continuation is not loaded: the caller takes the
 * frame-pointer stack. */
static __always_inline void gp_off_cfi_walk(void *ctx, u32 tgid, u32 tid, struct gp_off_start *s)
{
    struct gp_cfi_proc *p = gp_cfi_registered(tgid);
    if (!p)
        return;
    int zero = 0;
    struct gp_cfi_state *st = gp_off_cfi_state.lookup(&zero);
    struct gp_off_pending *pending = gp_off_cfi_pending.lookup(&zero);
    if (!st || !pending)
        return;
    gp_cfi_count(0);
    if (!gp_cfi_begin_in_kernel(st, p->first, p->count, tgid, GP_IDS_OFFCPU))
        return;
    pending->tid = tid;
    __builtin_memcpy(&pending->s, s, sizeof(*s));
    gp_off_cfi_progs.call(ctx, 0); /* does not return when gp_off_cfi_cont is loaded */
}
#endif

/* A raw tracepoint: the kernel's own arguments, without the record a plain tracepoint builds at
 * every switch (both task names copied, the state mapped), a third of what a switch cost hpcc when
 * the program did nothing (docs/collector.md, job_slowdown). args: [0] preempt, [1] prev, [2] next,
 * [3] prev's state. */
RAW_TRACEPOINT_PROBE(sched_switch)
{
    /* runnable (preempted, or yielded): nothing to record, and nothing read (see the top) */
    u32 state = (u32)ctx->args[3];
    if (ctx->args[0] || state == 0)
        return 0;
    /* runs in prev's context: the current task is the one leaving the CPU */
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 prev = (u32)id; /* prev is the current task */
    if (tgid == 0)
        return 0;
    if (state & GP_TASK_DEAD) {
        gp_off_start.delete(&prev); /* its last switch: nothing will wake it again */
#ifdef GP_TASK_RUN_DELAY
        if (gp_in_job(tgid)) {
            /* offsets from the running kernel's BTF (bpf_support.task_run_queue_offsets): the
             * headers BCC compiles against may be another build's */
            u8 *task = (u8 *)bpf_get_current_task();
            struct gp_off_exit e = {};
            e.pid = tgid;
            bpf_probe_read_kernel(&e.run_delay, sizeof(e.run_delay), task + GP_TASK_RUN_DELAY);
            bpf_probe_read_kernel(&e.pcount, sizeof(e.pcount), task + GP_TASK_PCOUNT);
            if (gp_off_exited.update(&prev, &e) != 0) {
                int two = 2;
                u64 *d = gp_off_drops.lookup(&two);
                if (d)
                    (*d)++;
            }
        }
#endif
        return 0;
    }
    if (!gp_in_job(tgid))
        return 0;
    struct gp_off_start s = {};
    s.t_out = bpf_ktime_get_ns();
    s.pid = tgid;
    s.kernel_stack = gp_off_stacks.get_stackid(ctx, 0);
    s.py_stack = gp_py_walk(tgid, prev, GP_IDS_OFFCPU);
#ifdef GP_WITH_CFI
    gp_off_cfi_walk(ctx, tgid, prev, &s);
#endif
    s.user_stack = gp_off_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    gp_off_save(prev, &s);
    return 0;
}

#ifdef GP_WITH_CFI
/* GP_CFI_STEPS frames of a switch-out's CFI walk; again by a tail call of itself until the walk
 * is over (at most 16 programs, under the kernel's 33), then the switch-out is stored with its CFI
 * stack (or its frame-pointer stack when its leaf is in no registered mapping). */
int gp_off_cfi_cont(void *ctx)
{
    int zero = 0;
    struct gp_cfi_state *st = gp_off_cfi_state.lookup(&zero);
    struct gp_off_pending *pending = gp_off_cfi_pending.lookup(&zero);
    if (!st || !pending)
        return 0;
    if (!gp_cfi_steps(st))
        gp_off_cfi_progs.call(ctx, 0); /* a tail call fails past the kernel's limit: the walk is cut */
    struct gp_off_start s;
    __builtin_memcpy(&s, &pending->s, sizeof(s));
    u32 tid = pending->tid;
    s.cfi_stack = gp_cfi_store(st);
    s.user_stack = s.cfi_stack ? -EFAULT : gp_off_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    gp_off_save(tid, &s);
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    gp_off_account(args->pid);
    return 0;
}
