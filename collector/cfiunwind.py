"""User-space side of the BPF CFI unwinder (bpf/cfiunwind.h): which job processes are walked by
CFI tables, the tables in the kernel's maps, and the pc lists of a drain's CFI stack ids.

At each drain (`register`) the job's pids not registered yet, those that exec'd, and those whose
walk met a pc outside their registered mappings (gp_cfi_stale: a dlopen) get their executable
mappings read from /proc/PID/maps; each mapped file is opened through /proc/PID/map_files (the
exact object mapped, never a path the job controls) and its table compiled once per build id
(collector/cfitables.py, `TableCache`). A process's mappings (start, end, load bias, row range) go
into a range of gp_cfi_mappings and the range into gp_cfi_procs[pid]. A table's rows are written
once into a range of gp_cfi_rows shared by every process that maps the file, when a walk first
needs them: a mapping whose table is not loaded is registered LAZY (its key and segments only,
for the bias), the BPF walk through it takes the frame-pointer rule and asks (gp_cfi_wanted), and
the registration thread loads the table and points every mapping of the file at it within
POLL_S. Loaded at once: the program's and the C library's tables, in every stack
(in_every_stack), and those a walk of an earlier job of the host needed (TableCache.hot; these
are loaded when the unwinder starts, before the job's processes run: _preload_hot): a walk
through a LAZY mapping is cut short or guessed, so a table is waited for once per host. A
job maps far more than it runs: hpcc's job maps 161 files with tables, its walks needed 25. A
process is registered only when every table it needs is compiled: tables not in the cache are
compiled by one background thread (`Compiler`; the descriptor is opened at the drain, while the
process lives), so a drain never waits for a compile, and the process's samples keep their
frame-pointer stacks until its tables are there (about 0.6 s of CPU for Debian's libc the first
time, 1.5 s for python3.11; then from the disk cache, milliseconds).

Kernel memory is bounded by the compile-time sizes of the maps (GP_CFI_ROWS, GP_CFI_MAPPINGS) and
user memory by `max_rows` (config sources.stacks.cfi_max_rows): a file whose table does not fit in
what is left gets none (its frames take the frame-pointer rule; counted in `status()`).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gpuprof.collector.bpf_object import BpfError, libbpf
from gpuprof.collector.bpf_support import BpfHub, parse_maps, read_maps_text, stack_unwinder
from gpuprof.collector.cfitables import (
    ROW_DTYPE,
    CfiTable,
    CompileCancelled,
    NoTable,
    TableCache,
    file_key,
    open_mapped_file,
    own_vdso,
    vaddr_minus_offset,
    vdso_table,
)
from gpuprof.collector.osthread import named_thread
from gpuprof.collector.safeio import ELF_MAX_BYTES, UnsafeFile, open_user_file

MAPPING_DTYPE = np.dtype([("start", "<u8"), ("end", "<u8"), ("bias", "<u8"), ("first", "<u4"), ("count", "<u4"),
                          ("page_first", "<u4"), ("page_count", "<u4"), ("page_base", "<u4"), ("pad", "<u4")])
PAGE_SHIFT = 12  # GP_CFI_PAGE_SHIFT: a table's page index has an entry per 4 KB of its code
LAZY = 0xFFFFFFFF  # a mapping's `first` while its table is not loaded (GP_CFI_LAZY, bpf/cfiunwind.h)
MAX_KEYS_COUNTED = 65536  # the tables_deferred figure stops counting there
MAX_MAPPINGS_PER_PROC = 4096  # GP_CFI_MAP_STEPS = 12 binary search steps
END_REASONS = ("complete", "no_mapping", "stop_rule", "read_failed", "bad_cfa", "truncated", "no_frame_pointer")
COMPILE_QUEUE_MAX = 256  # files waiting for the compile thread (more wait for a later drain)
POLL_S = 0.1  # registrations asked for by the BPF program are made this often between drains
# With the native watch (collector/native/mapwatch.c) the registration thread sleeps until the BPF
# program asks for a registration (the watch looks every POLL_S), a drain posts, or the compile
# thread finishes a file; it looks on its own at least this often all the same.
IDLE_POLL_S = 1.0


class Compiler:
    """One background thread compiling tables into a TableCache, one file at a time (at the
    collector's own priority); requests are open descriptors, closed by the thread."""

    def __init__(self, cache: TableCache) -> None:
        self.cache = cache
        # (priority, order, request): the tables a job process waits for before the prewarm's,
        # in the order asked; None (close) first of all
        self.queue: queue.PriorityQueue[tuple[int, int, tuple[int, os.stat_result, bool] | None]] = \
            queue.PriorityQueue()
        self.order = itertools.count()
        self.pending: set[str] = set()  # file identities queued or being compiled
        self.done = 0  # files finished (compiled, or found to have no table)
        self.on_done: Any = None  # called after each file finished (the unwinder's wake-up), or None
        self.lock = threading.Lock()
        self.thread = named_thread(self._run, "gpuprof-cfi-compiler")
        self.thread.start()

    def submit(self, fd: int, st: os.stat_result, warm: bool = False) -> bool:
        """Queue the open file (the thread closes fd); False (fd closed here) when it is queued already
        or the queue is full. warm: into the disk cache only (TableCache.warm)."""
        key = file_key(st)
        with self.lock:
            if key in self.pending or len(self.pending) >= COMPILE_QUEUE_MAX:
                os.close(fd)
                return False
            self.pending.add(key)
        self.queue.put((1 if warm else 0, next(self.order), (fd, st, warm)))
        return True

    def _run(self) -> None:
        while True:
            _, _, item = self.queue.get()
            if item is None:
                return
            fd, st, warm = item
            try:
                if warm:
                    self.cache.warm(fd, st)
                else:
                    self.cache.get(fd, st, child=True)
            except (NoTable, OSError, ValueError):
                pass  # remembered by the cache (NoTable) or tried again at a later registration
            except CompileCancelled:
                pass  # the collector stops
            finally:
                os.close(fd)
                with self.lock:
                    self.pending.discard(file_key(st))
                    self.done += 1
                if self.on_done is not None:
                    self.on_done()

    def idle(self) -> bool:
        with self.lock:
            return not self.pending

    def close(self) -> None:
        """Stop at once (the seal has a deadline): a compile in flight is left to finish into the disk
        cache for the next job (compile_in_child), lock waits end."""
        self.cache.cancel.set()
        self.queue.put((-1, next(self.order), None))
        self.thread.join(timeout=1)


class RangeAlloc:
    """First-fit ranges of [0, capacity); a range freed is reusable from the next drain on (a sample
    in flight may still read it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_list: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        self.pending: list[tuple[int, int]] = []
        self.used = 0

    def alloc(self, n: int) -> int | None:
        for i, (start, size) in enumerate(self.free_list):
            if size >= n:
                if size == n:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (start + n, size - n)
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        if n:
            self.pending.append((start, n))
            self.used -= n

    def free_now(self, start: int, n: int) -> None:
        """Free a range no walk can be reading (nothing ever pointed at it): reusable at once."""
        if n:
            self.used -= n
            self._merge([(start, n)])

    def new_drain(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        self._merge(pending)

    def _merge(self, freed: list[tuple[int, int]]) -> None:
        ranges = sorted(self.free_list + freed)
        merged: list[tuple[int, int]] = []
        for start, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free_list = merged


@dataclass
class _Loaded:
    first: int
    count: int
    # its page index in gp_cfi_pages (page_index: page_count + 1 entries); page_count 0: none
    page_first: int = 0
    page_count: int = 0
    page_base: int = 0
    users: set[int] = field(default_factory=set)  # pids

    def mapping_fields(self) -> tuple[int, int, int, int, int]:
        """(first, count, page_first, page_count, page_base) of a mapping of its file."""
        return self.first, self.count, self.page_first, self.page_count, self.page_base


# a maps line as the registration compares them: (start, end, offset, device, inode, path)
MapsLine = tuple[int, int, int, str, int, str]


@dataclass
class _Proc:
    exe: str
    maps_text: str
    first: int
    count: int
    keys: set[str]
    # what each of its mappings got, by the maps line's (start, end, offset, device, inode, path):
    # (table key, bias); a registration again (a dlopen since) reuses it for the lines unchanged
    tabled: dict[MapsLine, tuple[str, int]] = field(default_factory=dict)
    # its mappings (index in gp_cfi_mappings) whose file's table is not loaded yet: table key
    lazy: dict[int, str] = field(default_factory=dict)


def page_index(pcs: np.ndarray) -> tuple[int, np.ndarray]:
    """A table's page index (gp_cfi_pages, bpf/cfiunwind.h) from its rows' sorted pcs: the first
    page (pc >> PAGE_SHIFT of its first row) and, for each page from there to its last row's and
    one more, the number of rows whose pc is at most the page's start. The rows of a pc in page k
    lie between entries k and k + 1, so the BPF walk searches those (a few cache lines) instead
    of the whole table (17 steps over libgromacs's, most of them a new cache line)."""
    if not len(pcs):
        return 0, np.zeros(0, np.uint32)
    base = int(pcs[0]) >> PAGE_SHIFT
    starts = (np.arange(base, (int(pcs[-1]) >> PAGE_SHIFT) + 2, dtype=np.uint64) << PAGE_SHIFT)
    return base, np.searchsorted(pcs, starts, side="right").astype(np.uint32)


def in_every_stack(path: str, exe: str) -> bool:
    """Whether a mapped file is in (almost) every stack of the process: its program and the C
    library (main, __libc_start_main, _start: the outer frames). Their tables are loaded at the
    registration, so that a process's first walks reach _start; the other files' when a walk
    needs them."""
    return path == exe or os.path.basename(path).startswith("libc.so.")


def _native_take() -> Any:
    """collector/native's gp_cfi_stacks_take, or None when the library is not built."""
    from gpuprof.collector import native

    try:
        return native.sampler().gp_cfi_stacks_take
    except native.NativeUnavailable:
        return None


class CfiUnwinder:
    def __init__(self, bpf: Any, compiler: Compiler, report: Any = None) -> None:
        """compiler: the table compiler (its cache bounds the rows: cache.max_rows), started before the
        BPF object by start_compiler, so that the prewarm runs while the object compiles."""
        self.lib = libbpf()
        self._take = _native_take()  # None: take() reads id by id through ctypes
        self._take_refused = ""  # why the native take fell back (status)
        self.bpf = bpf
        self.report = report  # report(message): an error row (None: kept in self.errors only)
        self.errors: list[str] = []
        self.rows_map = bpf[b"gp_cfi_rows"]
        self.maps_map = bpf[b"gp_cfi_mappings"]
        self.procs_map = bpf[b"gp_cfi_procs"]
        self.stacks_map = bpf[b"gp_cfi_stacks"]
        self.stale_map = bpf[b"gp_cfi_stale"]
        self.wanted_map = bpf[b"gp_cfi_wanted"]
        self.counters = bpf[b"gp_cfi_counters"]
        kernel_rows = int(self.rows_map.max_entries)
        max_rows = compiler.cache.max_rows
        if max_rows > kernel_rows:
            raise ValueError(f"sources.stacks.cfi_max_rows = {max_rows} is more than the BPF map's {kernel_rows} "
                             f"(GP_CFI_ROWS)")
        self.rows = RangeAlloc(max_rows)
        self._rows_window = RowsWindow.open(self.rows_map)
        self.rows_written_by = "memory map" if self._rows_window is not None else "batch update"
        self.mappings = RangeAlloc(int(self.maps_map.max_entries))
        self.pages_map = bpf[b"gp_cfi_pages"]
        self.pages = RangeAlloc(int(self.pages_map.max_entries))
        self.page_indexed = 0  # tables loaded with their page index
        self.no_page_index = 0  # tables loaded without one (no room in gp_cfi_pages): searched whole
        self.gen_map = bpf[b"gp_cfi_gen"]
        self._raise_generation()  # a BPF object shared with an earlier unwinder: its cached rules go
        self.cache = compiler.cache
        self.compiler = compiler
        self.lock = threading.RLock()
        self._done_seen = 0
        self._stop = threading.Event()
        # a BPF object shared with an earlier source (the bench's) may hold its registrations
        for m in (self.procs_map, self.stacks_map, self.stale_map, self.wanted_map):
            m.clear()
        on = bpf[b"gp_cfi_on"]
        on[on.Key(0)] = on.Leaf(1)  # unregistered job processes are marked stale from now on

        self.loaded: dict[str, _Loaded] = {}
        self.procs: dict[int, _Proc] = {}
        self.waiting: set[int] = set()  # pids whose tables are not all compiled yet
        self.no_table: dict[str, str] = {}  # file identity -> why (reported; bounded below)
        self.no_room = 0  # tables that did not fit in what was left of max_rows
        # mappings registered with their table not loaded (LAZY): index in gp_cfi_mappings -> (pid, key);
        # loaded when a walk asks (gp_cfi_wanted), for every mapping of the file at once
        self.lazy: dict[int, tuple[int, str]] = {}
        self.lazy_by_key: dict[str, set[int]] = {}  # key -> its LAZY mappings' indices (the same entries)
        self.loaded_on_demand = 0  # tables loaded because a walk asked for them
        self.deferred: set[str] = set()  # the tables ever registered LAZY (status: how many waited)
        self._vdso_table: CfiTable | None | Literal[False] = None  # False: none (the reason in no_table)
        self.registrations = 0
        self.last_counts = [0] * 13
        bpf.program(b"gp_cfi_cont")  # in gp_cfi_progs since the compile (bpf_support.tail_calls_for); or why not
        self._posted_live: frozenset[int] | None = None  # after_drain's, for the registration thread
        self._last_live: frozenset[int] = frozenset()  # the last set after_drain woke the thread for
        self._wake = threading.Event()  # something for the registration thread (with the native watch)
        self._watch: _RequestWatch | None = _RequestWatch.start((bpf[b"gp_cfi_asks"],), self._wake.set)
        self._watch_wakes: int | None = None  # the watch's count when it stopped (None: never started)
        self.poll_how = (f"native watch every {POLL_S} s, python when asked or every {IDLE_POLL_S} s"
                         if self._watch is not None else f"python every {POLL_S} s ({_RequestWatch.why_not})")
        compiler.on_done = self._wake.set
        # the vDSO's table (a compile, 37 ms of CPU) now, while the prolog waits, not at the job's
        # first registration, on its cores
        self._vdso(len(own_vdso()))
        self._preloaded: set[str] = set()  # preloaded tables no process has mapped yet (evictable)
        # the tables a job process used (a mapping pointed at them): marked hot at the close, the
        # newest marks, so that the host's next job preloads them first (_preload_hot)
        self.used: set[str] = set()
        self.preloaded = self._preload_hot()
        self.cache.read_index()  # here, not at the job's first registration (333 lines: a few ms)
        self.poller = named_thread(self._poll, "gpuprof-cfi-register")
        self.poller.start()

    # --- registration ----------------------------------------------------------------------------
    def register(self, pids: Iterable[int]) -> None:
        """Register (or refresh) the processes of pids that need it, and those the BPF program marked
        stale (an exec, a pc outside their mappings, a job process not registered yet); those
        whose tables are not all compiled yet are registered with what is there and again when
        the compile thread has more. (Freed ranges become reusable once a drain: _poll.)"""
        with self.lock:
            stale = self._take_stale()
            retry = self.waiting if self.compiler.done != self._done_seen else set()
            self._done_seen = self.compiler.done
            self._register_some(set(pids) | stale | retry, stale | retry)

    def after_drain(self, live: set[int]) -> None:
        """What the stacks source's drain tells the unwinder, without waiting for it: the job's
        processes now (the others are unregistered), and that a drain passed (ranges freed before
        become reusable). The registration thread acts on it; a drain never waits for a
        registration, which can take seconds when a process maps many files whose tables are
        compiled on the spot (a job's slurmstepd maps dozens of Slurm plugins)."""
        posted = frozenset(live)
        self._posted_live = posted  # one assignment: read whole by the registration thread
        if posted != self._last_live:
            # processes came or went: forget the gone ones now. An unchanged set (the usual drain)
            # waits for the thread's next wake-up (IDLE_POLL_S at most): two drains a second
            # woke it for nothing to do.
            self._last_live = posted
            self._wake.set()

    def _poll(self) -> None:
        """The registration thread: every POLL_S, the registrations the BPF program asked for
        (gp_cfi_stale: a job process sampled without tables, an exec, a dlopen), the processes whose
        tables the compile thread has finished, and what the last drain posted (after_drain). Only
        processes that are sampled are registered: a job process that never runs costs nothing."""
        timeout = IDLE_POLL_S if self._watch is not None else POLL_S
        while True:
            self._wake.wait(timeout)
            if self._stop.is_set():
                return
            self._wake.clear()
            if self._watch is not None:
                self._watch.ack()  # before the map is read: a request made after it wakes us again
            try:
                live, self._posted_live = self._posted_live, None
                if live is not None:
                    with self.lock:
                        self.rows.new_drain()
                        self.pages.new_drain()
                        self.mappings.new_drain()
                        self._forget(set(live))
                self._serve_wanted()
                pending = next(iter(self.stale_map.keys()), None) is not None
                if pending or (self.waiting and self.compiler.done != self._done_seen):
                    self.register(())
            except (OSError, ValueError, KeyError) as e:
                self._error(f"CFI registration between drains failed: {e}")

    def _register_some(self, pids: set[int], stale: set[int]) -> None:
        from gpuprof.collector.symbolize import _exe

        for pid in pids:
            known = self.procs.get(pid)
            if known is not None and pid not in stale and pid not in self.waiting and known.exe == _exe(pid):
                continue
            text = read_maps_text(pid)
            if text is None:
                continue
            if (known is not None and known.maps_text == text and pid not in self.waiting
                    and pid in stale and self.procs_map.get(self.procs_map.Key(pid)) is not None):
                continue  # nothing mapped since (a pc outside every mapping: JIT code, a lost walk)
            try:
                self._register(pid, _exe(pid), text)
            except (OSError, ValueError) as e:  # a map update failed: this process keeps frame pointers
                self._error(f"CFI tables of pid {pid} not registered: {e}")

    def _error(self, msg: str) -> None:
        if len(self.errors) < 64:
            self.errors.append(msg)
            if self.report is not None:
                self.report(msg)

    def _take_stale(self) -> set[int]:
        out = set()
        for k in list(self.stale_map.keys()):
            out.add(int(k.value))
            try:
                del self.stale_map[k]
            except KeyError:
                pass
        return out

    def _register(self, pid: int, exe: str, text: str) -> None:
        """The process's executable mappings into gp_cfi_mappings, each with its file's table when
        that is loaded already (another process maps the file), in every stack (the program and
        its C library: in_every_stack) or needed by an earlier job's walks (hot), else LAZY: the
        table's rows are loaded when a walk first goes through the mapping (_serve_wanted). Here
        only the table's key and segments (for the load bias) are looked up: the rows of a job's
        many mapped files are read only for the few its samples walk."""
        maps = sorted(parse_maps(text, executable_only=True), key=lambda m: m.start)
        if len(maps) > MAX_MAPPINGS_PER_PROC:
            maps = maps[:MAX_MAPPINGS_PER_PROC]
        # the entries' columns as lists, into MAPPING_DTYPE once at the end: a field written into a
        # numpy record costs about a microsecond, and a job's registrations write ten thousand
        bias = [0] * len(maps)
        # (first, count, page_first, page_count, page_base) of each (_Loaded.mapping_fields)
        fields = [(0, 0, 0, 0, 0)] * len(maps)
        keys: set[str] = set()
        eager: list[tuple[int, CfiTable]] = []  # the vDSO's: its table is in memory already
        tabled: dict[MapsLine, tuple[str, int]] = {}  # line -> (table key, bias)
        by_index: dict[int, str] = {}  # mapping -> table key, of the mappings that have a table
        before = self.procs.get(pid)
        missing = False
        for i, m in enumerate(maps):
            line = (m.start, m.end, m.offset, m.dev, m.inode, m.path)
            had = before.tabled.get(line) if before is not None and before.exe == exe else None
            if had is not None:
                # the same file mapped at the same place: its table key and bias stand (no open, no lookup)
                bias[i] = had[1]
                tabled[line] = had
                by_index[i] = had[0]
                continue
            if m.path == "[vdso]":
                t = self._vdso(m.end - m.start)
                d = t.vaddr_minus_offset(m.offset) if t is not None else None
                if t is not None and d is not None:
                    bias[i] = (m.start - m.offset - d) & 0xFFFFFFFFFFFFFFFF
                    eager.append((i, t))
                continue
            if not m.path.startswith("/"):
                continue  # anonymous code: the frame-pointer rule
            try:
                fd, st = open_mapped_file(pid, m.start, m.end)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ESRCH):
                    return  # exited, or the mapping changed since the maps were read
                self._no_table(f"{m.path}", str(e))
                continue
            except NoTable as e:
                self._no_table(m.path, str(e))
                continue
            try:
                found = self.cache.locate(fd, st)  # memory, else the disk cache (no rows read)
            except (NoTable, OSError) as e:
                os.close(fd)
                self._no_table(m.path, str(e))
                continue
            if found is None:  # not compiled yet: by the compile thread, then at a later drain
                self.compiler.submit(fd, st)
                missing = True
                continue
            os.close(fd)
            key, segments = found
            d = vaddr_minus_offset(segments, m.offset)
            if d is None:
                continue
            bias[i] = (m.start - m.offset - d) & 0xFFFFFFFFFFFFFFFF
            tabled[line] = (key, bias[i])
            by_index[i] = key
            if key not in self.loaded and (in_every_stack(m.path, exe) or self.cache.hot(key)):
                t = self.cache.load(key)
                if t is not None:
                    eager.append((i, t))
        if missing:  # registered with what is there (the rest: the frame-pointer rule), again later
            self.waiting.add(pid)
        else:
            self.waiting.discard(pid)
        attached: list[tuple[int, str, _Loaded | None]] = [(i, t.key, self._load(t)) for i, t in eager]
        eager_at = {i for i, _ in eager}
        attached += [(i, key, self.loaded.get(key)) for i, key in by_index.items() if i not in eager_at]
        lazy: dict[int, str] = {}  # mapping -> key, of those whose table is not loaded
        for i, key, lt in attached:
            if lt is None:
                if i in by_index:
                    fields[i] = (LAZY, 0, 0, 0, 0)
                    lazy[i] = key
                    if len(self.deferred) < MAX_KEYS_COUNTED:
                        self.deferred.add(key)
                continue
            lt.users.add(pid)
            keys.add(key)
            self.used.add(key)
            fields[i] = lt.mapping_fields()
        entries = np.zeros(len(maps), MAPPING_DTYPE)
        entries["start"] = [m.start for m in maps]
        entries["end"] = [m.end for m in maps]
        entries["bias"] = bias
        if maps:
            columns = np.array(fields, np.uint32)
            for col, name in enumerate(("first", "count", "page_first", "page_count", "page_base")):
                entries[name] = columns[:, col]
        first = self.mappings.alloc(len(entries)) if len(entries) else None
        if first is None:
            for k in keys:
                self._unuse(k, pid)
            return
        self._update_batch(self.maps_map, first, entries)
        old = self.procs.get(pid)
        leaf = self.procs_map.Leaf()
        leaf.first, leaf.count = first, len(entries)
        self.procs_map[self.procs_map.Key(pid)] = leaf
        proc = self.procs[pid] = _Proc(exe, text, first, len(entries), keys, tabled,
                                       {first + i: key for i, key in lazy.items()})
        for at, key in proc.lazy.items():
            self.lazy[at] = (pid, key)
            self.lazy_by_key.setdefault(key, set()).add(at)
        self.registrations += 1
        if old is not None:
            self._drop_lazy(old)
            self.mappings.free(old.first, old.count)
            for k in old.keys - keys:
                self._unuse(k, pid)

    def _drop_lazy(self, proc: _Proc) -> None:
        for at, key in proc.lazy.items():
            self._forget_lazy(at, key)
        proc.lazy.clear()

    def _forget_lazy(self, at: int, key: str) -> None:
        self.lazy.pop(at, None)
        ats = self.lazy_by_key.get(key)
        if ats is not None:
            ats.discard(at)
            if not ats:
                del self.lazy_by_key[key]

    def _serve_wanted(self) -> None:
        """Load the tables the BPF walks asked for (gp_cfi_wanted: a pc in a LAZY mapping) and point
        every mapping of their files at them, of every process (the rows first: the mappings'
        updates, system calls, publish them)."""
        asked = [int(k.value) for k in self.wanted_map]  # its keys
        if not asked:
            return
        with self.lock:
            for at in asked:
                try:
                    del self.wanted_map[self.wanted_map.Key(at)]
                except KeyError:
                    pass
            for key in {self.lazy[at][1] for at in asked if at in self.lazy}:
                t = self.cache.load(key)
                lt = self._load(t) if t is not None else None
                if t is None:
                    self._no_table(key, "its table left the disk cache before a walk needed it")
                elif lt is not None:
                    self.loaded_on_demand += 1
                    self.cache.mark_hot(key)  # the host's next registrations load it at once
                for at in sorted(self.lazy_by_key.get(key, ())):
                    pid, _ = self.lazy[at]
                    self._forget_lazy(at, key)
                    proc = self.procs[pid]
                    del proc.lazy[at]
                    leaf = self.maps_map[self.maps_map.Key(at)]
                    # no table (gone, or no room): the frame-pointer rule from now on, no more asking
                    (leaf.first, leaf.count, leaf.page_first, leaf.page_count,
                     leaf.page_base) = lt.mapping_fields() if lt is not None else (0, 0, 0, 0, 0)
                    self.maps_map[self.maps_map.Key(at)] = leaf
                    if lt is not None:
                        lt.users.add(pid)
                        proc.keys.add(key)
                        self.used.add(key)

    def _preload_hot(self) -> int:
        """Load the tables that walks of earlier jobs of this host needed (TableCache.hot_keys) now,
        while the prolog waits, up to PRELOAD_ROWS_SHARE of max_rows: a registration then only
        points the job's mappings at them, where it loaded them on the job's cores as its processes
        started (hpcc's: 27 of the 69 ms of its registrations). A preloaded table no process maps
        stays until the collector stops or a table the job needs finds no room (it is then freed:
        _evict_unused_preloads); one that a process maps is freed with its last user, as any.
        Returns how many were loaded."""
        budget = int(self.rows.capacity * PRELOAD_ROWS_SHARE)
        for key in self.cache.hot_keys():
            if key in self.loaded:
                continue
            t = self.cache.load(key, keep=False)  # its rows live in the BPF map: no second copy here
            if t is None or self.rows.used + len(t.rows) > budget:
                continue  # gone from the disk cache since, or too large for what is left: a later walk asks
            if self._load(t) is not None:
                self._preloaded.add(key)
        return len(self._preloaded)

    def _vdso(self, size: int) -> CfiTable | None:
        """The host's vDSO table (cfitables.vdso_table), for a [vdso] mapping of the collector's
        own vDSO's size; another size is another image (a 32-bit process's): the frame-pointer rule."""
        if self._vdso_table is None:
            try:
                self._vdso_table = vdso_table(self.cache.max_rows)
            except (NoTable, OSError) as e:
                self._vdso_table = False
                self._no_table("[vdso]", str(e))
        if self._vdso_table is False or size != len(own_vdso()):
            return None
        return self._vdso_table

    def _no_table(self, path: str, why: str) -> None:
        if len(self.no_table) >= 1024:
            self.no_table.pop(next(iter(self.no_table)))
        self.no_table[path] = why

    def _load(self, t: CfiTable) -> _Loaded | None:
        lt = self.loaded.get(t.key)
        if lt is not None:
            return lt
        first = self.rows.alloc(len(t.rows))
        if first is None and self._evict_unused_preloads():
            first = self.rows.alloc(len(t.rows))
        if first is None:
            self.no_room += 1
            return None
        if self._rows_window is not None:
            # rows no mapping points at yet (a free range): the mappings' update that follows, a
            # system call, publishes them to the BPF program
            self._rows_window.write(first, t.rows)
        else:
            self._update_batch(self.rows_map, first, t.rows)
        lt = self.loaded[t.key] = _Loaded(first, len(t.rows))
        base, index = page_index(t.rows["pc"])
        page_first = self.pages.alloc(len(index)) if len(index) else None
        if page_first is None:
            self.no_page_index += 1  # its walks search the whole table: slower, as right as ever
        else:
            self._update_batch(self.pages_map, page_first, index)
            lt.page_first, lt.page_count, lt.page_base = page_first, len(index) - 1, base
            self.page_indexed += 1
        return lt

    def _free(self, lt: _Loaded, now: bool, new_generation: bool = True) -> None:
        """A table's rows and page index back to their allocators: now (no mapping ever pointed
        at them), or at the next drain (a walk in flight may still read them). The walks' cached
        rules keyed by its rows are misses from now on (their range may hold another table's),
        unless new_generation is False: the caller raises the generation once for many."""
        rows_free, pages_free = (self.rows.free_now, self.pages.free_now) if now else (self.rows.free, self.pages.free)
        rows_free(lt.first, lt.count)
        if lt.page_count:  # loaded with an index
            pages_free(lt.page_first, lt.page_count + 1)
        if new_generation:
            self._raise_generation()

    def _raise_generation(self) -> None:
        """gp_cfi_gen[0] + 1: every rule the BPF walks cached before is a miss from now on."""
        key = self.gen_map.Key(0)
        self.gen_map[key] = self.gen_map.Leaf((self.gen_map[key].value + 1) & 0xFFFFFFFF)

    def _evict_unused_preloads(self) -> bool:
        """Free the preloaded tables no process maps (_preload_hot's guesses), to make room for
        one this job needs; whether any was freed. No mapping ever pointed at their rows (a table
        that had users left `loaded` with its last one), so no walk reads them: reusable at once."""
        freed = False
        for key in list(self._preloaded):
            lt = self.loaded[key]
            if not lt.users:
                del self.loaded[key]
                self._preloaded.discard(key)
                self._free(lt, now=True, new_generation=False)
                freed = True
        if freed:
            self._raise_generation()  # once: a map update through the hub, about 0.5 ms on a busy node
        return freed

    def _unuse(self, key: str, pid: int) -> None:
        lt = self.loaded.get(key)
        if lt is None:
            return
        lt.users.discard(pid)
        if not lt.users:
            del self.loaded[key]
            self._preloaded.discard(key)
            self._free(lt, now=False)

    def _update_batch(self, table: Any, first: int, values: np.ndarray) -> None:
        """Array map entries [first, first+len(values)) = values, by BPF_MAP_UPDATE_BATCH."""
        values = np.ascontiguousarray(values)
        if values.dtype.itemsize != ctypes.sizeof(table.Leaf):
            raise ValueError(f"{values.dtype} does not match the map's {ctypes.sizeof(table.Leaf)}-byte values")
        keys = np.arange(first, first + len(values), dtype=np.uint32)
        done = 0
        while done < len(values):
            count = ctypes.c_uint32(len(values) - done)
            res = self.lib.bpf_map_update_batch(table.map_fd, ctypes.c_void_p(keys.ctypes.data + 4 * done),
                                                ctypes.c_void_p(values.ctypes.data + values.dtype.itemsize * done),
                                                ctypes.byref(count), None)
            if res != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"BPF_MAP_UPDATE_BATCH: {os.strerror(err)}")
            if count.value == 0:
                raise OSError(errno.EIO, "BPF_MAP_UPDATE_BATCH made no progress")
            done += count.value

    def forget(self, live: set[int]) -> None:
        """Unregister processes that left the job; their tables' rows are freed when unused."""
        with self.lock:
            self._forget(live)

    def _forget(self, live: set[int]) -> None:
        from gpuprof.collector.bpf_support import pid_alive

        jobs = self.bpf[b"gp_job_pids"]
        for pid in [p for p in self.procs if p not in live]:
            if live and pid_alive(pid) and jobs.get(jobs.Key(pid)) is not None:
                continue  # registered between drains (a fork the tracker has not seen yet): still the job's
            proc = self.procs.pop(pid)
            try:
                del self.procs_map[self.procs_map.Key(pid)]
            except KeyError:
                pass
            self._drop_lazy(proc)
            self.mappings.free(proc.first, proc.count)
            for k in proc.keys:
                self._unuse(k, pid)
        self.waiting &= live

    # --- stacks ----------------------------------------------------------------------------------
    def take(self, ids: set[int], keep: set[int]) -> dict[int, tuple[int, ...] | None]:
        """The pcs of each CFI stack id, innermost first (None: not in the map any more); freed in
        the kernel map unless in keep (ids a new window or a sleeping thread still uses). The ids
        are 64-bit hashes, never below 2^13 but with a chance of 2^-51: they go into the same
        frames dict as the kernel stack map's ids. The CPU sampler's and off-CPU's drains call this
        from their own threads: the buffers are this call's."""
        if self._take is not None and ids:
            native = self._take_native(ids, keep)
            if native is not None:
                return native
        out: dict[int, tuple[int, ...] | None] = {}
        fd = self.stacks_map.map_fd
        key = ctypes.c_uint64()
        leaf = self.stacks_map.Leaf()
        words = np.frombuffer(leaf, np.uint64)
        for sid in ids:
            key.value = sid
            if self.lib.bpf_map_lookup_elem(fd, ctypes.byref(key), ctypes.byref(leaf)) < 0:
                out[sid] = None
                continue
            depth = min(int(leaf.depth), len(leaf.pc))
            # words: [depth | end], then the pcs
            out[sid] = tuple(words[1:1 + depth].tolist())
            if sid not in keep:
                self.lib.bpf_map_delete_elem(fd, ctypes.byref(key))
        return out

    def _take_native(self, ids: set[int], keep: set[int]) -> dict[int, tuple[int, ...] | None] | None:
        """take() in C (collector/native/stacktake.c gp_cfi_stacks_take): the map read whole and the
        ids freed in a few system calls, not two per id. None when the kernel refuses the batch
        calls (nothing is freed then: the caller reads id by id)."""
        ids64 = np.unique(np.fromiter(ids, np.uint64, len(ids)))
        keep64 = np.unique(np.fromiter(keep, np.uint64, len(keep)))
        leaf_size = ctypes.sizeof(self.stacks_map.Leaf)
        stride = leaf_size // 8 - 1
        words = np.empty((max(len(ids64), 1), stride), np.uint64)
        lens = np.empty(len(ids64), np.int64)
        status = np.empty(len(ids64), np.int32)
        err = int(self._take(self.stacks_map.map_fd, leaf_size, ids64.ctypes.data, len(ids64), keep64.ctypes.data,
                             len(keep64), words.ctypes.data, lens.ctypes.data, status.ctypes.data))
        if err:
            if not self._take_refused:
                self._take_refused = f"gp_cfi_stacks_take: {os.strerror(-err)}: CFI stacks read id by id"
            return None
        return {sid: (tuple(words[i, :n].tolist()) if st == 0 else None)
                for i, (sid, n, st) in enumerate(zip(ids64.tolist(), lens.tolist(), status.tolist()))}

    def counts(self) -> dict[str, int]:
        """Counters of the BPF side (all CPUs), by name."""
        from gpuprof.collector.bpf_support import read_ring_drops

        try:
            c = read_ring_drops(self.counters)
        except BpfError:  # the object is freed (the source stopped): as of the last read, at close()
            c = self.last_counts
        self.last_counts = c
        out = {"walks": c[0], "stored": c[1], "not_stored_map_full": c[2], "no_user_registers": c[3],
               "left_to_frame_pointers": c[4], "frames_by_frame_pointer_rule": c[5]}
        for i, name in enumerate(END_REASONS):
            out[f"end_{name}"] = c[6 + i]
        return out

    def close(self) -> None:
        """Stop the threads and unregister every process (the source stops)."""
        self._stop.set()
        self._wake.set()
        self.poller.join(timeout=5)
        if self._watch is not None:
            self._watch_wakes = self._watch.wakes()  # status() after the close still says it
            self._watch.stop()  # after the poller: it acknowledges through the watch
            self._watch = None
        self.compiler.on_done = None
        self.compiler.close()
        on = self.bpf[b"gp_cfi_on"]
        on[on.Key(0)] = on.Leaf(0)
        self.forget(set())
        self.counts()  # the last figures, read while the map lives: status() after the close says them
        # after the job, off its cores: its tables are the host's most recently used
        for key in sorted(self.used):
            self.cache.mark_hot(key)

    def status(self) -> dict[str, Any]:
        return {"processes": len(self.procs), "waiting": len(self.waiting), "tables_loaded": len(self.loaded),
                "stack_reads": ("python (the native library is not built)" if self._take is None
                                else self._take_refused or "native batch"),
                "tables_preloaded": self.preloaded,
                "tables_deferred": len(self.deferred), "tables_loaded_on_demand": self.loaded_on_demand,
                "tables_not_loaded_yet": len(self.lazy_by_key),
                "rows_written_by": self.rows_written_by,
                "rows_used": self.rows.used, "rows_max": self.rows.capacity, "tables_no_room": self.no_room,
                "page_index_used": self.pages.used, "page_index_max": self.pages.capacity,
                "tables_page_indexed": self.page_indexed, "tables_without_page_index": self.no_page_index,
                "files_without_table": len(self.no_table), "compiled": self.cache.compiled,
                "compile_cpu_s": round(self.cache.compile_s + self.cache.child_cpu_s, 3), "disk_hits": self.cache.disk_hits,
                "compiled_by_another_collector": self.cache.waited_for_others, "prewarmed": self.cache.warmed,
                "registrations": self.registrations, "registration_wakeups": self.poll_how,
                "registration_watch_wakes": self._watch.wakes() if self._watch is not None else self._watch_wakes,
                **self.counts()}


ROW_BYTES = ROW_DTYPE.itemsize
# The share of max_rows the tables of earlier jobs may take when they are loaded at the unwinder's
# start (_preload_hot), the most recently used first; the rest stays for the tables the job's own
# walks ask for, and a preloaded table no process maps gives its room at once when one needs it
# (_evict_unused_preloads). Half was too little: a GROMACS job uses 103 tables of 914 000 rows, and
# what the preload left out was loaded at the registrations, on the ranks' cores as they started.
PRELOAD_ROWS_SHARE = 0.9


# Runtime libraries most jobs of an HPC or ML node map (sonames, as `ldconfig -p` lists them):
# compiled into the host's disk cache when a collector starts (start_compiler)
PREWARM_SONAMES = ("libc.so.6", "ld-linux-x86-64.so.2", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6",
                   "libgfortran.so.5", "libmpi.so.40", "libopen-pal.so.40", "libopen-rte.so.40", "libmpich.so.12")


class RowsWindow:
    """Rows written into the rows map through a memory mapping of just their pages, unmapped after
    the write. The map's whole memory mapped for good would count all of it (16 MB, kernel memory
    that exists either way) in the collector's resident set: the kernel maps an array map's
    pages in at mmap time. The kernel lays an array map's values out at 8-byte strides: 16 bytes
    a 12-byte row."""

    def __init__(self, fd: int, entries: int, stride: int) -> None:
        self.fd, self.entries, self.stride = fd, entries, stride
        names = list(ROW_DTYPE.names or ())
        fields: dict[str, Any] = dict(ROW_DTYPE.fields or {})
        self.dtype = np.dtype({"names": names, "formats": [fields[n][0] for n in names],
                               "offsets": [fields[n][1] for n in names], "itemsize": stride})

    @classmethod
    def open(cls, rows_map: Any) -> RowsWindow | None:
        """None when the map cannot be mapped (compiled without GP_CFI_ROWS_MMAPABLE: a kernel
        before 5.5): rows then go in by BPF_MAP_UPDATE_BATCH."""
        try:
            mmap.mmap(rows_map.map_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        except OSError:
            return None
        return cls(rows_map.map_fd, int(rows_map.max_entries), -(-ctypes.sizeof(rows_map.Leaf) // 8) * 8)

    def write(self, first: int, rows: np.ndarray) -> None:
        """Rows [first, first + len(rows)) of the map = rows."""
        if first < 0 or first + len(rows) > self.entries:
            raise ValueError(f"rows {first}..{first + len(rows)} outside the map's {self.entries}")
        if not len(rows):
            return
        lo, hi = first * self.stride, (first + len(rows)) * self.stride
        page_lo = lo - lo % mmap.PAGESIZE
        mem = mmap.mmap(self.fd, -(-(hi - page_lo) // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.MAP_SHARED,
                        mmap.PROT_READ | mmap.PROT_WRITE, offset=page_lo)
        try:
            view = np.ndarray((len(rows),), self.dtype, buffer=mem, offset=lo - page_lo)
            view[:] = rows
            del view  # the mapping closes only without views of it
        finally:
            mem.close()


def prewarm_files() -> list[str]:
    """Real paths of PREWARM_SONAMES found by the dynamic loader's cache, then this collector's own
    interpreter (the node's Python: a Python job's interpreter is usually that very file) and the
    BLAS its numpy loaded, the largest table (hundreds of thousands of rows) last. Root-owned
    files only (opened so by start_compiler)."""
    import re
    import sys

    from gpuprof.collector.sources.collective_calls import system_libraries

    want = re.compile("|".join(re.escape(n) + "$" for n in PREWARM_SONAMES))
    by_name = {os.path.basename(p): p for p in system_libraries(want)}
    out = [by_name[n] for n in sorted(by_name, key=lambda n: _soname_rank(n))]
    out.append(os.path.realpath(sys.executable))
    text = read_maps_text(os.getpid()) or ""
    out += sorted({m.path for m in parse_maps(text) if "openblas" in os.path.basename(m.path) and "x" in m.perms})
    return list(dict.fromkeys(out))  # each file once, in order


def _soname_rank(real_name: str) -> int:
    for i, n in enumerate(PREWARM_SONAMES):
        if real_name.startswith(n.split(".so")[0] + "."):
            return i
    return len(PREWARM_SONAMES)


def start_compiler(ctx: Any, unwinder: str | None) -> Compiler | None:
    """The CFI table compiler of a stacks source that walks by CFI (None: frame pointers), started
    before the source's BPF object compiles (seconds of CPU), with the prewarm queued
    (sources.stacks.cfi_prewarm): the node's common runtime libraries go into the host's disk cache
    while the object compiles, so that a node's first profiled job is walked whole from its first
    seconds (its C library's, interpreter's and MPI's tables take seconds of CPU each). Once per
    host and library version: the other collectors of the host find them on disk, or wait for the
    compile's lock. Handed to start_unwinder; close() it when the unwinder does not start."""
    conf = ctx.config["sources.stacks"]
    if stack_unwinder(ctx.config, unwinder) != "cfi":
        return None
    cache_mb = int(conf["cfi_cache_mb"])
    state = ctx.config["paths"]["state_dir"]
    cache_dir = os.path.join(str(state), "cfi-tables") if state and cache_mb > 0 else None
    compiler = Compiler(TableCache(int(conf["cfi_max_rows"]), cache_dir, cache_mb << 20))
    if conf["cfi_prewarm"] and compiler.cache.disk_dir is not None:
        for path in prewarm_files():
            try:
                fd, st = open_user_file(path, owners=(0,), max_bytes=ELF_MAX_BYTES)
            except (OSError, UnsafeFile) as e:
                ctx.report_error("stacks", f"CFI table of {path} not prewarmed: {e}")
                continue
            compiler.submit(fd, st, warm=True)
    return compiler


class _RequestWatch:
    """The native watch over the BPF program's requests (gp_cfi_stale: register a process;
    gp_cfi_wanted: load a table), collector/native/mapwatch.c on ticker.c's shared tick: it reads
    the program's request counter (gp_cfi_asks, raised after each request's entry) and calls wake()
    from its thread when the counter moved. One watch a counter map given."""

    why_not = ""  # why the last start() returned None

    def __init__(self, lib: Any, watches: list[tuple[int, Any]], wake_fn: Any) -> None:
        self.lib, self.watches, self.wake_fn = lib, watches, wake_fn  # watches: (gp_mapwatch *, its ticker)

    @classmethod
    def start(cls, maps: Iterable[Any], wake: Any) -> _RequestWatch | None:
        from gpuprof.collector import native

        try:
            lib = native.sampler()
        except native.NativeUnavailable as e:
            cls.why_not = str(e)
            return None
        wake_fn = native.WAKE_FN(wake)
        watches: list[tuple[int, Any]] = []
        for m in maps:
            ptr = lib.gp_mapwatch_new(m.map_fd, wake_fn)
            if not ptr:
                cls.why_not = f"mapwatch: {os.strerror(ctypes.get_errno())}"
            else:
                try:
                    watches.append((ptr, native.SharedTicker(lib, "gp_mapwatch_tick", ptr, POLL_S)))
                    continue
                except native.NativeUnavailable as e:
                    lib.gp_mapwatch_free(ptr)
                    cls.why_not = str(e)
            cls(lib, watches, wake_fn).stop()
            return None
        return cls(lib, watches, wake_fn)

    def ack(self) -> None:
        for ptr, _ in self.watches:
            self.lib.gp_mapwatch_ack(ptr)

    def wakes(self) -> int:
        return sum(int(self.lib.gp_mapwatch_wakes(ptr)) for ptr, _ in self.watches)

    def stop(self) -> None:
        stuck = False
        for ptr, ticker in self.watches:
            if ticker.stop(2.0):
                self.lib.gp_mapwatch_free(ptr)
            else:  # stuck in a wake-up: its thread may still use the watch and the callback, kept for good
                stuck = True
        if stuck:
            _STUCK_WATCHES.append(self)


_STUCK_WATCHES: list[_RequestWatch] = []


def start_unwinder(hub: BpfHub, ctx: Any, unwinder: str | None, compiler: Compiler | None = None) -> CfiUnwinder | None:
    """The CFI unwinder of the stacks source (None: sources.stacks.unwinder = "frame_pointers", or it
    could not start: the reason is an error row and the samples keep their frame-pointer stacks).
    compiler: start_compiler's (None: started here); closed here when no unwinder starts."""
    if stack_unwinder(ctx.config, unwinder) != "cfi":
        if compiler is not None:
            compiler.close()
        return None
    if not hub.has("GP_WITH_CFI"):
        ctx.report_error("stacks", "CFI unwinder unavailable, frame pointers only: the shared BPF object was "
                         "compiled without it (another source compiled it first with another unwinder)")
        if compiler is not None:
            compiler.close()
        return None
    if compiler is None:
        compiler = start_compiler(ctx, unwinder)
    assert compiler is not None  # the unwinder is cfi here
    try:
        return CfiUnwinder(hub.bpf, compiler, report=lambda msg: ctx.report_error("stacks", msg))
    except Exception as e:  # noqa: BLE001 - optional: whatever stops its start (a program the verifier refused, the rows map's mapping) leaves frame pointers
        compiler.close()
        ctx.report_error("stacks", f"CFI unwinder unavailable, frame pointers only: {str(e).strip()[:300]}")
        return None

