"""Stacks of the eBPF sources (CPU samples, off-CPU episodes, CUDA launches): one id space per
collector, frames kept as (module, offset) while the job runs, names resolved at seal.

The BPF programs store stacks in kernel stack-trace maps; every drain reads the frames of the ids
that its rows reference, turns each address into (module, file offset) with the process's mappings
as last read from /proc/PID/maps (read when a pid is first seen, again when an address falls outside
them or the pid exec'd), and gives the whole stack an id of its own. So a process that exited before
seal still symbolizes: each mapped file is opened once, when a stack first goes through it (in the
drain that read the stack), through /proc/PID/map_files/START-END (the object the process maps,
whatever its path names later) and the descriptor kept until seal, where its symbols are read
(collector/debuginfo.py: .symtab, else .dynsym; the separate debug file found by build id under
the debug roots; inlined frames from DWARF). A file not held so (the process was gone before it
could be opened) is opened by its path only through safeio's opener: no symlink anywhere on the
path, the same device and inode as the process mapped, owned by root or the process's user. What
nothing names is written as `[unknown MODULE+0xOFFSET]`. Kernel frames: /proc/kallsyms (KernelSymbols). Frames
in anonymous executable memory (JIT code, Python 3.12+ `-X perf` trampolines): /tmp/perf-PID.map
when the process wrote one. Python frames read from the interpreter (collector/pyframes.py) are
named when the stack is interned (the code objects are read from the live process) and put in
place of the interpreter's evaluation frames (`merge_python_frames`).

Written at seal (docs/probes.md): /stacks/frames (stack_id, depth, symbol_id; depth 0 = innermost)
and /stacks/symbols (symbol_id, name, module). Stack id 0 = no stack, STACK_LOST = not captured.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import errno
import functools
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import h5py
import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_support import attach_path, parse_maps, pid_alive, read_maps_text, same_file_view
from gpuprof.collector.cfitables import own_vdso
from gpuprof.collector.debuginfo import (
    DEFAULT_DEBUG_ROOTS,
    DIE_BUDGET,
    INLINE_BUDGET_S,
    DebugFiles,
    DebugInfoError,
    DieBudget,
    ModuleNames,
    debug_roots_from,
    demangle,  # noqa: F401 - its users import it from here
    read_elf_fd,
)
from gpuprof.collector.pyframes import frame_label
from gpuprof.collector.safeio import (
    ELF_MAX_BYTES,
    PERF_MAP_MAX_BYTES,
    UnsafeFile,
    open_user_file,
    read_user_file,
)

log = logging.getLogger("gpuprof.collector")

STACK_NONE = 0
STACK_LOST = 0xFFFFFFFF  # the kernel could not store the stack (map full, hash collision)
KERNEL = 0  # module index of kernel frames
UNKNOWN_NAME = "[unknown]"  # kernel frames kallsyms does not name (their addresses are not written: KASLR)

Frame = tuple[int, int]  # (module index, offset: file offset for ELF files, address otherwise)


@dataclass(frozen=True)
class Module:
    kind: str  # "kernel", "elf", "perfmap" (anonymous executable memory of pid), "python", "none"
    path: str = ""  # ELF: a path the collector can open; perfmap: the perf map file; python: the source file
    pid: int = 0
    name: str = ""  # shown in /stacks/symbols.module
    uid: int = -1  # perfmap, elf: the process's uid when its maps were read (whose files it may read)
    ident: str = ""  # elf: "DEV:INODE" as /proc/PID/maps gave it (the file itself, not its path)


VDSO_IDENT = "[vdso]"  # Module.ident of the host's vDSO (no file: its image is the collector's own)


def unknown_name(module: str, offset: int) -> str:
    """The name of a frame nothing names: where it is, so that a reader with the file's symbols
    can name it later (docs/probes.md)."""
    return f"[unknown {module}+0x{offset:x}]"


def is_unknown(name: str) -> bool:
    """Whether a /stacks/symbols name is an unnamed frame (`[unknown]`, `[unknown MODULE+0xOFF]`)."""
    return name.startswith("[unknown")


# Mapped files held open from the first stack through them to seal (one descriptor per distinct
# file): past this, files are opened by path at seal (safeio's checks). The collector's own limit
# is 1024 descriptors.
HELD_FILES_MAX = 256


# Addresses held by the caches of interned stacks by address (per process, and of kernel stacks,
# together): when they reach it, every cache is emptied (they only save work: the ids do not
# depend on them). ~40 bytes an address: ~10 MB at most.
STACK_CACHE_MAX_ADDRS = 262144


@dataclass
class _ProcMaps:
    exe: str
    starts: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, module index)
    offsets: list[int] = field(default_factory=list)  # file offset of each span's start (ELF)
    ends: list[int] = field(default_factory=list)  # each span's end (= spans[i][1])
    modules: list[int] = field(default_factory=list)  # each span's module index (= spans[i][2])
    deltas: list[int | None] = field(default_factory=list)  # ELF: offset - start (frame = addr + delta); else None
    text: str | None = None  # the /proc/PID/maps text these were parsed from (None: given parsed)
    perfmap_uid: int | None = None  # the process's uid as its perf map module names it (if any)
    # module index -> (start, end) of one of its executable mappings, for the files not held yet:
    # held when a stack first goes through them (StackStore._hold_used), not when the maps are
    # read: a job maps far more than it runs (hpcc's: 161 files, its stacks went through 25)
    unheld: dict[int, tuple[int, int]] = field(default_factory=dict)
    # user stack (addresses, innermost first) -> (stack id, the addresses of its frames that lay
    # outside these mappings): the same addresses under the same mappings give the same frames, as
    # long as none of those outside has come into an executable mapping since (ProcmapQuery)
    cache: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # frame address (a return address already stepped back into its call) -> its frame, for the
    # addresses inside these mappings whose module _hold_used has seen: a deep C++ stack nearly
    # always differs from the last as a whole (the cache above misses), rarely frame by frame
    frames: dict[int, Frame] = field(default_factory=dict)


_STEP_BACK = (-1).__add__  # a return address points past its call: a - 1 lies in it


class StackStore:
    """Stack ids shared by the tables of one collector's eBPF sources (thread-safe)."""

    def __init__(self, debug_roots: Iterable[str] = DEFAULT_DEBUG_ROOTS) -> None:
        self.lock = threading.Lock()
        self.debug_roots = debug_roots_from(list(debug_roots))
        self.held: dict[str, int] = {}  # Module.ident -> descriptor of the mapped file (map_files)
        self.held_refused: dict[str, str] = {}  # ident -> why it could not be held (first 64)
        self._hold_tried: set[str] = set()  # idents tried and not held (not tried again; bounded)
        self.last_resolver_stats: dict[str, Any] = {}  # the last seal's naming figures (status, benches)
        self.modules: list[Module] = [Module("kernel", name="[kernel]")]
        self._module_ids: dict[Module, int] = {self.modules[0]: KERNEL}
        self.bases: dict[int, tuple[int, int]] = {}  # module -> (pid, load address of offset 0)
        self.stacks: list[tuple[Frame, ...]] = [()]  # index = stack id (0: no stack)
        self.py_names: list[str] = []  # offset of a "python" frame = index here (its full name)
        self._py_name_ids: dict[str, int] = {}
        self._ids: dict[tuple[Frame, ...], int] = {(): STACK_NONE}
        self._maps: dict[int, _ProcMaps] = {}
        self._refreshed: set[int] = set()  # pids whose maps were re-read in the current drain
        self._kernel_cache: dict[tuple[int, ...], int] = {}  # kernel stack (addresses) -> stack id
        self._cache_addrs = 0  # addresses held by the caches (STACK_CACHE_MAX_ADDRS)
        self._none_modules: dict[int, int] = {}  # pid -> index of its Module("none", "pid PID")
        self._outside: set[tuple[int, int]] = set()  # (pid, address) not in an executable mapping, this drain
        self._query = ProcmapQuery()
        self.maps_reads = 0  # /proc/PID/maps read (tests, status)
        self.maps_parses = 0  # ... of which parsed (the text differed from the last read)
        self.written: set[str] = set()

    # --- while the job runs --------------------------------------------------------------------
    def new_drain(self) -> None:
        """Each drain may re-read a process's maps once (an address outside them: dlopen)."""
        with self.lock:
            self._refreshed.clear()
            self._outside.clear()
            self._query.close()

    def watch(self, pids: Iterable[int]) -> None:
        """Read the maps of pids not seen before, or that exec'd since (cheap: one readlink each)."""
        with self.lock:
            for pid in pids:
                pm = self._maps.get(pid)
                if pm is None or pm.exe != _exe(pid):
                    self._read_maps(pid)

    def update_maps(self, pid: int, maps: list[Any]) -> None:
        """Mappings a source has just read for its own purposes (saves reading them again)."""
        with self.lock:
            self._read_maps(pid, maps)

    def _module(self, m: Module) -> int:
        i = self._module_ids.get(m)
        if i is None:
            i = self._module_ids[m] = len(self.modules)
            self.modules.append(m)
        return i

    def _read_maps(self, pid: int, maps: list[Any] | None = None) -> _ProcMaps | None:
        text: str | None = None
        if maps is None:
            text = read_maps_text(pid)
            self.maps_reads += 1
            old = self._maps.get(pid)
            if (text and old is not None and old.text == text
                    and (old.perfmap_uid is None or old.perfmap_uid == _uid(pid))):
                # unchanged since the last parse (the usual case of a re-read after an address
                # outside them: a frame-pointer walk through code built without them)
                old.exe = _exe(pid)
                self._refreshed.add(pid)
                return old
            maps = parse_maps(text or "", executable_only=True)
            self.maps_parses += bool(maps)
        if not maps:
            return self._maps.get(pid)
        pm = _ProcMaps(_exe(pid), text=text)
        uid: int | None = None
        same_view: bool | None = None
        for m in sorted(maps, key=lambda m: m.start):
            if "x" not in m.perms:
                continue
            if m.path.startswith("/") and not m.path.endswith(" (deleted)"):
                if uid is None:
                    uid = _uid(pid)
                if same_view is None:
                    same_view = same_file_view(pid)
                ident = f"{m.dev}:{m.inode}"
                idx = self._module(Module("elf", attach_path(pid, m.path, same_view), 0, os.path.basename(m.path),
                                          uid, ident))
                self.bases.setdefault(idx, (pid, m.start - m.offset))
                if ident not in self.held and ident not in self._hold_tried:
                    pm.unheld.setdefault(idx, (m.start, m.end))
                off = m.offset
            elif m.path == "[vdso]" and m.end - m.start == len(own_vdso()):
                # the host's vDSO, named from the collector's own copy (_load)
                idx, off = self._module(Module("elf", name=m.path, ident=VDSO_IDENT)), m.offset
            elif m.path in ("[vdso]", "[vsyscall]"):
                idx, off = self._module(Module("none", name=m.path)), m.start
            else:  # anonymous executable memory: JIT code, perf trampolines
                if pm.perfmap_uid is None:
                    pm.perfmap_uid = _uid(pid)
                idx = self._module(Module("perfmap", f"/tmp/perf-{pid}.map", pid, f"perf-{pid}.map",
                                          pm.perfmap_uid))
                off = m.start
            pm.starts.append(m.start)
            pm.spans.append((m.start, m.end, idx))
            pm.offsets.append(off)
            pm.ends.append(m.end)
            pm.modules.append(idx)
            pm.deltas.append(off - m.start if self.modules[idx].kind == "elf" else None)
        self._maps[pid] = pm
        self._refreshed.add(pid)
        return pm

    def _hold_used(self, pid: int, frames: Iterable[Frame]) -> None:
        """Hold the files of the frames' modules that are not held yet (the lock held)."""
        pm = self._maps.get(pid)
        if pm is None or not pm.unheld:
            return
        for idx, _ in frames:
            span = pm.unheld.pop(idx, None)
            if span is not None:
                ident = self.modules[idx].ident
                if ident and ident not in self.held and ident not in self._hold_tried:
                    self._hold(pid, span[0], span[1], ident)

    def _hold(self, pid: int, start: int, end: int, ident: str) -> None:
        """Open the file mapped at [start, end) through /proc/PID/map_files (the object itself: no
        path of the job's is walked) and keep it for seal, when it is the file the maps line named."""
        if len(self.held) >= HELD_FILES_MAX:
            return
        if len(self._hold_tried) >= 4096:
            self._hold_tried.clear()
        try:
            fd, st = open_user_file(f"/proc/{pid}/map_files/{start:x}-{end:x}", owners=None, max_bytes=ELF_MAX_BYTES,
                                    magic_link=True)
        except (OSError, UnsafeFile) as e:
            self._hold_tried.add(ident)
            if len(self.held_refused) < 64:
                self.held_refused[ident] = str(e)
            return
        if _ident(st) != ident:
            # remapped between the maps read and the open, or a file system whose maps line names
            # another device than the file's (overlayfs): named by path at seal, if at all
            os.close(fd)
            self._hold_tried.add(ident)
            return
        self.held[ident] = fd

    def close(self) -> None:
        """Close the files held for seal (a store is not used after)."""
        with self.lock:
            for fd in self.held.values():
                os.close(fd)
            self.held.clear()

    def _user_frame(self, pid: int, addr: int) -> Frame:
        return self._user_frame_hit(pid, addr)[0]

    def _user_frame_hit(self, pid: int, addr: int) -> tuple[Frame, bool]:
        """The frame of an address, and whether it lies in the process's mappings."""
        pm = self._maps.get(pid)
        for attempt in (0, 1):
            if pm is not None:
                i = bisect.bisect_right(pm.starts, addr) - 1
                if i >= 0 and addr < pm.spans[i][1]:
                    start, _, idx = pm.spans[i]
                    kind = self.modules[idx].kind
                    return (idx, (addr - start + pm.offsets[i]) if kind == "elf" else addr), True
            if attempt == 0 and self._may_have_moved(pid, addr):
                pm = self._read_maps(pid)
        none = self._none_modules.get(pid)
        if none is None:
            none = self._none_modules[pid] = self._module(Module("none", name=f"pid {pid}"))
        return (none, addr), False

    def _may_have_moved(self, pid: int, addr: int) -> bool:
        """Whether reading the process's maps again may place an address that lies outside them:
        not read again in this drain yet, the process alive, and, where the kernel answers
        PROCMAP_QUERY (Linux 6.11), the address now in an executable mapping. Otherwise the re-read
        would leave the address where it is (outside), so it is not done: a frame-pointer walk
        through code built without them yields such addresses in every drain."""
        if pid in self._refreshed or (pid, addr) in self._outside:
            return False
        covered = self._query.executable(pid, addr)
        if covered is None:  # cannot ask: read again, as long as the process lives
            return pid_alive(pid)
        if not covered:
            self._outside.add((pid, addr))
        return covered

    def intern_user(self, pid: int, addrs: Iterable[int]) -> int:
        """Stack id of a user stack (innermost first) of process pid."""
        key = tuple(addrs)
        with self.lock:
            pm = self._maps.get(pid)
            if pm is not None:
                hit = pm.cache.get(key)
                if hit is not None and (not hit[1] or not any(self._may_have_moved(pid, a) for a in hit[1])):
                    return hit[0]
            # return addresses point past the call: step back into it (the leaf is exact)
            at = [key[0], *map(_STEP_BACK, key[1:])] if key else []
            if pm is not None:
                try:  # the usual case: every frame seen before (looked up in C, no loop here)
                    return self._intern(tuple(map(pm.frames.__getitem__, at)))
                except KeyError:
                    pass
                # the next: only the leaf is new (a sample lands on any instruction of a hot
                # function, its callers' return addresses repeat; a third of GROMACS's stacks): the
                # callers in C as above, the leaf by one search of the mappings
                try:
                    callers: tuple[Frame, ...] | None = tuple(map(pm.frames.__getitem__, at[1:]))
                except KeyError:
                    callers = None
                if callers is not None:
                    leaf_at = at[0]
                    i = bisect.bisect_right(pm.starts, leaf_at) - 1
                    if i >= 0 and leaf_at < pm.ends[i]:
                        delta = pm.deltas[i]
                        leaf = (pm.modules[i], leaf_at if delta is None else leaf_at + delta)
                        sid = self._intern((leaf, *callers))
                        self._hold_used(pid, (leaf,))  # the callers' files: when they were cached
                        self._cache_room(1 + len(key))
                        pm.frames[leaf_at] = leaf
                        pm.cache[key] = (sid, ())
                        return sid
            frames: list[Frame] = []
            outside: set[int] = set()
            new: list[tuple[int, Frame]] = []
            cur = pm
            bisect_right = bisect.bisect_right
            for a in at:
                if cur is not None:
                    fr = cur.frames.get(a)
                    if fr is not None:
                        frames.append(fr)
                        continue
                    i = bisect_right(cur.starts, a) - 1  # _user_frame_hit's first lookup, inline
                    if i >= 0 and a < cur.ends[i]:
                        delta = cur.deltas[i]
                        fr = (cur.modules[i], a if delta is None else a + delta)
                        frames.append(fr)
                        new.append((a, fr))
                        continue
                fr, inside = self._user_frame_hit(pid, a)  # outside: the maps may be read again
                cur = self._maps.get(pid)
                frames.append(fr)
                if not inside:
                    outside.add(a)
            sid = self._intern(tuple(frames))
            self._hold_used(pid, frames)
            if new and pm is not None and self._maps.get(pid) is pm:  # held above: cached from now on
                self._cache_room(len(new))
                pm.frames.update(new)
            if pm is not None and self._maps.get(pid) is pm:  # all frames from the same mappings
                self._cache_room(len(key))
                pm.cache[key] = (sid, tuple(outside))
            return sid

    def _cache_room(self, n: int) -> None:
        self._cache_addrs += n
        if self._cache_addrs > STACK_CACHE_MAX_ADDRS:
            for pm in self._maps.values():
                pm.cache.clear()
                pm.frames.clear()
            self._kernel_cache.clear()
            self._cache_addrs = n

    def intern_python(self, pid: int, addrs: Iterable[int], chunks: list[list[tuple[str, str, int]]],
                      eval_ranges: tuple[str, tuple[tuple[int, int], ...]] | None) -> int:
        """Stack id of a user stack with the thread's Python frames merged in. chunks: (function,
        file, line) innermost first, one list per C-level call of the evaluation loop; eval_ranges:
        (ELF path, file offset ranges) of the loop's function, whose frames the chunks replace."""
        with self.lock:
            native = [self._user_frame(pid, a if d == 0 else a - 1) for d, a in enumerate(addrs)]
            self._hold_used(pid, native)
            py = [[self._python_frame(frame_label(*f), f[1]) for f in chunk] for chunk in chunks]

            def is_eval(fr: Frame) -> bool:
                m = self.modules[fr[0]]
                return (eval_ranges is not None and m.kind == "elf" and m.path == eval_ranges[0]
                        and any(lo <= fr[1] < hi for lo, hi in eval_ranges[1]))

            return self._intern(tuple(merge_python_frames(native, py, is_eval)))

    def _python_frame(self, label: str, filename: str) -> Frame:
        i = self._py_name_ids.get(label)
        if i is None:
            i = self._py_name_ids[label] = len(self.py_names)
            self.py_names.append(label)
        return self._module(Module("python", filename, name=os.path.basename(filename) or "python")), i

    def intern_kernel(self, addrs: Iterable[int]) -> int:
        key = tuple(addrs)
        with self.lock:
            sid = self._kernel_cache.get(key)
            if sid is None:
                sid = self._intern(tuple((KERNEL, a if d == 0 else a - 1) for d, a in enumerate(key)))
                self._cache_room(len(key))
                self._kernel_cache[key] = sid
            return sid

    def _intern(self, frames: tuple[Frame, ...]) -> int:
        i = self._ids.get(frames)
        if i is None:
            i = self._ids[frames] = len(self.stacks)
            self.stacks.append(frames)
        return i

    def module_frame_address(self, pid: int, addr: int) -> tuple[str, int] | None:
        """(ELF path, file offset) of an address in a process (kernel function pointers at seal)."""
        with self.lock:
            idx, off = self._user_frame(pid, addr)
            self._hold_used(pid, [(idx, off)])
            m = self.modules[idx]
            return (m.path, off) if m.kind == "elf" else None

    # --- at seal -------------------------------------------------------------------------------
    def symbol_tables(self, die_budget: int | None = None,
                      inline_seconds: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(/stacks/frames rows, /stacks/symbols rows) of every stack interned so far. A frame in
        inlined code is several rows (the inlined functions innermost, then the real one).
        die_budget, inline_seconds: the DWARF walk's bound (None: debuginfo's defaults; benches)."""
        with self.lock:
            stacks = list(self.stacks)
            modules = list(self.modules)
            bases = dict(self.bases)
            py_names = list(self.py_names)
            held = dict(self.held)
        resolver = Resolver(modules, bases, py_names, held=held, debug_roots=self.debug_roots, die_budget=die_budget,
                            inline_seconds=inline_seconds)
        try:
            sym_ids: dict[tuple[str, str], int] = {}
            rows: list[tuple[int, int, int]] = []
            for sid, st in enumerate(stacks):
                depth = 0
                for mod, off in st:
                    for key in resolver.resolve_frames(mod, off):
                        rows.append((sid, depth, sym_ids.setdefault(key, len(sym_ids))))
                        depth += 1
        finally:
            stats = resolver.stats()
            resolver.close()
        with self.lock:
            self.last_resolver_stats = stats
        frames = schema.STACK_FRAMES.empty(len(rows))
        if rows:
            arr = np.array(rows, dtype=np.int64)
            frames["stack_id"], frames["depth"], frames["symbol_id"] = arr[:, 0], np.minimum(arr[:, 1], 65535), arr[:, 2]
        symbols = schema.STACK_SYMBOLS.empty(len(sym_ids))
        for (name, module), i in sym_ids.items():
            symbols[i] = (i, _fit(name, 200), _fit(module, 64))
        return frames, symbols

    def write(self, f: h5py.File) -> None:
        """Append the stack table to a sealed file once (every stack source calls this at seal)."""
        if f.filename in self.written or schema.STACK_FRAMES.path not in f:
            return
        self.written.add(f.filename)
        frames, symbols = self.symbol_tables()
        for table, rows in ((schema.STACK_FRAMES, frames), (schema.STACK_SYMBOLS, symbols)):
            ds = f[table.path]
            n = ds.shape[0]
            ds.resize((n + len(rows),))
            ds[n:] = rows


class _ProcmapQueryArg(ctypes.Structure):
    """struct procmap_query of <linux/fs.h> (Linux 6.11)."""

    _fields_ = [("size", ctypes.c_uint64), ("query_flags", ctypes.c_uint64), ("query_addr", ctypes.c_uint64),
                ("vma_start", ctypes.c_uint64), ("vma_end", ctypes.c_uint64), ("vma_flags", ctypes.c_uint64),
                ("vma_page_size", ctypes.c_uint64), ("vma_offset", ctypes.c_uint64), ("inode", ctypes.c_uint64),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("vma_name_size", ctypes.c_uint32),
                ("build_id_size", ctypes.c_uint32), ("vma_name_addr", ctypes.c_uint64),
                ("build_id_addr", ctypes.c_uint64)]


PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_ProcmapQueryArg) << 16) | (ord("f") << 8) | 17  # _IOWR('f', 17, ...)
PROCMAP_QUERY_VMA_EXECUTABLE = 0x04


class ProcmapQuery:
    """Is an address of a process in an executable mapping now? One PROCMAP_QUERY ioctl on its
    /proc/PID/maps (about 1 us) instead of reading the whole file (about 150 us for an MPI rank's
    270 mappings). The descriptors are kept until close() (each drain)."""

    supported: bool | None = None  # None: not known yet; False: the kernel has no PROCMAP_QUERY

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}
        self.arg = _ProcmapQueryArg()
        self.libc: Any = None

    def executable(self, pid: int, addr: int) -> bool | None:
        """True / False; None when it cannot be asked (old kernel, process gone, not readable)."""
        if ProcmapQuery.supported is False:
            return None
        if self.libc is None:
            self.libc = ctypes.CDLL(None, use_errno=True)
        fd = self.fds.get(pid)
        if fd is None:
            try:
                fd = self.fds[pid] = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        a = self.arg
        a.size, a.query_flags, a.query_addr = ctypes.sizeof(a), PROCMAP_QUERY_VMA_EXECUTABLE, addr
        a.vma_name_size = a.build_id_size = 0
        a.vma_name_addr = a.build_id_addr = 0
        if self.libc.ioctl(fd, PROCMAP_QUERY, ctypes.byref(a)) == 0:
            ProcmapQuery.supported = True
            return True
        err = ctypes.get_errno()
        if err == errno.ENOENT:
            ProcmapQuery.supported = True
            return False
        if err in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP) and not ProcmapQuery.supported:
            ProcmapQuery.supported = False
        return None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def merge_python_frames(native: list[Frame], chunks: list[list[Frame]], is_eval: Any) -> list[Frame]:
    """One user stack (innermost first) from the native frames and the thread's Python frames.

    Each run of Python frames (chunks[i], innermost first) ran inside one C-level call of the
    evaluation loop: it takes the place of the i-th evaluation frame of the native stack
    (is_eval(frame)), so native code called from Python sits above the Python function that called
    it and the interpreter's C frames below the outermost Python frame stay where they are. Runs
    left over (the native unwinder lost the interpreter's frames: a build without frame pointers)
    go on the outer side of the last evaluation frame replaced, or, when none was found, at the
    outer end of the native frames (the native frames then read as called from the innermost
    Python function)."""
    out: list[Frame] = []
    used = 0
    insert_at: int | None = None
    for fr in native:
        if used < len(chunks) and is_eval(fr):
            out.extend(chunks[used])
            used += 1
            insert_at = len(out)
        else:
            out.append(fr)
    rest = [fr for chunk in chunks[used:] for fr in chunk]
    if insert_at is None:
        insert_at = len(out)
    return out[:insert_at] + rest + out[insert_at:]


def _fit(s: str, n: int) -> bytes:
    b = s.encode(errors="replace")
    return b if len(b) <= n else b[: n - 3] + b"..."


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _ident(st: os.stat_result) -> str:
    """A file's "DEV:INODE" as /proc/PID/maps writes it (hex major:minor, decimal inode)."""
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


class Resolver:
    """(module, offset) -> names and module name, each ELF file's names loaded once (by build id).

    held: Module.ident -> a descriptor of the file the process mapped (StackStore._hold); a module
    without one is opened by its path through safeio's opener only (no symlink on the path, the
    device and inode its maps line gave, owned by root or the process's user): anything refused is
    `[unknown MODULE+0xOFFSET]`, and nothing of it is read."""

    def __init__(self, modules: list[Module], bases: dict[int, tuple[int, int]] | None = None,
                 py_names: list[str] | None = None, *, held: dict[str, int] | None = None,
                 debug_roots: Iterable[str] = DEFAULT_DEBUG_ROOTS, die_budget: int | None = None,
                 inline_seconds: float | None = None) -> None:
        self.modules = modules
        self.bases = bases or {}
        self.py_names = py_names or []
        self.held = held or {}
        self.debug = DebugFiles(tuple(debug_roots))
        # what inlined frames may cost this seal (collector/debuginfo.py: DIE_BUDGET, INLINE_BUDGET_S)
        self.budget = DieBudget(DIE_BUDGET if die_budget is None else die_budget,
                                INLINE_BUDGET_S if inline_seconds is None else inline_seconds)
        self._perfmaps: dict[int, tuple[list[int], list[tuple[int, int, str]]]] = {}
        self._names: dict[int, ModuleNames | None] = {}  # module index -> its file's names
        self._by_key: dict[str, ModuleNames] = {}  # build id (else DEV:INODE) -> names
        self._opened: list[int] = []  # descriptors opened here (closed by close())
        self._frames: dict[Frame, list[tuple[str, str]]] = {}
        self.refused: dict[int, str] = {}  # module index -> why its file was not read

    def stats(self) -> dict[str, Any]:
        """What this resolver did: files read and where their names came from, frames named,
        DWARF entries parsed for inlined frames, whether that budget ran out, files refused."""
        return {"files": {mn.elf.label: mn.source for mn in self._by_key.values()},
                "frames": len(self._frames), "dies_parsed": self.budget.used,
                "inline_budget_exhausted": self.budget.exhausted and self.budget.used > 0,
                "refused": dict(list({self.modules[i].name: why for i, why in self.refused.items()}.items())[:16]),
                "debug_refused": self.debug.refused[:16]}

    def close(self) -> None:
        for mn in self._by_key.values():
            mn.close()
        self._by_key.clear()
        self._names.clear()
        self.debug.close()
        for fd in self._opened:
            os.close(fd)
        self._opened.clear()

    def resolve(self, mod: int, off: int) -> tuple[str, str]:
        """(name, module) of a frame: the function holding it (the outermost of resolve_frames)."""
        return self.resolve_frames(mod, off)[-1]

    def resolve_frames(self, mod: int, off: int) -> list[tuple[str, str]]:
        """[(name, module)] of a frame, innermost first: more than one where DWARF says the code
        at off was inlined."""
        hit = self._frames.get((mod, off))
        if hit is not None:
            return hit
        m = self.modules[mod]
        names: list[str] = []
        unknown = UNKNOWN_NAME
        if m.kind == "kernel":
            name = kernel_symbol(off)
            names = [name] if name else []
        elif m.kind == "elf":
            mn = self._module_names(mod, m)
            if mn is not None:
                names = mn.names(off)
                if not names:
                    unknown = unknown_name(m.name, mn.function_start(off))
            else:
                unknown = unknown_name(m.name, off)
        elif m.kind == "perfmap":
            name = self._perfmap(mod, m, off)
            names = [name] if name else []
            unknown = unknown_name(m.name, off)
        elif m.kind == "python":
            names = [self.py_names[off]] if 0 <= off < len(self.py_names) else []
        else:  # "none": [vdso], or an address in no mapping of the process (pid N)
            unknown = unknown_name(m.name, off)
        out = [(n, m.name) for n in names] or [(unknown, m.name)]
        self._frames[(mod, off)] = out
        return out

    def _module_names(self, mod: int, m: Module) -> ModuleNames | None:
        if mod in self._names:
            return self._names[mod]
        mn: ModuleNames | None = None
        try:
            mn = self._load(m)
        except (OSError, UnsafeFile, DebugInfoError) as e:
            self.refused[mod] = str(e)
            log.info("symbols of %s not read: %s", m.path, e)
        self._names[mod] = mn
        return mn

    def _load(self, m: Module) -> ModuleNames:
        fd = self.held.get(m.ident) if m.ident else None
        if fd is None and m.ident == VDSO_IDENT:
            fd = self._vdso_fd()
        elif fd is None:
            fd = self._open_by_path(m)
        elf = read_elf_fd(fd, m.path)
        key = elf.build_id or m.ident or m.path
        mn = self._by_key.get(key)
        if mn is None:
            owners = (0,) if m.uid < 0 else (0, m.uid)
            # .debug/ beside the file only where its path here is the one the process named
            file_dir = os.path.dirname(m.path) if not m.path.startswith("/proc/") else None
            debug = None
            if not elf.has_symtab() or not elf.has_dwarf():
                debug = self.debug.find(elf, file_dir, owners)
            mn = self._by_key[key] = ModuleNames(elf, fd, debug, self.budget)
        return mn

    def _vdso_fd(self) -> int:
        """A memory file holding the collector's own vDSO (the same image as every x86-64
        process's of this host: cfitables.own_vdso), for its symbols (__vdso_clock_gettime, ...)."""
        image = own_vdso()
        if not image:
            raise OSError(errno.ENOENT, "no [vdso] in the collector")
        fd = os.memfd_create("gpuprof-vdso", os.MFD_CLOEXEC)
        self._opened.append(fd)
        os.write(fd, image)
        return fd

    def _open_by_path(self, m: Module) -> int:
        """The module's file by its path (no descriptor was held): safeio's checks, and the device
        and inode the process's maps gave (else a file put there since would be named instead)."""
        owners = (0,) if m.uid < 0 else (0, m.uid)
        fd, st = open_user_file(m.path, owners=owners, max_bytes=ELF_MAX_BYTES, no_symlinks=True)
        self._opened.append(fd)
        if m.ident and _ident(st) != m.ident:
            raise UnsafeFile(f"{m.path}: not the file the process mapped ({_ident(st)}, not {m.ident})")
        return fd

    def _perfmap(self, mod: int, m: Module, addr: int) -> str | None:
        pm = self._perfmaps.get(mod)
        if pm is None:
            pm = self._perfmaps[mod] = read_perf_map(m.pid, m.uid)
        starts, entries = pm
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < entries[i][0] + max(entries[i][1], 1):
            return entries[i][2]
        return None


def read_perf_map(pid: int, uid: int | None = None) -> tuple[list[int], list[tuple[int, int, str]]]:
    """/tmp/perf-PID.map ("START SIZE name" in hex, as perf and Python's -X perf write it), from
    the process's own mount namespace (/proc/PID/root/tmp) while it lives, else from ours.

    The file is the job user's, read by root: opened without following a symlink or blocking on a
    FIFO, and read only when it is a regular file owned by the process's uid (uid, as seen when its
    maps were read; else its current one) of at most 16 MB (collector/safeio.py). Anything else is
    not read at all: its frames stay [unknown]."""
    if uid is None or uid < 0:
        uid = _uid(pid)
    if uid < 0:
        return [], []  # whose file it should be is not known: not read
    entries: list[tuple[int, int, str]] = []
    for path in (f"/proc/{pid}/root/tmp/perf-{pid}.map", f"/tmp/perf-{pid}.map"):
        try:
            data = read_user_file(path, owners=(uid,), max_bytes=PERF_MAP_MAX_BYTES)
        except FileNotFoundError:
            continue
        except (OSError, UnsafeFile) as e:
            log.warning("perf map not read: %s", e)
            break  # the process's file exists but is refused: not looked for elsewhere
        for line in data.decode(errors="replace").splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3:
                try:
                    entries.append((int(parts[0], 16), int(parts[1], 16), parts[2]))
                except ValueError:
                    continue
        break
    entries.sort()
    return [e[0] for e in entries], entries


KALLSYMS = "/proc/kallsyms"
KERNEL_TEXT_TYPES = frozenset(b"tTwW")  # kallsyms' types of code: text and weak symbols


class KernelSymbols:
    """The kernel's code symbols (/proc/kallsyms), sorted by address: two numpy arrays and one bytes
    string, about 3 MB for 120 000 symbols where Python strings would take 15. Read once, while the
    prolog waits (the first lookup reads them)."""

    def __init__(self, path: str = KALLSYMS) -> None:
        starts, name_at, names = array.array("Q"), array.array("I"), bytearray()
        with open(path, "rb") as f:
            for line in f:
                addr, kind, rest = line.split(b" ", 2)
                if kind[0] not in KERNEL_TEXT_TYPES:
                    continue
                starts.append(int(addr, 16))
                name_at.append(len(names))
                names += rest.split(b"\t", 1)[0].rstrip(b"\n")
        name_at.append(len(names))
        bounds = np.frombuffer(name_at, np.uint32).copy()
        order = np.argsort(np.frombuffer(starts, np.uint64), kind="stable")
        self.starts = np.frombuffer(starts, np.uint64)[order]
        self._name_start, self._name_end = bounds[:-1][order], bounds[1:][order]
        self._names = bytes(names)
        # without root (kptr_restrict) every address reads 0: then nothing is known
        self.usable = bool(len(self.starts)) and int(self.starts[-1]) != 0

    def name(self, addr: int) -> str | None:
        """The function an address is in (the last symbol at or below it), None when not known."""
        if not self.usable:
            return None
        i = int(np.searchsorted(self.starts, np.uint64(addr), side="right")) - 1
        if i < 0 or int(self.starts[i]) == 0:
            return None
        return self._names[self._name_start[i]: self._name_end[i]].decode(errors="replace")


@functools.cache
def kernel_symbols() -> KernelSymbols | None:
    try:
        return KernelSymbols()
    except (OSError, ValueError) as e:
        log.warning("kernel symbols not read from %s: %s", KALLSYMS, e)
        return None


@lru_cache(maxsize=65536)
def kernel_symbol(addr: int) -> str | None:
    """The kernel function an address is in (/proc/kallsyms), None when not known."""
    syms = kernel_symbols()
    return syms.name(addr) if syms is not None else None


# --- reading the tables back -----------------------------------------------------------------------
def stack_names(g: h5py.Group) -> dict[int, list[str]]:
    """stack id -> frame names, innermost first, from a node file (or its group in a job file)."""
    if "stacks/frames" not in g or "stacks/symbols" not in g:
        return {}
    frames = g["stacks/frames"][()]
    symbols = g["stacks/symbols"][()]
    names = {int(s["symbol_id"]): s["name"].decode(errors="replace") for s in symbols}
    out: dict[int, list[tuple[int, str]]] = {}
    for r in frames:
        out.setdefault(int(r["stack_id"]), []).append((int(r["depth"]), names.get(int(r["symbol_id"]), "?")))
    return {k: [n for _, n in sorted(v)] for k, v in out.items()}


def folded_stacks(g: h5py.Group, table: str = "stacks/samples", weight: str = "count") -> Counter[str]:
    """Folded stacks (root first, frames joined by ';', kernel frames after user frames) weighted by
    a column of /stacks/samples (count) or /offcpu/intervals (blocked_ns, runnable_ns)."""
    out: Counter[str] = Counter()
    if table not in g:
        return out
    names = stack_names(g)
    rows = g[table][()]
    for r in rows:
        user = names.get(int(r["user_stack"]), [])
        kern = names.get(int(r["kernel_stack"]), [])
        key = ";".join([*reversed(user), *reversed(kern)]) or "[no stack]"
        out[key] += int(r[weight])
    return out


# --- native stacks without frame pointers: the user-space unwinder over stack copies -------------
class UnwinderUnavailable(RuntimeError):
    """The unwinder library is not built (make -C collector/native unwind, needs libdw-dev) or the
    process's mappings could not be read; the message says which."""


UNWIND_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "build", "libgpuprof_unwind.so")
_unwind_lib: Any = None


def _unwind_library() -> Any:
    global _unwind_lib
    if _unwind_lib is None:
        if not os.path.exists(UNWIND_LIBRARY):
            raise UnwinderUnavailable(f"{UNWIND_LIBRARY} not built: make -C collector/native unwind "
                                      "(apt-get install libdw-dev)")
        lib = ctypes.CDLL(UNWIND_LIBRARY)
        lib.gp_unwinder_new.restype = ctypes.c_void_p
        lib.gp_unwinder_new.argtypes = [ctypes.c_int]
        lib.gp_unwinder_refresh.restype = ctypes.c_int
        lib.gp_unwinder_refresh.argtypes = [ctypes.c_void_p]
        lib.gp_unwind.restype = ctypes.c_int
        lib.gp_unwind.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                                  ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        lib.gp_unwinder_free.restype = None
        lib.gp_unwinder_free.argtypes = [ctypes.c_void_p]
        _unwind_lib = lib
    return _unwind_lib


class DwarfUnwinder:
    """Walks copies of one process's user stack (bpf/stackcopy.c) with the call frame information
    of its mapped files (collector/native/unwind_dwarf.c, elfutils' libdwfl), so code built without
    frame pointers unwinds. Each file's tables are parsed once per process and kept."""

    MAX_FRAMES = 127

    def __init__(self, pid: int) -> None:
        self.lib = _unwind_library()
        self.pid = pid
        self.handle = self.lib.gp_unwinder_new(pid)
        if not self.handle:
            raise UnwinderUnavailable(f"pid {pid}: its mappings could not be read for unwinding")
        self._out = (ctypes.c_uint64 * self.MAX_FRAMES)()

    def unwind(self, ip: int, sp: int, bp: int, stack: bytes) -> list[int]:
        """Program counters, innermost first (the leaf exact, the others return addresses)."""
        if not self.handle:
            raise UnwinderUnavailable(f"pid {self.pid}: unwinder closed")
        n = self.lib.gp_unwind(self.handle, ip, sp, bp, stack, sp, len(stack), self._out, self.MAX_FRAMES)
        return list(self._out[:n])

    def refresh(self) -> None:
        """Read the process's mappings again (a library it dlopen'ed since)."""
        if self.lib.gp_unwinder_refresh(self.handle) != 0:
            raise UnwinderUnavailable(f"pid {self.pid}: mappings not read again (exited?)")

    def close(self) -> None:
        if self.handle:
            self.lib.gp_unwinder_free(self.handle)
            self.handle = None
