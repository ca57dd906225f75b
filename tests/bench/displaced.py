"""What the collector's threads displaced when they ran (bench_slowdown.py --displaced): a BCC
program on sched_switch that, each time a thread named "gp-*" (the collector's named threads:
collector/osthread.py; its main thread only waits, and seals after the job) is switched in, notes
what the CPU was doing just before, and adds the thread's run time until it is switched out to
that class:

  preempted_rank  a rank of the job (its comm) that was running its own code: what the rank
                  waits, and on a node whose every core runs a rank in lock-step, what the job waits
  yielded_rank    a rank inside sched_yield (Open MPI's idle polling with mpi_yield_when_idle, as
                  the realapps' mpirun runs it): the rank had nothing to do; it pays only when its
                  message arrives while the collector still runs
  idle            an idle CPU, or a rank that blocked (slept) before the switch
  other           anything else (slurmd, kernel threads, the bench's own sampler)

A collector thread switched in from another collector thread inherits that one's class: it goes
on displacing the same thing. The program runs at every context switch of the machine (a few
hundred nanoseconds each), in both arms of a pair alike, so it is off by default.

Needs root and BCC (python3-bpfcc).
"""

from __future__ import annotations

from typing import Any

CLASSES = ("preempted_rank", "yielded_rank", "idle", "other")

PROGRAM = r"""
struct on_cpu { u64 since; u32 cls; };
struct by_thread { char comm[16]; u32 cls; };
BPF_HASH(collector_on, u32, struct on_cpu, 4096);  /* collector tid -> since when, what it displaced */
BPF_HASH(yielding, u32, u8, 65536);                /* tids inside sched_yield */
BPF_HASH(total_ns, struct by_thread, u64, 1024);   /* (thread name, class: CLASSES' order) -> ns */

static __always_inline int is_collector(const char *comm) {
    return comm[0] == 'g' && comm[1] == 'p' && comm[2] == '-';
}

static __always_inline int is_rank(const char *comm) {
    const char want[] = RANK_COMM;
#pragma unroll
    for (int i = 0; i < sizeof(want); i++) {
        if (comm[i] != want[i])
            return 0;
        if (want[i] == 0)
            return 1;
    }
    return 1;
}

TRACEPOINT_PROBE(syscalls, sys_enter_sched_yield) {
    u32 tid = bpf_get_current_pid_tgid();
    u8 one = 1;
    yielding.update(&tid, &one);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_sched_yield) {
    u32 tid = bpf_get_current_pid_tgid();
    yielding.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 inherited = 4;
    if (is_collector(args->prev_comm)) {
        u32 tid = args->prev_pid;
        struct on_cpu *was = collector_on.lookup(&tid);
        if (was) {
            struct by_thread key = {};
            bpf_get_current_comm(key.comm, sizeof(key.comm));  /* current is still prev here */
            key.cls = was->cls;
            u64 zero = 0;
            u64 *sum = total_ns.lookup_or_try_init(&key, &zero);
            if (sum)
                __sync_fetch_and_add(sum, now - was->since);
            inherited = was->cls;
            collector_on.delete(&tid);
        }
    }
    if (!is_collector(args->next_comm))
        return 0;
    u32 cls = 3;
    if (inherited < 4) {
        cls = inherited;
    } else if (args->prev_pid == 0) {
        cls = 2;
    } else if (is_rank(args->prev_comm)) {
        u32 prev = args->prev_pid;
        if (yielding.lookup(&prev))
            cls = 1;
        else
            /* no sleep state (TASK_REPORT, 0x7f): runnable, preempted (0x80, "R+") or gave the
               CPU up while running; else it slept */
            cls = (args->prev_state & 0x7f) == 0 ? 0 : 2;
    }
    struct on_cpu now_on = {now, cls};
    u32 next = args->next_pid;
    collector_on.update(&next, &now_on);
    return 0;
}
"""


class Displacement:
    """The program attached until close(); by_thread() the collector's run time so far by thread
    name and class (a thread still on a CPU is counted when it leaves)."""

    def __init__(self, rank_comm: str) -> None:
        from bcc import BPF  # python3-bpfcc

        comm = rank_comm[:15].replace("\\", "\\\\").replace('"', '\\"')
        self._bpf: Any = BPF(text=PROGRAM, cflags=[f'-DRANK_COMM="{comm}"'])
        self._totals = self._bpf[b"total_ns"]

    def by_thread(self) -> dict[tuple[str, str], int]:
        """(collector thread name, class) -> ns so far."""
        return {(k.comm.decode(errors="replace"), CLASSES[k.cls]): int(v.value) for k, v in self._totals.items()}

    def close(self) -> None:
        self._bpf.cleanup()
