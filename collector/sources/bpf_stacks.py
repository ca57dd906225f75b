"""Mode `stacks`: CPU stacks of the job's threads sampled by a perf event (bpf/stacks.c).

A CPU_CLOCK perf event at sources.stacks.rate_hz on every CPU runs a BPF program that counts
samples of job threads only (gp_job_pids) in a kernel hash map keyed by (window, pid, tid, cpu,
user stack id, kernel stack id): nothing crosses to user space per sample. Every `interval_s` the
source flips the window, drains the finished half into /stacks/samples rows, copies the frames of
the stack ids those rows use into the collector's `StackStore` (collector/symbolize.py) and frees
them in the kernel map. Names are resolved at seal (/stacks/frames, /stacks/symbols).

Python processes (CPython 3.10-3.13, collector/pyframes.py) are registered in gp_py_procs when
first seen (and again after an exec): their samples also carry a Python stack id (bpf/pyframes.h),
whose frames are named from the live process at the drain and merged into the user stack.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import BpfHub, defines_for_all, read_maps, read_ring_drops
from gpuprof.collector.pyframes import NONE, NotPython, PyFrameNamer, PyProcess, PyReadError, find_interpreter
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.symbolize import STACK_LOST, STACK_NONE, StackStore, _exe

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0


def stack_store(hub: BpfHub) -> StackStore:
    """The StackStore of a BPF object: one id space for every stack table of the file."""
    with hub.attach_lock:
        store = hub.shared.get("stack_store")
        if store is None:
            store = hub.shared["stack_store"] = StackStore()
        return store


def acquire_hub(ctx: SourceContext, mode: str) -> BpfHub:
    modes = ctx.modes if mode in ctx.modes else (*ctx.modes, mode)
    return BpfHub.acquire(modes, defines_for_all)


class WindowedCounts:
    """A kernel hash map whose keys carry a window bit (struct gp_stack_key.gen), the array that
    holds the current bit, and the stack map the keys point into.

    drain() flips the bit, takes the finished window's entries out of the map, reads the frames of
    the stack ids they use and frees those ids in the stack map unless still in use (by the new
    window, or by `keep` ids of in-flight state such as a sleeping thread's switch-out stack).
    Freeing keeps the stack map small and its hash collisions rare; a stack seen again is stored
    again under the same id.
    """

    def __init__(self, bpf: Any, counts: bytes, gen: bytes, stacks: bytes) -> None:
        self.counts = bpf[counts]
        self.gen = bpf[gen]
        self.stacks = bpf[stacks]

    def drain(self, keep: Iterable[int] = ()) -> tuple[list[tuple[Any, Any]], dict[int, list[int] | None]]:
        k0 = self.gen.Key(0)
        old = int(self.gen[k0].value)
        self.gen[k0] = self.gen.Leaf(old ^ 1)
        items = list(self.counts.items_lookup_batch()) if _has_entries(self.counts) else []
        done = [(k, v) for k, v in items if k.gen == old]
        self.live_keys = [k for k, _ in items if k.gen != old]  # the new window's (Python stacks in use)
        keep_ids = set(keep)
        for k, _ in items:
            if k.gen != old:
                keep_ids.update((k.user_stack, k.kernel_stack))
        if done:
            keys = (self.counts.Key * len(done))(*(k for k, _ in done))
            self.counts.items_delete_batch(keys)
        ids = {s for k, _ in done for s in (k.user_stack, k.kernel_stack) if s >= 0}
        frames: dict[int, list[int] | None] = {}
        for sid in ids:
            try:
                frames[sid] = list(self.stacks.walk(sid))
            except KeyError:
                frames[sid] = None  # freed under a sample racing with the previous drain
            if sid not in keep_ids:
                try:
                    del self.stacks[self.stacks.Key(sid)]
                except KeyError:
                    pass
        return done, frames


def _has_entries(table: Any) -> bool:
    try:
        next(iter(table.keys()))
    except StopIteration:
        return False
    return True


def own_stack(store: StackStore, sid: int, frames: dict[int, list[int] | None], pid: int | None) -> int:
    """The store's id of a kernel stack id (pid None: a kernel stack)."""
    if sid < 0:
        # -EFAULT: no stack of that kind (a sample in user mode has no kernel stack)
        return STACK_NONE if sid == -errno.EFAULT else STACK_LOST
    addrs = frames.get(sid)
    if addrs is None:
        return STACK_LOST
    return store.intern_kernel(addrs) if pid is None else store.intern_user(pid, addrs)


class PythonStacks:
    """The Python side of the sampler: which job processes run CPython (registered in gp_py_procs
    with their layout), and the frames of the Python stack ids of a drain, named."""

    def __init__(self, bpf: Any) -> None:
        self.procs_map = bpf[b"gp_py_procs"]
        self.stacks_map = bpf[b"gp_py_stacks"]
        self.counters = bpf[b"gp_py_counters"]
        self.procs: dict[int, tuple[str, PyProcess | None]] = {}  # pid -> (exe when checked, interpreter)
        self.namers: dict[int, PyFrameNamer] = {}
        self.not_python: dict[int, str] = {}  # pid -> why (last seen), for status and tests
        self.last_counts = [0, 0, 0, 0]  # counts() as of the last drain (the map dies at stop)

    def register(self, pids: Iterable[int]) -> None:
        """Look for an interpreter in pids not checked yet or that exec'd since (one readlink each)."""
        for pid in pids:
            exe = _exe(pid)
            known = self.procs.get(pid)
            if known is not None and known[0] == exe:
                continue
            proc: PyProcess | None = None
            try:
                proc = find_interpreter(pid, read_maps(pid))
            except (NotPython, PyReadError, OSError, ValueError) as e:
                self.not_python[pid] = str(e)
            self.procs[pid] = (exe, proc)
            if proc is not None:
                self.not_python.pop(pid, None)
            key = self.procs_map.Key(pid)
            if proc is None:
                if self.procs_map.get(key) is not None:
                    del self.procs_map[key]
                continue
            lay = proc.layout
            leaf = self.procs_map.Leaf()
            leaf.interp_head_addr = proc.runtime + lay.runtime_interp_head
            for field in ("interp_next", "interp_threads_head", "tstate_next", "tstate_thread_id", "tstate_frame",
                          "cframe_frame", "frame_code", "frame_previous", "frame_instr", "frame_owner",
                          "frame_is_entry"):
                setattr(leaf, field, getattr(lay, field))
            leaf.thread_id_is_pthread = int(lay.thread_id_is_pthread)
            leaf.instr_is_index = int(lay.instr_is_index)
            leaf.boundary_each_frame = int(lay.boundary_each_frame)
            leaf.owner_cstack = 3 if lay.frame_owner != NONE else 0xFF
            used = [o for o in (lay.frame_code, lay.frame_previous, lay.frame_instr, lay.frame_owner,
                                lay.frame_is_entry) if o != NONE]
            leaf.frame_read_from = min(used)
            leaf.frame_read_len = max(used) + 8 - min(used)  # one read per frame, of the fields used only
            self.procs_map[key] = leaf
            self.namers[pid] = PyFrameNamer(proc)

    def forget(self, live: set[int]) -> None:
        """Drop what is kept of processes that left the job (bounded memory over long jobs)."""
        for pid in [p for p in self.procs if p not in live]:
            del self.procs[pid]
            self.namers.pop(pid, None)
            self.not_python.pop(pid, None)
            try:
                del self.procs_map[self.procs_map.Key(pid)]
            except KeyError:
                pass

    def take(self, ids: set[int], keep: set[int]) -> dict[int, list[tuple[int, int]] | None]:
        """The entries (code, instr) of each Python stack id, innermost first; freed in the kernel
        map unless the new window uses it."""
        out: dict[int, list[tuple[int, int]] | None] = {}
        for sid in ids:
            key = self.stacks_map.Key(sid)
            try:
                rec = self.stacks_map[key]
            except KeyError:
                out[sid] = None
                continue
            out[sid] = [(int(rec.e[i].code), int(rec.e[i].instr)) for i in range(min(int(rec.depth), len(rec.e)))]
            if sid not in keep:
                try:
                    del self.stacks_map[key]
                except KeyError:
                    pass
        return out

    def counts(self) -> list[int]:
        """[records walked, thread state not found, record not stored, truncated], all CPUs."""
        self.last_counts = read_ring_drops(self.counters)
        return self.last_counts


class BpfStacksSource(Source):
    """99 Hz (configurable) CPU stack sampling of the job's threads."""

    name = "stacks"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.STACK_SAMPLES, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 1.0  # one window per drain

    def __init__(self, rate_hz: float | None = None, python_frames: bool = True) -> None:
        # rate_hz: samples per second per CPU; None = sources.stacks.rate_hz of the config
        # python_frames: False = native stacks only (the bench's baseline for the cost of the walk)
        self.rate_hz = rate_hz
        self.python_frames = python_frames
        self.python: PythonStacks | None = None
        self.hub: BpfHub | None = None
        self.store: StackStore | None = None
        self._attached = False
        self.samples_total = 0

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        rate = float(self.rate_hz if self.rate_hz is not None else ctx.config["sources.stacks"]["rate_hz"])
        if not 0 < rate <= 10000:
            raise SourceUnavailable(f"sources.stacks.rate_hz = {rate} is out of range (0, 10000]")
        self.rate_hz = rate
        self.hub = acquire_hub(ctx, "stacks")
        if not self.hub.has("GP_WITH_STACKS"):
            self.hub.release()
            self.hub = None
            raise SourceUnavailable("the shared BPF object was compiled without stacks")
        self.store = stack_store(self.hub)
        self.hub.set_pids(ctx.pids())
        self.store.watch(ctx.pids())
        self.counts = WindowedCounts(self.hub.bpf, b"gp_cpu_counts", b"gp_cpu_gen", b"gp_cpu_stacks")
        self.python = PythonStacks(self.hub.bpf) if self.python_frames else None
        if self.python is not None:
            self.python.register(ctx.pids())
        try:
            self.hub.bpf.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                           fn_name=b"gp_cpu_sample", sample_freq=round(rate))
        except Exception as e:  # noqa: BLE001 - BCC raises bare Exception when perf_event_open fails
            self.stop()
            raise SourceUnavailable(f"perf event sampling unavailable: {str(e).strip()[:200]}") from None
        self._attached = True
        self.window_t0 = _now_ns()

    def _job_tgids(self) -> set[int]:
        assert self.hub is not None
        pids = set(self.ctx.pids())
        self.hub.set_pids(pids)
        return pids

    def _drain(self, now_ns: int) -> list[Batch]:
        assert self.hub is not None and self.store is not None
        self.store.new_drain()
        tgids = self._job_tgids()
        self.store.watch(tgids)
        if self.python is not None:
            self.python.register(tgids)
        t0, self.window_t0 = self.window_t0, now_ns
        done, frames = self.counts.drain()
        rows = schema.STACK_SAMPLES.empty(len(done))
        if not done:
            return []
        sampled = {int(k.pid) for k, _ in done}
        self.store.watch(sampled)
        if self.python is not None:
            self.python.register(sampled - tgids)  # forked since the tracker's last scan (mpirun's ranks)
        py_entries: dict[int, list[tuple[int, int]] | None] = {}
        if self.python is not None:
            py_entries = self.python.take({int(k.py_stack) for k, _ in done if k.py_stack},
                                          {int(k.py_stack) for k in self.counts.live_keys if k.py_stack})
        merged: dict[tuple[int, int, int], int] = {}
        for i, (k, v) in enumerate(done):
            pid = int(k.pid)
            user = own_stack(self.store, k.user_stack, frames, pid)
            entries = py_entries.get(int(k.py_stack)) if k.py_stack else None
            if entries and self.python is not None and pid in self.python.namers:
                mkey = (pid, int(k.user_stack), int(k.py_stack))
                if mkey not in merged:
                    merged[mkey] = self._merged_stack(pid, k.user_stack, frames, entries)
                user = merged[mkey]
            rows[i] = (t0, pid, int(k.tid), int(k.cpu), user,
                       own_stack(self.store, k.kernel_stack, frames, None), int(getattr(v, "value", v)))
        if self.python is not None:
            self.python.forget(tgids | {int(k.pid) for k, _ in done})
            self.python.counts()
        self.samples_total += int(rows["count"].sum())
        return [(schema.STACK_SAMPLES, np.sort(rows, order=("pid", "tid", "cpu")))]

    def _merged_stack(self, pid: int, sid: int, frames: dict[int, list[int] | None],
                      entries: list[tuple[int, int]]) -> int:
        """The store's id of a native user stack with the thread's Python frames merged in."""
        assert self.python is not None and self.store is not None
        namer = self.python.namers[pid]
        addrs = (frames.get(sid) or []) if sid >= 0 else []
        return self.store.intern_python(pid, addrs, namer.chunks(entries),
                                        (namer.proc.path, namer.proc.eval_ranges))

    def sample(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns)

    def final(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns)

    def drops(self) -> int:
        """Samples not counted because the counts map was full (stacks not stored are rows with
        user_stack or kernel_stack = not captured)."""
        if self.hub is None:
            return 0
        return read_ring_drops(self.hub.bpf[b"gp_cpu_drops"])[0]

    def stop(self) -> None:
        if self.hub is not None:
            if self._attached:
                try:
                    self.hub.bpf.detach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK)
                except Exception:  # noqa: BLE001, S110 - BCC raises bare Exception; detach is best effort
                    pass
                self._attached = False
            self.hub.release()
            self.hub = None

    def at_seal(self, f: Any) -> None:
        if self.store is not None:
            self.store.write(f)


def _now_ns() -> int:
    import time

    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


