"""The collector's BPF object, held through file descriptors, with no BCC and no LLVM in the process.

`BpfObject.compile` runs bpf_compile.py in a child (BCC's compile, about 1 s of CPU and 200 MB at
its peak, all of it gone when the child exits) and receives the descriptors of the object's maps,
programs and tracepoint attachments; or, where an earlier collector on the node compiled the same
source for the same kernel, loads the object from the image it kept (bpf_image.py: no child, a few
milliseconds). Then, in the collector:

- maps are read and written with libbpf's low-level calls (Debian's libbpf1, which BCC's own
  package depends on): `Table`, with the subset of BCC's table interface the sources use (Key,
  Leaf, map_fd, max_entries, [], get, del, keys, items, clear, walk for stack maps);
- ring buffers are consumed with libbpf's ring_buffer (`open_ring_buffer`, `ring_buffer_consume`,
  `event` as BCC has them);
- uprobes and CPU-clock sampling are attached as BCC attaches them: one perf event each (the uprobe
  PMU, at the symbol's file offset; one software event per online CPU), the program set on it by
  ioctl. A detach closes the event.

The sources keep calling the object as they called BCC's (`hub.bpf`).
"""

from __future__ import annotations

import array
import ctypes
import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector.bpf_compile import FDS_PER_MESSAGE
from gpuprof.collector.bpf_image import ImageCache, image_key, load_image
from gpuprof.collector.bpf_kernel import (
    PERF_ATTR_FREQ,
    RING_CALLBACK,
    BpfError,
    PerfEventAttr,
    enable_with_program,
    libbpf,
    libbpf_missing,
    perf_event_open,
    uprobe_pmu,
)

COMPILE_SCRIPT = Path(__file__).resolve().with_name("bpf_compile.py")
COMPILE_TIMEOUT_S = 300.0  # a compile takes 1-3 s; a child stuck this long is killed

# linux/bpf.h, enum bpf_map_type
MAP_HASH, MAP_ARRAY, MAP_PROG_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY = 1, 2, 3, 5, 6
MAP_STACK_TRACE, MAP_LRU_HASH, MAP_LRU_PERCPU_HASH, MAP_RINGBUF = 7, 9, 10, 27
ARRAY_TYPES = (MAP_ARRAY, MAP_PERCPU_ARRAY)  # entries always there: a delete zeroes (a program array's is a delete)
PERCPU_TYPES = (MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH)


# --- BCC's type descriptions as ctypes ----------------------------------------------------------------
_SCALARS: dict[str, Any] = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "wchar_t": ctypes.c_wchar, "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "int": ctypes.c_int, "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long, "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float, "double": ctypes.c_double,
    "long double": ctypes.c_longdouble, "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2,
}


def ctype_of(desc: Any) -> Any:
    """The ctypes type of BCC's JSON description of a C type: a scalar's name, or [name, fields,
    "struct" | "struct_packed" | "union"], a field being [name, type], [name, type, [count]] (an
    array), [name, type, bits] or a nested struct."""
    if isinstance(desc, str):
        return _SCALARS[desc]
    anon: list[str] = []
    fields: list[tuple[Any, ...]] = []
    for f in desc[1]:
        if len(f) == 2:
            fields.append((f[0], ctype_of(f[1])))
        elif isinstance(f[2], list):
            fields.append((f[0], ctype_of(f[1]) * f[2][0]))
        elif isinstance(f[2], int):
            fields.append((f[0], ctype_of(f[1]), f[2]))
        elif f[2] in ("struct", "struct_packed", "union"):
            name = f[0] or f"__anon{len(anon)}"
            if not f[0]:
                anon.append(name)
            fields.append((name, ctype_of(f)))
        else:
            raise BpfError(f"a BPF map's type is not understood: {f!r}")
    kind = desc[2] if len(desc) > 2 else "struct"
    attrs: dict[str, Any] = {"_anonymous_": anon, "_fields_": fields}
    if kind == "struct_packed":
        attrs["_pack_"] = 1
    return type(str(desc[0]) or "anon", (ctypes.Union if kind == "union" else ctypes.Structure,), attrs)


# The C types BCC names for a ring buffer event's fields ("name#type").
_EVENT_TYPES: dict[str, Any] = {
    "char": ctypes.c_char, "s8": ctypes.c_char, "unsigned char": ctypes.c_ubyte, "u8": ctypes.c_ubyte,
    "u8 *": ctypes.c_char_p, "char *": ctypes.c_char_p, "short": ctypes.c_short, "s16": ctypes.c_short,
    "unsigned short": ctypes.c_ushort, "u16": ctypes.c_ushort, "int": ctypes.c_int, "s32": ctypes.c_int,
    "enum": ctypes.c_int, "unsigned int": ctypes.c_uint, "u32": ctypes.c_uint, "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong, "s64": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong, "u64": ctypes.c_ulonglong, "void *": ctypes.c_void_p,
    "__int128": ctypes.c_longlong * 2, "unsigned __int128": ctypes.c_ulonglong * 2,
}
_ARRAY_FIELD = re.compile(r"([^ ]+) ?\[([0-9]+)\]$")


def event_class(map_name: str, fields: list[str]) -> Any:
    out = []
    for f in fields:
        name, _, typ = f.partition("#")
        typ = "enum" if typ.startswith("enum ") else typ
        m = _ARRAY_FIELD.match(typ)
        try:
            out.append((name, _EVENT_TYPES[m[1]] * int(m[2]) if m else _EVENT_TYPES[typ]))
        except KeyError:
            raise BpfError(f"ring buffer {map_name}: field {name} has a type not understood: {typ}") from None
    return type(f"{map_name}_event", (ctypes.Structure,), {"_fields_": out})


def _cpu_list(path: str) -> list[int]:
    """CPUs of a sysfs list such as 0-3,8."""
    out: list[int] = []
    for part in Path(path).read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


# --- maps --------------------------------------------------------------------------------------------
class Table:
    """One map of the object. Keys and values are ctypes (Key, Leaf); a per-CPU map's value is a
    list, one per possible CPU (ints for a scalar value)."""

    def __init__(self, owner: BpfObject, spec: dict[str, Any], fd: int) -> None:
        self.owner = owner
        self.name = spec["name"]
        self._fd = fd
        self.map_type = int(spec["type"])
        self.max_entries = int(spec["max_entries"])
        self.flags = int(spec["flags"])
        # a ring buffer has neither (BCC describes none): int, as BCC's tables have
        self.Key: Any = ctype_of(spec["key_desc"]) if spec["key_desc"] is not None else ctypes.c_int
        self.Leaf: Any = ctype_of(spec["value_desc"]) if spec["value_desc"] is not None else ctypes.c_int
        if ctypes.sizeof(self.Key) != spec["key_size"] and self.map_type != MAP_RINGBUF:
            raise BpfError(f"map {self.name}: key is {spec['key_size']} bytes, its description "
                           f"{ctypes.sizeof(self.Key)}")
        self._event_fields: list[str] = spec.get("event_fields", [])
        self._ncpus = len(_cpu_list("/sys/devices/system/cpu/possible")) if self.map_type in PERCPU_TYPES else 1
        self._lib = libbpf()

    def __repr__(self) -> str:
        return f"<bpf map {self.name} fd {self._fd}{' (freed)' if self.owner.closed else ''}>"

    @property
    def map_fd(self) -> int:
        """The map's descriptor; BpfError once the object is freed: its number is closed then and
        may already name another file or map, which a late read or write would reach instead."""
        if self.owner.closed:
            raise BpfError(f"map {self.name}: its BPF object is freed")
        return self._fd

    def _raise(self, rc: int, what: str) -> None:
        raise BpfError(f"map {self.name}: {what}: {os.strerror(-rc)}")

    # values
    def _value_buffer(self) -> Any:
        if self.map_type not in PERCPU_TYPES:
            return self.Leaf()
        stride = -(-ctypes.sizeof(self.Leaf) // 8) * 8
        return (ctypes.c_uint8 * (stride * self._ncpus))()

    def _per_cpu(self, buf: Any) -> list[Any]:
        stride = -(-ctypes.sizeof(self.Leaf) // 8) * 8
        vals = [self.Leaf.from_buffer_copy(buf, i * stride) for i in range(self._ncpus)]
        return [v.value for v in vals] if issubclass(self.Leaf, ctypes._SimpleCData) else vals

    def get(self, key: Any, default: Any = None) -> Any:
        buf = self._value_buffer()
        if self._lib.bpf_map_lookup_elem(self.map_fd, ctypes.byref(key), ctypes.byref(buf)) < 0:
            return default
        return self._per_cpu(buf) if self.map_type in PERCPU_TYPES else buf

    def __getitem__(self, key: Any) -> Any:
        out = self.get(key)
        if out is None:
            raise KeyError(key)
        return out

    def __setitem__(self, key: Any, leaf: Any) -> None:
        if self.map_type in PERCPU_TYPES:
            raise BpfError(f"map {self.name}: per-CPU values are written by the BPF programs only")
        rc = self._lib.bpf_map_update_elem(self.map_fd, ctypes.byref(key), ctypes.byref(leaf), 0)
        if rc < 0:
            self._raise(rc, "update")

    def __delitem__(self, key: Any) -> None:
        """Delete a hash entry (KeyError when absent); an array's entry is set to zero."""
        if self.map_type in ARRAY_TYPES:
            self[key] = self.Leaf()
        elif self._lib.bpf_map_delete_elem(self.map_fd, ctypes.byref(key)) < 0:
            raise KeyError(key)

    def keys(self) -> Iterator[Any]:
        key, nxt = None, self.Key()
        while self._lib.bpf_map_get_next_key(self.map_fd, None if key is None else ctypes.byref(key),
                                              ctypes.byref(nxt)) == 0:
            key = self.Key.from_buffer_copy(nxt)
            yield key

    __iter__ = keys

    def items(self) -> list[tuple[Any, Any]]:
        out = []
        for k in list(self.keys()):
            v = self.get(k)
            if v is not None:  # deleted by a program between the two calls
                out.append((k, v))
        return out

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def clear(self) -> None:
        """Every entry deleted (an array's set to zero)."""
        if self.map_type in ARRAY_TYPES:
            for i in range(self.max_entries):
                self[self.Key(i)] = self.Leaf()
            return
        for k in list(self.keys()):
            self._lib.bpf_map_delete_elem(self.map_fd, ctypes.byref(k))  # gone already: fine

    # stack maps
    def walk(self, stack_id: int) -> Iterator[int]:
        """A stack map's addresses, innermost first."""
        stack = self.get(self.Key(stack_id))
        if stack is None:
            return
        for ip in stack.ip:
            if not ip:
                return
            yield int(ip)

    # ring buffers
    @functools.cached_property
    def _event(self) -> Any:
        return event_class(self.name, self._event_fields)

    def event(self, data: int) -> Any:
        """The record a ring buffer callback received, as the struct the program submitted."""
        return ctypes.cast(data, ctypes.POINTER(self._event)).contents

    def open_ring_buffer(self, callback: Callable[[Any, int, int], Any]) -> None:
        """callback(ctx, data, size) for every record, run by the object's ring_buffer_consume."""
        if self.map_type != MAP_RINGBUF:
            raise BpfError(f"map {self.name} is not a ring buffer")
        self.owner._open_ring(self, callback)


# --- the object --------------------------------------------------------------------------------------
@dataclass
class CompileCost:
    """What the compile child used, as it measured itself: its CPU and its peak resident set
    (VmHWM); and the wall time until the collector held the object. from_image: no child, the
    object was loaded from its kept image (bpf_image.py); cpu_s is then the loading thread's."""

    cpu_s: float
    peak_rss_mb: float
    wall_s: float
    from_image: bool = False


class BpfObject:
    """The maps, programs and tracepoint attachments of one compiled object, and the probes the
    collector attaches afterwards."""

    def __init__(self, reply: dict[str, Any], fds: list[int], cost: CompileCost,
                 symbol_offset: Callable[[str, str], int | None] | None = None) -> None:
        self.cost = cost
        self.image_key = ""  # the key of its kept image, when one is kept (compile's `images`)
        # (file, function) -> the function's file offset, where its uprobe goes
        self._symbol_offset = symbol_offset
        self._fds = list(fds)
        at = iter(fds)
        self.tables = {m["name"]: Table(self, m, next(at)) for m in reply["maps"]}
        self.programs = {name: next(at) for name in reply["programs"]}
        self.program_errors: dict[str, str] = dict(reply["program_errors"])
        self.attached_tracepoints = {tp: next(at) for tp in reply["attached"]}
        self._probes: dict[tuple[str, str, bool], int] = {}  # (path, symbol, return probe) -> perf event
        self._perf_events: dict[tuple[int, int], list[int]] = {}  # (type, config) -> one per CPU
        self._rings: Any = None
        self._callbacks: list[Any] = []  # the ctypes callbacks libbpf holds pointers to
        self._callback_error: BaseException | None = None
        self._lock = threading.Lock()
        # libbpf's ring_buffer is not safe for an add during a consume (another source's thread)
        self._ring_lock = threading.Lock()
        self.closed = False

    @classmethod
    def compile(cls, source: str, cflags: list[str], program_types: dict[str, str] | None = None,
                tail_calls: list[tuple[str, int, str]] | None = None,
                symbol_offset: Callable[[str, str], int | None] | None = None,
                images: ImageCache | None = None) -> BpfObject:
        """Compile `source` with BCC in a child process (bpf_compile.py) and hold what it made.
        program_types: program name -> "perf_event" | "raw_tracepoint" | ... (default "kprobe",
        which uprobes are); tail_calls: (program array, index, program) written after the load;
        symbol_offset(file, function): the function's file offset (uprobes are placed there);
        images: where compiled objects are kept (bpf_image.py): the same request on the same
        kernel loads the kept image instead of compiling (cost.from_image)."""
        why = libbpf_missing()
        if why:
            raise BpfError(why)
        calls = tail_calls or []
        request = compile_request(source, cflags, program_types, calls)
        key = image_key(request) if images is not None else ""
        if images is not None:
            entry = images.load(key)
            if entry is not None:
                t0, cpu0 = time.monotonic(), time.thread_time()
                try:
                    reply, fds = load_image(entry, calls)
                except BpfError as e:
                    images.errors.append(f"kept object {key[:12]} did not load ({e}): compiling anew")
                    images.drop(key)
                else:
                    cost = CompileCost(cpu_s=time.thread_time() - cpu0, peak_rss_mb=0.0,
                                       wall_s=time.monotonic() - t0, from_image=True)
                    obj = cls(reply, fds, cost, symbol_offset)
                    obj.image_key = key
                    return obj
            request["image"] = True
        reply, fds, wall_s = _compile_in_child(request)
        kept = images is not None and images.store(key, reply)
        cost = CompileCost(cpu_s=float(reply["cost"]["cpu_s"]), peak_rss_mb=float(reply["cost"]["peak_rss_mb"]),
                           wall_s=wall_s)
        obj = cls(reply, fds, cost, symbol_offset)
        obj.image_key = key if kept else ""
        return obj

    def __getitem__(self, name: bytes | str) -> Table:
        key = name.decode() if isinstance(name, bytes) else name
        try:
            return self.tables[key]
        except KeyError:
            raise KeyError(f"the BPF object has no map {key}") from None

    def __contains__(self, name: bytes | str) -> bool:
        return (name.decode() if isinstance(name, bytes) else name) in self.tables

    def program(self, name: bytes | str) -> int:
        """A program's descriptor; BpfError with the verifier's words when it did not load."""
        key = name.decode() if isinstance(name, bytes) else name
        if key in self.program_errors:
            raise BpfError(f"program {key} did not load: {self.program_errors[key]}")
        if key not in self.programs:
            raise BpfError(f"the BPF object has no program {key}")
        return self.programs[key]

    # uprobes
    def attach_uprobe(self, name: bytes, sym: bytes, fn_name: bytes) -> None:
        self._attach_probe(name.decode(), sym.decode(), fn_name, ret=False)

    def attach_uretprobe(self, name: bytes, sym: bytes, fn_name: bytes) -> None:
        self._attach_probe(name.decode(), sym.decode(), fn_name, ret=True)

    def detach_uprobe(self, name: bytes, sym: bytes) -> None:
        self._detach_probe(name.decode(), sym.decode(), ret=False)

    def detach_uretprobe(self, name: bytes, sym: bytes) -> None:
        self._detach_probe(name.decode(), sym.decode(), ret=True)

    def _attach_probe(self, path: str, sym: str, fn_name: bytes, ret: bool) -> None:
        prog = self.program(fn_name)
        if self._symbol_offset is None:
            raise BpfError(f"uprobe {path}:{sym}: the object was compiled without a symbol resolver")
        offset = self._symbol_offset(path, sym)
        if offset is None:
            raise BpfError(f"{path}: no function {sym}")
        pmu_type, ret_bit = uprobe_pmu()
        attr = PerfEventAttr(type=pmu_type, size=ctypes.sizeof(PerfEventAttr), sample_period=1, wakeup_events=1)
        attr.config = (1 << ret_bit) if ret else 0
        path_c = ctypes.create_string_buffer(path.encode())
        attr.config1 = ctypes.addressof(path_c)
        attr.config2 = offset
        fd = perf_event_open(attr, -1, 0, f"uprobe {path}:{sym}")
        enable_with_program(fd, prog, f"uprobe {path}:{sym}")
        with self._lock:
            old = self._probes.pop((path, sym, ret), None)
            self._probes[(path, sym, ret)] = fd
        if old is not None:
            os.close(old)

    def _detach_probe(self, path: str, sym: str, ret: bool) -> None:
        with self._lock:
            fd = self._probes.pop((path, sym, ret), None)
        if fd is None:
            raise BpfError(f"no {'return ' if ret else ''}probe on {path}:{sym}")
        os.close(fd)

    # sampling
    def attach_perf_event(self, ev_type: int, ev_config: int, fn_name: bytes, sample_period: int = 0,
                          sample_freq: int = 0) -> None:
        """The program on one event per online CPU, every sample_period events or sample_freq
        times a second."""
        prog = self.program(fn_name)
        fds: list[int] = []
        try:
            for cpu in _cpu_list("/sys/devices/system/cpu/online"):
                attr = PerfEventAttr(type=ev_type, size=ctypes.sizeof(PerfEventAttr), config=ev_config)
                if sample_freq:
                    attr.sample_period, attr.flags = sample_freq, PERF_ATTR_FREQ
                else:
                    attr.sample_period = sample_period
                fd = perf_event_open(attr, -1, cpu, f"perf event {ev_type}:{ev_config} on CPU {cpu}")
                fds.append(fd)
                enable_with_program(fd, prog, f"perf event {ev_type}:{ev_config} on CPU {cpu}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        with self._lock:
            self._perf_events.setdefault((ev_type, ev_config), []).extend(fds)

    def detach_perf_event(self, ev_type: int, ev_config: int) -> None:
        with self._lock:
            fds = self._perf_events.pop((ev_type, ev_config), [])
        for fd in fds:
            os.close(fd)

    # ring buffers
    def _open_ring(self, table: Table, callback: Callable[[Any, int, int], Any]) -> None:
        def run(ctx: Any, data: Any, size: int) -> int:
            try:
                callback(ctx, data, size)
            except BaseException as e:  # noqa: BLE001 - kept and raised by ring_buffer_consume
                if self._callback_error is None:
                    self._callback_error = e
            return 0

        cb = RING_CALLBACK(run)
        lib = libbpf()
        with self._ring_lock:
            self._callbacks.append(cb)
            if self._rings is None:
                self._rings = lib.ring_buffer__new(table.map_fd, cb, None, None)
                if not self._rings:
                    raise BpfError(f"ring buffer {table.name}: {os.strerror(ctypes.get_errno())}")
            elif lib.ring_buffer__add(self._rings, table.map_fd, cb, None) < 0:
                raise BpfError(f"ring buffer {table.name}: {os.strerror(ctypes.get_errno())}")

    def ring_buffer_consume(self) -> None:
        """Run every open ring buffer's callback on its waiting records; the first exception a
        callback raised is raised here, after the others ran."""
        with self._ring_lock:
            if self._rings is None:
                raise BpfError("no ring buffer is open")
            rc = libbpf().ring_buffer__consume(self._rings)
            err, self._callback_error = self._callback_error, None
        if err is not None:
            raise err
        if rc < 0:
            raise BpfError(f"ring buffers: {os.strerror(-rc)}")

    def cleanup(self) -> None:
        """Detach everything and close every descriptor: the kernel frees the object."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            probes = list(self._probes.values()) + [fd for fds in self._perf_events.values() for fd in fds]
            self._probes.clear()
            self._perf_events.clear()
        with self._ring_lock:
            rings, self._rings = self._rings, None
        if rings:
            libbpf().ring_buffer__free(rings)
        for fd in probes + self._fds:
            os.close(fd)
        self._callbacks.clear()


def compile_request(source: str, cflags: list[str], program_types: dict[str, str] | None,
                    tail_calls: list[tuple[str, int, str]]) -> dict[str, Any]:
    """What the compile child is asked for, and what a kept image's key digests (image_key)."""
    return {"source": source, "cflags": cflags, "program_types": program_types or {}, "tail_calls": tail_calls}


# --- the child -----------------------------------------------------------------------------------------
def _compile_in_child(request: dict[str, Any]) -> tuple[dict[str, Any], list[int], float]:
    """bpf_compile.py's reply, the descriptors it sent, and the wall time it took."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", str(COMPILE_SCRIPT), str(theirs.fileno())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(theirs.fileno(),), close_fds=True)
    finally:
        theirs.close()
    try:
        try:
            out, err = proc.communicate(json.dumps(request).encode(), timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BpfError(f"the BPF compile ({COMPILE_SCRIPT.name}) ran past {COMPILE_TIMEOUT_S:.0f} s") from None
        wall_s = time.monotonic() - t0
        try:
            reply = json.loads(out.decode() or "null")
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or "error" in reply or proc.returncode != 0:
            why = reply.get("error") if isinstance(reply, dict) else None
            text = err.decode(errors="replace")
            # clang's diagnostics are on the child's stderr: the first errors say what is wrong
            errors = [line.strip() for line in text.splitlines() if "error:" in line][:3]
            detail = "; ".join(errors) or text.strip()[-400:]
            raise BpfError(f"the BPF compile failed (exit status {proc.returncode}): "
                           f"{why or 'no reply'}{': ' + detail if detail else ''}")
        fds = _receive_fds(ours)
    finally:
        ours.close()
    want = len(reply["maps"]) + len(reply["programs"]) + len(reply["attached"])
    if len(fds) != want:
        for fd in fds:
            os.close(fd)
        raise BpfError(f"the BPF compile sent {len(fds)} descriptors for {want} maps, programs and tracepoints")
    return reply, fds, wall_s


def _receive_fds(sock: socket.socket) -> list[int]:
    """Every descriptor the child sent, in order, until it closed its end."""
    fds: list[int] = []
    while True:
        msg, anc, _flags, _addr = sock.recvmsg(4, socket.CMSG_SPACE(FDS_PER_MESSAGE * 4))
        if not msg:
            return fds
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[: len(data) - len(data) % got.itemsize])
                fds.extend(got)
