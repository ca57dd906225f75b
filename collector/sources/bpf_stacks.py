"""Mode `stacks`: CPU stacks of the job's threads sampled by a perf event (bpf/stacks.c).

A CPU_CLOCK perf event at sources.stacks.rate_hz on every CPU runs a BPF program that counts
samples of job threads only (gp_job_pids) in a kernel hash map keyed by (window, pid, tid, cpu,
user stack id, kernel stack id): nothing crosses to user space per sample. Every `interval_s` the
source flips the window, drains the finished half into /stacks/samples rows, copies the frames of
the stack ids those rows use into the collector's `StackStore` (collector/symbolize.py) and frees
them in the kernel map. Names are resolved at seal (/stacks/frames, /stacks/symbols).

Python processes (CPython 3.10-3.13, collector/pyframes.py) are registered in gp_py_procs when
first seen (and again after an exec; a process whose executable is named like an interpreter but
whose libpython is not mapped yet, between its exec and the dynamic loader's mmap, is looked at
again at the next drains, PY_INTERP_RETRIES at most): their samples also carry a Python stack id
(bpf/pyframes.h), whose frames are named from the live process at the drain and merged into the
user stack.

With sources.stacks.unwinder = "cfi" (collector/cfiunwind.py, bpf/cfiunwind.h) the user stacks of
job processes are walked by the CFI tables of their mapped files in the BPF program (code without
frame pointers); their samples carry a CFI stack id whose pc list replaces the frame-pointer stack.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuprof.collector import native, schema
from gpuprof.collector.bpf_object import BpfError, libbpf
from gpuprof.collector.bpf_support import (
    BpfHub,
    HubSource,
    kernel_member_offset,
    read_maps,
    read_ring_drops,
)
from gpuprof.collector.cfiunwind import CfiUnwinder, start_compiler, start_unwinder
from gpuprof.collector.pyframes import (
    NONE,
    NotPython,
    PyFrameNamer,
    PyProcess,
    PyReadError,
    find_interpreter,
    named_like_interpreter,
)
from gpuprof.collector.sources.base import Batch, SourceContext, SourceUnavailable
from gpuprof.collector.symbolize import STACK_LOST, STACK_NONE, StackStore, _exe

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0


def stack_store(hub: BpfHub, ctx: SourceContext) -> StackStore:
    """The StackStore of a BPF object: one id space for every stack table of the file (its debug
    roots: sources.stacks.debug_roots)."""
    with hub.attach_lock:
        store = hub.shared.get("stack_store")
        if store is None:
            store = hub.shared["stack_store"] = StackStore(ctx.config["sources.stacks"]["debug_roots"])
        return store


class WindowedCounts:
    """A kernel hash map whose keys carry a window bit (struct gp_stack_key.gen), the array that
    holds the current bit, and the stack map the keys point into.

    drain() flips the bit, takes the finished window's entries out of the map, reads the frames of
    the stack ids they use and frees those ids in the stack map unless still in use (by the new
    window, or by `keep` ids of in-flight state such as a sleeping thread's switch-out stack).
    Freeing keeps the stack map small and its hash collisions rare; a stack seen again is stored
    again under the same id.

    An id is freed one drain after its last use, not at once: a sample taken between the drain's
    read of the map and the free reuses the id of its stack (the stack map keeps one entry per
    stack and counts no users), and its key, in the new window, then pointed at a freed stack (an
    off-CPU row of CI's with no kernel stack). Held one drain more, an id is freed only when
    nothing used it for a whole window: a stack that recurs, the usual case, is never freed under
    a sample.

    The map is read with one BPF_MAP_LOOKUP_BATCH into numpy buffers kept across drains and the
    finished keys deleted with one BPF_MAP_DELETE_BATCH; the stacks are read and freed by
    collector/native/stacktake.c, TAKE_IDS ids a call into buffers kept too (`reader` "native"), or
    where the library is not built or the map holds build ids, one ctypes lookup and delete per id
    (`reader` "python (why)"): the same frames either way.
    """

    def __init__(self, bpf: Any, counts: bytes, gen: bytes, stacks: bytes) -> None:
        self.lib = libbpf()
        self.counts = bpf[counts]
        self.gen = bpf[gen]
        self.stacks = bpf[stacks]
        self.key_dtype = np.dtype(self.counts.Key)
        self.leaf_dtype = np.dtype(self.counts.Leaf)
        cap = int(self.counts.max_entries)
        self._keys = np.zeros(cap, self.key_dtype)
        self._leaves = np.zeros(cap, self.leaf_dtype)
        self._stack_key = ctypes.c_uint32()
        self._stack_leaf = self.stacks.Leaf()
        # frames of a stack: the leaf's u64 words up to the first 0 (Table.walk, without build ids)
        self._stack_words = np.frombuffer(self._stack_leaf, np.uint64)[:STACK_MAX_DEPTH]
        self.build_ids = bool(int(getattr(self.stacks, "flags", 0)) & STACK_F_BUILD_ID)
        self.live_keys = self._keys[:0]
        self._unused: set[int] = set()  # ids the last drain found unused: freed now unless used again
        self._take: Any = None
        self.reader = _stack_reader(self.build_ids, ctypes.sizeof(self._stack_leaf))
        if self.reader == "native":
            self._take = native.sampler().gp_stacks_take
            self._take_words = np.zeros(TAKE_IDS * STACK_MAX_DEPTH, np.uint64)
            self._take_offsets = np.zeros(TAKE_IDS + 1, np.int64)
            self._take_status = np.zeros(TAKE_IDS, np.int32)

    def _lookup_all(self) -> tuple[np.ndarray, np.ndarray]:
        """Every entry of the counts map (copies), by BPF_MAP_LOOKUP_BATCH."""
        return lookup_all(self.lib, self.counts.map_fd, self._keys, self._leaves)

    def _delete(self, keys: np.ndarray) -> None:
        keys = np.ascontiguousarray(keys)
        count = ctypes.c_uint32(len(keys))
        if self.lib.bpf_map_delete_batch(self.counts.map_fd, ctypes.c_void_p(keys.ctypes.data), ctypes.byref(count),
                                      None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"BPF_MAP_DELETE_BATCH of a counts map: {os.strerror(err)}")

    def frames(self, sid: int) -> tuple[int, ...] | None:
        """The addresses of a stack id, innermost first; None when the id is not in the map."""
        if self.build_ids:
            try:
                return tuple(self.stacks.walk(sid))
            except KeyError:
                return None
        self._stack_key.value = sid
        if self.lib.bpf_map_lookup_elem(self.stacks.map_fd, ctypes.byref(self._stack_key),
                                    ctypes.byref(self._stack_leaf)) < 0:
            return None
        words = self._stack_words
        zero = np.flatnonzero(words == 0)
        return tuple(words[: zero[0] if len(zero) else len(words)].tolist())

    def free(self, sid: int) -> None:
        self._stack_key.value = sid
        self.lib.bpf_map_delete_elem(self.stacks.map_fd, ctypes.byref(self._stack_key))  # gone already: fine

    def drain(self, keep: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, ...] | None]]:
        """(keys, values) of the finished window as numpy rows of the map's key and leaf structs,
        and the frames of every stack id they use (None: freed under a sample racing with the
        previous drain). The new window's keys are left in self.live_keys."""
        k0 = self.gen.Key(0)
        old = int(self.gen[k0].value)
        self.gen[k0] = self.gen.Leaf(old ^ 1)
        keys, leaves = self._lookup_all()
        is_done = keys["gen"] == old
        done_k, done_v = keys[is_done], leaves[is_done]
        self.live_keys = keys[~is_done]  # the new window's (Python stacks in use)
        keep_ids = set(keep)
        keep_ids.update(self.live_keys["user_stack"].tolist())
        keep_ids.update(self.live_keys["kernel_stack"].tolist())
        if len(done_k):
            self._delete(done_k)
        ids = np.unique(np.concatenate((done_k["user_stack"], done_k["kernel_stack"])))
        ids = ids[ids >= 0]
        used = keep_ids | set(ids.tolist())
        if self._take is not None:
            frames = self._take_frames(ids, used)  # read, none freed: all are used
        else:
            frames = {sid: self.frames(sid) for sid in ids.tolist()}
        for sid in self._unused - used:
            self.free(sid)
        self._unused = used - keep_ids
        return done_k, done_v, frames

    def _take_frames(self, ids: np.ndarray, keep_ids: set[int]) -> dict[int, tuple[int, ...] | None]:
        """frames() of each id, in order, and free() of those not in keep_ids: in C, TAKE_IDS a call."""
        ids32 = np.ascontiguousarray(ids, np.int32)
        keep = np.unique(np.fromiter(keep_ids, np.int64, len(keep_ids))).astype(np.int32)
        words, offsets, status = self._take_words, self._take_offsets, self._take_status
        frames: dict[int, tuple[int, ...] | None] = {}
        pos = 0
        while pos < len(ids32):
            got = int(self._take(self.stacks.map_fd, ctypes.sizeof(self._stack_leaf), STACK_MAX_DEPTH,
                                 ids32[pos:].ctypes.data, min(len(ids32) - pos, len(status)), keep.ctypes.data,
                                 len(keep), words.ctypes.data, len(words), offsets.ctypes.data, status.ctypes.data))
            if got <= 0:  # the value size was checked at start (_stack_reader): a broken build
                raise OSError(-got or errno.EINVAL, f"gp_stacks_take: {os.strerror(-got or errno.EINVAL)}")
            flat = words[: offsets[got]].tolist()
            offs = offsets[: got + 1].tolist()
            for j, (sid, st) in enumerate(zip(ids32[pos: pos + got].tolist(), status[:got].tolist())):
                frames[sid] = tuple(flat[offs[j]: offs[j + 1]]) if st == 0 else None
            pos += got
        return frames


def lookup_all(lib: Any, fd: int, keys: np.ndarray, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every entry of the hash map fd (copies), by BPF_MAP_LOOKUP_BATCH into the buffers keys and
    leaves (kept by the caller across reads; as many entries as the map holds at most)."""
    cap = len(keys)
    kp, vp = keys.ctypes.data, leaves.ctypes.data
    ks, vs = keys.dtype.itemsize, leaves.dtype.itemsize
    in_batch, out_batch, count = ctypes.c_uint32(0), ctypes.c_uint32(0), ctypes.c_uint32(0)
    total = 0
    while total < cap:
        count.value = cap - total
        res = lib.bpf_map_lookup_batch(fd, ctypes.byref(in_batch) if total else None, ctypes.byref(out_batch),
                                       ctypes.c_void_p(kp + ks * total), ctypes.c_void_p(vp + vs * total),
                                       ctypes.byref(count), None)
        err = ctypes.get_errno()
        total += count.value
        if res != 0:
            if err != errno.ENOENT:
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            break  # the whole map was read
        if count.value == 0:
            break  # no progress (concurrent updates): the rest at the next read
        in_batch.value = out_batch.value
    return keys[:total].copy(), leaves[:total].copy()


STACK_MAX_DEPTH = 127  # PERF_MAX_STACK_DEPTH, the stack maps' depth
STACK_F_BUILD_ID = 1 << 5  # BPF_F_STACK_BUILD_ID
TAKE_IDS = 512  # stack ids read per native call: its buffers are ~520 KB, kept across drains
STACK_TAKE_MAX_BYTES = 8192  # stacktake.c's GP_STACK_MAX_WORDS * 8


def _stack_reader(build_ids: bool, value_size: int) -> str:
    """Which reader drains a stack map: "native" (stacktake.c) or "python (why not native)"."""
    if build_ids:
        return "python (a build-id stack map: Table.walk reads it)"
    if value_size % 8 or not 0 < value_size <= STACK_TAKE_MAX_BYTES:
        return f"python (a stack value of {value_size} bytes: stacktake.c reads up to {STACK_TAKE_MAX_BYTES})"
    try:
        native.sampler()
    except native.NativeUnavailable as e:
        return f"python ({e})"
    return "native"


class StackIds:
    """The store's ids of one drain's stack ids. A kernel stack is interned once per drain (its
    id depends on its addresses only); a user stack each time, as its frames depend on the
    process's mappings, which an address outside them makes the store read again (the store
    caches what cannot change)."""

    def __init__(self, store: StackStore, frames: Mapping[int, Sequence[int] | None]) -> None:
        self.store = store
        self.frames = frames
        self.kernel_ids: dict[int, int] = {}

    def user(self, sid: int, pid: int) -> int:
        return own_stack(self.store, sid, self.frames, pid)

    def kernel(self, sid: int) -> int:
        out = self.kernel_ids.get(sid)
        if out is None:
            out = self.kernel_ids[sid] = own_stack(self.store, sid, self.frames, None)
        return out


def own_stack(store: StackStore, sid: int, frames: Mapping[int, Sequence[int] | None], pid: int | None) -> int:
    """The store's id of a kernel stack id (pid None: a kernel stack)."""
    if sid < 0:
        # -EFAULT: no stack of that kind (a sample in user mode has no kernel stack)
        return STACK_NONE if sid == -errno.EFAULT else STACK_LOST
    addrs = frames.get(sid)
    if addrs is None:
        return STACK_LOST
    return store.intern_kernel(addrs) if pid is None else store.intern_user(pid, addrs)


# Drains at which a process whose executable is named like an interpreter (python3.X) but maps no
# interpreter yet is looked at again: a shared-libpython build (pyenv's, --enable-shared) has
# /proc/PID/exe changed at exec but its libpython3.X.so mapped by the dynamic loader just after.
PY_INTERP_RETRIES = 5


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
        self.retries: dict[int, int] = {}  # pid -> drains left to look again (its exe unchanged)
        self.last_counts = [0, 0, 0, 0]  # counts() as of the last source's release (the map dies at stop)

    def register(self, pids: Iterable[int]) -> None:
        """Look for an interpreter in pids not checked yet or that exec'd since (one readlink each)."""
        for pid in pids:
            exe = _exe(pid)
            known = self.procs.get(pid)
            same_exe = known is not None and known[0] == exe
            if same_exe and self.retries.get(pid, 0) <= 0:
                continue
            proc: PyProcess | None = None
            try:
                proc = find_interpreter(pid, read_maps(pid))
            except (NotPython, PyReadError, OSError, ValueError) as e:
                self.not_python[pid] = str(e)
            self.procs[pid] = (exe, proc)
            if proc is not None:
                self.not_python.pop(pid, None)
                self.retries.pop(pid, None)
            elif same_exe:
                self.retries[pid] -= 1
            elif named_like_interpreter(exe):
                self.retries[pid] = PY_INTERP_RETRIES
            else:
                self.retries.pop(pid, None)
            key = self.procs_map.Key(pid)
            if proc is None:
                if self.procs_map.get(key) is not None:
                    del self.procs_map[key]
                continue
            lay = proc.layout
            task_fsbase = 0
            if lay.thread_id_is_pthread:  # 3.10: threads matched by their fs base, read from the task
                try:
                    task_fsbase = (kernel_member_offset("task_struct", "thread")
                                   + kernel_member_offset("thread_struct", "fsbase"))
                except (OSError, LookupError, ValueError) as e:
                    self.not_python[pid] = f"pid {pid}: Python 3.10's threads are matched by fs base: {e}"
                    self.procs[pid] = (exe, None)
                    if self.procs_map.get(key) is not None:
                        del self.procs_map[key]
                    continue
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
            leaf.task_fsbase = task_fsbase
            leaf.gil_addr = proc.runtime + lay.gil_runtime if lay.gil_runtime != NONE else 0
            for field in ("tstate_interp", "interp_ceval_gil", "gil_holder", "gil_locked"):
                setattr(leaf, field, getattr(lay, field))
            self.procs_map[key] = leaf
            self.namers[pid] = PyFrameNamer(proc)

    def forget(self, live: set[int]) -> None:
        """Drop what is kept of processes that left the job (bounded memory over long jobs)."""
        for pid in [p for p in self.procs if p not in live]:
            del self.procs[pid]
            self.namers.pop(pid, None)
            self.not_python.pop(pid, None)
            self.retries.pop(pid, None)
            try:
                del self.procs_map[self.procs_map.Key(pid)]
            except KeyError:
                pass

    def take(self, ids: set[int], keep: set[int]) -> tuple[dict[int, list[tuple[int, int]] | None], dict[int, int]]:
        """(the entries (code, instr) of each Python stack id, innermost first; the GIL state of
        each id read, GIL_* of schema.STACK_SAMPLES' gil column); freed in the kernel map unless the
        new window uses it."""
        out: dict[int, list[tuple[int, int]] | None] = {}
        gil: dict[int, int] = {}
        for sid in ids:
            key = self.stacks_map.Key(sid)
            try:
                rec = self.stacks_map[key]
            except KeyError:
                out[sid] = None
                continue
            out[sid] = [(int(rec.e[i].code), int(rec.e[i].instr)) for i in range(min(int(rec.depth), len(rec.e)))]
            gil[sid] = int(rec.gil)
            if sid not in keep:
                try:
                    del self.stacks_map[key]
                except KeyError:
                    pass
        return out, gil

    def counts(self) -> list[int]:
        """[records walked, thread state not found, record not stored, truncated], all CPUs."""
        self.last_counts = read_ring_drops(self.counters)
        return self.last_counts


class HeldIds:
    """The ids one source's drains read from a kernel map keyed by content (the CFI walks'
    gp_cfi_stacks, the Python stacks' gp_py_stacks), freed one drain after their last use, for
    WindowedCounts' reason: a sample taken between the drain's read of its window and the free
    finds its record stored (the insert's BPF_NOEXIST fails with EEXIST), keeps the id, and its
    key in the new window pointed at a freed record (a CPU sample with a lost user stack, in 1 of
    7 runs of test_cpu_samples_and_offcpu_share_the_user_stacks)."""

    def __init__(self) -> None:
        self.unused: set[int] = set()  # read by the last drain and used by nothing it kept

    def step(self, read: set[int], keep: set[int]) -> set[int]:
        """The ids to free now, as a drain reads `read` while `keep` are still in use (a new
        window's, a sleeping thread's)."""
        used = read | keep
        free = self.unused - used
        self.unused = used - keep
        return free


def take_and_free(take: Callable[[set[int], set[int]], Any], read: set[int], free: set[int]) -> Any:
    """take(ids, keep) of a record map (CfiUnwinder.take, PythonStacks.take), which frees each id
    read that is not kept: the ids in read kept, those in free (read by an earlier drain) freed."""
    return take(read | free, read)


class UserStacks:
    """The user stacks of the job's threads as both sources of mode `stacks` record them, the CPU
    sampler (bpf/stacks.c) and off-CPU (bpf/offcpu.c): one per BPF object (hub.shared, taken with
    shared_user_stacks), so that a process is registered once for both (Python layouts in
    gp_py_procs, CFI tables in gp_cfi_procs) and a drain's keys decode the same way in both: the
    CFI walk's pc list in place of the frame-pointer stack, the Python frames merged into it.

    Each source's ids are its own (GP_IDS_CPU, GP_IDS_OFFCPU in bpf/common.h: the kernel maps of
    the CFI and Python records are shared, their ids are not), so each drain frees only what its
    source's keys used. A process is forgotten when no source's last drain saw it. Drains of the
    two sources run in their own threads: what they change here is under one lock."""

    def __init__(self, hub: BpfHub, ctx: SourceContext, unwinder: str | None, compiler: Any) -> None:
        self.hub = hub
        self.lock = threading.RLock()
        self.python: PythonStacks | None = None
        self.cfi: CfiUnwinder | None = start_unwinder(hub, ctx, unwinder, compiler)  # None: frame pointers only
        self.live: dict[str, frozenset[int]] = {}  # source -> the processes its last drain saw
        self.users: set[str] = set()
        self.held: dict[str, tuple[HeldIds, HeldIds]] = {}  # source -> its (CFI, Python) ids held a drain

    def acquire(self, source: str, python_frames: bool, pids: Iterable[int]) -> None:
        """A source starts using the user stacks (python_frames: it asks for Python frames; the
        first one that does registers Python processes for both)."""
        with self.lock:
            self.users.add(source)
            if python_frames and self.python is None:
                self.python = PythonStacks(self.hub.bpf)
            pids = set(pids)
            if self.python is not None:
                self.python.register(pids)
            if self.cfi is not None:
                self.cfi.register(pids)

    def register(self, pids: Iterable[int]) -> None:
        """Python processes among pids not registered yet (CFI registrations run in the unwinder's
        thread, on what the BPF programs mark)."""
        if self.python is not None:
            with self.lock:
                self.python.register(pids)

    def take(self, source: str, cfi_ids: set[int], py_ids: set[int], keep_cfi: set[int], keep_py: set[int],
             frames: Mapping[int, Sequence[int] | None]
             ) -> tuple[dict[int, Sequence[int] | None], dict[int, list[tuple[int, int]] | None], dict[int, int]]:
        """(frames with the pc lists of the CFI ids added, the Python entries of the Python ids,
        the GIL state of the Python ids), read from the kernel maps. An id is freed there one
        drain of the source after its last use (HeldIds), never while kept (ids a new window or a
        sleeping thread still uses)."""
        out: dict[int, Sequence[int] | None] = dict(frames)
        py_entries: dict[int, list[tuple[int, int]] | None] = {}
        py_gil: dict[int, int] = {}
        with self.lock:
            held_cfi, held_py = self.held.setdefault(source, (HeldIds(), HeldIds()))
            if self.cfi is not None:
                free = held_cfi.step(cfi_ids, keep_cfi)
                if cfi_ids or free:
                    taken = take_and_free(self.cfi.take, cfi_ids, free)
                    out.update((sid, taken[sid]) for sid in cfi_ids)
            if self.python is not None:
                free = held_py.step(py_ids, keep_py)
                if py_ids or free:
                    entries, gil = take_and_free(self.python.take, py_ids, free)
                    py_entries = {sid: entries[sid] for sid in py_ids}
                    py_gil = {sid: gil[sid] for sid in py_ids if sid in gil}
        return out, py_entries, py_gil

    def decoder(self, store: StackStore, frames: Mapping[int, Sequence[int] | None],
                py_entries: dict[int, list[tuple[int, int]] | None], python_frames: bool = True) -> UserStackDecoder:
        return UserStackDecoder(self, store, frames, py_entries if python_frames else {})

    def after_drain(self, source: str, live: set[int]) -> None:
        """A source's drain saw these processes: what no source saw is forgotten (Python processes
        at once, CFI registrations by the unwinder's thread)."""
        with self.lock:
            self.live[source] = frozenset(live)
            seen: set[int] = set()
            for pids in self.live.values():
                seen |= pids
            if self.python is not None:
                self.python.forget(seen)
            if self.cfi is not None:
                self.cfi.after_drain(seen)

    def release(self, source: str) -> None:
        """The source stops using the user stacks; the last one closes the CFI unwinder."""
        with self.lock:
            self.users.discard(source)
            self.live.pop(source, None)
            held_cfi, held_py = self.held.pop(source, (HeldIds(), HeldIds()))
            if self.cfi is not None and held_cfi.unused:
                self.cfi.take(held_cfi.unused, set())  # the source's last reads, freed
            if self.python is not None:
                if held_py.unused:
                    self.python.take(held_py.unused, set())
                # read at each release, not at each drain: a per-CPU map read key by key through
                # Python at every drain of both sources, for figures only the tests read
                self.python.counts()
            if self.users:
                return
            if self.cfi is not None:
                self.cfi.close()  # its threads; its processes unregistered
            with self.hub.attach_lock:
                if self.hub.shared.get("user_stacks") is self:
                    del self.hub.shared["user_stacks"]


class UserStackDecoder:
    """The store's user stack ids of one drain's keys (stack id of the kernel's stack map, Python
    stack id, CFI stack id), a merged stack interned once per (pid, native stack, Python stack)."""

    def __init__(self, users: UserStacks, store: StackStore, frames: Mapping[int, Sequence[int] | None],
                 py_entries: dict[int, list[tuple[int, int]] | None]) -> None:
        self.users = users
        self.store = store
        self.frames = frames
        self.ids = StackIds(store, frames)
        self.py_entries = py_entries
        self.merged: dict[tuple[int, int, int], int] = {}

    def user(self, pid: int, us: int, py: int, cf: int) -> int:
        if cf:
            us = cf  # the user stack walked by CFI tables (bpf/cfiunwind.h) instead of frame pointers
        user = self.ids.user(us, pid)  # also where Python frames replace it (the native stack is kept)
        entries = self.py_entries.get(py) if py else None
        python = self.users.python
        if entries and python is not None:
            namer = python.namers.get(pid)
            if namer is not None:
                mkey = (pid, us, py)
                merged_id = self.merged.get(mkey)
                if merged_id is None:
                    addrs = (self.frames.get(us) or []) if us >= 0 else []
                    with self.users.lock:  # the namer's caches, shared by both sources' drains
                        chunks = namer.chunks(entries)
                    merged_id = self.merged[mkey] = self.store.intern_python(
                        pid, addrs, chunks, (namer.proc.path, namer.proc.eval_ranges))
                user = merged_id
        return user

    def kernel(self, sid: int) -> int:
        return self.ids.kernel(sid)


def shared_user_stacks(hub: BpfHub, ctx: SourceContext, source: str, python_frames: bool = True,
                       unwinder: str | None = None, compiler: Any = None) -> UserStacks:
    """The object's UserStacks, created by the first source of mode `stacks` that starts (with the
    CFI unwinder when the object was compiled with it; compiler: start_compiler's, closed here when
    another source created the unwinder already)."""
    with hub.attach_lock:
        users = hub.shared.get("user_stacks")
        created = users is None
        if users is None:
            users = hub.shared["user_stacks"] = UserStacks(hub, ctx, unwinder, compiler)
    if not created and compiler is not None:
        compiler.close()
    users.acquire(source, python_frames, ctx.pids())
    return users


class BpfStacksSource(HubSource):
    """CPU stack sampling of the job's threads, 19 Hz per CPU by default (sources.stacks.rate_hz)."""

    name = "stacks"
    attaches = True  # sees only what happens after it started (a late start is recorded)
    tables = (schema.STACK_SAMPLES, schema.STACK_FRAMES, schema.STACK_SYMBOLS)
    interval_s = 1.0  # one window per drain
    shares_drain_thread = True  # its drain reads maps and /proc: nothing that can wedge
    drops_map = b"gp_cpu_drops"  # [0] counts map full; [1] stack not stored, which rows show
    drops_slots = slice(0, 1)

    def __init__(self, rate_hz: float | None = None, python_frames: bool = True, unwinder: str | None = None) -> None:
        # rate_hz: samples per second per CPU; None = sources.stacks.rate_hz of the config
        # python_frames: False = native stacks only (the bench's baseline for the cost of the walk)
        # unwinder: "cfi" or "frame_pointers"; None = sources.stacks.unwinder of the config
        self.rate_hz = rate_hz
        self.python_frames = python_frames
        self.unwinder = unwinder
        self.users: UserStacks | None = None  # shared with the off-CPU source (kept after stop: status)
        self.store: StackStore | None = None
        self._attached = False
        self.samples_total = 0
        self.unwind_status: dict[str, Any] | None = None  # the CFI unwinder's last status, for the file

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        rate = float(self.rate_hz if self.rate_hz is not None else ctx.config["sources.stacks"]["rate_hz"])
        if not 0 < rate <= 10000:
            raise SourceUnavailable(f"sources.stacks.rate_hz = {rate} is out of range (0, 10000]")
        self.rate_hz = rate
        compiler = start_compiler(ctx, self.unwinder)  # tables (the prewarm) while the BPF object compiles
        try:
            hub = self.take_hub(ctx, "stacks", "GP_WITH_STACKS", "stacks", self.unwinder)
        except BaseException:
            if compiler is not None:
                compiler.close()
            raise
        self.store = stack_store(hub, ctx)
        hub.set_pids(ctx.pids())
        self.store.watch(ctx.pids())
        self.counts = WindowedCounts(hub.bpf, b"gp_cpu_counts", b"gp_cpu_gen", b"gp_cpu_stacks")
        self.users = shared_user_stacks(hub, ctx, self.name, self.python_frames, self.unwinder, compiler)
        try:
            hub.bpf.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                      fn_name=b"gp_cpu_sample", sample_freq=round(rate))
        except BpfError as e:
            self.stop()
            raise SourceUnavailable(f"perf event sampling unavailable: {str(e).strip()[:200]}") from None
        self._attached = True
        self.window_t0 = _now_ns()

    def _job_tgids(self) -> set[int]:
        assert self.hub is not None
        pids = set(self.ctx.pids())
        self.hub.set_pids(pids)
        return pids

    @property
    def python(self) -> PythonStacks | None:
        """The Python side of the user stacks (None: python_frames off)."""
        return self.users.python if self.users is not None and self.python_frames else None

    @property
    def cfi(self) -> CfiUnwinder | None:
        """The CFI unwinder of the user stacks (None: frame pointers only)."""
        return self.users.cfi if self.users is not None else None

    def _drain(self, now_ns: int) -> list[Batch]:
        assert self.hub is not None and self.store is not None and self.users is not None
        self.store.new_drain()
        tgids = self._job_tgids()
        self.store.watch(tgids)
        if self.python_frames:
            self.users.register(tgids)
        t0, self.window_t0 = self.window_t0, now_ns
        keys, values, frames = self.counts.drain()
        if not len(keys):
            return []
        pids = keys["pid"].tolist()
        sampled = set(pids)
        # the tracker's pids were watched above (one readlink each, the drain's largest cost
        # after the stacks' reads): only those forked since
        self.store.watch(sampled - tgids)
        if self.python_frames:
            self.users.register(sampled - tgids)  # forked since the tracker's last scan (mpirun's ranks)
        cfi_ids = keys["cfi_stack"].tolist()
        # Python ids are read and freed even without python_frames: the off-CPU source may have
        # registered the process for its own walks (they are then not merged here)
        py_ids = keys["py_stack"].tolist()
        live = self.counts.live_keys  # the new window's CFI and Python ids stay in the kernel maps
        all_frames, py_entries, py_gil = self.users.take(self.name, {c for c in cfi_ids if c}, {p for p in py_ids if p},
                                                 nonzero_ids(live["cfi_stack"]), nonzero_ids(live["py_stack"]), frames)
        dec = self.users.decoder(self.store, all_frames, py_entries, self.python_frames)
        users = np.empty(len(keys), np.uint32)
        kernels = np.empty(len(keys), np.uint32)
        for i, (pid, us, ks, py, cf) in enumerate(zip(pids, keys["user_stack"].tolist(), keys["kernel_stack"].tolist(),
                                                      py_ids, cfi_ids)):
            users[i] = dec.user(pid, us, py, cf)
            kernels[i] = dec.kernel(ks)
        rows = schema.STACK_SAMPLES.empty(len(keys))
        rows["t_ns"], rows["pid"], rows["tid"], rows["cpu"] = t0, keys["pid"], keys["tid"], keys["cpu"]
        rows["user_stack"], rows["kernel_stack"] = users, kernels
        rows["gil"] = [py_gil.get(py, schema.GIL_UNKNOWN) for py in py_ids]
        rows["count"] = values if values.dtype.names is None else values[values.dtype.names[0]]
        # what no source sees any more is forgotten; CFI registrations run in the unwinder's own
        # thread, on what the BPF programs mark
        self.users.after_drain(self.name, tgids | sampled)
        self.samples_total += int(rows["count"].sum())
        return [(schema.STACK_SAMPLES, schema.sort_rows(rows, "pid", "tid", "cpu"))]

    def sample(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns)

    def final(self, now_ns: int) -> list[Batch]:
        return self._drain(now_ns)

    def detach(self, hub: BpfHub) -> None:
        if self._attached:
            hub.bpf.detach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK)
            self._attached = False
        if self.users is not None:
            if self.users.cfi is not None:  # while registered and the maps exist (at_seal comes after)
                self.unwind_status = self.users.cfi.status()
            self.users.release(self.name)  # the last of the two sources closes the unwinder

    def at_seal(self, f: Any) -> None:
        if self.store is not None:
            self.store.write(f)
            # the unwinder that ran (frame_pointers also where cfi was asked for and did not start)
            f.attrs["unwind_json"] = json.dumps({"unwinder": "cfi" if self.unwind_status is not None
                                                 else "frame_pointers", "cfi": self.unwind_status}, sort_keys=True)


def nonzero_ids(ids: np.ndarray) -> set[int]:
    """The stack ids of a key column that name a record (0: none)."""
    return set(ids[ids != 0].tolist())


def _now_ns() -> int:
    import time

    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


