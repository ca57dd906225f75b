"""Mode `stacks`, off-CPU half: where and how long the job's threads were not running (bpf/offcpu.c).

The sched_switch and sched_wakeup tracepoints measure, per job thread, the time blocked (switched
out asleep until woken), with the thread's stacks at the switch-out; the kernel sums them per
(window, pid, tid, stacks). The time runnable but waiting for a CPU (woken or preempted until
switched in) is the kernel's own per-thread counter, read here (RunQueueTime): recording it per
switch cost the job more than all the rest (bpf/offcpu.c). Every sources.offcpu.flush_interval_s
the source drains the finished window into /offcpu/intervals, whose stack ids share /stacks/frames
with /stacks/samples; the run-queue time is in rows of its own, without stacks.

The user stacks are those of the CPU samples (bpf_stacks.UserStacks, shared with the stacks
source): walked by the CFI tables of the process's files (sources.stacks.unwinder = "cfi"; the
kernel's frame-pointer walk for a process without tables yet), with the Python frames of a
CPython process merged in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_object import BpfError, libbpf
from gpuprof.collector.bpf_support import BpfHub, HubSource, task_run_queue_offsets
from gpuprof.collector.sources.base import Batch, SourceContext, SourceUnavailable
from gpuprof.collector.sources.bpf_stacks import (
    UserStacks,
    WindowedCounts,
    lookup_all,
    nonzero_ids,
    shared_user_stacks,
    stack_store,
)
from gpuprof.collector.symbolize import STACK_NONE, StackStore, kernel_symbol


def from_schedule(addrs: tuple[int, ...]) -> tuple[int, ...]:
    """A blocked switch-out's kernel stack from __schedule outwards. The raw tracepoint's stack
    starts inside the tracing itself (the BPF program's code, bpf_trace_run4,
    __traceiter_sched_switch: the frames differ between kernels), which says nothing of why the
    thread blocked; the plain tracepoint's started at __schedule. Unchanged when no frame of the
    innermost few is in __schedule."""
    for i, a in enumerate(addrs[:SCHEDULE_WITHIN]):
        if kernel_symbol(a) == "__schedule":
            return addrs[i:]
    return addrs


SCHEDULE_WITHIN = 8  # frames of the tracing between the program and __schedule, at most


class RunQueueTime:
    """Each job thread's time runnable but waiting for a CPU, from the kernel's per-thread counter:
    the second field of /proc/PID/task/TID/schedstat (run_delay, ns; the third counts the times the
    thread was switched in), read at each drain. Exact, and free per switch.

    A thread listed at the first read (the source's start) counts from then; a thread first seen
    later was born since and counts its whole life. A thread that exits between two reads is gone
    from /proc by the next: its final counters come from its last switch-out (gp_off_exited,
    bpf/offcpu.c). The files stay open between reads (up to KEPT_FDS): a read is then one pread
    instead of an open, a read and a close (0.22 against 0.99 ms of CPU for 64 threads)."""

    KEPT_FDS = 4096

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}  # tid -> (run_delay ns, switch-ins) at the last read
        self.fds: dict[int, int] = {}  # tid -> its schedstat file, open
        self.started = False
        self.unreadable: str | None = None  # the first file that could not be read, and why

    def _since(self, tid: int, cur: tuple[int, int]) -> tuple[int, int]:
        before = self.last.get(tid, cur if not self.started else (0, 0))
        return cur[0] - before[0], max(cur[1] - before[1], 0)

    def _counters(self, pid: int, tid: int) -> tuple[int, int] | None:
        """(run_delay, switch-ins) of a thread; None when it is gone or its file unreadable."""
        path = f"/proc/{pid}/task/{tid}/schedstat"
        fd = self.fds.get(tid)
        try:
            if fd is None:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                if len(self.fds) < self.KEPT_FDS:
                    self.fds[tid] = fd
            try:
                fields = os.pread(fd, 128, 0).split()
            finally:
                if self.fds.get(tid) != fd:
                    os.close(fd)
        except (FileNotFoundError, ProcessLookupError):
            return None  # the thread exited since the listing: its counters come with the exits
        except OSError as e:
            self.unreadable = self.unreadable or f"{path}: {e.strerror}"
            return None
        if len(fields) < 3:
            if fields:
                self.unreadable = self.unreadable or f"{path}: {len(fields)} fields, 3 expected"
            return None  # empty: the thread is gone
        return int(fields[1]), int(fields[2])

    def read(self, pids: Iterable[int], exited: dict[int, tuple[int, int, int]] | None = None
             ) -> list[tuple[int, int, int, int]]:
        """(pid, tid, ns waited, switch-ins) since the last read, for every thread that waited;
        exited: tid -> (pid, run_delay, switch-ins) of the threads that exited since."""
        out: list[tuple[int, int, int, int]] = []
        now: dict[int, tuple[int, int]] = {}
        for tid, (pid, delay, runs) in (exited or {}).items():
            # kept at its final value: a process's leader stays listed until it is reaped
            cur = now[tid] = (delay, runs)
            waited, n = self._since(tid, cur)
            if waited > 0:
                out.append((pid, tid, waited, n))
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                continue  # the process is gone
            except OSError as e:
                self.unreadable = self.unreadable or f"/proc/{pid}/task: {e.strerror}"
                continue
            for name in tids:
                tid = int(name)
                if tid in now:
                    continue
                counters = self._counters(pid, tid)
                if counters is None:
                    continue
                now[tid] = counters
                waited, n = self._since(tid, counters)
                if waited > 0:
                    out.append((pid, tid, waited, n))
        for tid in [t for t in self.fds if t not in now or t in (exited or {})]:
            os.close(self.fds.pop(tid))
        self.last = now
        self.started = True
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class BpfOffcpuSource(HubSource):
    """Blocked and run-queue time of the job's threads, with the blocking stack."""

    name = "offcpu"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.OFFCPU_INTERVALS, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 1.0
    shares_drain_thread = True  # its drain reads maps and /proc: nothing that can wedge
    drops_map = b"gp_off_drops"

    def __init__(self, flush_interval_s: float | None = None, python_frames: bool = True) -> None:
        # flush_interval_s: window length; None = sources.offcpu.flush_interval_s of the config
        # python_frames: False = native stacks only
        self.flush_interval_s = flush_interval_s
        if flush_interval_s is not None:
            # before start: the node file's rates_json, written as the collector starts, says the
            # windows' length, which the merge places the rows by (loading.row_window_ns)
            self.interval_s = float(flush_interval_s)
        self.python_frames = python_frames
        self.store: StackStore | None = None
        self.users: UserStacks | None = None  # shared with the stacks source
        self.cfi_walk = False  # the CFI walk's continuation is loaded (blocked stacks walked by CFI)
        self.run_queue: RunQueueTime | None = None

    @classmethod
    def from_config(cls, config: dict[str, dict[str, Any]]) -> BpfOffcpuSource:
        """The source with the config's window (sources.offcpu.flush_interval_s)."""
        return cls(flush_interval_s=float(config["sources.offcpu"]["flush_interval_s"]))

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        every = float(self.flush_interval_s if self.flush_interval_s is not None
                      else ctx.config["sources.offcpu"]["flush_interval_s"])
        if not 0.05 <= every <= 3600:
            raise SourceUnavailable(f"sources.offcpu.flush_interval_s = {every} is out of range [0.05, 3600]")
        self.interval_s = every
        hub = self.take_hub(ctx, "stacks", "GP_WITH_OFFCPU", "off-CPU tracepoints")
        self.store = stack_store(hub, ctx)
        hub.set_pids(ctx.pids())
        self.store.watch(ctx.pids())
        b = hub.bpf
        try:
            self.users = shared_user_stacks(hub, ctx, self.name, self.python_frames)
            if self.users.cfi is not None:
                self._load_cfi_walk(ctx)
        except BaseException:
            self.stop()
            raise
        self.counts = WindowedCounts(b, b"gp_off_counts", b"gp_off_gen", b"gp_off_stacks")
        self.starts = b[b"gp_off_start"]
        # the switch-out state of sleeping threads, read in one batch at each drain (Table.items()
        # is two ctypes calls per entry); buffers sized for the whole map, touched as far as used
        self._libbpf = libbpf()
        self._start_keys = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Key))
        self._start_leaves = np.zeros(int(self.starts.max_entries), np.dtype(self.starts.Leaf))
        self.window_t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.exits = b[b"gp_off_exited"]
        offsets = task_run_queue_offsets()
        if isinstance(offsets, str):
            ctx.report_error(self.name, f"the run-queue time a thread waited between the last drain and its "
                                        f"exit is not counted: {offsets}")
        self.run_queue = RunQueueTime()
        self.run_queue.read(ctx.pids())  # what the threads waited before the start is not counted
        self._said_unreadable = False
        # the kernel's symbols are read at the first lookup (/proc/kallsyms): now, while the prolog
        # waits for the sources, instead of in the first drain, on the job's cores
        kernel_symbol(0)

    def _load_cfi_walk(self, ctx: SourceContext) -> None:
        """The continuation of the CFI walk at blocked switch-outs (gp_off_cfi_cont, bpf/offcpu.c)
        into its program array; without it the switch-outs keep the frame-pointer stack."""
        assert self.hub is not None
        try:
            self.hub.bpf.program(b"gp_off_cfi_cont")  # in gp_off_cfi_progs since the compile, or why not
        except BpfError as e:
            ctx.report_error(self.name, f"off-CPU stacks by frame pointers only: the CFI walk's continuation "
                                        f"did not load: {str(e).strip()[:300]}")
            return
        self.cfi_walk = True

    def _drain(self, now_ns: int, final: bool) -> list[Batch]:
        assert self.hub is not None and self.store is not None and self.users is not None
        assert self.run_queue is not None
        job = set(self.ctx.pids())
        self.hub.set_pids(job)
        self.store.new_drain()
        self.store.watch(job)
        if self.python_frames:
            self.users.register(job)
        # a sleeping thread's switch-out stacks are still needed when it wakes: not freed
        _, sleeping = lookup_all(self._libbpf, self.starts.map_fd, self._start_keys, self._start_leaves)
        keep = set(sleeping["user_stack"].tolist()) | set(sleeping["kernel_stack"].tolist())
        pending: list[Any] = []
        t0, self.window_t0 = self.window_t0, now_ns
        keys, values, frames = self.counts.drain(keep)
        if final:
            # threads still off CPU at the end: their episode so far
            pending = list(self.starts.items())
            for _, v in pending:
                frames.update({s: self.counts.frames(s) for s in (v.user_stack, v.kernel_stack) if s >= 0})
        for sid in set(keys["kernel_stack"].tolist()) | {int(v.kernel_stack) for _, v in pending}:
            addrs = frames.get(sid)
            if addrs:
                frames[sid] = from_schedule(tuple(addrs))
        waits = self.run_queue.read(job, self._take_exits())
        if self.run_queue.unreadable and not self._said_unreadable:
            self._said_unreadable = True
            self.ctx.report_error(self.name, f"run-queue time not recorded for some threads: "
                                             f"{self.run_queue.unreadable}")
        n_done = len(keys)
        rows = schema.OFFCPU_INTERVALS.empty(n_done + len(waits) + (len(pending) if final else 0))
        pids = keys["pid"].tolist()
        seen = set(pids)
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
        all_frames, py_entries, _gil = self.users.take(self.name, want_cfi, want_py, keep_cfi, keep_py, frames)  # blocked: no GIL
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
        done["blocked_ns"], done["runnable_ns"], done["count"] = values["blocked_ns"], 0, values["count"]
        i = n_done
        for pid, tid, waited, runs in waits:
            rows[i] = (t0, pid, tid, STACK_NONE, STACK_NONE, 0, waited, runs)
            i += 1
        if final:
            for k, v in pending:  # asleep at the end: blocked until now
                pid = int(v.pid)
                rows[i] = (t0, pid, int(k.value),
                           dec.user(pid, int(v.user_stack), int(v.py_stack), int(v.cfi_stack)),
                           dec.kernel(int(v.kernel_stack)), max(now_ns - int(v.t_out), 0), 0, 1)
                i += 1
        rows = rows[:i]
        self.users.after_drain(self.name, job | seen)
        return [(schema.OFFCPU_INTERVALS, schema.sort_rows(rows, "pid", "tid"))] if i else []

    def _take_exits(self) -> dict[int, tuple[int, int, int]]:
        """The job threads that exited since the last drain, with their final run-queue counters
        (tid -> (pid, run_delay ns, switch-ins)), taken out of the kernel map."""
        out = {int(k.value): (int(v.pid), int(v.run_delay), int(v.pcount)) for k, v in self.exits.items()}
        for tid in out:
            del self.exits[self.exits.Key(tid)]  # only this drain deletes: each is there
        return out

    def sample(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns, final=False)

    def final(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns, final=True)

    def stop(self) -> None:
        if self.run_queue is not None:
            self.run_queue.close()
        super().stop()

    def detach(self, hub: BpfHub) -> None:
        if self.users is not None:
            self.users.release(self.name)  # the last of the two sources closes the CFI unwinder

    def at_seal(self, f: Any) -> None:
        if self.store is not None:
            self.store.write(f)

