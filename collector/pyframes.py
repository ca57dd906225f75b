"""Python frames of job processes: CPython's layouts per version, finding the interpreter in a
process, and naming the (code object, instruction) pairs that bpf/pyframes.h records.

The BPF side walks the sampled thread's interpreter frames with the offsets of one `PyLayout`
(written per pid into gp_py_procs) and records, innermost first, the address of each frame's code
object and its instruction (a pointer into the bytecode, or an index on 3.10), with a boundary
entry where one C-level call of the evaluation loop ends. This module turns those into
(function, file, line), reading the process's memory with process_vm_readv once per code object
(cached per pid and code address, bounded).

Layouts are data, one table per version (x86-64, default builds, not free-threaded):
* 3.10, 3.11, 3.12: offsetof() over each version's own headers (Debian 12's python3.11-dev; pyenv's
  builds 3.10.13, 3.11.7 and 3.12.1 under /root/.pyenv/versions, whose include/ has the internal
  headers), checked by tests that compile them; tested on Debian 12's python3.11
  (tests/test_python_stacks.py) and on pyenv's builds, which map libpython3.X.so
  (tests/test_python_stacks_pyenv.py: frames of four threads of a blocked program read with the
  layout, programs sampled by BPF in one and three threads);
* 3.13: read from the process itself (_Py_DebugOffsets at the start of _PyRuntime, cookie
  "xdebugpy": all 72 fields, in 3.13's order, compared with Debian 13's 3.13.5 header by hand and
  with pyenv's 3.13.0 header by offsetof()); tested on Debian 13's python3.13 in a trixie root made
  by `make setup`, run with chroot (tests/test_python_stacks_313.py), and on pyenv's 3.13.0
  (tests/test_python_stacks_pyenv.py), with the same checks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from gpuprof.collector.bpf_support import Mapping, attach_path, elf_symbols, read_maps, symbol_address

NONE = 0xFFFF  # GP_PY_NONE: a field the version does not have
LAST_OF_CALL = 1 << 63  # GP_PY_LAST_OF_CALL: in a recorded instr, the last frame of its C-level call
FRAME_OWNED_BY_CSTACK = 3  # 3.12+: the evaluation loop's entry frame (no code of the program)
MAX_NAME_CHARS = 1024
MAX_LINETABLE_BYTES = 1 << 20
MAX_CODES_PER_PID = 65536  # names cached per process; the cache is emptied past this
UNKNOWN_FRAME = ("[unknown]", "", 0)


class PyReadError(OSError):
    """The process's memory could not be read at an address (gone, unmapped, freed object)."""


@dataclass(frozen=True)
class PyLayout:
    version: tuple[int, int]
    tested: bool
    # _PyRuntime -> interpreters -> thread states -> frames (bpf/pyframes.h struct gp_py_proc)
    runtime_interp_head: int
    interp_next: int
    interp_threads_head: int
    tstate_next: int
    tstate_thread_id: int
    tstate_frame: int
    cframe_frame: int
    frame_code: int
    frame_previous: int
    frame_instr: int
    frame_owner: int
    frame_is_entry: int
    thread_id_is_pthread: bool
    instr_is_index: bool
    boundary_each_frame: bool
    # read in user space
    code_filename: int
    code_name: int  # co_qualname where the version has it, else co_name
    code_linetable: int
    code_firstlineno: int
    code_adaptive: int  # offset of the inline bytecode (3.11+); 0 on 3.10 (instr is an index)
    unicode_ascii_size: int  # sizeof(PyASCIIObject)
    unicode_compact_size: int  # sizeof(PyCompactUnicodeObject)
    linetable: str  # "3.10": (bytecode delta, line delta) pairs; "3.11": the location table
    # the GIL the thread runs under (bpf/pyframes.h gp_py_gil): 3.10/3.11 one per process, at this
    # offset of _PyRuntime (ceval.gil); 3.12+ one per interpreter, through tstate->interp->ceval.gil
    gil_runtime: int = NONE
    tstate_interp: int = NONE
    interp_ceval_gil: int = NONE
    gil_holder: int = NONE  # offsetof(struct _gil_runtime_state, last_holder)
    gil_locked: int = NONE  # offsetof(struct _gil_runtime_state, locked)


LAYOUTS: dict[tuple[int, int], PyLayout] = {
    (3, 10): PyLayout(
        (3, 10), True, runtime_interp_head=32, interp_next=0, interp_threads_head=8, tstate_next=8,
        tstate_thread_id=176, tstate_frame=24, cframe_frame=NONE, frame_code=32, frame_previous=24,
        frame_instr=96, frame_owner=NONE, frame_is_entry=NONE, thread_id_is_pthread=True, instr_is_index=True,
        boundary_each_frame=True, code_filename=104, code_name=112, code_linetable=120, code_firstlineno=40,
        code_adaptive=0, unicode_ascii_size=48, unicode_compact_size=72, linetable="3.10",
        gil_runtime=352, gil_holder=8, gil_locked=16),
    (3, 11): PyLayout(
        (3, 11), True, runtime_interp_head=40, interp_next=0, interp_threads_head=16, tstate_next=8,
        tstate_thread_id=160, tstate_frame=56, cframe_frame=8, frame_code=32, frame_previous=48,
        frame_instr=56, frame_owner=NONE, frame_is_entry=68, thread_id_is_pthread=False, instr_is_index=False,
        boundary_each_frame=False, code_filename=112, code_name=128, code_linetable=136, code_firstlineno=72,
        code_adaptive=184, unicode_ascii_size=48, unicode_compact_size=72, linetable="3.11",
        gil_runtime=360, gil_holder=8, gil_locked=16),
    (3, 12): PyLayout(
        (3, 12), True, runtime_interp_head=40, interp_next=0, interp_threads_head=72, tstate_next=8,
        tstate_thread_id=144, tstate_frame=56, cframe_frame=0, frame_code=0, frame_previous=8,
        frame_instr=56, frame_owner=70, frame_is_entry=NONE, thread_id_is_pthread=False, instr_is_index=False,
        boundary_each_frame=False, code_filename=112, code_name=128, code_linetable=136, code_firstlineno=68,
        code_adaptive=192, unicode_ascii_size=40, unicode_compact_size=56, linetable="3.11",
        tstate_interp=16, interp_ceval_gil=384, gil_holder=8, gil_locked=16),
}

# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h): u64 fields, in this order, after
# the 8-byte cookie. Each name is "struct.field"; the ones used here are looked up by name.
_DEBUG_OFFSETS_313 = (
    "version", "free_threaded",
    "runtime_state.size", "runtime_state.finalizing", "runtime_state.interpreters_head",
    "interpreter_state.size", "interpreter_state.id", "interpreter_state.next",
    "interpreter_state.threads_head", "interpreter_state.gc", "interpreter_state.imports_modules",
    "interpreter_state.sysdict", "interpreter_state.builtins", "interpreter_state.ceval_gil",
    "interpreter_state.gil_runtime_state", "interpreter_state.gil_runtime_state_enabled",
    "interpreter_state.gil_runtime_state_locked", "interpreter_state.gil_runtime_state_holder",
    "thread_state.size", "thread_state.prev", "thread_state.next", "thread_state.interp",
    "thread_state.current_frame", "thread_state.thread_id", "thread_state.native_thread_id",
    "thread_state.datastack_chunk", "thread_state.status",
    "interpreter_frame.size", "interpreter_frame.previous", "interpreter_frame.executable",
    "interpreter_frame.instr_ptr", "interpreter_frame.localsplus", "interpreter_frame.owner",
    "code_object.size", "code_object.filename", "code_object.name", "code_object.qualname",
    "code_object.linetable", "code_object.firstlineno", "code_object.argcount",
    "code_object.localsplusnames", "code_object.localspluskinds", "code_object.co_code_adaptive",
    "pyobject.size", "pyobject.ob_type",
    "type_object.size", "type_object.tp_name", "type_object.tp_repr", "type_object.tp_flags",
    "tuple_object.size", "tuple_object.ob_item", "tuple_object.ob_size",
    "list_object.size", "list_object.ob_item", "list_object.ob_size",
    "dict_object.size", "dict_object.ma_keys", "dict_object.ma_values",
    "float_object.size", "float_object.ob_fval",
    "long_object.size", "long_object.lv_tag", "long_object.ob_digit",
    "bytes_object.size", "bytes_object.ob_size", "bytes_object.ob_sval",
    "unicode_object.size", "unicode_object.state", "unicode_object.length", "unicode_object.asciiobject_size",
    "gc.size", "gc.collecting",
)
# Where read_unicode and read_bytes_object look in a str and a bytes object (the same on 3.10-3.13);
# a 3.13 process whose debug offsets say otherwise is refused rather than misread.
_OBJECT_FIELDS_313 = {"unicode_object.length": 16, "unicode_object.state": 32, "bytes_object.ob_size": 16,
                      "bytes_object.ob_sval": 32}
DEBUG_COOKIE = b"xdebugpy"


def layout_from_debug_offsets(raw: bytes) -> PyLayout:
    """The layout of a 3.13 process from its _Py_DebugOffsets (raw: the struct's first bytes).
    Raises ValueError when the cookie or the version is not 3.13's, or the build is free-threaded."""
    if raw[:8] != DEBUG_COOKIE:
        raise ValueError(f"_PyRuntime does not start with the {DEBUG_COOKIE!r} cookie")
    n = len(_DEBUG_OFFSETS_313)
    if len(raw) < 8 + 8 * n:
        raise ValueError(f"_Py_DebugOffsets: {len(raw)} bytes read, {8 + 8 * n} needed")
    vals = dict(zip(_DEBUG_OFFSETS_313, struct.unpack_from(f"<{n}Q", raw, 8), strict=True))
    version = vals["version"]
    major, minor = version >> 24 & 0xFF, version >> 16 & 0xFF
    if (major, minor) != (3, 13):
        raise ValueError(f"_Py_DebugOffsets of Python {major}.{minor}; only 3.13's field order is known")
    if vals["free_threaded"]:
        raise ValueError("free-threaded CPython: its frame layout is not supported")
    for name, want in _OBJECT_FIELDS_313.items():
        if vals[name] != want:
            raise ValueError(f"_Py_DebugOffsets: {name} is {vals[name]}, the str/bytes reader expects {want}")
    ascii_size = vals["unicode_object.asciiobject_size"]
    return PyLayout(
        (3, 13), True, runtime_interp_head=vals["runtime_state.interpreters_head"],
        interp_next=vals["interpreter_state.next"], interp_threads_head=vals["interpreter_state.threads_head"],
        tstate_next=vals["thread_state.next"], tstate_thread_id=vals["thread_state.native_thread_id"],
        tstate_frame=vals["thread_state.current_frame"], cframe_frame=NONE,
        frame_code=vals["interpreter_frame.executable"], frame_previous=vals["interpreter_frame.previous"],
        frame_instr=vals["interpreter_frame.instr_ptr"], frame_owner=vals["interpreter_frame.owner"],
        frame_is_entry=NONE, thread_id_is_pthread=False, instr_is_index=False, boundary_each_frame=False,
        code_filename=vals["code_object.filename"], code_name=vals["code_object.qualname"],
        code_linetable=vals["code_object.linetable"], code_firstlineno=vals["code_object.firstlineno"],
        code_adaptive=vals["code_object.co_code_adaptive"], unicode_ascii_size=ascii_size,
        unicode_compact_size=ascii_size + 16,  # PyCompactUnicodeObject: + utf8_length, utf8
        linetable="3.11", tstate_interp=vals["thread_state.interp"],
        interp_ceval_gil=vals["interpreter_state.ceval_gil"],
        gil_holder=_gil_field(vals, "holder"), gil_locked=_gil_field(vals, "locked"))


def _gil_field(vals: dict[str, int], field: str) -> int:
    """A field's offset in struct _gil_runtime_state, from where 3.13's debug offsets put it in the
    interpreter's own GIL (_gil); NONE (no GIL read) when that is not inside the struct."""
    off = vals[f"interpreter_state.gil_runtime_state_{field}"] - vals["interpreter_state.gil_runtime_state"]
    return off if 0 <= off < 256 else NONE


# --- reading another process's memory --------------------------------------------------------------
class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                              ctypes.c_ulong, ctypes.c_ulong]


class ProcessMemory:
    """Reads of a live process's memory (process_vm_readv: no ptrace stop, the process runs on)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, addr: int, size: int) -> bytes:
        if addr <= 0 or size <= 0:
            raise PyReadError(errno.EFAULT, f"pid {self.pid}: no memory at {addr:#x}")
        buf = ctypes.create_string_buffer(size)
        local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), size)
        remote = _IoVec(ctypes.c_void_p(addr), size)
        n = _process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n != size:
            err = ctypes.get_errno() if n < 0 else errno.EFAULT
            raise PyReadError(err, f"pid {self.pid}: {size} bytes at {addr:#x} not readable "
                                   f"({os.strerror(err)})")
        return buf.raw

    def u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def i32(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 4), "little", signed=True)


# --- finding the interpreter of a process -----------------------------------------------------------
_INTERP_FILE = re.compile(r"^(?:lib)?python(\d)\.(\d+)[a-z]*(?:\.so[.\d]*|-.*)?$")


@dataclass(frozen=True)
class PyProcess:
    pid: int
    path: str  # the ELF file that holds _PyRuntime (the executable or libpython)
    runtime: int  # run-time address of _PyRuntime
    layout: PyLayout
    eval_ranges: tuple[tuple[int, int], ...]  # file offsets of _PyEval_EvalFrameDefault (and .cold) in path


def named_like_interpreter(path: str) -> bool:
    """The file's name is one an interpreter's executable or libpython has (python3.10,
    libpython3.12.so.1.0), whatever it holds."""
    return _INTERP_FILE.match(os.path.basename(path)) is not None


class NotPython(LookupError):
    """The process runs no CPython this module knows (the message says what was found)."""


def find_interpreter(pid: int, maps: list[Mapping] | None = None) -> PyProcess:
    """The CPython interpreter of a process: the mapped file (executable or libpython) that defines
    _PyRuntime, its version and layout. Raises NotPython."""
    maps = read_maps(pid) if maps is None else maps
    seen: set[str] = set()
    for m in maps:
        base = os.path.basename(m.path)
        if "x" not in m.perms or not m.path.startswith("/") or m.path in seen:
            continue
        match = _INTERP_FILE.match(base)
        if not match:
            continue
        seen.add(m.path)
        path = attach_path(pid, m.path)  # the process's own file (a container's, through its root)
        runtime = symbol_address(pid, path, "_PyRuntime", maps)
        if runtime is None:
            continue
        mem = ProcessMemory(pid)
        version = (int(match[1]), int(match[2]))
        py_version = symbol_address(pid, path, "Py_Version", maps)  # 3.11+: PY_VERSION_HEX
        if py_version is not None:
            hexv = int.from_bytes(mem.read(py_version, 4), "little")
            version = (hexv >> 24 & 0xFF, hexv >> 16 & 0xFF)
        if version >= (3, 13):
            layout = layout_from_debug_offsets(mem.read(runtime, 8 + 8 * len(_DEBUG_OFFSETS_313)))
        elif version in LAYOUTS:
            layout = LAYOUTS[version]
        else:
            raise NotPython(f"pid {pid}: Python {version[0]}.{version[1]} in {m.path}; frames known for 3.10-3.13")
        return PyProcess(pid, path, runtime, layout, eval_ranges(path))
    raise NotPython(f"pid {pid}: no mapped python executable or libpython defines _PyRuntime")


def eval_ranges(path: str) -> tuple[tuple[int, int], ...]:
    """File offset ranges of the evaluation loop's function (GCC may split a .cold part)."""
    syms = elf_symbols(path)
    out = []
    for name, (value, size, _) in syms.by_name.items():
        if name == "_PyEval_EvalFrameDefault" or name.startswith("_PyEval_EvalFrameDefault."):
            off = syms.vaddr_to_offset(value)
            if off is not None:
                out.append((off, off + max(size, 1)))
    return tuple(sorted(set(out)))


# --- naming code objects ------------------------------------------------------------------------------
def read_unicode(mem: ProcessMemory, addr: int, layout: PyLayout) -> str:
    """A str object of the process (compact strings: what code objects hold)."""
    head = mem.read(addr, layout.unicode_ascii_size)
    length = int.from_bytes(head[16:24], "little")
    state = int.from_bytes(head[32:36], "little")
    kind, compact, ascii_ = state >> 2 & 7, state >> 5 & 1, state >> 6 & 1
    if not compact or kind not in (1, 2, 4):
        raise PyReadError(errno.EINVAL, f"pid {mem.pid}: str at {addr:#x} is not a compact string")
    n = min(length, MAX_NAME_CHARS)
    data_at = addr + (layout.unicode_ascii_size if ascii_ else layout.unicode_compact_size)
    raw = mem.read(data_at, n * kind) if n else b""
    codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
    return raw.decode(codec, errors="replace")


def read_bytes_object(mem: ProcessMemory, addr: int) -> bytes:
    size = int.from_bytes(mem.read(addr + 16, 8), "little")  # ob_size; the bytes start at 32
    if size > MAX_LINETABLE_BYTES:
        raise PyReadError(errno.EFBIG, f"pid {mem.pid}: bytes object at {addr:#x} of {size} bytes")
    return mem.read(addr + 32, size) if size else b""


def line_of(linetable: bytes, firstlineno: int, index: int, fmt: str) -> int:
    """Source line of instruction `index` (code units) from a code object's co_linetable; 0 = none."""
    return _line_310(linetable, firstlineno, index * 2) if fmt == "3.10" else _line_311(linetable, firstlineno, index)


def _line_310(table: bytes, line: int, target: int) -> int:
    # (bytecode byte delta, signed line delta) pairs; a line delta of -128 = no line for the range
    start = 0
    for i in range(0, len(table) - 1, 2):
        sdelta, ldelta = table[i], table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
        this = 0 if ldelta == -128 else line + ldelta
        if ldelta != -128:
            line += ldelta
        if start <= target < start + sdelta:
            return this
        start += sdelta
    return 0


def _line_311(table: bytes, line: int, target: int) -> int:
    # PEP 657 location table: entries of (1xxxxlll: kind x, length l+1 code units) and their data
    i, unit = 0, 0
    n = len(table)

    def varint() -> int:
        nonlocal i
        b = table[i]
        i += 1
        val, shift = b & 63, 6
        while b & 64 and i < n:
            b = table[i]
            i += 1
            val |= (b & 63) << shift
            shift += 6
        return val

    while i < n:
        first = table[i]
        i += 1
        kind, length = first >> 3 & 15, (first & 7) + 1
        this: int | None
        if kind == 15:  # no location
            this = None
        elif kind == 14:  # long form: line delta, end line, column, end column
            u = varint()
            line += -(u >> 1) if u & 1 else u >> 1
            this = line
            varint()
            varint()
            varint()
        elif kind == 13:  # no column
            u = varint()
            line += -(u >> 1) if u & 1 else u >> 1
            this = line
        elif kind >= 10:  # one line: delta kind-10, then column and end column bytes
            line += kind - 10
            this = line
            i += 2
        else:  # short form: same line, one byte of columns
            this = line
            i += 1
        if unit <= target < unit + length:
            return this or 0
        unit += length
    return 0


@dataclass
class _Code:
    name: str
    filename: str
    firstlineno: int
    linetable: bytes


class PyFrameNamer:
    """(function, file, line) of the (code, instr) pairs of one process, code objects read once."""

    def __init__(self, proc: PyProcess) -> None:
        self.proc = proc
        self.mem = ProcessMemory(proc.pid)
        self.codes: dict[int, _Code | None] = {}
        self.read_errors = 0

    def _code(self, addr: int) -> _Code | None:
        if addr in self.codes:
            return self.codes[addr]
        if len(self.codes) >= MAX_CODES_PER_PID:
            self.codes.clear()
        lay = self.proc.layout
        code: _Code | None
        try:
            name = read_unicode(self.mem, self.mem.u64(addr + lay.code_name), lay)
            filename = read_unicode(self.mem, self.mem.u64(addr + lay.code_filename), lay)
            first = self.mem.i32(addr + lay.code_firstlineno)
            table = read_bytes_object(self.mem, self.mem.u64(addr + lay.code_linetable))
            code = _Code(name, filename, first, table)
        except PyReadError:
            self.read_errors += 1
            code = None  # freed or never a code object: named [unknown], not retried
        self.codes[addr] = code
        return code

    def name(self, code_addr: int, instr: int) -> tuple[str, str, int]:
        """(qualified function name, file, line; 0 = not known) of one recorded frame."""
        code = self._code(code_addr)
        if code is None:
            return UNKNOWN_FRAME
        lay = self.proc.layout
        index = instr if lay.instr_is_index else (instr - code_addr - lay.code_adaptive) // 2
        line = line_of(code.linetable, code.firstlineno, index, lay.linetable) if index >= 0 else 0
        return code.name, code.filename, line or code.firstlineno

    def chunks(self, entries: Iterable[tuple[int, int]]) -> list[list[tuple[str, str, int]]]:
        """The recorded entries (innermost first) as runs of frames, one per C-level call of the
        evaluation loop (a run ends at an entry frame, code 0, or after a frame marked
        LAST_OF_CALL)."""
        out: list[list[tuple[str, str, int]]] = [[]]
        for code, instr in entries:
            if code == 0:
                if out[-1]:
                    out.append([])
                continue
            out[-1].append(self.name(code, instr & ~LAST_OF_CALL))
            if instr & LAST_OF_CALL:
                out.append([])
        return [c for c in out if c]


def frame_label(name: str, filename: str, line: int) -> str:
    """The name of a Python frame in /stacks/symbols: `py::function (file:line)`. Python's own
    perf maps (-X perf) name frames `py::function:file`; the prefix is the same, and the line is
    the sampled one."""
    if not filename:
        return f"py::{name[:60]}"  # [unknown]: the code object could not be read
    if len(filename) > 120:  # names are cut at 200 bytes: keep the file's end and the line
        filename = "..." + filename[-117:]
    return f"py::{name[:60]} ({filename}:{line})" if line else f"py::{name[:60]} ({filename})"
