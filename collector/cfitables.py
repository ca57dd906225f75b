"""Unwind tables for the BPF unwinder (bpf/cfiunwind.h): an ELF file's call frame information
(`.eh_frame`, and `.debug_frame` where it covers more) compiled into one sorted array of rows,
x86-64 only.

A row says, from its `pc` (an ELF virtual address of the file) up to the next row's, how to find
the caller's frame: the canonical frame address (CFA) is rsp+N or rbp+N (or the PLT's well-known
rsp-based expression), the return address is at CFA-8, and the caller's rbp is unchanged or saved
at CFA+M. Anything else the table cannot say in those terms (a DWARF expression other than the
PLT's, a signal frame, a return address not at CFA-8, a CFA in another register) is a "stop" row;
a return address marked undefined (`_start`, `clone3`: the outermost frame) is an "end" row; a gap
between FDEs is a "none" row (no CFI there: the walker tries the frame-pointer rule).

pyelftools parses the sections (the CIEs, FDEs and their instructions); the instructions are
interpreted here (pyelftools 0.33's own decoder rejects DW_CFA_GNU_args_size, which glibc uses, and
copies a dict per row). Tables are cached per build id (`TableCache`: in memory, and optionally on
disk in a root-only directory, both bounded).

Files are opened by the caller (`open_mapped_file`: /proc/PID/map_files/START-END, the exact
object the process maps; never a path the job controls); compile_table reads the descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import io
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gpuprof.collector.debuginfo import NOTE_SECTION_MAX_BYTES, SHT_NOTE, build_id_note
from gpuprof.collector.safeio import ELF_MAX_BYTES, UnsafeFile, open_user_file, own_directory_problem

# struct gp_cfi_row of bpf/cfiunwind.h (12 bytes)
ROW_DTYPE = np.dtype([("pc", "<u4"), ("cfa_off", "<i4"), ("rbp_off", "<i2"), ("cfa_type", "u1"),
                      ("rbp_type", "u1")])

CFA_NONE = 0  # no CFI covers the pc (a gap between FDEs): the walker tries the frame-pointer rule
CFA_RSP = 1  # CFA = rsp + cfa_off
CFA_RBP = 2  # CFA = rbp + cfa_off
CFA_PLT = 3  # CFA = rsp + 8 + ((pc & 15) >= cfa_off ? 8 : 0): the PLT entries' expression
CFA_STOP = 4  # a rule the walker does not follow (other expressions, signal frames): the walk ends
CFA_END = 5  # return address undefined: the outermost frame (_start, clone3); the walk ends, complete

RBP_SAME = 0  # the caller's rbp is the current one
RBP_AT_CFA = 1  # saved at CFA + rbp_off
RBP_UNDEF = 2  # not recoverable (the walk goes on with rbp = 0)

# DWARF register numbers (x86-64 psABI)
REG_RBP, REG_RSP, REG_RA = 6, 7, 16

# The PLT's CFA expression (binutils): DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and;
# DW_OP_lit<N>; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus  (N = 10 or 11, at index 6)
_PLT_EXPR_HEAD = (0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A)
_PLT_EXPR_TAIL = (0x2A, 0x33, 0x24, 0x22)

MAX_PC = (1 << 32) - 1


class CompileCancelled(Exception):
    """The collector is stopping: a compile in flight (or a wait for another's) was abandoned."""


class NoTable(ValueError):
    """A file that gets no table; the message says why (not ELF, not x86-64, no CFI, too big)."""


Segments = list[tuple[int, int, int]]  # CfiTable.segments


@dataclass
class CfiTable:
    key: str  # build id (hex) when the file has one, else "file:<dev>:<ino>:<size>:<mtime_ns>"
    rows: np.ndarray  # ROW_DTYPE, sorted by pc, one row per change of rule
    # executable PT_LOAD segments: (p_vaddr, p_offset, p_filesz), for the load bias of a mapping
    segments: Segments = field(default_factory=list)
    fdes: int = 0
    stats: dict[str, int] = field(default_factory=dict)  # rows by kind: plt, stop, end

    def vaddr_minus_offset(self, file_offset: int) -> int | None:
        """p_vaddr - p_offset of the executable segment holding file_offset (None: none does)."""
        return vaddr_minus_offset(self.segments, file_offset)


def vaddr_minus_offset(segments: Segments, file_offset: int) -> int | None:
    """p_vaddr - p_offset of the executable segment holding file_offset (None: none does)."""
    for vaddr, off, size in segments:
        # a mapping starts at the page holding the segment's first byte
        if off - (off & 0xFFF) <= file_offset < off + size:
            return vaddr - off
    return None


@dataclass
class _State:
    cfa_type: int = CFA_STOP
    cfa_reg: int = REG_RSP
    cfa_off: int = 8
    rbp: tuple[int, int] = (RBP_SAME, 0)
    ra: tuple[str, int] = ("offset", -8)

    def copy(self) -> _State:
        return _State(self.cfa_type, self.cfa_reg, self.cfa_off, self.rbp, self.ra)

    def row(self) -> tuple[int, int, int, int]:
        """(cfa_type, cfa_off, rbp_type, rbp_off) of this state."""
        if self.ra[0] == "undefined":
            return CFA_END, 0, RBP_SAME, 0
        if self.ra != ("offset", -8):
            return CFA_STOP, 0, RBP_SAME, 0
        if self.cfa_type == CFA_PLT:
            return CFA_PLT, self.cfa_off, RBP_SAME, 0
        if self.cfa_type != CFA_RSP or self.cfa_reg not in (REG_RSP, REG_RBP):
            return CFA_STOP, 0, RBP_SAME, 0
        if not -(1 << 31) <= self.cfa_off < (1 << 31):
            return CFA_STOP, 0, RBP_SAME, 0
        rbp_type, rbp_off = self.rbp
        if rbp_type == RBP_AT_CFA and not -(1 << 15) <= rbp_off < (1 << 15):
            rbp_type, rbp_off = RBP_UNDEF, 0
        return (CFA_RSP if self.cfa_reg == REG_RSP else CFA_RBP), self.cfa_off, rbp_type, rbp_off


def _reg_rule(state: _State, reg: int, rule: tuple[str, int]) -> None:
    if reg == REG_RBP:
        if rule[0] == "offset":
            state.rbp = (RBP_AT_CFA, rule[1])
        elif rule[0] == "same":
            state.rbp = (RBP_SAME, 0)
        else:
            state.rbp = (RBP_UNDEF, 0)
    elif reg == REG_RA:
        state.ra = rule


def _run(instructions: list[Any], state: _State, initial: _State | None, loc: int, caf: int, daf: int,
         out: list[tuple[int, int, int, int, int]] | None) -> int:
    """Interpret CFI instructions from state at loc; append (pc, rule...) rows to out (None: a CIE's
    initial instructions, which emit nothing). Returns the final location."""
    stack: list[_State] = []
    for ins in instructions:
        op, args = ins.opcode, ins.args
        if op in (0x40, 0x02, 0x03, 0x04):  # advance_loc, advance_loc1/2/4
            if out is not None:
                out.append((loc, *state.row()))
            loc += args[0] * caf
        elif op == 0x01:  # set_loc
            if out is not None:
                out.append((loc, *state.row()))
            loc = args[0]
        elif op == 0x0C:  # def_cfa
            state.cfa_type, state.cfa_reg, state.cfa_off = CFA_RSP, args[0], args[1]
        elif op == 0x12:  # def_cfa_sf
            state.cfa_type, state.cfa_reg, state.cfa_off = CFA_RSP, args[0], args[1] * daf
        elif op == 0x0D:  # def_cfa_register
            if state.cfa_type == CFA_RSP:
                state.cfa_reg = args[0]
            else:
                state.cfa_type, state.cfa_reg = CFA_STOP, args[0]
        elif op == 0x0E:  # def_cfa_offset
            state.cfa_off = args[0]
        elif op == 0x13:  # def_cfa_offset_sf
            state.cfa_off = args[0] * daf
        elif op == 0x0F:  # def_cfa_expression
            expr = tuple(args[0])
            if (len(expr) == 11 and expr[:6] == _PLT_EXPR_HEAD and expr[7:] == _PLT_EXPR_TAIL
                    and 0x30 <= expr[6] <= 0x4F):
                state.cfa_type, state.cfa_off = CFA_PLT, expr[6] - 0x30
            else:
                state.cfa_type = CFA_STOP
        elif op in (0x80, 0x05, 0x11):  # offset, offset_extended(_sf): factored by daf
            _reg_rule(state, args[0], ("offset", args[1] * daf))
        elif op == 0x2F:  # GNU_negative_offset_extended
            _reg_rule(state, args[0], ("offset", -args[1] * daf))
        elif op in (0xC0, 0x06):  # restore, restore_extended
            reg = args[0]
            base = initial if initial is not None else _State()
            if reg == REG_RBP:
                state.rbp = base.rbp
            elif reg == REG_RA:
                state.ra = base.ra
        elif op == 0x07:  # undefined
            _reg_rule(state, args[0], ("undefined", 0))
        elif op == 0x08:  # same_value
            _reg_rule(state, args[0], ("same", 0))
        elif op in (0x09, 0x10, 0x14, 0x15, 0x16):  # register, expression, val_offset(_sf), val_expression
            _reg_rule(state, args[0], ("other", 0))
        elif op == 0x0A:  # remember_state
            stack.append(state.copy())
        elif op == 0x0B:  # restore_state
            if stack:
                saved = stack.pop()
                state.cfa_type, state.cfa_reg, state.cfa_off = saved.cfa_type, saved.cfa_reg, saved.cfa_off
                state.rbp, state.ra = saved.rbp, saved.ra
        elif op in (0x00, 0x2E):  # nop, GNU_args_size (no effect on the rules followed here)
            pass
        else:  # an opcode of another architecture or vendor: nothing after it is trusted
            state.cfa_type = CFA_STOP
    return loc


def _fde_rows(fde: Any, out: list[tuple[int, int, int, int, int]]) -> int:
    """Rows of one FDE, and its end (one past its last byte)."""
    cie = fde.cie
    caf = int(cie["code_alignment_factor"])
    daf = int(cie["data_alignment_factor"])
    state = _State()
    aug = cie.header.get("augmentation") or b""
    if isinstance(aug, str):
        aug = aug.encode()
    _run(cie.instructions, state, None, 0, caf, daf, None)
    initial = state.copy()
    if b"S" in aug:  # a signal frame (__restore_rt): its rules are expressions over the sigcontext
        state.cfa_type = CFA_STOP
        initial.cfa_type = CFA_STOP
    start = int(fde["initial_location"])
    end = start + int(fde["address_range"])
    loc = _run(fde.instructions, state, initial, start, caf, daf, out)
    if loc < end:
        out.append((loc, *state.row()))
    if b"S" in aug:  # every row of a signal frame stops the walk
        pass
    return end


def _iter_fdes(entries: Any) -> Any:
    from elftools.dwarf.callframe import FDE

    for e in entries:
        if isinstance(e, FDE):
            yield e


def compile_table(f: BinaryIO, fallback_key: str, max_rows: int) -> CfiTable:
    """The table of an ELF file open in f. Raises NoTable when it has none (not x86-64 ELF, no CFI,
    addresses past 4 GB, more than max_rows rows)."""
    from elftools.common.exceptions import ELFError, ELFParseError
    from elftools.elf.elffile import ELFFile

    try:
        elf = ELFFile(f)
        if elf["e_machine"] != "EM_X86_64":
            raise NoTable(f"not x86-64 ({elf['e_machine']})")
        key = _peek_build_id(f) or fallback_key
        segments = [(int(s["p_vaddr"]), int(s["p_offset"]), int(s["p_filesz"])) for s in elf.iter_segments()
                    if s["p_type"] == "PT_LOAD" and int(s["p_flags"]) & 1]
        has_eh = elf.get_section_by_name(".eh_frame") is not None
        has_debug = elf.get_section_by_name(".debug_frame") is not None
        if not has_eh and not has_debug:
            raise NoTable("no .eh_frame or .debug_frame")
        dwarf = elf.get_dwarf_info(follow_links=False)
        raw: list[tuple[int, int, int, int, int]] = []
        ends: list[int] = []
        fdes = 0
        covered: list[tuple[int, int]] = []
        if has_eh and dwarf.has_EH_CFI():
            for fde in _iter_fdes(dwarf.EH_CFI_entries()):
                n0 = len(raw)
                end = _fde_rows(fde, raw)
                if len(raw) > n0:
                    ends.append(end)
                    covered.append((int(fde["initial_location"]), end))
                fdes += 1
                if len(raw) > 4 * max_rows:
                    raise NoTable(f"more than {max_rows} rows")
        if has_debug and dwarf.has_CFI():
            # .debug_frame: only FDEs over code .eh_frame does not cover (a -g build's extra CFI)
            covered.sort()
            starts = [c[0] for c in covered]
            import bisect

            for fde in _iter_fdes(dwarf.CFI_entries()):
                lo = int(fde["initial_location"])
                i = bisect.bisect_right(starts, lo) - 1
                if i >= 0 and lo < covered[i][1]:
                    continue
                n0 = len(raw)
                end = _fde_rows(fde, raw)
                if len(raw) > n0:
                    ends.append(end)
                fdes += 1
    except (ELFError, ELFParseError, KeyError, IndexError, AssertionError, TypeError, ValueError) as e:
        if isinstance(e, NoTable):
            raise
        raise NoTable(f"unreadable ELF or CFI: {type(e).__name__}: {str(e)[:200]}") from None
    if not raw:
        raise NoTable("no FDE")
    table = _pack(raw, ends, max_rows)
    stats = {"plt": int((table["cfa_type"] == CFA_PLT).sum()), "stop": int((table["cfa_type"] == CFA_STOP).sum()),
             "end": int((table["cfa_type"] == CFA_END).sum())}
    return CfiTable(key, table, segments, fdes, stats)


def _pack(raw: list[tuple[int, int, int, int, int]], ends: list[int], max_rows: int) -> np.ndarray:
    """Sorted rows, gaps between FDEs marked CFA_NONE, one row per change of rule."""
    real = np.array(raw, dtype=np.int64).reshape(-1, 5)
    gaps = np.zeros((len(ends), 5), dtype=np.int64)
    gaps[:, 0] = ends
    gaps[:, 1] = CFA_NONE  # column order below: pc, cfa_type, cfa_off, rbp_type, rbp_off
    cols = np.concatenate((real[:, [0, 1, 2, 3, 4]], gaps))
    # raw tuples are (pc, cfa_type, cfa_off, rbp_type, rbp_off)
    is_real = np.concatenate((np.ones(len(real), np.int8), np.zeros(len(gaps), np.int8)))
    order = np.arange(len(cols))
    # by pc; at one pc a real row beats a gap marker, and a later real row beats an earlier one
    idx = np.lexsort((order, is_real, cols[:, 0]))
    cols = cols[idx]
    if len(cols) and (cols[:, 0].min() < 0 or cols[:, 0].max() > MAX_PC):
        raise NoTable("addresses past 4 GB")
    last_at_pc = np.ones(len(cols), bool)
    last_at_pc[:-1] = cols[1:, 0] != cols[:-1, 0]
    cols = cols[last_at_pc]
    rule = cols[:, 1:]
    changed = np.ones(len(cols), bool)
    changed[1:] = np.any(rule[1:] != rule[:-1], axis=1)
    cols = cols[changed]
    if len(cols) > max_rows:
        raise NoTable(f"{len(cols)} rows, more than the {max_rows} allowed")
    out = np.zeros(len(cols), ROW_DTYPE)
    out["pc"] = cols[:, 0]
    out["cfa_type"] = cols[:, 1]
    out["cfa_off"] = cols[:, 2]
    out["rbp_type"] = cols[:, 3]
    out["rbp_off"] = cols[:, 4]
    return out


def lookup(rows: np.ndarray, pc: int) -> np.void | None:
    """The row for pc (an ELF address), as the BPF walker finds it (tests)."""
    i = int(np.searchsorted(rows["pc"], pc, side="right")) - 1
    return None if i < 0 else rows[i]


# --- files -------------------------------------------------------------------------------------


def open_mapped_file(pid: int, start: int, end: int) -> tuple[int, os.stat_result]:
    """A descriptor of the object a process maps at [start, end): /proc/PID/map_files/START-END,
    which the kernel resolves to the mapped file itself (no path of the job's is followed; a file
    replaced or deleted since is still the one mapped). Regular files of at most ELF_MAX_BYTES."""
    try:
        return open_user_file(f"/proc/{pid}/map_files/{start:x}-{end:x}", owners=None, max_bytes=ELF_MAX_BYTES,
                              magic_link=True)
    except UnsafeFile as e:
        raise NoTable(str(e)) from None


def file_key(st: os.stat_result) -> str:
    return f"file:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


# --- cache -------------------------------------------------------------------------------------


MAX_FILES_REMEMBERED = 65536  # file identities (by_file) and located tables' segments kept in memory
SEGMENTS_MAX_BYTES = 1 << 16  # a table's .seg file: 24 bytes an executable segment, one or two a file
COMPILE_LOCK_WAIT_S = 120.0  # longest wait for another collector's compile of the same file
# The disk cache's index of located files: one line per file identity that a collector of the host
# located from the disk cache ("<file_key> <build id> <vaddr>,<offset>,<size>;..."), read once by
# each new collector, so that a job's registrations find its files' keys and segments without
# reading each file's build id and .seg (hpcc's job: 22 of its 66 ms of registrations).
INDEX_NAME = "located.idx"
INDEX_MAX_LINES = 65536  # no line is added past this (a later locate reads the file, as without)
INDEX_MAX_BYTES = 16 << 20
CANCEL_POLL_S = 0.1  # how soon a stopping collector stops waiting for its compile child


class TableCache:
    """Compiled tables by key (build id, else content hash: cache_id): in memory up to max_rows rows
    in all (least recently used dropped first), and on disk in a directory only root may
    write, up to disk_bytes in all (oldest files removed first). Files without a table are
    remembered too (by key) so that they are not compiled again."""

    def __init__(self, max_rows: int, disk_dir: str | None, disk_bytes: int) -> None:
        self.max_rows = max_rows
        self.disk_dir = Path(disk_dir) if disk_dir and disk_bytes > 0 else None
        self.disk_bytes = disk_bytes
        self.mem: OrderedDict[str, CfiTable] = OrderedDict()
        self.mem_rows = 0
        self.no_table: OrderedDict[str, str] = OrderedDict()  # key -> why
        self.by_file: OrderedDict[str, str] = OrderedDict()  # file identity -> key (build id)
        self.segments: OrderedDict[str, Segments] = OrderedDict()  # key -> its table's segments (locate)
        self._hot: dict[str, bool] = {}  # key -> whether hot() (its .hot file), as first asked
        self._index_lines: int | None = None  # lines in the disk cache's index (None: not read yet)
        self.lock = threading.Lock()
        self.compiled = 0
        self.compile_s = 0.0
        self.disk_hits = 0
        self.disk_errors: list[str] = []
        self.child_cpu_s = 0.0  # CPU of the compile children, as they report it
        self.waited_for_others = 0  # tables another process of the host compiled while this one waited
        self.warmed = 0  # tables compiled ahead of the job's processes (warm)
        # set when the collector stops: a compile child is left to finish into the disk cache (killed
        # when there is none), lock waits end (a stop must not wait for seconds: the seal has a deadline)
        self.cancel = threading.Event()

    def peek(self, st: os.stat_result) -> CfiTable | None:
        """The table of a file already compiled (memory only; None: not yet). Raises NoTable for a
        file known to have none."""
        fkey = file_key(st)
        with self.lock:
            key = self.by_file.get(fkey, fkey)
            if key in self.no_table:
                raise NoTable(self.no_table[key])
            t = self.mem.get(key)
            if t is not None:
                self.mem.move_to_end(key)
            return t

    def get(self, fd: int, st: os.stat_result, compile: bool = True, child: bool = False) -> CfiTable | None:
        """The table of the open file (raises NoTable); compile=False: None when it is neither in
        memory nor on disk and its CFI is more than SMALL_CFI_BYTES (what the drain thread asks,
        leaving the long compiles to the compile thread). child: compile in a child process at the
        lowest priority (`compile_in_child`: pyelftools is pure Python, and a compile in the
        collector's process would hold its GIL for seconds, starving the drains)."""
        t = self.peek(st)
        if t is not None:
            return t
        fkey = file_key(st)
        with os.fdopen(os.dup(fd), "rb") as f:
            bid = cache_id(f)
            if bid is not None:
                with self.lock:
                    t = self.mem.get(bid)
                    if t is not None:
                        self.by_file[fkey] = bid
                        self._trim_files()
                        return t
                t = self._disk_load(bid)
                if t is not None:
                    self._remember(fkey, t)
                    return t
            if not compile and _cfi_bytes(f) > SMALL_CFI_BYTES:
                return None
            # The long compiles (child) of one build id are made once per host: the collectors of
            # the jobs of a node (four at once on the local cluster) share the disk cache, and the
            # first to take the build id's lock compiles while the others wait and then load it.
            lock_fd = self._compile_lock(bid) if child and bid is not None else None
            try:
                if lock_fd is not None:
                    assert bid is not None
                    t = self._disk_load(bid)
                    if t is not None:
                        self.waited_for_others += 1
                        self._remember(fkey, t)
                        return t
                t0 = time.process_time()
                try:
                    f.seek(0)
                    key = bid or fkey  # a file without a build id: its table keyed by its content
                    if child:
                        t = compile_in_child(f.fileno(), key, self.max_rows, self.cancel,
                                             self._child_store(bid), lock_fd)
                        self.child_cpu_s += t.stats.pop("cpu_ms", 0) / 1000
                    else:
                        t = compile_table(f, key, self.max_rows)
                except NoTable as e:
                    with self.lock:
                        self.no_table[bid or fkey] = str(e)
                        self.by_file[fkey] = bid or fkey
                        while len(self.no_table) > 4096:
                            self.no_table.popitem(last=False)
                        self._trim_files()
                    raise
                finally:
                    self.compile_s += time.process_time() - t0
                self.compiled += 1
                self._remember(fkey, t)
                if bid is not None and not t.stats.pop("stored", 0):
                    self._disk_store(t)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the flock
        return t

    def locate(self, fd: int, st: os.stat_result) -> tuple[str, Segments] | None:
        """The key and segments of the open file's table, without reading its rows when they are
        only on disk (the registration loads a table's rows only once a walk needs them:
        CfiUnwinder; load() then reads them); None and NoTable as get(compile=False)."""
        fkey = file_key(st)
        self.read_index()
        with self.lock:
            key = self.by_file.get(fkey)
            if key is not None and key in self.segments:
                # located before (another process maps the same file, or the index has it): no read at all
                self.segments.move_to_end(key)
                return key, self.segments[key]
        t = self.peek(st)
        if t is not None:
            return t.key, t.segments
        with os.fdopen(os.dup(fd), "rb") as f:
            bid = _peek_build_id(f)
        if bid is not None:
            with self.lock:
                t = self.mem.get(bid)
            segments = t.segments if t is not None else self._disk_segments(bid)
            if segments is not None:
                with self.lock:
                    self.by_file[fkey] = bid
                    self._trim_files()
                    self._keep_segments(bid, segments)
                self._index_add(fkey, bid, segments)
                return bid, segments
        # no build id (keyed by content), or not compiled yet: as before, rows and all
        t = self.get(fd, st, compile=False)
        if t is None:
            return None
        with self.lock:
            self._keep_segments(t.key, t.segments)
        return t.key, t.segments

    def read_index(self) -> None:
        """The disk cache's index (INDEX_NAME) into by_file and segments, once per cache (at the
        first locate, or before: CfiUnwinder reads it as it starts, while the prolog waits): a line
        that does not parse (cut short by a crash, or not ours) is skipped; a file that is not a
        regular file of ours, or is over INDEX_MAX_BYTES, is not read (and removed when too big)."""
        if self._index_lines is not None:
            return
        self._index_lines = 0
        if self.disk_dir is None or not self._disk_ok():
            return
        raw = self._index_bytes()
        if raw is None:
            return
        if len(raw) > INDEX_MAX_BYTES:
            (self.disk_dir / INDEX_NAME).unlink(missing_ok=True)  # started anew by the next locates
            return
        lines = raw.split(b"\n")
        self._index_lines = len(lines)
        with self.lock:
            for line in lines:
                parsed = parse_index_line(line)
                if parsed is not None and self._disk_paths(parsed[1]) is not None:
                    fkey, key, segments = parsed
                    self.by_file[fkey] = key
                    self._keep_segments(key, segments)
            self._trim_files()

    def _index_bytes(self) -> bytes | None:
        """The index's bytes, INDEX_MAX_BYTES + 1 at most (more: too big); None when there is none
        yet, or it is not a regular file of ours (then said in disk_errors)."""
        assert self.disk_dir is not None
        fd = self._open_own(self.disk_dir / INDEX_NAME)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(INDEX_MAX_BYTES + 1)

    def _open_own(self, path: Path, max_size: int | None = None) -> int | None:
        """A file of the disk cache, opened to read: without following a link or blocking on a
        FIFO, and only when it is a regular file of this user's (of max_size bytes at most). None
        when there is none (quietly) or it is refused (said in disk_errors)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENOENT:
                self._disk_error(f"{path}: {e}")
            return None
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or (max_size is not None and st.st_size > max_size)):
            os.close(fd)
            self._disk_error(f"{path}: not a cache file of ours")
            return None
        return fd

    def _index_add(self, fkey: str, key: str, segments: Segments) -> None:
        """One line for a file located from the disk cache (one write, O_APPEND: the host's
        collectors add theirs side by side), unless the index is full."""
        if self._index_lines is None or self._index_lines >= INDEX_MAX_LINES or self.disk_dir is None:
            return
        line = index_line(fkey, key, segments)
        path = self.disk_dir / INDEX_NAME
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._disk_error(f"{path}: {e}")
            return
        try:
            os.write(fd, line)
            self._index_lines += 1
        except OSError as e:
            self._disk_error(f"{path}: {e}")
        finally:
            os.close(fd)

    def _keep_segments(self, key: str, segments: Segments) -> None:
        """locate()'s answers by key (the lock held): a few bytes a file, bounded as by_file."""
        self.segments[key] = segments
        self.segments.move_to_end(key)
        while len(self.segments) > MAX_FILES_REMEMBERED:
            self.segments.popitem(last=False)

    def load(self, key: str, keep: bool = True) -> CfiTable | None:
        """The table of a key locate() gave, rows and all: from memory, else the disk cache (None:
        in neither any more, e.g. removed from the disk cache since). keep=False: a table read
        from disk is not kept in memory (its rows go into the BPF map at once and stay there)."""
        with self.lock:
            t = self.mem.get(key)
            if t is not None:
                self.mem.move_to_end(key)
                return t
        t = self._disk_load(key)
        if t is not None and keep:
            with self.lock:
                self._keep(t)
        return t

    def hot(self, key: str) -> bool:
        """Whether a walk of some job of this host needed the table of key (mark_hot): then a
        registration loads it at once instead of waiting for a walk to ask (what the first
        walks through it would lose). Remembered for the collector's life."""
        with self.lock:
            known = self._hot.get(key)
        if known is not None:
            return known
        paths = self._disk_paths(key)
        found = paths is not None and os.path.lexists(paths[0].with_suffix(".hot"))
        with self.lock:
            self._hot[key] = found
            self._trim_hot()
        return found

    def _trim_hot(self) -> None:
        """hot()'s answers bounded as by_file, the oldest dropped (the lock held)."""
        while len(self._hot) > MAX_FILES_REMEMBERED:
            self._hot.pop(next(iter(self._hot)))

    def hot_keys(self) -> list[str]:
        """The keys of every table a walk of some job of this host needed (mark_hot's marks in the
        disk cache), the newest marks first; [] without a disk cache. What CfiUnwinder loads at
        its start, before the job's processes run."""
        if self.disk_dir is None or not self._disk_ok():
            return []
        marks: list[tuple[int, str]] = []
        try:
            with os.scandir(self.disk_dir) as entries:
                for e in entries:
                    key = e.name.removesuffix(".hot")
                    if key == e.name or self._disk_paths(key) is None or not e.is_file(follow_symlinks=False):
                        continue
                    marks.append((e.stat(follow_symlinks=False).st_mtime_ns, key))
        except OSError as e:  # the directory, or a mark removed with its table meanwhile
            self._disk_error(f"{self.disk_dir}: {e}")
        keys = [key for _, key in sorted(marks, reverse=True)]
        with self.lock:
            for key in keys[:MAX_FILES_REMEMBERED]:
                self._hot[key] = True
            self._trim_hot()
        return keys

    def mark_hot(self, key: str) -> None:
        """A walk needed the table of key, or a job used it: the next registrations on this host
        load it at once (hot()), and the next unwinders preload it before others (hot_keys: the
        newest marks first); an empty <key>.hot beside its rows in the disk cache, removed with
        them, its modification time set to now."""
        with self.lock:
            self._hot[key] = True
        paths = self._disk_paths(key)
        if paths is None or not self._disk_ok():
            return
        if not os.path.lexists(paths[0]):
            return  # a table kept in memory only (the vDSO's): nothing to preload it from
        hot_p = paths[0].with_suffix(".hot")
        try:
            fd = os.open(hot_p, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.utime(fd)  # an existing mark too: O_CREAT leaves its time as it was
            finally:
                os.close(fd)
        except OSError as e:
            self._disk_error(f"{hot_p}: {e}")

    def warm(self, fd: int, st: os.stat_result) -> bool:
        """Compile the open file's table into the disk cache only (a library the node's jobs are
        likely to map: the next registration of it is a disk hit); not kept in memory. True when
        compiled now; False when it is cached already, has no cache id, or there is no disk cache."""
        with os.fdopen(os.dup(fd), "rb") as f:
            bid = cache_id(f)
        store = self._child_store(bid)
        if bid is None or store is None or self._on_disk(bid):
            return False
        lock_fd = self._compile_lock(bid)
        try:
            if self._on_disk(bid):  # another collector of the host compiled it while this one waited
                return False
            t = compile_in_child(fd, bid, self.max_rows, self.cancel, store, lock_fd)
            self.child_cpu_s += t.stats.pop("cpu_ms", 0) / 1000
            if not t.stats.pop("stored", 0):
                self._disk_store(t)
            self.warmed += 1
            return True
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _on_disk(self, bid: str) -> bool:
        paths = self._disk_paths(bid)
        return paths is not None and os.path.lexists(paths[0])

    def _child_store(self, bid: str | None) -> tuple[str, int] | None:
        """Where a compile child stores its table itself ((cache directory, bytes); None: no disk
        cache), so that a compile the collector leaves at its stop still serves the next job."""
        if bid is None or self.disk_dir is None or self._disk_paths(bid) is None or not self._disk_ok():
            return None
        return str(self.disk_dir), self.disk_bytes

    def _compile_lock(self, bid: str) -> int | None:
        """An open descriptor holding the exclusive lock of `bid` in the disk cache (None: no disk
        cache, or the lock could not be had within COMPILE_LOCK_WAIT_S: then this process compiles
        on its own, as without a cache). A holder that dies releases it (flock)."""
        paths = self._disk_paths(bid)
        if paths is None or not self._disk_ok():
            return None
        lock_p = paths[0].with_suffix(".lock")
        try:
            fd = os.open(lock_p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._disk_error(f"{lock_p}: {e}")
            return None
        deadline = time.monotonic() + COMPILE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                if self.cancel.wait(0.1):
                    os.close(fd)
                    raise CompileCancelled(bid) from None
            except OSError as e:
                self._disk_error(f"{lock_p}: {e}")
                os.close(fd)
                return None

    def _remember(self, fkey: str, t: CfiTable) -> None:
        with self.lock:
            self.by_file[fkey] = t.key
            self._trim_files()
            self._keep(t)

    def _keep(self, t: CfiTable) -> None:
        """In memory (the lock held), the least recently used dropped beyond max_rows."""
        if t.key not in self.mem:
            self.mem[t.key] = t
            self.mem_rows += len(t.rows)
        while self.mem_rows > self.max_rows and len(self.mem) > 1:
            _, old = self.mem.popitem(last=False)
            self.mem_rows -= len(old.rows)

    def _trim_files(self) -> None:
        while len(self.by_file) > MAX_FILES_REMEMBERED:
            self.by_file.popitem(last=False)

    # on-disk copies: <dir>/<build id>.npy (rows) + .seg (segments), written by root only
    def _disk_paths(self, bid: str) -> tuple[Path, Path] | None:
        if self.disk_dir is None or not bid or bid.strip("0123456789abcdef") or len(bid) > 128:
            return None
        return self.disk_dir / f"{bid}.npy", self.disk_dir / f"{bid}.seg"

    def _disk_ok(self) -> bool:
        """The cache directory exists (made 0700 if not), is root's and writable by nobody else."""
        assert self.disk_dir is not None
        problem = own_directory_problem(self.disk_dir, 0o022)
        if problem:
            self._disk_error(problem)
        return not problem

    def _disk_error(self, msg: str) -> None:
        if len(self.disk_errors) < 16:
            self.disk_errors.append(msg)

    def _disk_segments(self, bid: str) -> Segments | None:
        """The segments of a table in the disk cache, without its rows (None: not there, or not a
        file of ours: _disk_load says why when the rows are read)."""
        paths = self._disk_paths(bid)
        if paths is None or not self._disk_ok():
            return None
        rows_p, seg_p = paths
        try:
            st = os.lstat(rows_p)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            return _read_segments(seg_p)
        except (OSError, ValueError):
            return None

    def _disk_load(self, bid: str) -> CfiTable | None:
        paths = self._disk_paths(bid)
        if paths is None or not self._disk_ok():
            return None
        rows_p, seg_p = paths
        fd = self._open_own(rows_p, 16 * self.max_rows + 4096)
        if fd is None:
            return None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                rows = np.load(f, allow_pickle=False)
            segments = _read_segments(seg_p)
        except FileNotFoundError:
            self._disk_error(f"{seg_p}: missing beside {rows_p.name}")
            return None
        except (OSError, ValueError) as e:
            self._disk_error(f"{rows_p}: {e}")
            return None
        finally:
            os.close(fd)
        if rows.dtype != ROW_DTYPE:
            self._disk_error(f"{rows_p}: not a table of this version")
            return None
        self.disk_hits += 1
        os.utime(rows_p)  # recently used: kept longest
        return CfiTable(bid, rows, segments, 0, {})

    def _disk_store(self, t: CfiTable) -> None:
        paths = self._disk_paths(t.key)
        if paths is None or not self._disk_ok():
            return
        rows_p, seg_p = paths
        tmp = rows_p.with_suffix(f".tmp{os.getpid()}")
        seg_tmp = seg_p.with_suffix(f".segtmp{os.getpid()}")
        try:
            # the segments first: a reader that finds the rows (the name it looks up) finds them too
            np.array([x for s in t.segments for x in s], dtype="<u8").tofile(seg_tmp)
            os.replace(seg_tmp, seg_p)
            with open(tmp, "wb") as f:
                np.save(f, t.rows, allow_pickle=False)
            os.replace(tmp, rows_p)
            self._disk_trim()
        except OSError as e:
            self._disk_error(f"{rows_p}: {e}")
            tmp.unlink(missing_ok=True)
            seg_tmp.unlink(missing_ok=True)

    def _disk_trim(self) -> None:
        assert self.disk_dir is not None
        files = []
        for p in self.disk_dir.glob("*.npy"):
            try:
                st = p.lstat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        removed: set[str] = set()
        for _, size, p in sorted(files):
            if total <= self.disk_bytes:
                break
            p.unlink(missing_ok=True)
            p.with_suffix(".seg").unlink(missing_ok=True)
            p.with_suffix(".lock").unlink(missing_ok=True)
            p.with_suffix(".hot").unlink(missing_ok=True)
            removed.add(p.stem)
            total -= size
        if removed:
            self._index_drop(removed)

    def _index_drop(self, keys: set[str]) -> None:
        """The index without the lines of keys (their tables left the disk cache): written anew
        and renamed over it. A line another collector adds meanwhile may be lost: a cache miss."""
        assert self.disk_dir is not None
        path = self.disk_dir / INDEX_NAME
        raw = self._index_bytes()
        if raw is None:
            return
        kept = [line for line in raw.split(b"\n") if (p := parse_index_line(line)) is not None and p[1] not in keys]
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, path)
        except OSError as e:
            self._disk_error(f"{path}: {e}")
            tmp.unlink(missing_ok=True)


def index_line(fkey: str, key: str, segments: Segments) -> bytes:
    """A line of the disk cache's index (INDEX_NAME)."""
    return f"{fkey} {key} {';'.join(f'{v},{o},{n}' for v, o, n in segments)}\n".encode()


def parse_index_line(line: bytes) -> tuple[str, str, Segments] | None:
    """(file key, build id, segments) of an index line; None when it is not one (cut short, empty)."""
    try:
        fkey, key, segs = line.decode("ascii").split(" ")
        if not fkey.startswith("file:") or not key or key.strip("0123456789abcdef"):
            return None
        segments = [(int(v), int(o), int(n)) for v, o, n in (s.split(",") for s in segs.split(";"))]
    except ValueError:  # a wrong count of fields or numbers, or not ASCII
        return None
    return fkey, key, segments


def _read_segments(seg_p: Path) -> Segments:
    """A disk-cache .seg file: (vaddr, file offset, size) of each loaded segment, three
    little-endian u64 each. Opened without following a link; ValueError when it is not such a
    file (too big, or not whole triples)."""
    fd = os.open(seg_p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(SEGMENTS_MAX_BYTES + 1)
    if len(raw) > SEGMENTS_MAX_BYTES or len(raw) % 24:
        raise ValueError(f"{seg_p}: {len(raw)} bytes, not segments of this version")
    segs = np.frombuffer(raw, dtype="<u8").reshape(-1, 3)
    return [(int(a), int(b), int(c)) for a, b, c in segs]


SMALL_CFI_BYTES = 32 << 10  # .eh_frame + .debug_frame compiled at once (tens of ms at most)


def _cfi_bytes(f: BinaryIO) -> int:
    from elftools.common.exceptions import ELFError, ELFParseError
    from elftools.elf.elffile import ELFFile

    try:
        f.seek(0)
        elf = ELFFile(f)
        return sum(int(sec["sh_size"]) for name in (".eh_frame", ".debug_frame")
                   if (sec := elf.get_section_by_name(name)) is not None)
    except (ELFError, ELFParseError, ValueError, KeyError):
        return 0


CHILD_TIMEOUT_S = 120.0


@functools.lru_cache(maxsize=1)
def own_vdso() -> bytes:
    """This process's vDSO image (b"": it has none). The kernel maps the same image into every
    x86-64 process of the host (it is the kernel's, not the job's), so the collector compiles its
    table and reads its symbols from its own copy: nothing of a job's memory is read for it. A
    [vdso] of another size is another image (a 32-bit process's)."""
    import ctypes

    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[vdso]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return ctypes.string_at(lo, hi - lo)
    return b""


def vdso_table(max_rows: int) -> CfiTable:
    """The CFI table of the host's vDSO (own_vdso; keyed by its build id), for walks whose leaf is
    in clock_gettime or gettimeofday (an MPI progress loop's timer: most samples of a process
    polling the clock). Debian 12's vDSO keeps frame pointers, so the frame-pointer rule unwound
    it too, except at its entries and exits before rbp is set (3 of 190 samples of
    tests/progs/vdso_loop.c ended there); a vDSO built without them is unwound only with this.
    Raises NoTable when there is no vDSO or it has no CFI."""
    image = own_vdso()
    if not image:
        raise NoTable("no [vdso] in this process")
    return compile_table(io.BytesIO(image), "vdso", max_rows)


def compile_in_child(fd: int, fallback_key: str, max_rows: int, cancel: threading.Event | None = None,
                     store: tuple[str, int] | None = None, lock_fd: int | None = None) -> CfiTable:
    """compile_table in a child process (`python -m gpuprof.collector.cfitables`, at the collector's
    own priority: hooks.collector_nice) reading the descriptor it inherits; its answer on stdout:
    one JSON line, then the rows (.npy). Its CPU time is in stats["cpu_ms"].

    store: (cache directory, bytes): the child writes the table into the disk cache itself, before
    it answers (stats["stored"] = 1), and holds `lock_fd` (the build id's compile lock) until it
    exits. `cancel` set (the collector stops): CompileCancelled is raised within CANCEL_POLL_S and
    the child is left to finish into the disk cache, bounded by CHILD_TIMEOUT_S of CPU, so that a
    big table that did not finish during a short job serves the next one on the host; without a
    disk cache there is nothing to finish for and it is killed."""
    import json
    import subprocess
    import sys

    os.lseek(fd, 0, os.SEEK_SET)
    argv = [sys.executable, "-I", "-m", "gpuprof.collector.cfitables", str(fd), fallback_key, str(max_rows)]
    if store is not None:
        argv += [store[0], str(store[1])]
    pass_fds = (fd,) if lock_fd is None else (fd, lock_fd)
    # -I: no current directory, PYTHONPATH or user site on the child's path (it runs as root)
    proc = subprocess.Popen(argv, pass_fds=pass_fds, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    abandoned = False
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=CANCEL_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    abandoned = store is not None
                    raise CompileCancelled(fallback_key) from None
                if time.monotonic() >= deadline:
                    raise NoTable(f"compile took more than {CHILD_TIMEOUT_S:.0f} s") from None
    finally:
        if proc.returncode is None:
            if abandoned:  # its answer is not read: it stores, then meets a closed pipe and leaves
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            else:
                proc.kill()
                proc.communicate()
    head, _, body = stdout.partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        raise NoTable(f"compile failed (exit {proc.returncode}): {stderr.decode(errors='replace')[-300:]}") \
            from None
    if "no_table" in meta:
        raise NoTable(str(meta["no_table"]))
    try:
        rows = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError) as e:
        raise NoTable(f"compile returned no table: {e}") from None
    if rows.dtype != ROW_DTYPE:
        raise NoTable("compile returned rows of another layout")
    return CfiTable(str(meta["key"]), rows, [(int(a), int(b), int(c)) for a, b, c in meta["segments"]],
                    int(meta["fdes"]), {k: int(v) for k, v in meta["stats"].items()})


def _child_main(argv: list[str]) -> int:
    import json
    import resource
    import signal
    import sys

    # bounded on its own: it may outlive a collector that stopped (compile_in_child)
    limit = int(CHILD_TIMEOUT_S)
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
    signal.alarm(3 * limit)
    fd, key, max_rows = int(argv[0]), argv[1], int(argv[2])
    store = (argv[3], int(argv[4])) if len(argv) >= 5 else None
    out = sys.stdout.buffer
    try:
        with os.fdopen(fd, "rb") as f:
            t = compile_table(f, key, max_rows)
    except NoTable as e:
        out.write(json.dumps({"no_table": str(e)}).encode() + b"\n")
        return 0
    stats = {**t.stats, "cpu_ms": round(time.process_time() * 1000)}
    if store is not None:
        cache = TableCache(max_rows, store[0], store[1])
        if cache._disk_paths(t.key) is not None:  # a cache id (build id or content hash; a file key is not kept)
            cache._disk_store(t)
            stats["stored"] = int(not cache.disk_errors)
    buf = io.BytesIO()  # (np.save to a real file writes the data past its own buffer)
    np.save(buf, t.rows, allow_pickle=False)
    try:
        out.write(json.dumps({"key": t.key, "segments": t.segments, "fdes": t.fdes, "stats": stats}).encode() + b"\n")
        out.write(buf.getvalue())
        out.flush()
    except BrokenPipeError:
        pass  # the collector stopped and left this compile to finish into the disk cache
    return 0


CONTENT_ID_MAX_BYTES = 2 << 30  # larger files without a build id are not hashed (not kept on disk)


def cache_id(f: BinaryIO) -> str | None:
    """The disk cache's name of a file's table: its build id, else the SHA-256 of its bytes (64 hex
    digits). pip's wheels ship libraries without a build id (numpy's OpenBLAS, 25 MB, about 5 s of
    CPU to compile): keyed by file identity alone they were compiled again by every collector of
    every job, during the job. None: neither (not an ELF file, or too large to hash)."""
    bid = _peek_build_id(f)
    if bid is not None:
        return bid
    f.seek(0, os.SEEK_END)
    if f.tell() > CONTENT_ID_MAX_BYTES:
        return None
    f.seek(0)
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _peek_build_id(f: BinaryIO) -> str | None:
    """The GNU build id (hex) of the ELF file in f, read with struct from its section headers and note sections
    only: each library a job maps is looked up by it at registration (hpcc's ranks map 161), and
    pyelftools took about a millisecond a file to parse what this reads in tens of microseconds.
    None when f is not an ELF file, is malformed, or has no GNU build-id note."""
    try:
        f.seek(0)
        ident = f.read(64)
        if len(ident) < 52 or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            return None
        wide, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
        if wide:
            shoff, shentsize, shnum = struct.unpack_from(end + "Q", ident, 40)[0], *struct.unpack_from(end + "HH", ident, 58)
        else:
            shoff, shentsize, shnum = struct.unpack_from(end + "I", ident, 32)[0], *struct.unpack_from(end + "HH", ident, 46)
        # a section header: type at 4; offset, size and alignment at 24/32/48 (64-bit) or 16/20/32
        shdr = struct.Struct(end + ("IIQQQQIIQQ" if wide else "IIIIIIIIII"))
        if not shoff or shentsize < shdr.size:
            return None
        if shnum == 0:  # more than 0xff00 sections: the count is section 0's size (extended numbering)
            f.seek(shoff)
            first = f.read(shdr.size)
            if len(first) < shdr.size:
                return None
            shnum = shdr.unpack(first)[5]
        if shnum > 1 << 16:
            return None
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        if len(table) < shentsize * shnum:
            return None
        for i in range(shnum):
            fields = shdr.unpack_from(table, i * shentsize)
            if fields[1] != SHT_NOTE:
                continue
            offset, size, align = fields[4], fields[5], fields[8]
            if size > NOTE_SECTION_MAX_BYTES:
                continue
            f.seek(offset)
            bid = build_id_note(f.read(size), end, align)
            if bid is not None:
                return bid
        return None
    except (OSError, ValueError, struct.error):
        return None


def digest(rows: np.ndarray) -> str:
    """A short digest of a table (tests)."""
    return hashlib.sha256(rows.tobytes()).hexdigest()[:16]


if __name__ == "__main__":
    import sys

    sys.exit(_child_main(sys.argv[1:]))
