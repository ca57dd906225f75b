"""Mode `stacks`, off-CPU half: where and how long the job's threads were not running (bpf/offcpu.c).

sched_switch / sched_wakeup(_new) tracepoints measure, per job thread, time blocked (switched out
asleep until woken) and time runnable but waiting for a CPU (woken or preempted until switched in),
with the thread's user and kernel stacks at switch-out. The kernel sums them per (window, pid, tid,
stacks); every sources.offcpu.flush_interval_s the source drains the finished window into
/offcpu/intervals, whose stack ids share /stacks/frames with /stacks/samples.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import BpfHub, read_ring_drops
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.bpf_stacks import (
    StackIds,
    WindowedCounts,
    acquire_hub,
    lookup_all,
    own_stack,
    stack_store,
)
from gpuprof.collector.symbolize import StackStore


def _tgid_of(tid: int) -> int:
    """The process of a thread, while it exists (0 when it is gone)."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class BpfOffcpuSource(Source):
    """Blocked and run-queue time of the job's threads, with the blocking stack."""

    name = "offcpu"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.OFFCPU_INTERVALS, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 1.0

    def __init__(self, flush_interval_s: float | None = None) -> None:
        # flush_interval_s: window length; None = sources.offcpu.flush_interval_s of the config
        self.flush_interval_s = flush_interval_s
        self.hub: BpfHub | None = None
        self.store: StackStore | None = None

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        every = float(self.flush_interval_s if self.flush_interval_s is not None
                      else ctx.config["sources.offcpu"]["flush_interval_s"])
        if not 0.05 <= every <= 3600:
            raise SourceUnavailable(f"sources.offcpu.flush_interval_s = {every} is out of range [0.05, 3600]")
        self.interval_s = every
        self.hub = acquire_hub(ctx, "stacks")
        if not self.hub.has("GP_WITH_OFFCPU"):
            self.hub.release()
            self.hub = None
            raise SourceUnavailable("the shared BPF object was compiled without off-CPU tracepoints")
        self.store = stack_store(self.hub, ctx)
        self.hub.set_pids(ctx.pids())
        self.store.watch(ctx.pids())
        b = self.hub.bpf
        self.counts = WindowedCounts(b, b"gp_off_counts", b"gp_off_gen", b"gp_off_stacks")
        self.starts = b[b"gp_off_start"]
        # the switch-out state of sleeping threads, read in one batch at each drain (BCC's items()
        # is two ctypes calls per entry); buffers sized for the whole map, touched as far as used
        from bcc.libbcc import lib  # the BCC that compiled the object is importable

        self._bcc = lib
        self._start_keys = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Key))
        self._start_leaves = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Leaf))
        self.window_t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)

    def _drain(self, now_ns: int, final: bool) -> list[Batch]:
        assert self.hub is not None and self.store is not None
        job = set(self.ctx.pids())
        self.hub.set_pids(job)
        self.store.new_drain()
        self.store.watch(job)
        # a sleeping thread's switch-out stacks are still needed when it wakes: not freed
        _, sleeping = lookup_all(self._bcc, self.starts.map_fd, self._start_keys, self._start_leaves)
        keep = set(sleeping["user_stack"].tolist()) | set(sleeping["kernel_stack"].tolist())
        pending: list[Any] = []
        t0, self.window_t0 = self.window_t0, now_ns
        keys, values, frames = self.counts.drain(keep)
        if final:
            # threads still off CPU at the end: their episode so far
            pending = list(self.starts.items())
            for _, v in pending:
                frames.update({s: self.counts.frames(s) for s in (v.user_stack, v.kernel_stack) if s >= 0})
        n_done = len(keys)
        rows = schema.OFFCPU_INTERVALS.empty(n_done + (len(pending) if final else 0))
        pids = keys["pid"].tolist()
        self.store.watch({p for p in pids if p} - job)  # the job's were watched above: those forked since
        ids = StackIds(self.store, frames)
        users = np.empty(n_done, np.uint32)
        kernels = np.empty(n_done, np.uint32)
        tids = keys["tid"].tolist()
        for i, (pid, tid, us, ks) in enumerate(zip(pids, tids, keys["user_stack"].tolist(),
                                                   keys["kernel_stack"].tolist())):
            if not pid:
                pids[i] = pid = _tgid_of(tid)
            users[i] = ids.user(us, pid)
            kernels[i] = ids.kernel(ks)
        done = rows[:n_done]
        done["t_ns"], done["pid"], done["tid"] = t0, pids, keys["tid"]
        done["user_stack"], done["kernel_stack"] = users, kernels
        done["blocked_ns"], done["runnable_ns"], done["count"] = (values["blocked_ns"], values["runnable_ns"],
                                                                  values["count"])
        i = n_done
        if final:
            for k, v in pending:
                tid = int(k.value)
                pid = int(v.pid) or _tgid_of(tid)
                end = max(now_ns, int(v.t_out))
                woke = int(v.t_wake) or end
                blocked, runnable = (woke - int(v.t_out), end - woke) if v.blocked else (0, end - int(v.t_out))
                rows[i] = (t0, pid, tid, own_stack(self.store, v.user_stack, frames, pid),
                           own_stack(self.store, v.kernel_stack, frames, None), blocked, runnable, 1)
                i += 1
        rows = rows[:i]
        return [(schema.OFFCPU_INTERVALS, np.sort(rows, order=("pid", "tid")))] if i else []

    def sample(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns, final=False)

    def final(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns, final=True)

    def drops(self) -> int:
        """Off-CPU episodes lost because a kernel map was full."""
        if self.hub is None:
            return 0
        return sum(read_ring_drops(self.hub.bpf[b"gp_off_drops"]))

    def stop(self) -> None:
        if self.hub is not None:
            self.hub.release()
            self.hub = None

    def at_seal(self, f: Any) -> None:
        if self.store is not None:
            self.store.write(f)

