/* Off-CPU time of the job's threads (mode `stacks`), from the scheduler's tracepoints.
 *
 * At switch-out of a job thread: its time, whether it left blocked (a sleeping state) or runnable
 * (preempted, or yielded), and, when blocked, its user and kernel stacks, in gp_off_start[tid]. At wakeup: the time it became
 * runnable. At switch-in: blocked = wakeup - switch-out, runnable = switch-in - wakeup (or
 * switch-in - switch-out when it was preempted), added to gp_off_counts under (window, pid, tid,
 * stacks) and drained by collector/sources/bpf_offcpu.py every sources.offcpu.flush_interval_s.
 * An episode is counted in the window in which the thread runs again.
 */
#include "gpuprof_events.h"

#ifndef GP_OFF_STACK_ENTRIES
#define GP_OFF_STACK_ENTRIES 4096
#endif
#ifndef GP_OFF_COUNT_ENTRIES
#define GP_OFF_COUNT_ENTRIES 16384
#endif
/* prev_state of sched_switch: the low byte holds the sleeping state bits; a preempted task is
 * reported as TASK_REPORT_MAX (0x100), a task that yielded as 0 (both: runnable). */
#define GP_TASK_STATE_MASK 0xff
#define GP_TASK_EXITING 0x30 /* EXIT_DEAD | EXIT_ZOMBIE ("X", "Z") */

struct gp_off_start {
    u64 t_out;
    u64 t_wake; /* 0: not woken yet */
    u32 pid;
    s32 user_stack;
    s32 kernel_stack;
    u32 blocked;
};

BPF_STACK_TRACE(gp_off_stacks, GP_OFF_STACK_ENTRIES);
BPF_HASH(gp_off_start, u32, struct gp_off_start, 65536);
BPF_HASH(gp_off_counts, struct gp_stack_key, struct gp_off_value, GP_OFF_COUNT_ENTRIES);
BPF_ARRAY(gp_off_gen, u32, 1);
BPF_PERCPU_ARRAY(gp_off_drops, u64, 2); /* [0] counts map full, [1] start map full */

static __always_inline void gp_off_account(u32 tid, u64 now)
{
    struct gp_off_start *s = gp_off_start.lookup(&tid);
    if (!s)
        return;
    int zero = 0;
    u32 *gen = gp_off_gen.lookup(&zero);
    struct gp_stack_key key = {};
    key.gen = gen ? *gen : 0;
    key.pid = s->pid;
    key.tid = tid;
    key.user_stack = s->user_stack;
    key.kernel_stack = s->kernel_stack;
    u64 blocked = 0, runnable = 0;
    if (s->blocked) {
        u64 woke = s->t_wake ? s->t_wake : now; /* wakeup not seen: all of it blocked */
        blocked = woke - s->t_out;
        runnable = now - woke;
    } else {
        runnable = now - s->t_out;
    }
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
    __sync_fetch_and_add(&v->runnable_ns, runnable);
    __sync_fetch_and_add(&v->count, 1);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    /* runs in prev's context: the current task is the one leaving the CPU */
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 prev = args->prev_pid;
    if (tgid != 0 && prev == (u32)id && (args->prev_state & GP_TASK_EXITING)) {
        gp_off_start.delete(&prev); /* its last switch: nothing will switch it in again */
    } else if (tgid != 0 && prev == (u32)id && gp_in_job(tgid)) {
        struct gp_off_start s = {};
        s.t_out = now;
        s.pid = tgid;
        s.blocked = (args->prev_state & GP_TASK_STATE_MASK) != 0;
        if (s.blocked) {
            s.user_stack = gp_off_stacks.get_stackid(args, BPF_F_USER_STACK);
            s.kernel_stack = gp_off_stacks.get_stackid(args, 0);
        } else {
            /* Runnable (preempted, or it yielded): its time is counted, without stacks. MPI
             * libraries poll with sched_yield on a node with more ranks than cores, 250,000
             * switches a second here under hpcc, and two stack walks at each made the job 40 %
             * slower (docs/collector.md, job_slowdown); where it runs is in the CPU samples. */
            s.user_stack = -EFAULT; /* read as "no stack of that kind", not as a stack lost */
            s.kernel_stack = -EFAULT;
        }
        if (gp_off_start.update(&prev, &s) != 0) {
            int one = 1;
            u64 *d = gp_off_drops.lookup(&one);
            if (d)
                (*d)++;
        }
    }
    /* only job threads have a start entry: other threads cost one failed lookup */
    u32 next = args->next_pid;
    if (next != 0)
        gp_off_account(next, now);
    return 0;
}

static __always_inline void gp_off_woken(u32 tid)
{
    struct gp_off_start *s = gp_off_start.lookup(&tid);
    if (s && s->blocked && s->t_wake == 0)
        s->t_wake = bpf_ktime_get_ns();
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    gp_off_woken(args->pid);
    return 0;
}

/* A new thread of a job process waits in the run queue before its first run: runnable time,
 * without a stack (it has not run yet). Runs in the parent's context. */
TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid == 0 || !gp_in_job(tgid))
        return 0;
    u32 tid = args->pid;
    struct gp_off_start s = {};
    s.t_out = bpf_ktime_get_ns();
    s.pid = 0; /* a new thread's or a new process's tgid: read from /proc/TID by the collector */
    s.user_stack = -EFAULT; /* no stack of that kind (not a stack the kernel failed to store) */
    s.kernel_stack = -EFAULT;
    gp_off_start.update(&tid, &s);
    return 0;
}
