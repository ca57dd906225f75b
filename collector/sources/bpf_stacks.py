"""Mode `stacks`: CPU stacks of the job's threads sampled by a perf event (bpf/stacks.c).

A CPU_CLOCK perf event at sources.stacks.rate_hz on every CPU runs a BPF program that counts
samples of job threads only (gp_job_pids) in a kernel hash map keyed by (window, pid, tid, cpu,
user stack id, kernel stack id): nothing crosses to user space per sample. Every `interval_s` the
source flips the window, drains the finished half into /stacks/samples rows, copies the frames of
the stack ids those rows use into the collector's `StackStore` (collector/symbolize.py) and frees
them in the kernel map. Names are resolved at seal (/stacks/frames, /stacks/symbols).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import BpfHub, defines_for_all, read_ring_drops
from gpuprof.collector.sources.base import Batch, Source, SourceContext, SourceUnavailable
from gpuprof.collector.symbolize import STACK_LOST, STACK_NONE, StackStore

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


class BpfStacksSource(Source):
    """99 Hz (configurable) CPU stack sampling of the job's threads."""

    name = "stacks"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.STACK_SAMPLES, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 1.0  # one window per drain

    def __init__(self, rate_hz: float | None = None) -> None:
        # rate_hz: samples per second per CPU; None = sources.stacks.rate_hz of the config
        self.rate_hz = rate_hz
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
        self.store.watch(self._job_tgids())
        t0, self.window_t0 = self.window_t0, now_ns
        done, frames = self.counts.drain()
        rows = schema.STACK_SAMPLES.empty(len(done))
        if not done:
            return []
        self.store.watch({int(k.pid) for k, _ in done})
        for i, (k, v) in enumerate(done):
            pid = int(k.pid)
            rows[i] = (t0, pid, int(k.tid), int(k.cpu), own_stack(self.store, k.user_stack, frames, pid),
                       own_stack(self.store, k.kernel_stack, frames, None), int(getattr(v, "value", v)))
        self.samples_total += int(rows["count"].sum())
        return [(schema.STACK_SAMPLES, np.sort(rows, order=("pid", "tid", "cpu")))]

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


