"""What every eBPF source shares: is BPF usable here (and if not, why), the one BPF object of the
collector, the job's pid set in the kernel, libraries mapped into job processes, ELF symbols.

BCC itself is Debian's `python3-bpfcc` (module `bcc`). It runs only in the compile's child process
(bpf_object.py, bpf_compile.py): the collector holds the object through its descriptors, with
libbpf. A node without BCC still runs the other sources; every failure becomes a
`SourceUnavailable` whose text is also what `gpuprof doctor` prints (`bpf_doctor()`).
"""

from __future__ import annotations

import bisect
import errno
import functools
import importlib.util
import os
import platform
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from gpuprof.collector import schema
from gpuprof.collector.bpf_image import ImageCache, image_key
from gpuprof.collector.bpf_object import BpfError, BpfObject, compile_request, libbpf_missing
from gpuprof.collector.debuginfo import offset_to_vaddr, vaddr_to_offset
from gpuprof.collector.safeio import ELF_MAX_BYTES, UnsafeFile, open_user_file, read_user_file
from gpuprof.collector.schema import INTERNAL_COMM_OPS
from gpuprof.collector.sources.base import Source, SourceContext, SourceUnavailable
from gpuprof.collector.sources.probe_table import collectives_defines

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"
MAIN_SOURCE = BPF_DIR / "gpuprof.c"
OPS_HEADER = BPF_DIR / "gpuprof_ops.h"



# --- generated header ----------------------------------------------------------------------------
def ops_header() -> str:
    """bpf/gpuprof_ops.h: op numbers of the schema's enums for the C side (a test keeps it in sync)."""
    lines = [
        "/* Generated from collector/schema.py by gpuprof.collector.bpf_support.ops_header(): do not edit.",
        " * Regenerate: .venv/bin/python -m gpuprof.collector.bpf_support > bpf/gpuprof_ops.h */",
        "#ifndef GPUPROF_OPS_H",
        "#define GPUPROF_OPS_H",
    ]
    lines += [f"#define GP_OP_{name} {i}" for i, name in enumerate(schema.COLLECTIVE_OPS)]
    lines += [f"#define GP_COP_{name} {i}" for i, name in enumerate(schema.COMMUNICATOR_OPS)]
    lines += [f"#define GP_COP_{name} {i}" for name, i in INTERNAL_COMM_OPS.items()]
    lines += ["#endif", ""]
    return "\n".join(lines)


# --- can BPF run here? ---------------------------------------------------------------------------
def kernel_build_dir() -> Path:
    return Path("/lib/modules") / platform.release() / "build"


def bpf_doctor() -> list[tuple[str, bool, str]]:
    """Checks for `gpuprof doctor`: (check, ok, how to fix it when not ok)."""
    checks: list[tuple[str, bool, str]] = []
    checks.append(("running as root", os.geteuid() == 0, "the collector loads BPF programs: run it as root"))
    bcc_ok, bcc_why = _bcc_importable()
    checks.append(("BCC python module (bcc)", bcc_ok,
                   (f"{bcc_why}; apt-get install python3-bpfcc bpfcc-tools and use a venv made with "
                    "--system-site-packages (the PyPI package 'bcc' is unrelated)")))
    libbpf_why = libbpf_missing()
    checks.append(("libbpf (libbpf.so.1)", libbpf_why is None, libbpf_why or ""))
    build = kernel_build_dir()
    checks.append((f"kernel headers at {build}", (build / "include").is_dir() or (build / "Makefile").exists(),
                   ("apt-get install linux-headers-amd64, then link /lib/modules/$(uname -r)/build and "
                    "source to /usr/src/linux-headers-<ver>-amd64 and -common (etc/dev/setup.sh)")))
    checks.append(("tracefs mounted at /sys/kernel/tracing", Path("/sys/kernel/tracing/events").is_dir(),
                   "mount -t tracefs nodev /sys/kernel/tracing"))
    checks.append(("debugfs mounted at /sys/kernel/debug", os.path.ismount("/sys/kernel/debug"),
                   "mount -t debugfs nodev /sys/kernel/debug"))
    checks.append(("uprobes (uprobe_events)", Path("/sys/kernel/tracing/uprobe_events").exists(),
                   "a kernel with CONFIG_UPROBE_EVENTS=y and tracefs mounted"))
    paranoid = _read_int("/proc/sys/kernel/perf_event_paranoid")
    checks.append(("perf events (stacks sampling)", paranoid is not None,
                   "a kernel with CONFIG_PERF_EVENTS=y"))
    return checks


def bpf_unavailable_reason() -> str | None:
    """The first failed doctor check as one sentence, or None when BPF should work."""
    for name, ok, fix in bpf_doctor():
        if not ok:
            return f"BPF unavailable: {name} failed: {fix}"
    return None


def _bcc_importable() -> tuple[bool, str]:
    """Whether the compile child (bpf_compile.py) will find BCC. Only looked up: importing it here
    would map libbcc and LLVM (60 MB) into the collector, which never needs them."""
    if importlib.util.find_spec("bcc") is None:
        return False, "no module named bcc"
    return True, "ok"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# --- /proc/PID/maps ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    dev: str
    inode: int
    path: str
    perms: str


VMLINUX_BTF = "/sys/kernel/btf/vmlinux"
# bytes after the 12-byte header of a BTF type, per kind: fixed, and per vlen item
# (INT 1, ARRAY 3, STRUCT 4, UNION 5, ENUM 6, FUNC_PROTO 13, VAR 14, DATASEC 15, DECL_TAG 17, ENUM64 19)
_BTF_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0), 15: (0, 12),
              17: (4, 0), 19: (0, 12)}
_BTF_KINDS_WITHOUT_DATA = {2, 7, 8, 9, 10, 11, 12, 16, 18}


@lru_cache(maxsize=8)
def kernel_member_offset(struct_name: str, member: str, btf_path: str = VMLINUX_BTF) -> int:
    """Byte offset of a member of a kernel struct, from the running kernel's own BTF: the kernel
    headers BCC compiles against may be another build's (a struct read through them is then read at
    the wrong place). Raises OSError (no BTF) or LookupError/ValueError (not found, unknown format)."""
    data = Path(btf_path).read_bytes()
    if len(data) < 24 or int.from_bytes(data[:2], "little") != 0xEB9F:
        raise ValueError(f"{btf_path}: not little-endian BTF")
    hdr_len, type_off, type_len, str_off = (int.from_bytes(data[i:i + 4], "little") for i in (4, 8, 12, 16))
    strings = hdr_len + str_off

    def name(off: int) -> str:
        end = data.index(b"\0", strings + off)
        return data[strings + off:end].decode("ascii", "replace")

    i, end = hdr_len + type_off, hdr_len + type_off + type_len
    while i < end:
        name_off, info = int.from_bytes(data[i:i + 4], "little"), int.from_bytes(data[i + 4:i + 8], "little")
        kind, vlen, kflag = info >> 24 & 0x1F, info & 0xFFFF, info >> 31
        i += 12
        if kind == 4 and name(name_off) == struct_name:
            for j in range(vlen):
                m = i + 12 * j
                if name(int.from_bytes(data[m:m + 4], "little")) == member:
                    bits = int.from_bytes(data[m + 8:m + 12], "little")
                    return (bits & 0xFFFFFF if kflag else bits) // 8
            raise LookupError(f"{btf_path}: struct {struct_name} has no member {member}")
        if kind in _BTF_EXTRA:
            fixed, per = _BTF_EXTRA[kind]
            i += fixed + per * vlen
        elif kind not in _BTF_KINDS_WITHOUT_DATA:
            raise ValueError(f"{btf_path}: BTF type kind {kind} unknown")
    raise LookupError(f"{btf_path}: no struct {struct_name}")


_MAPS_RE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) (\S+) (\d+)\s*(.*)$")


def read_maps_text(pid: int) -> str | None:
    """/proc/PID/maps as text; None when the process is gone or its maps are not readable."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return None


def read_maps(pid: int) -> list[Mapping]:
    """The mappings of a process; [] when it is gone or not readable."""
    return parse_maps(read_maps_text(pid) or "")


def parse_maps(text: str, executable_only: bool = False) -> list[Mapping]:
    """The mappings of /proc/PID/maps text; executable_only: those with x in their permissions
    only, the others skipped before they are parsed (the CFI registration's, which read the maps
    of every new job process: hpcc's have about 400 lines, 80 of them executable)."""
    out = []
    for line in text.splitlines():
        perms = line.find(" ") + 1  # "start-end rwxp ...": the x is the third letter of the permissions
        if executable_only and line[perms + 2:perms + 3] != "x":
            continue
        m = _MAPS_RE.match(line)
        if m:
            out.append(Mapping(int(m[1], 16), int(m[2], 16), int(m[4], 16), m[5], int(m[6]), m[7], m[3]))
    return out


def path_in_root(pid: int, path: str) -> str:
    """A path of /proc/PID/maps as the process names it, inside its own root. The kernel writes a
    mapped file's path as seen from the reader's root: a process chroot'ed in this mount namespace
    (/proc/PID/root -> /srv/trixie) maps /srv/trixie/usr/bin/python3.13, which is
    /usr/bin/python3.13 inside its root; a container's files (another mount namespace, its root
    not reachable from here) are already named inside their root."""
    try:
        root = os.readlink(f"/proc/{pid}/root")
    except OSError:
        return path
    if root != "/" and root.startswith("/") and path.startswith(root + "/"):
        return path[len(root):]
    return path


def same_file_view(pid: int) -> bool:
    """Whether a path means the same file to the process as to the collector: the process's root
    is "/" and it is in the collector's mount namespace. Then attach_path needs no check per file
    (three path walks each: the store looked up 80 mapped files of every new rank that way)."""
    try:
        return (os.readlink(f"/proc/{pid}/root") == "/"
                and os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino)
    except OSError:
        return False


def attach_path(pid: int, path: str, same_view: bool = False) -> str:
    """A path through which the collector can open a library the process maps (`path` as written
    in /proc/PID/maps): the path itself when it is the same file here as inside the process's root,
    else through the process's root (a container's file system; safeio opens /proc/PID/root/...
    with RESOLVE_IN_ROOT). same_view: same_file_view(pid), asked once for all of a process's files."""
    if same_view:
        return path
    inside = path_in_root(pid, path)
    try:
        st = os.stat(path)
        pst = os.stat(f"/proc/{pid}/root{inside}")
        if (st.st_dev, st.st_ino) == (pst.st_dev, pst.st_ino):
            return path
        return f"/proc/{pid}/root{inside}"
    except OSError:
        return f"/proc/{pid}/root{inside}"


def mapped_libraries(pid: int, pattern: re.Pattern[str], maps: list[Mapping] | None = None) -> set[str]:
    """Files mapped executable by the process whose base name matches the pattern."""
    return {
        attach_path(pid, m.path)
        for m in (read_maps(pid) if maps is None else maps)
        if m.path.startswith("/") and "x" in m.perms and pattern.search(os.path.basename(m.path))
    }


def read_environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


# --- ELF symbols ---------------------------------------------------------------------------------
_SYM_DTYPE = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]
)
STT_OBJECT, STT_FUNC, STT_GNU_IFUNC = 1, 2, 10


@dataclass
class ElfSymbols:
    """Symbols of one ELF file (.symtab when present, and .dynsym), and its loadable segments."""

    path: str
    by_name: dict[str, tuple[int, int, int]]  # name -> (value, size, type)
    funcs_start: list[int] = field(default_factory=list)
    funcs: list[tuple[int, int, str]] = field(default_factory=list)  # sorted (value, size, name)
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (p_offset, p_vaddr, p_filesz)

    def offset_to_vaddr(self, off: int) -> int | None:
        return offset_to_vaddr(self.loads, off)

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        return vaddr_to_offset(self.loads, vaddr)

    def function_at(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset into it) of the function containing vaddr."""
        i = bisect.bisect_right(self.funcs_start, vaddr) - 1
        while i >= 0:
            value, size, name = self.funcs[i]
            if vaddr < value + max(size, 1):
                return name, vaddr - value
            if size:
                return None
            i -= 1
        return None


@lru_cache(maxsize=256)
def _elf_symbols_cached(path: str, key: tuple[int, int, int]) -> ElfSymbols:
    return _parse_elf(path)


def elf_symbols(path: str) -> ElfSymbols:
    """Parsed symbols of an ELF file, cached by (device, inode, mtime). Raises OSError/ValueError."""
    st = os.stat(path)
    return _elf_symbols_cached(path, (st.st_dev, st.st_ino, int(st.st_mtime_ns)))


def _parse_elf(path: str) -> ElfSymbols:
    # A file a job process maps, maybe in the user's space: no symlink anywhere on its path (a
    # container's inside its root), no FIFO, bounded (safeio).
    try:
        data = read_user_file(path, owners=None, max_bytes=ELF_MAX_BYTES, no_symlinks=True)
    except UnsafeFile as e:
        raise ValueError(str(e)) from None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a little-endian ELF64 file")
    e_phoff = int.from_bytes(data[32:40], "little")
    e_shoff = int.from_bytes(data[40:48], "little")
    e_phentsize, e_phnum = (int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little"))
    e_shentsize, e_shnum = (int.from_bytes(data[58:60], "little"), int.from_bytes(data[60:62], "little"))
    loads = []
    for i in range(e_phnum):
        ph = data[e_phoff + i * e_phentsize : e_phoff + (i + 1) * e_phentsize]
        if int.from_bytes(ph[0:4], "little") == 1:  # PT_LOAD
            loads.append((int.from_bytes(ph[8:16], "little"), int.from_bytes(ph[16:24], "little"),
                          int.from_bytes(ph[32:40], "little")))
    sections = []
    for i in range(e_shnum):
        sh = data[e_shoff + i * e_shentsize : e_shoff + (i + 1) * e_shentsize]
        sections.append((int.from_bytes(sh[4:8], "little"), int.from_bytes(sh[24:32], "little"),
                         int.from_bytes(sh[32:40], "little"), int.from_bytes(sh[40:44], "little")))
    by_name: dict[str, tuple[int, int, int]] = {}
    funcs: dict[int, tuple[int, str]] = {}
    for sh_type, sh_offset, sh_size, sh_link in sections:
        if sh_type not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        _, str_off, str_size, _ = sections[sh_link]
        strtab = data[str_off : str_off + str_size]
        syms = np.frombuffer(data, dtype=_SYM_DTYPE, count=sh_size // 24, offset=sh_offset)
        for s in syms[syms["value"] != 0]:
            end = strtab.find(b"\0", int(s["name"]))
            name = strtab[int(s["name"]) : end].decode(errors="replace")
            if not name:
                continue
            typ = int(s["info"]) & 0xF
            value, size = int(s["value"]), int(s["size"])
            by_name.setdefault(name, (value, size, typ))
            if typ in (STT_FUNC, STT_GNU_IFUNC):
                # Prefer the longer, non-versioned, non-alias name only when none was seen.
                funcs.setdefault(value, (size, name))
    ordered = sorted((v, s, n) for v, (s, n) in funcs.items())
    return ElfSymbols(path, by_name, [v for v, _, _ in ordered], ordered, loads)


def symbol_address(pid: int, path: str, name: str, maps: list[Mapping] | None = None) -> int | None:
    """Run-time address of a symbol of a library mapped into a process (e.g. ompi_mpi_comm_world)."""
    try:
        syms = elf_symbols(path)
    except (OSError, ValueError):
        return None
    sym = syms.by_name.get(name)
    if sym is None:
        return None
    # Load bias = where the segment at file offset 0 is mapped minus its link-time address; a
    # symbol in .bss lies past the file's bytes, so it is found by address, not by file offset.
    first = min(syms.loads, default=None)
    if first is None:
        return None
    real = os.path.realpath(path)
    for m in maps if maps is not None else read_maps(pid):
        if m.offset == first[0] and m.path and (m.path == path or os.path.realpath(m.path) == real
                                                or path.endswith(m.path)
                                                or path == f"/proc/{pid}/root{path_in_root(pid, m.path)}"):
            return m.start - first[1] + sym[0]
    return None


def defined_functions(path: str, names: Iterable[str]) -> set[str]:
    """Which of the names the ELF file defines (so a missing one is reported, not a failed attach)."""
    try:
        syms = elf_symbols(path).by_name
    except (OSError, ValueError):
        return set()
    return {n for n in names if n in syms and syms[n][2] in (STT_FUNC, STT_GNU_IFUNC)}


@lru_cache(maxsize=4096)
def _dynamic_functions_cached(path: str, key: tuple[int, int, int]) -> frozenset[str]:
    return frozenset(_read_function_values(path, dynamic_only=True)[0])


def dynamic_functions(path: str) -> frozenset[str]:
    """Names of the functions an ELF file exports (.dynsym), read without loading the whole file
    (a process maps hundreds of libraries, some of them gigabytes). Empty when not an ELF64 file."""
    try:
        st = os.stat(path)
        return _dynamic_functions_cached(path, (st.st_dev, st.st_ino, int(st.st_mtime_ns)))
    except (OSError, ValueError):
        return frozenset()


@lru_cache(maxsize=64)
def _function_offsets_cached(path: str, key: tuple[int, int, int]) -> dict[str, int]:
    values, loads = _read_function_values(path, dynamic_only=False)
    out = {}
    for name, value in values.items():
        off = vaddr_to_offset(loads, value)
        if off is not None:
            out[name] = off
    return out


def function_file_offset(path: str, name: str) -> int | None:
    """The file offset of a function of an ELF file (.dynsym or .symtab), where a uprobe on it is
    placed; None when the file does not define it."""
    try:
        st = os.stat(path)
        return _function_offsets_cached(path, (st.st_dev, st.st_ino, int(st.st_mtime_ns))).get(name)
    except (OSError, ValueError):
        return None


def _read_function_values(path: str, dynamic_only: bool) -> tuple[dict[str, int], list[tuple[int, int, int]]]:
    """The functions of .dynsym (and of .symtab unless dynamic_only), name -> value, and the loadable
    segments (p_offset, p_vaddr, p_filesz); only the headers and the symbol tables are read."""
    try:
        # only the headers and the symbol tables are read, so any size is fine; no symlink, no FIFO (safeio)
        fd, _ = open_user_file(path, owners=None, max_bytes=1 << 40)
    except UnsafeFile:
        return {}, []
    with os.fdopen(fd, "rb") as f:
        eh = f.read(64)
        if eh[:4] != b"\x7fELF" or eh[4] != 2 or eh[5] != 1:
            return {}, []
        e_phoff, e_shoff = int.from_bytes(eh[32:40], "little"), int.from_bytes(eh[40:48], "little")
        e_phentsize, e_phnum = int.from_bytes(eh[54:56], "little"), int.from_bytes(eh[56:58], "little")
        e_shentsize, e_shnum = int.from_bytes(eh[58:60], "little"), int.from_bytes(eh[60:62], "little")
        f.seek(e_phoff)
        raw = f.read(e_phentsize * e_phnum)
        loads = [(int.from_bytes(raw[i + 8 : i + 16], "little"), int.from_bytes(raw[i + 16 : i + 24], "little"),
                  int.from_bytes(raw[i + 32 : i + 40], "little"))
                 for i in range(0, len(raw) - e_phentsize + 1, e_phentsize)
                 if int.from_bytes(raw[i : i + 4], "little") == 1]  # PT_LOAD
        f.seek(e_shoff)
        raw = f.read(e_shentsize * e_shnum)
        secs = [(int.from_bytes(raw[i + 4 : i + 8], "little"), int.from_bytes(raw[i + 24 : i + 32], "little"),
                 int.from_bytes(raw[i + 32 : i + 40], "little"), int.from_bytes(raw[i + 40 : i + 44], "little"))
                for i in range(0, len(raw) - e_shentsize + 1, e_shentsize)]
        out: dict[str, int] = {}
        wanted = (11,) if dynamic_only else (11, 2)  # SHT_DYNSYM, SHT_SYMTAB
        for sh_type, off, size, link in secs:
            if sh_type not in wanted or link >= len(secs):
                continue
            f.seek(off)
            syms = np.frombuffer(f.read(size), dtype=_SYM_DTYPE, count=size // 24)
            f.seek(secs[link][1])
            strtab = f.read(secs[link][2])
            typ = syms["info"] & 0xF
            for s in syms[(syms["value"] != 0) & ((typ == STT_FUNC) | (typ == STT_GNU_IFUNC))]:
                end = strtab.find(b"\0", int(s["name"]))
                out.setdefault(strtab[int(s["name"]) : end].decode(errors="replace"), int(s["value"]))
        return out, loads


# --- the shared BPF object -----------------------------------------------------------------------
# BPF programs compiled for each mode (bpf/gpuprof.c includes one C file per switch).
MODE_SWITCHES: dict[str, tuple[str, ...]] = {
    "collectives": ("GP_WITH_COLLECTIVES",),
    "stacks": ("GP_WITH_STACKS", "GP_WITH_OFFCPU"),
    "kernels": ("GP_WITH_KERNELS",),
}
# sources.stacks.unwinder: "cfi" compiles the CFI walk into the stacks program (GP_WITH_CFI)
UNWINDERS = ("cfi", "frame_pointers")


def stack_unwinder(config: dict[str, Any], override: str | None = None) -> str:
    """The user-stack unwinder of the job: `override` (a source's argument) or the config's."""
    kind = override if override is not None else config["sources.stacks"]["unwinder"]
    if kind not in UNWINDERS:
        raise ValueError(f"sources.stacks.unwinder = {kind!r}: one of {', '.join(UNWINDERS)}")
    return str(kind)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def inline_includes(path: Path, seen: set[Path] | None = None) -> str:
    """The source with its local #include "x" files pasted in (each once, with #line markers).

    BCC generates tracepoint argument structs (TRACEPOINT_PROBE) and rewrites map calls only in the
    main file it compiles, so the separate C files are joined here rather than included by clang.
    """
    # `seen` holds the files of the current include chain only: a header pasted inside one
    # #ifdef GP_WITH_* block must be pasted again in the next one (its include guard keeps it once).
    seen = set() if seen is None else seen
    text = path.read_text()

    def paste(m: re.Match[str]) -> str:
        inc = (path.parent / m[1]).resolve()
        if not inc.exists():
            return m[0]
        if inc in seen:
            return ""
        body = inline_includes(inc, seen | {path})
        return f'#line 1 "{inc}"\n{body}\n#line {text.count(chr(10), 0, m.end()) + 1} "{path}"'

    return _LOCAL_INCLUDE.sub(paste, text)


# Programs that are not uprobes (the compile loads every program of the object; BCC's default type,
# kprobe, is the uprobes' type), and the tail calls the compile writes into their program arrays.
PROGRAM_TYPES = {"gp_cpu_sample": "perf_event", "gp_copy_sample": "perf_event", "gp_cfi_cont": "perf_event",
                 "gp_off_cfi_cont": "raw_tracepoint"}


def tail_calls_for(switches: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """The CFI walk's continuations (bpf/stacks.c, bpf/offcpu.c) in their program arrays."""
    if "GP_WITH_CFI" not in switches:
        return []
    out = [("gp_cfi_progs", 0, "gp_cfi_cont")]
    if "GP_WITH_OFFCPU" in switches:
        out.append(("gp_off_cfi_progs", 0, "gp_off_cfi_cont"))
    return out


def hub_compile_args(switches: tuple[str, ...], defines: dict[str, str]) -> tuple[str, list[str], dict[str, str],
                                                                                 list[tuple[str, int, str]]]:
    """What BpfObject.compile gets for the shared object of these switches: the source, its flags,
    the program types and the tail calls (BpfHub compiles it; kept_image digests the same)."""
    cflags = ([f"-I{BPF_DIR}", "-Wno-macro-redefined", "-Wno-unused-function"] + [f"-D{s}=1" for s in switches]
              + [f"-D{k}={v}" for k, v in defines.items()])
    return inline_includes(MAIN_SOURCE), cflags, PROGRAM_TYPES, tail_calls_for(switches)


def kept_image(config: dict[str, Any], modes: Iterable[str]) -> str | None:
    """The kept image (bpf_image.py) a job of `modes` would load on this node: its path, '' when
    none is kept (that job compiles; `gpuprof prepare` would keep it), None when the cache is off or
    the modes use no BPF object. Nothing is compiled or loaded."""
    images = images_dir_for(config)
    switches = hub_switches(modes, stack_unwinder(config))
    if images is None or not switches:
        return None
    path = ImageCache(images).path(image_key(compile_request(*hub_compile_args(switches, defines_of(config)(switches)))))
    return str(path) if path.is_file() else ""


def hub_switches(modes: Iterable[str], unwinder: str) -> tuple[str, ...]:
    """The compile switches of the shared object for a job of `modes` (empty: no BPF object)."""
    modes = tuple(modes)
    switches = tuple(s for m in modes for s in MODE_SWITCHES.get(m, ()))
    if "stacks" in modes and unwinder == "cfi":
        switches += ("GP_WITH_CFI",)
    return switches


class BpfHub:
    """One BPF object per collector for all BPF sources of the job: the first source to start
    compiles gpuprof.c with the switches of every BPF mode of the job (BCC, in a child process:
    bpf_object.py; each compile is about 1 s of CPU), the others reuse it; the last to stop frees it."""

    _lock = threading.Lock()
    _instance: BpfHub | None = None

    def __init__(self, switches: tuple[str, ...], defines: dict[str, str], images_dir: str | None = None) -> None:
        reason = bpf_unavailable_reason()
        if reason:
            raise SourceUnavailable(reason)
        self.switches = switches
        self.users = 0
        self.attach_lock = threading.Lock()
        self.images = ImageCache(images_dir) if images_dir else None
        try:
            self.bpf = BpfObject.compile(*hub_compile_args(switches, defines), function_file_offset, self.images)
        except BpfError as e:
            raise SourceUnavailable(f"BPF program did not load: {str(e).strip()[:300]}") from None
        self.job_pids = self.bpf[b"gp_job_pids"]
        self._known: set[int] = set()
        # State the sources of one object share (the stack store of stacks, off-CPU and kernels).
        self.shared: dict[str, Any] = {}
        # One ring_buffer consumes all ring buffers of the object, running every source's
        # callbacks: sources that read rings consume under this lock (consume_rings).
        self.ring_lock = threading.Lock()

    @classmethod
    def acquire(cls, modes: Iterable[str], defines_for: Callable[[tuple[str, ...]], dict[str, str]],
                unwinder: str, images_dir: str | None = None) -> BpfHub:
        """The shared object, compiled on first use with everything the job's modes need (`unwinder`:
        stack_unwinder's; every source passes the same, as any of them may compile first; images_dir:
        images_dir_for's, where compiled objects are kept)."""
        with cls._lock:
            if cls._instance is None:
                switches = hub_switches(modes, unwinder)
                cls._instance = BpfHub(switches, defines_for(switches), images_dir)
            cls._instance.users += 1
            return cls._instance

    def release(self) -> None:
        with BpfHub._lock:
            self.users -= 1
            if self.users <= 0 and BpfHub._instance is self:
                BpfHub._instance = None
                self.bpf.cleanup()

    def consume_rings(self) -> None:
        """Run the callbacks of every ring buffer of the object, one thread at a time."""
        with self.ring_lock:
            self.bpf.ring_buffer_consume()

    def has(self, switch: str) -> bool:
        return switch in self.switches

    def summary(self) -> dict[str, Any]:
        """For the BPF sources' `status`: what the compile child used."""
        c = self.bpf.cost
        return {"bpf_compile": {"cpu_s": round(c.cpu_s, 3), "peak_rss_mb": round(c.peak_rss_mb, 1),
                                "wall_s": round(c.wall_s, 3), "programs": len(self.bpf.programs),
                                "programs_not_loaded": sorted(self.bpf.program_errors),
                                "from_image": c.from_image,
                                "image_problems": list(self.images.errors) if self.images is not None else []}}

    def set_pids(self, pids: Iterable[int]) -> None:
        """Add the job's pids to the kernel's set (children are added there at fork). A pid is
        written once while it stays in the job's set: the BPF program deletes a pid at its exit,
        and one that left the set is forgotten here, so that a pid number used again by a new job
        process is written again. (This used to look every known pid up in the map at every
        call, two sources' drains a second: one syscall per job process each.)"""
        table = self.job_pids
        one = table.Leaf(1)
        now = set(pids)
        for pid in now - self._known:
            table[table.Key(pid)] = one
        self._known = now


def acquire_hub(modes: Iterable[str], config: dict[str, Any], unwinder: str | None = None) -> BpfHub:
    """The shared BPF object of a job of `modes`, as the node's config compiles it: every BPF
    source and `gpuprof prepare` ask through here, as whichever comes first compiles for all, and
    the image prepare keeps must be the one a job's collector looks up."""
    return BpfHub.acquire(modes, defines_of(config), stack_unwinder(config, unwinder), images_dir_for(config))


class HubSource(Source):
    """A source on the job's shared BPF object. What every such source does alike: it counts its
    drops in a per-CPU array of the object (`drops_map`, the slots `drops_slots` of it), and as the
    counters go with the object, `stop` reads them once more before it lets the object go and
    `drops` answers that value after. Subclasses take `hub` in start and undo their attaches in
    `detach`."""

    drops_map: bytes = b""
    drops_slots = slice(None)
    hub: BpfHub | None = None
    dropped_total = 0  # the counters' last value, read at stop

    def take_hub(self, ctx: SourceContext, mode: str, switch: str, what: str, unwinder: str | None = None) -> BpfHub:
        """acquire_hub's object, held as self.hub; let go again (SourceUnavailable) when it was
        compiled without `switch` (what: the part it lacks, for the message)."""
        # mode joins the job's when the source runs for another mode's sake (off-CPU in stacks'
        # object, collectives on the uprobe path)
        modes = ctx.modes if mode in ctx.modes else (*ctx.modes, mode)
        hub = self.hub = acquire_hub(modes, ctx.config, unwinder)
        if not hub.has(switch):
            self.hub = None  # not stop(): an object without the switch has none of its maps
            hub.release()
            raise SourceUnavailable(f"the shared BPF object was compiled without {what}")
        return hub

    def drops(self) -> int:
        hub = self.hub  # once: stop() may clear it meanwhile, in another thread
        if hub is None:
            return self.dropped_total
        return sum(read_ring_drops(hub.bpf[self.drops_map])[self.drops_slots])

    def summary(self) -> dict[str, Any] | None:
        hub = self.hub
        return hub.summary() if hub is not None else None

    def detach(self, hub: BpfHub) -> None:
        """Undo the source's own attaches on the object, at stop while it still holds it."""

    def stop(self) -> None:
        hub = self.hub
        if hub is None:
            return
        self.dropped_total = self.drops()
        try:
            self.detach(hub)
        finally:
            self.hub = None
            hub.release()


def images_dir_for(config: dict[str, dict[str, Any]]) -> str | None:
    """Where the node keeps its compiled BPF objects (collector.bpf_object_cache), or None."""
    state = config["paths"]["state_dir"]
    return os.path.join(str(state), "bpf-objects") if state and config["collector"]["bpf_object_cache"] else None


@functools.cache
def task_run_queue_offsets() -> tuple[int, int] | str:
    """Offsets in struct task_struct of sched_info.run_delay and sched_info.pcount (the run-queue
    counters of /proc/PID/task/TID/schedstat), from the running kernel's BTF; or why not known."""
    try:
        base = kernel_member_offset("task_struct", "sched_info")
        return (base + kernel_member_offset("sched_info", "run_delay"),
                base + kernel_member_offset("sched_info", "pcount"))
    except (OSError, LookupError, ValueError) as e:
        return f"the kernel's task_struct.sched_info is not known: {e}"


def kernel_at_least(major: int, minor: int) -> bool:
    """Whether the running kernel's release is major.minor or later."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is not None and (int(m[1]), int(m[2])) >= (major, minor)


def defines_for_all(switches: tuple[str, ...], ring_pages: int = 256) -> dict[str, str]:
    """Compile-time constants of every BPF source (the program is compiled once for all of them);
    ring_pages: sources.collectives.ring_pages, the calls ring's pages per CPU."""
    out: dict[str, str] = {}
    if "GP_WITH_COLLECTIVES" in switches:
        out.update(collectives_defines())
        pages = ring_pages * (os.cpu_count() or 1)
        out["GP_CALLS_PAGES"] = str(1 << max(0, pages - 1).bit_length())  # a power of two
    if "GP_WITH_CFI" in switches and kernel_at_least(5, 5):
        out["GP_CFI_ROWS_MMAPABLE"] = "1"  # BPF_F_MMAPABLE arrays came with 5.5
    offsets = task_run_queue_offsets()
    if "GP_WITH_OFFCPU" in switches and not isinstance(offsets, str):
        out["GP_TASK_RUN_DELAY"], out["GP_TASK_PCOUNT"] = str(offsets[0]), str(offsets[1])
    return out


def defines_of(config: dict[str, Any]) -> Callable[[tuple[str, ...]], dict[str, str]]:
    """defines_for_all with the node's config: every BPF source passes this to BpfHub.acquire, as
    whichever starts first compiles the object for all of them."""
    return functools.partial(defines_for_all, ring_pages=int(config["sources.collectives"]["ring_pages"]))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def read_ring_drops(table: Any) -> list[int]:
    """Sum a BPF_PERCPU_ARRAY of u64 counters over CPUs."""
    return [int(sum(v)) for _, v in sorted(table.items(), key=lambda kv: kv[0].value)]


if __name__ == "__main__":
    print(ops_header(), end="")


def attach_symbols(hub: BpfHub, path: str, symbols: Iterable[str], attached: set[tuple[str, str]],
                   attach: Callable[[Any, bytes, bytes], None], report: Callable[[str], None]) -> list[str]:
    """Attach probes to each symbol of the file not attached yet, under the hub's lock; `attach(bpf,
    path, sym)` attaches the probes of one symbol. A symbol that fails is reported and skipped, the
    others go on. Returns the symbols attached now (and adds them to `attached`)."""
    done = []
    with hub.attach_lock:
        for sym in symbols:
            if (path, sym) in attached:
                continue
            try:
                attach(hub.bpf, path.encode(), sym.encode())
            except BpfError as e:
                report(f"attach {sym} in {path}: {e}"[:230])
                continue
            attached.add((path, sym))
            done.append(sym)
    return done


def detach_symbols(hub: BpfHub, attached: set[tuple[str, str]], detach: Callable[[Any, bytes, bytes], None]) -> None:
    """The inverse of attach_symbols: `detach(bpf, path, sym)` for every attached symbol, best
    effort (a probe that is not there is skipped); `attached` is emptied."""
    for path, sym in sorted(attached):
        try:
            detach(hub.bpf, path.encode(), sym.encode())
        except BpfError:  # not attached: nothing to detach
            continue
    attached.clear()
