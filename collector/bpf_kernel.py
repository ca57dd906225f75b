"""The kernel's and libbpf's calls under the collector's BPF object (bpf_object.py, bpf_image.py).

libbpf (Debian's libbpf1, which BCC's own package depends on) for the maps and ring buffers; the
bpf(2) system call itself for what libbpf offers only through structs of options that change
between its versions (creating a map, loading a program, opening a raw tracepoint): the kernel's
union bpf_attr only grows, each command's fields stay where they are; perf_event_open(2) for
probes, sampling and tracepoints.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import platform
from pathlib import Path

# linux/perf_event.h
PERF_TYPE_SOFTWARE = 1
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_ATTR_FREQ = 1 << 10  # the `freq` bit of the attribute's flags
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")
PERF_TYPE_TRACEPOINT = 2
BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}
# linux/bpf.h, enum bpf_cmd
BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN = 0, 5, 17
OBJECT_NAME_LEN = 16  # BPF_OBJ_NAME_LEN, with its terminating zero
VERIFIER_LOG_BYTES = 1 << 16


class BpfError(RuntimeError):
    """The object did not compile or load, a map call failed or a probe did not attach; the message
    names the map, program or file."""


# --- libbpf ----------------------------------------------------------------------------------------
RING_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


@functools.cache
def libbpf() -> ctypes.CDLL:
    """libbpf.so.1 with the calls the collector makes. Each returns a negative errno on failure."""
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    p, i, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
    for name, args, res in (
        ("bpf_map_lookup_elem", [i, p, p], i), ("bpf_map_update_elem", [i, p, p, u64], i),
        ("bpf_map_delete_elem", [i, p], i), ("bpf_map_get_next_key", [i, p, p], i),
        ("bpf_map_lookup_batch", [i, p, p, p, p, p, p], i), ("bpf_map_update_batch", [i, p, p, p, p], i),
        ("bpf_map_delete_batch", [i, p, p, p], i),
        ("ring_buffer__new", [i, RING_CALLBACK, p, p], p), ("ring_buffer__add", [p, i, RING_CALLBACK, p], i),
        ("ring_buffer__consume", [p], i), ("ring_buffer__free", [p], None),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def libbpf_missing() -> str | None:
    """Why libbpf cannot be loaded, or None."""
    try:
        libbpf()
    except OSError as e:
        return f"cannot load libbpf.so.1 ({e}): apt-get install libbpf1"
    return None


# --- perf events -------------------------------------------------------------------------------------
class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to config2, padded to the 128 bytes of PERF_ATTR_SIZE_VER7."""

    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32),
                ("bp_type", ctypes.c_uint32), ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
                ("_rest", ctypes.c_uint8 * 56)]


@functools.cache
def uprobe_pmu() -> tuple[int, int]:
    """The uprobe PMU's type and the config bit of a return probe."""
    try:
        pmu = int((UPROBE_PMU / "type").read_text())
        fmt = (UPROBE_PMU / "format" / "retprobe").read_text().strip()  # "config:0"
    except (OSError, ValueError) as e:
        raise BpfError(f"the kernel's uprobe PMU is not usable ({e}): a kernel of 4.17 or later is needed") from None
    return pmu, int(fmt.partition(":")[2])


@functools.cache
def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, what: str) -> int:
    nr = PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise BpfError(f"{what}: perf_event_open's number on {platform.machine()} is not known")
    fd = libc().syscall(ctypes.c_long(nr), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
                      ctypes.c_int(-1), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        raise BpfError(f"{what}: perf_event_open: {os.strerror(ctypes.get_errno())}")
    return int(fd)


def enable_with_program(fd: int, prog: int, what: str) -> None:
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError as e:
        os.close(fd)
        raise BpfError(f"{what}: the program was not set on the event: {e.strerror}") from None


# --- bpf(2) --------------------------------------------------------------------------------------------
class MapCreateAttr(ctypes.Structure):
    """union bpf_attr for BPF_MAP_CREATE, up to the map's name."""

    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * OBJECT_NAME_LEN)]


class ProgLoadAttr(ctypes.Structure):
    """union bpf_attr for BPF_PROG_LOAD, up to the program's name."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * OBJECT_NAME_LEN)]


class RawTracepointAttr(ctypes.Structure):
    """union bpf_attr for BPF_RAW_TRACEPOINT_OPEN."""

    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32)]


def bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    """bpf(cmd, attr): the descriptor it returns; BpfError naming `what` on failure."""
    nr = BPF_SYSCALL.get(platform.machine())
    if nr is None:
        raise BpfError(f"{what}: the bpf system call's number on {platform.machine()} is not known")
    fd = libc().syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        raise BpfError(f"{what}: {os.strerror(ctypes.get_errno())}")
    return int(fd)


def object_name(name: str) -> bytes:
    """A map's or program's name as the kernel takes it (and as BCC gives it): the first 15 of
    its letters, digits, '_' and '.'."""
    return "".join(c for c in name if c.isalnum() or c in "_.")[: OBJECT_NAME_LEN - 1].encode()


def create_map(map_type: int, name: str, key_size: int, value_size: int, max_entries: int, flags: int) -> int:
    attr = MapCreateAttr(map_type=map_type, key_size=key_size, value_size=value_size, max_entries=max_entries,
                         map_flags=flags, map_name=object_name(name))
    return bpf(BPF_MAP_CREATE, attr, f"map {name}")


def load_program(prog_type: int, name: str, insns: bytes, license_: bytes, kern_version: int) -> int:
    """The program's descriptor; BpfError with the verifier's last words when it refuses it."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license_)
    attr = ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(code),
                        license=ctypes.addressof(lic), kern_version=kern_version, prog_name=object_name(name))
    try:
        return bpf(BPF_PROG_LOAD, attr, f"program {name}")
    except BpfError as first:
        log = ctypes.create_string_buffer(VERIFIER_LOG_BYTES)  # again, with the verifier's log
        attr.log_level, attr.log_size, attr.log_buf = 1, VERIFIER_LOG_BYTES, ctypes.addressof(log)
        try:
            return bpf(BPF_PROG_LOAD, attr, f"program {name}")
        except BpfError:
            words = log.value.decode(errors="replace").strip().splitlines()[-3:]
            raise BpfError(f"{first}{': ' + ' / '.join(words) if words else ''}") from None


def open_raw_tracepoint(name: str, prog: int) -> int:
    event = ctypes.create_string_buffer(name.encode())
    return bpf(BPF_RAW_TRACEPOINT_OPEN, RawTracepointAttr(name=ctypes.addressof(event), prog_fd=prog),
               f"raw tracepoint {name}")


TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


def attach_tracepoint(tracepoint: str, prog: int) -> int:
    """The program on a tracepoint ("category:event"), as BCC attaches it: the perf event of the
    tracepoint on CPU 0, which runs the program on every CPU; the event's descriptor holds it."""
    category, _, event = tracepoint.partition(":")
    for root in TRACEFS:
        try:
            tp_id = int((root / "events" / category / event / "id").read_text())
            break
        except (OSError, ValueError):
            continue
    else:
        raise BpfError(f"tracepoint {tracepoint}: no id under {' or '.join(map(str, TRACEFS))}")
    attr = PerfEventAttr(type=PERF_TYPE_TRACEPOINT, size=ctypes.sizeof(PerfEventAttr), config=tp_id,
                         sample_period=1, wakeup_events=1)
    fd = perf_event_open(attr, -1, 0, f"tracepoint {tracepoint}")
    enable_with_program(fd, prog, f"tracepoint {tracepoint}")
    return fd
