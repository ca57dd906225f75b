"""Mode `stacks`, off-CPU half: where and how long the job's threads were not running (bpf/offcpu.c).

sched_switch / sched_wakeup(_new) tracepoints measure, per job thread, time blocked (switched out
asleep until woken) and time runnable but waiting for a CPU (woken or preempted until switched in),
with the thread's stacks at a blocked switch-out. The kernel sums them per (window, pid, tid,
stacks); every sources.offcpu.flush_interval_s the source drains the finished window into
/offcpu/intervals, whose stack ids share /stacks/frames with /stacks/samples.

The user stacks are those of the CPU samples (bpf_stacks.UserStacks, shared with the stacks
source): walked by the CFI tables of the process's files (sources.stacks.unwinder = "cfi"; the
kernel's frame-pointer walk for a process without tables yet), with the Python frames of a
CPython process merged in.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import BpfHub, read_ring_drops
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.bpf_stacks import (
    UserStacks,
    WindowedCounts,
    acquire_hub,
    lookup_all,
    nonzero_ids,
    shared_user_stacks,
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

    def __init__(self, flush_interval_s: float | None = None, python_frames: bool = True) -> None:
        # flush_interval_s: window length; None = sources.offcpu.flush_interval_s of the config
        # python_frames: False = native stacks only
        self.flush_interval_s = flush_interval_s
        self.python_frames = python_frames
        self.hub: BpfHub | None = None
        self.store: StackStore | None = None
        self.users: UserStacks | None = None  # shared with the stacks source
        self.cfi_walk = False  # the CFI walk's continuation is loaded (blocked stacks walked by CFI)

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
        try:
            self.users = shared_user_stacks(self.hub, ctx, self.name, self.python_frames)
            if self.users.cfi is not None:
                self._load_cfi_walk(ctx)
        except BaseException:
            self.stop()
            raise
        self.counts = WindowedCounts(b, b"gp_off_counts", b"gp_off_gen", b"gp_off_stacks")
        self.starts = b[b"gp_off_start"]
        # the switch-out state of sleeping threads, read in one batch at each drain (BCC's items()
        # is two ctypes calls per entry); buffers sized for the whole map, touched as far as used
        from bcc.libbcc import lib  # the BCC that compiled the object is importable

        self._bcc = lib
        self._start_keys = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Key))
        self._start_leaves = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Leaf))
        self.window_t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)

    def _load_cfi_walk(self, ctx: SourceContext) -> None:
        """The continuation of the CFI walk at blocked switch-outs (gp_off_cfi_cont, bpf/offcpu.c)
        into its program array; without it the switch-outs keep the frame-pointer stack."""
        import ctypes

        from bcc import BPF

        assert self.hub is not None
        b = self.hub.bpf
        try:
            cont = b.load_func(b"gp_off_cfi_cont", BPF.TRACEPOINT)
            progs = b[b"gp_off_cfi_progs"]
            progs[ctypes.c_int(0)] = ctypes.c_int(cont.fd)
        except Exception as e:  # noqa: BLE001 - BCC raises bare Exception when a program does not load
            ctx.report_error(self.name, f"off-CPU stacks by frame pointers only: the CFI walk's continuation "
                                        f"did not load: {str(e).strip()[:300]}")
            return
        self.cfi_walk = True

    def _drain(self, now_ns: int, final: bool) -> list[Batch]:
        assert self.hub is not None and self.store is not None and self.users is not None
        job = set(self.ctx.pids())
        self.hub.set_pids(job)
        self.store.new_drain()
        self.store.watch(job)
        if self.python_frames:
            self.users.register(job)
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
        tids = keys["tid"].tolist()
        for i, (pid, tid) in enumerate(zip(pids, tids)):
            if not pid:  # a new thread's first wait (sched_wakeup_new): its process from /proc
                pids[i] = _tgid_of(tid)
        seen = set(pids) - {0}
        self.store.watch(seen - job)  # the job's were watched above: those forked since
        if self.python_frames:
            self.users.register(seen - job)
        # the CFI and Python records of the window, and of the threads still asleep at the end;
        # those of the new window and of sleeping threads stay in the kernel maps
        cfi_ids = keys["cfi_stack"].tolist()
        py_ids = keys["py_stack"].tolist()  # read and freed even without python_frames (not merged then)
        want_cfi = {c for c in cfi_ids if c} | {int(v.cfi_stack) for _, v in pending if v.cfi_stack}
        want_py = {p for p in py_ids if p} | {int(v.py_stack) for _, v in pending if v.py_stack}
        live = self.counts.live_keys
        keep_cfi = nonzero_ids(live["cfi_stack"]) | nonzero_ids(sleeping["cfi_stack"])
        keep_py = nonzero_ids(live["py_stack"]) | nonzero_ids(sleeping["py_stack"])
        if final:
            keep_cfi, keep_py = set(), set()  # nothing is read after the last drain
        all_frames, py_entries, _gil = self.users.take(want_cfi, want_py, keep_cfi, keep_py, frames)  # blocked: no GIL
        dec = self.users.decoder(self.store, all_frames, py_entries, self.python_frames)
        users = np.empty(n_done, np.uint32)
        kernels = np.empty(n_done, np.uint32)
        for i, (pid, us, ks, py, cf) in enumerate(zip(pids, keys["user_stack"].tolist(),
                                                      keys["kernel_stack"].tolist(), py_ids, cfi_ids)):
            users[i] = dec.user(pid, us, py, cf)
            kernels[i] = dec.kernel(ks)
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
                rows[i] = (t0, pid, tid,
                           dec.user(pid, int(v.user_stack), int(v.py_stack), int(v.cfi_stack)),
                           dec.kernel(int(v.kernel_stack)), blocked, runnable, 1)
                i += 1
        rows = rows[:i]
        self.users.after_drain(self.name, job | seen)
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
            if self.users is not None:
                self.users.release(self.name)  # the last of the two sources closes the CFI unwinder
            self.hub.release()
            self.hub = None

    def at_seal(self, f: Any) -> None:
        if self.store is not None:
            self.store.write(f)

