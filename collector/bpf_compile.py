"""The BCC compile of the collector's BPF object, in a short-lived child process.

BCC compiles with clang/LLVM linked into libbcc: importing it maps about 60 MB and a compile raises
the resident set by about 110 MB more, and neither goes away while the process lives (docs/
collector.md, "Peak RSS"). So the collector does not import BCC at all. It runs this file as a
script (`python -I bpf_compile.py SOCKET_FD`, with the request on standard input):

1. BCC compiles the source, creates its maps and attaches the tracepoint programs (BCC's autoload);
2. every other program of the object is loaded with the type the request names for it (uprobes by
   default), and the request's tail calls are written into their program arrays;
3. the reply goes to standard output, one JSON object: each map's name, type, sizes, flags and
   BCC's description of its key, value and ring buffer event; each program's name (or why it did
   not load); the attached tracepoints. The file descriptors of the maps, programs and tracepoint
   attachments go over the socket (SCM_RIGHTS), in the order the reply lists them;
4. with "image" in the request, the reply also holds what loads the same object again without a
   compile (gpuprof.collector.bpf_image): each loaded program's instructions, with the maps their
   64-bit loads name, its type and the tracepoint BCC attached it to;
5. the child exits without BCC's clean-up. The kernel objects live on through the descriptors the
   collector now holds (gpuprof.collector.bpf_object).

A failed compile gives {"error": ...} and exit status 1. This file imports only the standard
library and BCC, so that it runs as a script, from the install's own directory (-I: no current
directory, no user site, no PYTHON* variables on the path of a root process).
"""

from __future__ import annotations

import array
import base64
import ctypes
import json
import os
import socket
import sys
from typing import Any

# Program types (linux/bpf.h, enum bpf_prog_type), as the request names them.
PROGRAM_TYPES = {"kprobe": 2, "tracepoint": 5, "perf_event": 7, "raw_tracepoint": 17}
# Prefixes of the programs BCC attaches itself when it loads the object (BPF._trace_autoload).
AUTOLOADED = (b"kprobe__", b"kretprobe__", b"tracepoint__", b"raw_tracepoint__", b"kfunc__", b"kretfunc__",
              b"lsm__")
# Descriptors per message: the kernel takes at most 253 (SCM_MAX_FD).
FDS_PER_MESSAGE = 200


def _library() -> Any:
    """libbcc with the per-table functions BCC's Python module does not declare."""
    from bcc.libbcc import lib

    for name, restype in (("bpf_num_tables", ctypes.c_ulonglong), ("bpf_table_name", ctypes.c_char_p),
                          ("bpf_table_fd_id", ctypes.c_int), ("bpf_table_key_size_id", ctypes.c_size_t),
                          ("bpf_table_leaf_size_id", ctypes.c_size_t),
                          ("bpf_table_key_desc_id", ctypes.c_char_p), ("bpf_table_leaf_desc_id", ctypes.c_char_p)):
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = [ctypes.c_void_p] if name == "bpf_num_tables" else [ctypes.c_void_p, ctypes.c_ulonglong]
    return lib


def compile_object(request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Compile, load and describe; returns the reply and the descriptors it refers to, in order."""
    from bcc import BPF

    lib = _library()
    b = BPF(text=request["source"].encode(), cflags=request["cflags"])
    fds: list[int] = []
    reply: dict[str, Any] = {"maps": [], "programs": [], "program_errors": {}, "attached": []}
    module = b.module
    for i in range(lib.bpf_num_tables(module)):
        name = lib.bpf_table_name(module, i)
        fd = lib.bpf_table_fd_id(module, i)
        if fd < 0:
            continue
        event: list[str] = []
        if lib.bpf_table_type_id(module, i) == 27:  # BPF_MAP_TYPE_RINGBUF: its submitted struct's fields
            event = [lib.bpf_perf_event_field(module, name, j).decode()
                     for j in range(lib.bpf_perf_event_fields(module, name))]
        reply["maps"].append({
            "name": name.decode(), "type": lib.bpf_table_type_id(module, i),
            "key_size": lib.bpf_table_key_size_id(module, i), "value_size": lib.bpf_table_leaf_size_id(module, i),
            "max_entries": lib.bpf_table_max_entries_id(module, i), "flags": lib.bpf_table_flags_id(module, i),
            "key_desc": json.loads((lib.bpf_table_key_desc_id(module, i) or b"null").decode()),
            "value_desc": json.loads((lib.bpf_table_leaf_desc_id(module, i) or b"null").decode()),
            "event_fields": event})
        fds.append(fd)
    types = request.get("program_types", {})
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        if name.startswith(AUTOLOADED):
            continue
        try:
            fn = b.load_func(name, PROGRAM_TYPES[types.get(name.decode(), "kprobe")])
        except Exception as e:  # noqa: BLE001 - BCC raises bare Exception when the verifier refuses one
            reply["program_errors"][name.decode()] = str(e).strip()[-600:]
            continue
        reply["programs"].append(name.decode())
        fds.append(fn.fd)
    for array_name, index, prog in request.get("tail_calls", []):
        if prog in reply["program_errors"]:
            continue
        try:
            progs = b[array_name.encode()]
        except KeyError:
            reply["program_errors"][prog] = f"the object has no program array {array_name}"
            continue
        progs[ctypes.c_int(index)] = ctypes.c_int(b.funcs[prog.encode()].fd)
    for tp, fd in [*b.tracepoint_fds.items(), *b.raw_tracepoint_fds.items()]:
        reply["attached"].append(tp.decode())
        fds.append(fd)
    if request.get("image"):
        reply["image"] = describe_image(lib, b, types)
    reply["cost"] = own_cost()
    return reply, fds


# The program types of BCC's autoloaded prefixes that the image can load again, with what attaches them.
AUTOLOADED_TYPES = {b"tracepoint__": ("tracepoint", 5), b"raw_tracepoint__": ("raw_tracepoint", 17)}
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
PSEUDO_MAP_FD = 1  # its source register when the 64-bit value is a map's descriptor


def describe_image(lib: Any, b: Any, types: dict[str, str]) -> dict[str, Any] | str:
    """Everything a loader needs to make this object again without BCC: the instructions of every
    loaded program (as the kernel got them, after the load) with the map each map load names,
    and the tracepoint an autoloaded program is attached to; or why the object cannot be kept
    (a program type or a 64-bit load the image does not describe)."""
    module = b.module
    by_fd = {lib.bpf_table_fd_id(module, i): lib.bpf_table_name(module, i).decode()
             for i in range(lib.bpf_num_tables(module))}
    programs = []
    for name in b.funcs:
        attach = None
        kind = types.get(name.decode(), "kprobe")
        for prefix, (how, prog_type) in AUTOLOADED_TYPES.items():
            if name.startswith(prefix):
                event = name[len(prefix):].decode()
                # BCC's names: tracepoint__CATEGORY__EVENT, raw_tracepoint__EVENT
                attach = {how: event.replace("__", ":", 1) if how == "tracepoint" else event}
                kind = how
        if name.startswith(AUTOLOADED) and attach is None:
            return f"program {name.decode()}: autoloaded kind the image does not describe"
        size = lib.bpf_function_size(module, name)
        insns = ctypes.string_at(lib.bpf_function_start(module, name), size)
        maps = []
        at = 0
        while at + 16 <= len(insns):
            if insns[at] == LD_IMM64:
                if insns[at + 1] >> 4 == PSEUDO_MAP_FD:
                    fd = int.from_bytes(insns[at + 4 : at + 8], "little", signed=True)
                    if fd not in by_fd:
                        return f"program {name.decode()}: instruction {at // 8} loads descriptor {fd}, not a map of the object"
                    maps.append([at // 8, by_fd[fd]])
                elif insns[at + 1] >> 4:
                    return f"program {name.decode()}: instruction {at // 8}: a 64-bit load of kind {insns[at + 1] >> 4}"
                at += 16
            else:
                at += 8
        programs.append({"name": name.decode(), "type": PROGRAM_TYPES[kind], "insns": base64.b64encode(insns).decode(),
                         "map_loads": maps, "attach": attach})
    return {"license": lib.bpf_module_license(module).decode(), "kern_version": lib.bpf_module_kern_version(module),
            "programs": programs}


def own_cost() -> dict[str, float]:
    """This process's CPU seconds and peak resident set (VmHWM, MB: the collector's RUSAGE_CHILDREN
    would count the collector's own resident set at the fork in it)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": hwm / 1024}


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    request = json.load(sys.stdin)
    try:
        reply, fds = compile_object(request)
    except Exception as e:  # noqa: BLE001 - BCC raises bare Exception for compile and load failures
        json.dump({"error": str(e).strip()[-600:]}, sys.stdout)
        sys.stdout.flush()
        return 1
    for at in range(0, len(fds), FDS_PER_MESSAGE):
        part = fds[at : at + FDS_PER_MESSAGE]
        sock.sendmsg([len(part).to_bytes(4, "little")],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", part).tobytes())])
    sock.close()
    json.dump(reply, sys.stdout)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # os._exit: without BCC's atexit clean-up, which would close this process's copies of what the
    # collector now holds (the kernel keeps an object while any descriptor refers to it) and walk
    # every table for nothing.
    os._exit(main())
