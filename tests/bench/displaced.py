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
on displacing the same thing.

What a yielded rank paid is told apart by what it did when it got its CPU back (yield_outcomes):

  polled  its next sched_yield came within RETURN_POLL_NS of getting the CPU back: its message had
          not arrived, it went on polling, and the collector's run cost it nothing
  worked  it ran longer than that before its next sched_yield (or was switched out first): its
          message arrived while the collector held its core, or it had work waiting; the
          collector's run time is what it may have lost, an upper bound (the message may have
          arrived at the run's end)

The program runs at every context switch of the machine (a few hundred nanoseconds each), in both
arms of a pair alike, so it is off by default.

control() checks that split where the answer is known: a rank that waits in one MPI_Recv for a
rank that sleeps has nothing to do but poll, so all the time a burning thread named like the
collector's takes from it should come out "polled" (bench_slowdown.py --displaced prints it first).

Needs root and BCC (python3-bpfcc); control() also mpicc and mpirun (Open MPI).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time
from typing import Any

from bench_collector import MPI_BENCH, build  # beside this file: mpi_bench, as its busy job builds it

CLASSES = ("preempted_rank", "yielded_rank", "idle", "other")
OUTCOMES = ("polled", "worked")
# Open MPI's polling loop with mpi_yield_when_idle yields about every microsecond (a MPI_Testany
# that completes nothing took 930 ns, the yield included: docs/collector.md, stop 34), so a rank
# that is back in sched_yield within 20 us of its return had found nothing to do
RETURN_POLL_NS = 20_000

PROGRAM = r"""
struct on_cpu { u64 since; u32 cls; u32 rank; };  /* rank: the yielded rank displaced (class 1) */
struct by_thread { char comm[16]; u32 cls; };
struct yielded { u64 ns; u64 back; };              /* collector ns while the rank waited; when it got back */
BPF_HASH(collector_on, u32, struct on_cpu, 4096);  /* collector tid -> since when, what it displaced */
BPF_HASH(yielding, u32, u8, 65536);                /* tids inside sched_yield */
BPF_HASH(total_ns, struct by_thread, u64, 1024);   /* (thread name, class: CLASSES' order) -> ns */
BPF_HASH(yielded_ranks, u32, struct yielded, 4096);  /* rank tid displaced while yielding -> its pending ns */
BPF_ARRAY(outcome_ns, u64, 2);                     /* OUTCOMES' order */
BPF_ARRAY(gap_ns, u64, 32);                        /* the same ns by log2 of the return's gap in us */

/* The rank got its CPU back at p->back and is now yielding again or leaving the CPU: polled or worked. */
static __always_inline void decide(u32 rank, struct yielded *p, u64 now) {
    u64 gap = now - p->back;
    int k = gap < RETURN_POLL_NS ? 0 : 1;
    u64 *sum = outcome_ns.lookup(&k);
    if (sum)
        __sync_fetch_and_add(sum, p->ns);
    int b = bpf_log2l(gap / 1000 + 1);
    sum = gap_ns.lookup(&b);
    if (sum)
        __sync_fetch_and_add(sum, p->ns);
    yielded_ranks.delete(&rank);
}

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
    struct yielded *p = yielded_ranks.lookup(&tid);
    if (p && p->back)
        decide(tid, p, bpf_ktime_get_ns());
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_sched_yield) {
    u32 tid = bpf_get_current_pid_tgid();
    yielding.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 inherited = 4, rank = 0;
    u32 prev_tid = args->prev_pid, next_tid = args->next_pid;
    struct yielded *p = yielded_ranks.lookup(&prev_tid);
    if (p && p->back)
        decide(prev_tid, p, now);  /* off its CPU before yielding again: it worked */
    p = yielded_ranks.lookup(&next_tid);
    if (p && !p->back)
        p->back = now;
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
            if (was->rank) {
                struct yielded none = {};
                struct yielded *y = yielded_ranks.lookup_or_try_init(&was->rank, &none);
                if (y)
                    __sync_fetch_and_add(&y->ns, now - was->since);
            }
            inherited = was->cls;
            rank = was->rank;
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
        if (yielding.lookup(&prev)) {
            cls = 1;
            rank = prev;
        } else
            /* no sleep state (TASK_REPORT, 0x7f): runnable, preempted (0x80, "R+") or gave the
               CPU up while running; else it slept */
            cls = (args->prev_state & 0x7f) == 0 ? 0 : 2;
    }
    struct on_cpu now_on = {now, cls, cls == 1 ? rank : 0};
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
        self._bpf: Any = BPF(text=PROGRAM, cflags=[f'-DRANK_COMM="{comm}"', f"-DRETURN_POLL_NS={RETURN_POLL_NS}ULL"])
        self._totals = self._bpf[b"total_ns"]
        self._outcomes = self._bpf[b"outcome_ns"]

    def by_thread(self) -> dict[tuple[str, str], int]:
        """(collector thread name, class) -> ns so far."""
        return {(k.comm.decode(errors="replace"), CLASSES[k.cls]): int(v.value) for k, v in self._totals.items()}

    def yield_outcomes(self) -> dict[str, int]:
        """The collector's run time on yielded ranks' cores so far (ns) by what the rank did on its
        return (OUTCOMES); a rank not back yet, or back but not yet decided, is counted later."""
        return {name: int(self._outcomes[self._outcomes.Key(k)].value) for k, name in enumerate(OUTCOMES)}

    def return_gaps(self) -> dict[str, int]:
        """yield_outcomes' ns by the gap between a rank's return and its next yield (or switch-out),
        in log2 buckets of microseconds: the evidence for RETURN_POLL_NS."""
        out = {}
        for k, v in self._bpf[b"gap_ns"].items():
            if v.value:
                out[f"<{2 ** (k.value + 1) - 1}us" if k.value else "<1us"] = int(v.value)
        return out

    def close(self) -> None:
        self._bpf.cleanup()


def control(seconds: float = 10.0, burst_s: float = 0.002, period_s: float = 0.03) -> dict[str, Any]:
    """A rank that only polls (mpi_bench wait: rank 0 in MPI_Recv, yielding, while rank 1 sleeps),
    displaced by a thread named gp-burst pinned to its core that burns burst_s of CPU every
    period_s: what it took, by class and by the rank's outcome on its return. All of it should be
    yielded_rank (or preempted_rank: caught between two yields) and polled."""
    build()
    d = Displacement(MPI_BENCH.name)
    stop = threading.Event()

    def burn() -> None:
        ctypes.CDLL(None).prctl(15, b"gp-burst", 0, 0, 0)  # PR_SET_NAME: named like the collector's threads
        os.sched_setaffinity(0, {0})  # rank 0's core (--bind-to core --map-by core)
        while not stop.is_set():
            t = time.thread_time()
            while time.thread_time() - t < burst_s:
                pass
            time.sleep(period_s)

    burner = threading.Thread(target=burn)
    burner.start()
    try:
        subprocess.run(["mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "core", "--map-by", "core",
                        "--mca", "mpi_yield_when_idle", "1", str(MPI_BENCH), "wait", str(seconds)],
                       check=True, capture_output=True, timeout=seconds + 120)
        stop.set()
        burner.join()
        classes: dict[str, float] = {}
        for (_, cls), ns in d.by_thread().items():
            classes[cls] = classes.get(cls, 0.0) + ns / 1e6
        outcomes = d.yield_outcomes()
        gaps = d.return_gaps()
    finally:
        stop.set()
        burner.join()
        d.close()
    decided = sum(outcomes.values())
    return {"bench": "job_slowdown_displaced_control", "rank": "mpi_bench wait: polls in MPI_Recv, never has work",
            "burst": f"{burst_s * 1e3:g} ms of CPU every {period_s * 1e3:g} ms on its core", "seconds": seconds,
            "burst_ms_by_class": {c: round(classes.get(c, 0.0), 1) for c in CLASSES},
            "yielded_rank_ms_by_outcome": {o: round(outcomes[o] / 1e6, 1) for o in OUTCOMES},
            "worked_percent_of_decided": round(100 * outcomes["worked"] / decided, 2) if decided else None,
            "yielded_rank_ms_by_return_gap": {k: round(ns / 1e6, 1) for k, ns in gaps.items()},
            "return_poll_us": RETURN_POLL_NS / 1000,
            "what": "the classifier where the answer is known: every outcome should be polled"}
