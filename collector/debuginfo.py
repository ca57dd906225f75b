"""Function names of native frames: an ELF file's symbols, its separate debug file (by build id or
.gnu_debuglink), inlined frames from DWARF, Fortran and C++ names (docs/probes.md, "Names of native
frames").

Everything here reads from descriptors (`os.pread`; never mmap: a file the job's user owns could be
truncated under us, and a mapped read past the end would kill the collector with SIGBUS) whose
opening the caller decided (collector/symbolize.py: /proc/PID/map_files/START-END at the first
stack through the file, or safeio's opener). The debug files are looked up here, only under the configured debug roots
(root's: `sources.stacks.debug_roots`) and in the `.debug/` directory beside the file (the job's
user may control it: opened without following any symlink, owned by root or the job's uid), and
each must carry the build id of the file it names (else, for files without one, the debuglink's
CRC32).

Costs are bounded: symbol tables of at most SYMTAB_MAX_BYTES, debug files of at most
safeio.ELF_MAX_BYTES, and the DWARF walk for inlined frames parses only the compile units that
hold a sampled address, up to a budget of DIEs per seal (`DieBudget`).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import lzma
import os
import stat
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from gpuprof.collector.safeio import ELF_MAX_BYTES, UnsafeFile, open_user_file

log = logging.getLogger("gpuprof.collector")

DEFAULT_DEBUG_ROOTS: tuple[str, ...] = ("/usr/lib/debug",)
SYMTAB_MAX_BYTES = 256 << 20  # one .symtab/.dynsym and its string table, each
DEBUGDATA_MAX_BYTES = 64 << 20  # .gnu_debugdata (MiniDebugInfo) once decompressed
DIE_BUDGET = 100_000  # DWARF entries parsed per seal for inlined frames
INLINE_BUDGET_S = 2.0  # ... and seconds spent on them (the epilog waits hooks.seal_timeout_s for a seal)
FUNCTION_DIE_MAX = 50_000  # a function with a bigger body is not walked (its frames stay whole)

_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                 ("size", "<u8")])
STT_FUNC, STT_GNU_IFUNC = 2, 10
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
SHT_SYMTAB, SHT_NOTE, SHT_NOBITS, SHT_DYNSYM = 2, 7, 8, 11
PT_LOAD = 1
NT_GNU_BUILD_ID = 3
NOTE_SECTION_MAX_BYTES = 1 << 16  # a build-id note is 36 bytes; other note sections stay small too



def offset_to_vaddr(loads: Sequence[tuple[int, int, int]], off: int) -> int | None:
    """The virtual address of a file offset, by the loadable segments (p_offset, p_vaddr, p_filesz)."""
    for p_off, p_vaddr, p_filesz in loads:
        if p_off <= off < p_off + max(p_filesz, 1):
            return off - p_off + p_vaddr
    return None


def vaddr_to_offset(loads: Sequence[tuple[int, int, int]], vaddr: int) -> int | None:
    """The file offset of a virtual address, by the loadable segments (offset_to_vaddr's inverse)."""
    for p_off, p_vaddr, p_filesz in loads:
        if p_vaddr <= vaddr < p_vaddr + max(p_filesz, 1):
            return vaddr - p_vaddr + p_off
    return None

class DebugInfoError(ValueError):
    """An ELF or debug file that gives no names (not ELF64 little-endian, truncated, too big, a
    debug file of another build); the message names the file and why."""


# --- names --------------------------------------------------------------------------------------
def fortran_name(name: str) -> str | None:
    """gfortran's names of module procedures, `__mymod_MOD_compute` -> `mymod::compute` (None:
    not one). `MAIN__` (the main program) is named by the caller, which may know the program's
    name from DWARF."""
    if name.startswith("__") and "_MOD_" in name:
        mod, _, proc = name[2:].partition("_MOD_")
        if mod and proc:
            return f"{mod}::{proc}"
    return None


_cxa: Any = None


@lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """C++ names through libstdc++'s __cxa_demangle, gfortran's module procedures
    (`__mymod_MOD_compute` -> `mymod::compute`); others unchanged."""
    global _cxa
    if not name.startswith("_Z"):
        return fortran_name(name) or name
    if _cxa is None:
        try:
            lib = ctypes.CDLL("libstdc++.so.6")
            _cxa = lib.__cxa_demangle
            _cxa.restype = ctypes.c_void_p
            _cxa.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        except (OSError, AttributeError):
            _cxa = False
    if not _cxa:
        return name
    status = ctypes.c_int()
    p = _cxa(name.encode(), None, None, ctypes.byref(status))
    if not p or status.value != 0:
        return name
    try:
        return ctypes.string_at(p).decode(errors="replace")
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(p))


# --- reading ELF files through a descriptor -----------------------------------------------------
Reader = Callable[[int, int], bytes]  # (offset, size) -> exactly size bytes, or DebugInfoError


def fd_reader(fd: int, size: int, label: str) -> Reader:
    def read(off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > size:
            raise DebugInfoError(f"{label}: read of {n} bytes at {off} past its {size} bytes")
        out = b""
        while len(out) < n:
            chunk = os.pread(fd, n - len(out), off + len(out))
            if not chunk:
                raise DebugInfoError(f"{label}: shorter than its header says (changed under us?)")
            out += chunk
        return out
    return read


def bytes_reader(data: bytes, label: str) -> Reader:
    def read(off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > len(data):
            raise DebugInfoError(f"{label}: read of {n} bytes at {off} past its {len(data)} bytes")
        return data[off: off + n]
    return read


@dataclass
class Section:
    name: str
    type: int
    addr: int
    offset: int
    size: int
    link: int
    align: int


class FuncTable:
    """Function symbols sorted by address: the function containing an address."""

    def __init__(self, entries: list[tuple[int, int, str]]) -> None:
        entries.sort()
        self.starts = [e[0] for e in entries]
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def function_at(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.starts, vaddr) - 1
        while i >= 0:
            value, size, name = self.entries[i]
            if vaddr < value + max(size, 1):
                return name
            if size:  # a sized function ends before vaddr: vaddr is in no function we know
                return None
            i -= 1  # a zero-sized label (assembly): look at the one before
        return None


@dataclass
class ElfFile:
    """What one ELF file says about itself (no DWARF: InlineIndex reads that)."""

    label: str
    size: int
    sections: list[Section]
    loads: list[tuple[int, int, int]]  # PT_LOAD (p_offset, p_vaddr, p_filesz)
    build_id: str | None
    debuglink: tuple[str, int] | None  # (file name, CRC32)
    read: Reader = field(repr=False)

    def section(self, name: str) -> Section | None:
        for s in self.sections:
            if s.name == name:
                return s
        return None

    def has_symtab(self) -> bool:
        return any(s.type == SHT_SYMTAB and s.size for s in self.sections)

    def has_dwarf(self) -> bool:
        s = self.section(".debug_info")
        return s is not None and s.type != SHT_NOBITS and s.size > 0

    def offset_to_vaddr(self, off: int) -> int | None:
        return offset_to_vaddr(self.loads, off)

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        return vaddr_to_offset(self.loads, vaddr)

    def functions(self, kinds: Collection[int] = (SHT_SYMTAB, SHT_DYNSYM)) -> FuncTable:
        """Function symbols of the tables of these kinds. At one address the first name by
        binding wins: global, then weak, then local (aliases: `__libc_malloc` / `malloc`)."""
        best: dict[int, tuple[int, int, str]] = {}  # value -> (rank, size, name)
        rank_of = {STB_GLOBAL: 0, STB_WEAK: 1, STB_LOCAL: 2}
        for sec in self.sections:
            if sec.type not in kinds or sec.type == SHT_NOBITS or not sec.size:
                continue
            if sec.size > SYMTAB_MAX_BYTES or not 0 <= sec.link < len(self.sections):
                raise DebugInfoError(f"{self.label}: symbol table {sec.name} of {sec.size} bytes not read")
            strsec = self.sections[sec.link]
            if strsec.size > SYMTAB_MAX_BYTES or strsec.type == SHT_NOBITS:
                raise DebugInfoError(f"{self.label}: string table of {strsec.size} bytes not read")
            strtab = self.read(strsec.offset, strsec.size)
            syms = np.frombuffer(self.read(sec.offset, sec.size - sec.size % _SYM.itemsize), dtype=_SYM)
            typ = syms["info"] & 0xF
            syms = syms[((typ == STT_FUNC) | (typ == STT_GNU_IFUNC)) & (syms["value"] != 0) & (syms["shndx"] != 0)]
            for s in syms:
                start = int(s["name"])
                end = strtab.find(b"\0", start)
                if start >= len(strtab) or end == start:
                    continue
                name = strtab[start: end if end >= 0 else len(strtab)].decode(errors="replace")
                value = int(s["value"])
                # versioned aliases (`memcpy@GLIBC_2.2.5`) only where nothing else names the address
                rank = rank_of.get(int(s["info"]) >> 4, 3) + (4 if "@" in name else 0)
                old = best.get(value)
                if old is None or rank < old[0] or (rank == old[0] and sec.type == SHT_SYMTAB and old[1] == 0):
                    best[value] = (rank, int(s["size"]), name)
        return FuncTable([(v, size, name) for v, (_, size, name) in best.items()])

    def function_starts(self) -> np.ndarray | None:
        """Sorted start addresses of the functions .eh_frame_hdr's search table lists (what CFI
        knows of a stripped file's functions), or None when it has none in the usual encoding."""
        sec = self.section(".eh_frame_hdr")
        if sec is None or sec.type == SHT_NOBITS or sec.size < 12 or sec.size > SYMTAB_MAX_BYTES:
            return None
        data = self.read(sec.offset, sec.size)
        version, _ptr_enc, count_enc, table_enc = data[0], data[1], data[2], data[3]
        # binutils writes eh_frame_ptr as pcrel sdata4, the count as udata4 and the table as
        # datarel sdata4 pairs (relative to the section's address); anything else: not read
        if version != 1 or count_enc != 0x03 or table_enc != 0x3B:
            return None
        count = struct.unpack_from("<I", data, 8)[0]
        if 12 + 8 * count > len(data):
            return None
        table = np.frombuffer(data, dtype="<i4", count=2 * count, offset=12).reshape(-1, 2)
        return np.sort(table[:, 0].astype(np.int64) + sec.addr)


def read_elf(read: Reader, size: int, label: str) -> ElfFile:
    """The headers, notes and debuglink of an ELF64 little-endian file. Raises DebugInfoError."""
    if size < 64:
        raise DebugInfoError(f"{label}: too small for ELF")
    h = read(0, 64)
    if h[:4] != b"\x7fELF" or h[4] != 2 or h[5] != 1:
        raise DebugInfoError(f"{label}: not a little-endian ELF64 file")
    e_phoff, e_shoff = struct.unpack_from("<QQ", h, 32)
    e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHHHH", h, 54)
    loads: list[tuple[int, int, int]] = []
    if e_phnum and e_phentsize >= 56 and e_phnum < 4096:
        ph = read(e_phoff, e_phentsize * e_phnum)
        for i in range(e_phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", ph, i * e_phentsize)
            if p_type == PT_LOAD:
                loads.append((p_offset, p_vaddr, p_filesz))
    sections: list[Section] = []
    if e_shnum and e_shentsize >= 64 and e_shnum < 65536:
        sh = read(e_shoff, e_shentsize * e_shnum)
        raw = [struct.unpack_from("<IIQQQQIIQ", sh, i * e_shentsize) for i in range(e_shnum)]
        names = b""
        if e_shstrndx < len(raw) and raw[e_shstrndx][5] <= (1 << 20):
            names = read(raw[e_shstrndx][4], raw[e_shstrndx][5])
        for name_off, typ, _, addr, off, sz, link, _, align in raw:
            end = names.find(b"\0", name_off)
            name = names[name_off: end].decode(errors="replace") if 0 <= name_off < len(names) and end >= 0 else ""
            sections.append(Section(name, typ, addr, off, sz, link, align))
    bid: str | None = None
    for sec in sections:
        if sec.type == SHT_NOTE and sec.size <= NOTE_SECTION_MAX_BYTES and bid is None:
            bid = build_id_note(read(sec.offset, sec.size), "<", sec.align)
    debuglink = None
    for sec in sections:
        if sec.name == ".gnu_debuglink" and 8 <= sec.size <= 4096 and sec.type != SHT_NOBITS:
            data = read(sec.offset, sec.size)
            end = data.find(b"\0")
            if end > 0:
                crc_at = (end + 4) & ~3
                if crc_at + 4 <= len(data):
                    debuglink = (data[:end].decode(errors="replace"), struct.unpack_from("<I", data, crc_at)[0])
    return ElfFile(label, size, sections, loads, bid, debuglink, read)


def build_id_note(notes: bytes, end: str, align: int) -> str | None:
    """The hex descriptor of the first NT_GNU_BUILD_ID note of owner "GNU" in a note section's
    bytes (end: struct's byte order; name and descriptor each padded to the section's alignment,
    8 when it says 8, else 4, as pyelftools reads them). None when there is none or the notes
    are cut short."""
    align = 8 if align == 8 else 4
    pos = 0
    while pos + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from(end + "III", notes, pos)
        name_at = pos + 12
        desc_at = name_at + -(-namesz // align) * align
        nxt = desc_at + -(-descsz // align) * align
        if desc_at + descsz > len(notes):
            return None
        if ntype == NT_GNU_BUILD_ID and descsz and notes[name_at:name_at + namesz].rstrip(b"\0") == b"GNU":
            return notes[desc_at:desc_at + descsz].hex()
        pos = nxt
    return None


def read_elf_fd(fd: int, label: str) -> ElfFile:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise DebugInfoError(f"{label}: not a regular file")
    return read_elf(fd_reader(fd, st.st_size, label), st.st_size, label)


def mini_debuginfo(elf: ElfFile) -> ElfFile | None:
    """The ELF file inside .gnu_debugdata (MiniDebugInfo: an xz-compressed .symtab of the static
    functions, as Fedora ships), or None."""
    sec = elf.section(".gnu_debugdata")
    if sec is None or sec.type == SHT_NOBITS or not sec.size or sec.size > DEBUGDATA_MAX_BYTES:
        return None
    dec = lzma.LZMADecompressor()
    try:
        data = dec.decompress(elf.read(sec.offset, sec.size), max_length=DEBUGDATA_MAX_BYTES)
    except lzma.LZMAError as e:
        raise DebugInfoError(f"{elf.label}: .gnu_debugdata: {e}") from None
    if not dec.eof:
        raise DebugInfoError(f"{elf.label}: .gnu_debugdata larger than {DEBUGDATA_MAX_BYTES} bytes")
    label = f"{elf.label}[.gnu_debugdata]"
    return read_elf(bytes_reader(data, label), len(data), label)


# --- separate debug files -----------------------------------------------------------------------
@dataclass
class DebugFile:
    path: str
    fd: int
    elf: ElfFile


class DebugFiles:
    """Separate debug files by build id (what gdb and elfutils look for): ROOT/.build-id/xx/rest.debug
    for each debug root, then the .gnu_debuglink name in ROOT/<the file's directory>/ and in
    <the file's directory>/.debug/. Each candidate must carry the file's build id (files without
    one: the debuglink's CRC32). Found files stay open (one descriptor each) until close()."""

    MAX_OPEN = 128

    def __init__(self, roots: Sequence[str] = DEFAULT_DEBUG_ROOTS) -> None:
        self.roots = [r.rstrip("/") or "/" for r in roots]
        self.found: OrderedDict[str, DebugFile | None] = OrderedDict()  # key (build id or path) -> file
        self.refused: list[str] = []  # why candidates were refused (status, tests; the first 32)

    def _refuse(self, msg: str) -> None:
        log.info("debug file refused: %s", msg)
        if len(self.refused) < 32:
            self.refused.append(msg)

    def find(self, elf: ElfFile, file_dir: str | None, owners: Collection[int]) -> DebugFile | None:
        """The debug file of elf (None: none found or none matched). file_dir: the directory of the
        mapped file as the process named it, when it is a path the collector may look beside
        (None: no `.debug/` lookup); owners: who may own a debug file there (root, the job's uid)."""
        key = elf.build_id or (f"link:{file_dir}/{elf.debuglink[0]}" if elf.debuglink else "")
        if not key:
            return None
        if key in self.found:
            self.found.move_to_end(key)
            return self.found[key]
        hit: DebugFile | None = None
        for path, trusted in self._candidates(elf, file_dir):
            hit = self._try(path, elf, trusted, owners)
            if hit is not None:
                break
        self.found[key] = hit
        while len(self.found) > self.MAX_OPEN:
            _, old = self.found.popitem(last=False)
            if old is not None:
                os.close(old.fd)
        return hit

    def _candidates(self, elf: ElfFile, file_dir: str | None) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        bid = elf.build_id
        if bid and len(bid) > 2 and all(c in "0123456789abcdef" for c in bid):
            out += [(f"{r}/.build-id/{bid[:2]}/{bid[2:]}.debug", True) for r in self.roots]
        if elf.debuglink is not None:
            name = elf.debuglink[0]
            if (name and "/" not in name and name not in (".", "..") and file_dir is not None
                    and file_dir.startswith("/")):
                out += [(f"{r}{file_dir}/{name}", True) for r in self.roots]
                out.append((f"{file_dir}/.debug/{name}", False))
        return out

    def _try(self, path: str, elf: ElfFile, trusted: bool, owners: Collection[int]) -> DebugFile | None:
        try:
            if trusted:
                # under a debug root: root's directories (Fedora's .build-id entries are symlinks
                # into the same tree), so links are followed; the file itself must be root's
                fd, _ = _open_trusted(path)
            else:
                fd, _ = open_user_file(path, owners=owners, max_bytes=ELF_MAX_BYTES, no_symlinks=True)
        except FileNotFoundError:
            return None
        except (OSError, UnsafeFile) as e:
            self._refuse(f"{path}: {e}")
            return None
        try:
            dbg = read_elf_fd(fd, path)
            if elf.build_id is not None:
                if dbg.build_id != elf.build_id:
                    raise DebugInfoError(f"{path}: build id {dbg.build_id}, not {elf.build_id}")
            elif elf.debuglink is None or _crc32(fd, dbg.size) != elf.debuglink[1]:
                raise DebugInfoError(f"{path}: CRC32 differs from the debuglink's")
        except (DebugInfoError, OSError) as e:
            os.close(fd)
            self._refuse(str(e))
            return None
        return DebugFile(path, fd, dbg)

    def close(self) -> None:
        for f in self.found.values():
            if f is not None:
                os.close(f.fd)
        self.found.clear()


def _open_trusted(path: str) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}, not root"
           if st.st_uid != 0 else f"{st.st_size} bytes, more than {ELF_MAX_BYTES}" if st.st_size > ELF_MAX_BYTES
           else "")
    if why:
        os.close(fd)
        raise UnsafeFile(f"{path}: {why}")
    return fd, st


def _crc32(fd: int, size: int) -> int:
    crc, off = 0, 0
    while off < size:
        chunk = os.pread(fd, min(1 << 20, size - off), off)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        off += len(chunk)
    return crc & 0xFFFFFFFF


# --- inlined frames from DWARF ------------------------------------------------------------------
class DieBudget:
    """What the inline walk may still spend in one seal (shared by every file): DWARF entries
    parsed and seconds of the walk. pyelftools parses an entry in 35-100 us here, so without a
    bound a seal that meets many compile units would take minutes; past the budget, frames are
    named by their function alone (no inlined frames)."""

    def __init__(self, dies: int = DIE_BUDGET, seconds: float = INLINE_BUDGET_S) -> None:
        self.left = dies
        self.used = 0
        self.deadline: float | None = None  # set at the first entry taken
        self.seconds = seconds
        self.exhausted = False

    def take(self, n: int) -> bool:
        if self.exhausted:
            return False
        now = time.monotonic() if self.used % 64 == 0 or n > 1 else None
        if now is not None:
            if self.deadline is None:
                self.deadline = now + self.seconds
            elif now > self.deadline:
                self.exhausted = True
                return False
        if n > self.left:
            self.exhausted = True
            return False
        self.left -= n
        self.used += n
        return True


@dataclass
class _Function:
    """One function's inlined subroutines (the subtree of its DW_TAG_subprogram)."""

    lo: np.ndarray  # [n] start of each inlined range
    hi: np.ndarray  # [n] end (exclusive)
    depth: np.ndarray  # [n] nesting: 1 = inlined into the function, 2 = into an inlined one...
    names: list[str]


@dataclass
class _Unit:
    """A compile unit's functions with code: sorted (lo, hi, DIE) and the main program's name."""

    starts: list[int]
    funcs: list[tuple[int, int, Any]]
    main: str | None = None  # Fortran: the program (DW_AT_main_subprogram) defined in this unit


class InlineIndex:
    """Inlined subroutines of one file with DWARF (the file itself or its debug file), by address.

    Only what an address needs is parsed: its compile unit (.debug_aranges, else its top entry's
    ranges), that unit's top-level functions (GCC's DW_AT_sibling lets pyelftools step over each
    function's body), and the body of the one function holding the address, once; its
    DW_TAG_inlined_subroutine entries are kept as ranges with their nesting depth and name."""

    def __init__(self, fd: int, label: str, budget: DieBudget) -> None:
        self.label = label
        self.budget = budget
        # a file description of its own (pyelftools seeks; a dup would share the offset with the
        # held descriptor, which another seal's reader may be using): reopened through our own
        # /proc/self/fd link, the same object
        self._file = os.fdopen(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), "rb")
        self._dwarf: Any = None
        self._aranges: Any = None
        self._cu_ranges: list[tuple[int, int, int]] | None = None  # (lo, hi, cu offset), no aranges
        self._units: dict[int, _Unit | None] = {}
        self._funcs: dict[int, _Function | None] = {}  # DIE offset of a subprogram -> its inlines
        self.broken: str | None = None
        self.functions_parsed = 0

    def close(self) -> None:
        self._file.close()

    def _open(self) -> bool:
        if self._dwarf is not None or self.broken:
            return self.broken is None
        from elftools.common.exceptions import ELFError, ELFParseError
        from elftools.elf.elffile import ELFFile

        try:
            elf = ELFFile(self._file)
            # no .gnu_debugaltlink (a path the file names): names only found there stay out
            self._dwarf = elf.get_dwarf_info(follow_links=False)
            self._aranges = self._dwarf.get_aranges()
        except (ELFError, ELFParseError, ValueError, KeyError, IndexError, AssertionError, TypeError) as e:
            self._broke(e)
            return False
        return True

    def _broke(self, e: Exception) -> None:
        self.broken = f"{self.label}: DWARF not read: {type(e).__name__}: {str(e)[:200]}"
        log.info("%s", self.broken)

    def _cu_offset(self, vaddr: int) -> int | None:
        if self._aranges is not None:
            off = self._aranges.cu_offset_at_addr(vaddr)
            return None if off is None else int(off)
        if self._cu_ranges is None:
            self._cu_ranges = []
            for cu in self._dwarf.iter_CUs():
                if not self.budget.take(1):
                    break
                top = cu.get_top_DIE()
                for lo, hi in _die_ranges(self._dwarf, cu, top):
                    self._cu_ranges.append((lo, hi, cu.cu_offset))
            self._cu_ranges.sort()
        i = bisect.bisect_right(self._cu_ranges, (vaddr, 1 << 64, 0)) - 1
        for j in range(i, max(i - 64, -1), -1):  # ranges of CUs may nest or overlap a little
            lo, hi, off = self._cu_ranges[j]
            if lo <= vaddr < hi:
                return off
        return None

    def _unit(self, vaddr: int) -> _Unit | None:
        off = self._cu_offset(vaddr)
        if off is None:
            return None
        if off not in self._units:
            if self.budget.exhausted:
                return None  # not parsed, not remembered as empty either
            self._units[off] = self._parse_unit(off)
        return self._units[off]

    def _parse_unit(self, off: int) -> _Unit | None:
        cu = self._dwarf.get_CU_at(off)
        funcs: list[tuple[int, int, Any]] = []
        main: str | None = None
        stack = [cu.get_top_DIE()]
        while stack:
            die = stack.pop()
            if not self.budget.take(1):
                return None
            for child in die.iter_children():
                if not self.budget.take(1):
                    return None
                tag = child.tag
                if tag == "DW_TAG_subprogram":
                    ranges = _die_ranges(self._dwarf, cu, child)
                    funcs += [(a, b, child) for a, b in ranges]
                    if ranges and "DW_AT_main_subprogram" in child.attributes and "DW_AT_name" in child.attributes:
                        main = child.attributes["DW_AT_name"].value.decode(errors="replace")
                elif tag in _SCOPES and child.has_children:
                    stack.append(child)  # namespaces, Fortran modules, classes: functions inside
        funcs.sort(key=lambda f: (f[0], f[1]))
        return _Unit([f[0] for f in funcs], funcs, main)

    def _function(self, die: Any) -> _Function | None:
        """The inlined subroutines in one function's body (parsed once)."""
        if die.offset in self._funcs:
            return self._funcs[die.offset]
        if self.budget.exhausted:
            return None
        lo: list[int] = []
        hi: list[int] = []
        depth: list[int] = []
        names: list[str] = []
        cu = die.cu
        result: _Function | None = None
        stack: list[tuple[Any, int]] = [(die, 0)]
        n = 0
        while stack:
            cur, d = stack.pop()
            n += 1
            if n > FUNCTION_DIE_MAX or not self.budget.take(1):
                break
            if cur.tag == "DW_TAG_inlined_subroutine":
                d += 1
                name = _die_name(cur)
                for a, b in _die_ranges(self._dwarf, cu, cur):
                    lo.append(a)
                    hi.append(b)
                    depth.append(d)
                    names.append(name)
            if cur.has_children and (cur is die or cur.tag in _BODY):
                stack.extend((c, d) for c in cur.iter_children())
        else:
            result = _Function(np.array(lo, np.uint64), np.array(hi, np.uint64), np.array(depth, np.int32), names)
            self.functions_parsed += 1
        self._funcs[die.offset] = result
        return result

    def _lookup(self, vaddr: int) -> tuple[_Unit | None, Any]:
        """(unit, the DW_TAG_subprogram holding vaddr or None)."""
        unit = self._unit(vaddr)
        if unit is None:
            return None, None
        i = bisect.bisect_right(unit.starts, vaddr) - 1
        for j in range(i, max(i - 8, -1), -1):
            a, b, die = unit.funcs[j]
            if a <= vaddr < b:
                return unit, die
        return unit, None

    def inlined_at(self, vaddr: int) -> list[str]:
        """Names of the inlined functions at vaddr, innermost first ([]: none, or not known)."""
        if not self._open():
            return []
        from elftools.common.exceptions import DWARFError, ELFError, ELFParseError

        try:
            _, die = self._lookup(vaddr)
            fn = self._function(die) if die is not None else None
        except (DWARFError, ELFError, ELFParseError, ValueError, KeyError, IndexError, AssertionError,
                TypeError) as e:
            self._broke(e)
            return []
        if fn is None or not len(fn.lo):
            return []
        a = np.uint64(vaddr)
        hit = np.nonzero((fn.lo <= a) & (a < fn.hi))[0]
        order = hit[np.argsort(-fn.depth[hit], kind="stable")]
        return [fn.names[i] for i in order]

    def main_program(self, vaddr: int) -> str | None:
        """The Fortran program's name when vaddr is in its main program (DW_AT_main_subprogram)."""
        if not self._open():
            return None
        from elftools.common.exceptions import DWARFError, ELFError, ELFParseError

        try:
            unit, die = self._lookup(vaddr)
        except (DWARFError, ELFError, ELFParseError, ValueError, KeyError, IndexError, AssertionError,
                TypeError) as e:
            self._broke(e)
            return None
        if unit is None or die is None or "DW_AT_main_subprogram" not in die.attributes:
            return None
        return unit.main


# entries whose children may be functions with code (a unit's top level)
_SCOPES = frozenset(("DW_TAG_namespace", "DW_TAG_module", "DW_TAG_class_type", "DW_TAG_structure_type",
                     "DW_TAG_union_type"))
# entries of a function's body whose children may hold inlined subroutines (types, variables and
# parameters are stepped over)
_BODY = frozenset(("DW_TAG_lexical_block", "DW_TAG_inlined_subroutine", "DW_TAG_try_block", "DW_TAG_catch_block"))


def _die_ranges(dwarf: Any, cu: Any, die: Any) -> list[tuple[int, int]]:
    """[lo, hi) address ranges of an entry (DW_AT_low_pc/high_pc or DW_AT_ranges)."""
    attrs = die.attributes
    if "DW_AT_ranges" in attrs:
        rl = dwarf.range_lists()
        if rl is None:
            return []
        top = cu.get_top_DIE()
        base = int(top.attributes["DW_AT_low_pc"].value) if "DW_AT_low_pc" in top.attributes else 0
        out = []
        for e in rl.get_range_list_at_offset(int(attrs["DW_AT_ranges"].value), cu=cu):
            if hasattr(e, "base_address"):
                base = int(e.base_address)
            elif e.is_absolute:
                out.append((int(e.begin_offset), int(e.end_offset)))
            else:
                out.append((base + int(e.begin_offset), base + int(e.end_offset)))
        return [(a, b) for a, b in out if b > a]
    if "DW_AT_low_pc" in attrs and "DW_AT_high_pc" in attrs:
        lo = int(attrs["DW_AT_low_pc"].value)
        hp = attrs["DW_AT_high_pc"]
        hi = int(hp.value) if hp.form == "DW_FORM_addr" or hp.form.startswith("DW_FORM_addrx") else lo + int(hp.value)
        return [(lo, hi)] if hi > lo else []
    return []


def _die_name(die: Any) -> str:
    """A function's name from its entry: the linkage name demangled (C++, Fortran modules), else
    DW_AT_name, following abstract_origin / specification (at most 6 steps)."""
    plain: str | None = None
    cur = die
    for _ in range(6):
        attrs = cur.attributes
        for key in ("DW_AT_linkage_name", "DW_AT_MIPS_linkage_name"):
            if key in attrs:
                link = attrs[key].value.decode(errors="replace")
                # C++ and Fortran module names say more than DW_AT_name (the class, namespace,
                # module); a C linkage name is an assembler label (glibc's __GI_ aliases)
                if link.startswith("_Z") or fortran_name(link):
                    return demangle(link)
        if plain is None and "DW_AT_name" in attrs:
            plain = attrs["DW_AT_name"].value.decode(errors="replace")
        nxt = None
        for key in ("DW_AT_abstract_origin", "DW_AT_specification"):
            if key in attrs:
                if attrs[key].form == "DW_FORM_GNU_ref_alt":  # in the dwz file, not followed
                    break
                nxt = cur.get_DIE_from_attribute(key)
                break
        if nxt is None:
            break
        cur = nxt
    return plain or "[inlined]"


# --- one file's names ---------------------------------------------------------------------------
class ModuleNames:
    """Names of one ELF file (by build id): its function symbols (the debug file's .symtab when the
    file has none, else its own .symtab/.dynsym, else MiniDebugInfo), inlined frames (from
    whichever of the file and its debug file has .debug_info) and its functions' starts as its CFI
    knows them (for naming the unnamed by where they are)."""

    def __init__(self, elf: ElfFile, fd: int, debug: DebugFile | None, budget: DieBudget) -> None:
        self.elf = elf
        self.debug = debug
        self.source = "symtab" if elf.has_symtab() else "dynsym"
        funcs = elf.functions()
        if debug is not None and debug.elf.has_symtab():
            try:
                dbg_funcs = debug.elf.functions((SHT_SYMTAB,))
            except DebugInfoError as e:
                log.info("%s", e)
            else:
                if len(dbg_funcs) >= len(funcs):
                    # the file's own exported names where it has them (the debug file's .symtab
                    # holds several aliases at one address: __EI_x, __GI_x, x@VERSION)
                    own = {v: (v, size, name) for v, size, name in funcs.entries}
                    funcs = FuncTable([own.get(e[0], e) for e in dbg_funcs.entries])
                    self.source = f"debug file {debug.path}"
        if self.source == "dynsym":
            try:
                mini = mini_debuginfo(elf)
            except DebugInfoError as e:
                log.info("%s", e)
                mini = None
            if mini is not None:
                extra = mini.functions((SHT_SYMTAB,))
                funcs = FuncTable(funcs.entries + [e for e in extra.entries if e[0] not in set(funcs.starts)])
                self.source = "dynsym+gnu_debugdata"
        self.funcs = funcs
        self.inline: InlineIndex | None = None
        if debug is not None and debug.elf.has_dwarf():
            self.inline = InlineIndex(debug.fd, debug.path, budget)
        elif elf.has_dwarf():
            self.inline = InlineIndex(fd, elf.label, budget)
        self._starts: np.ndarray | None = None
        self._starts_read = False

    def names(self, file_offset: int) -> list[str]:
        """Names at a file offset, innermost first: the inlined functions (if DWARF says so), then
        the function that holds the address. [] when nothing names it."""
        vaddr = self.elf.offset_to_vaddr(file_offset)
        if vaddr is None:
            return []
        name = self.funcs.function_at(vaddr)
        if name is None:
            return []
        if name == "MAIN__" and self.inline is not None:
            prog = self.inline.main_program(vaddr)
            # gfortran names a `program main` MAIN__ in DWARF too: then MAIN__ stays
            outer = f"program {prog}" if prog and prog != name else name
        else:
            outer = demangle(name)
        inner = self.inline.inlined_at(vaddr) if self.inline is not None else []
        return [*inner, outer]

    def function_start(self, file_offset: int) -> int:
        """File offset of the start of the function holding file_offset as .eh_frame_hdr lists it
        (the file's own offset when it lists none): the unnamed frames of one function share it."""
        if not self._starts_read:
            self._starts_read = True
            try:
                self._starts = self.elf.function_starts()
            except DebugInfoError:
                self._starts = None
        vaddr = self.elf.offset_to_vaddr(file_offset)
        if self._starts is None or vaddr is None or not len(self._starts):
            return file_offset
        i = int(np.searchsorted(self._starts, vaddr, side="right")) - 1
        if i < 0:
            return file_offset
        off = self.elf.vaddr_to_offset(int(self._starts[i]))
        return file_offset if off is None else off

    def close(self) -> None:
        if self.inline is not None:
            self.inline.close()


def debug_roots_from(values: Sequence[str] | None) -> tuple[str, ...]:
    """The configured debug roots (absolute paths); None: the default."""
    if values is None:
        return DEFAULT_DEBUG_ROOTS
    roots = tuple(str(v) for v in values)
    bad = [r for r in roots if not r.startswith("/")]
    if bad:
        raise DebugInfoError(f"debug roots must be absolute paths: {bad}")
    return roots


__all__ = ["DEFAULT_DEBUG_ROOTS", "DebugFiles", "DebugInfoError", "DieBudget", "ElfFile", "InlineIndex",
           "ModuleNames", "demangle", "fortran_name", "read_elf", "read_elf_fd"]
