"""The collector's BPF object loaded again without a compile: its image, kept per kernel and source.

A BCC compile costs a job's start 1 to 7 s of CPU and a child of 180 MB (docs/collector.md, "Peak
RSS"), and on a node that starts two collectors at once (the local cluster's virtual nodes, two
jobs sharing a node) both compile together, so that the probes of a short job attach after it
started. Yet the compile's output depends only on the source, the compile flags and the kernel:
every job of a node compiles the same object. So the first compile on a node also describes it
(bpf_compile.describe_image: each program's instructions, the maps its 64-bit loads name, the
tracepoint it attaches to), the collector keeps that in <state_dir>/bpf-objects/KEY.json, and the
next collectors make the same object from it with four system calls a map or program: create the
maps, put their descriptors into the programs' map loads, load the programs (the kernel's verifier
checks them as it checked BCC's), attach the tracepoint programs, write the tail calls.

KEY is a digest of the source, the flags, the program types and tail calls, the kernel (release,
build, machine, possible CPUs) and the BCC installed: a new kernel or a new BCC compiles anew. An
image that fails to load (a kernel the digest did not tell apart) is reported and the object is
compiled as before. The directory is root's, 0700, checked; an image is read only when it is a
regular file of the collector's uid (safeio.read_user_file), since what it holds is loaded into the
kernel.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

from gpuprof.collector.bpf_kernel import (
    BpfError,
    attach_tracepoint,
    create_map,
    libbpf,
    load_program,
    open_raw_tracepoint,
)
from gpuprof.collector.safeio import UnsafeFile, own_directory_problem, read_user_file

IMAGE_VERSION = 1
MAX_IMAGE_BYTES = 64 << 20
# images kept, the most recently used: one per set of modes and kernel (about 250 kB each); the
# others are removed when one is stored
KEEP_IMAGES = 16


# --- the key -----------------------------------------------------------------------------------------
def kernel_identity() -> dict[str, Any]:
    """What, besides the source and flags, decides a compile's output on this node."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            return f"unreadable: {e.strerror}"

    spec = importlib.util.find_spec("bcc")  # where BCC is, without importing it (and LLVM) here
    bcc: list[Any] = []
    if spec is not None and spec.origin:
        st = os.stat(spec.origin)
        bcc = [spec.origin, st.st_size, st.st_mtime_ns]
    return {"release": read("/proc/sys/kernel/osrelease"), "build": read("/proc/sys/kernel/version"),
            "machine": platform.machine(), "cpus": read("/sys/devices/system/cpu/possible"), "bcc": bcc}


def image_key(request: dict[str, Any]) -> str:
    """The digest an image is kept under: the compile request (source, flags, program types, tail
    calls) and kernel_identity()."""
    blob = json.dumps({"v": IMAGE_VERSION, "request": {k: request[k] for k in sorted(request) if k != "image"},
                       "kernel": kernel_identity()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# --- the directory -----------------------------------------------------------------------------------
class ImageCache:
    """KEY.json files in a root-only directory; problems go to `errors` (for the source's status)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.errors: list[str] = []

    def _dir_ok(self) -> bool:
        problem = own_directory_problem(self.dir, 0o077)
        if problem:
            self.errors.append(f"{problem}; images not used")
        return not problem

    def path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not an image key: {key!r}")
        return self.dir / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The image kept under key; None when there is none (quietly) or it is refused or broken
        (said in errors)."""
        if not self._dir_ok():
            return None
        path = self.path(key)
        try:
            data = read_user_file(str(path), owners=(os.geteuid(),), max_bytes=MAX_IMAGE_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, UnsafeFile) as e:
            self.errors.append(f"{path}: {e}")
            return None
        try:
            entry = json.loads(data)
        except ValueError as e:
            self.errors.append(f"{path}: not JSON ({e}); compiling anew")
            return None
        if not isinstance(entry, dict) or entry.get("version") != IMAGE_VERSION or entry.get("key") != key:
            self.errors.append(f"{path}: not an image of this version and key; compiling anew")
            return None
        try:
            os.utime(path)  # recently used: kept longest
        except OSError as e:
            self.errors.append(f"{path}: {e.strerror} (not marked as used)")
        return entry

    def store(self, key: str, reply: dict[str, Any]) -> bool:
        """Keep the compile's reply (maps, programs, image) under key: written aside, then renamed,
        so that a collector reading it meanwhile finds the old file or the whole new one. False
        (why in errors) when it was not kept."""
        if not isinstance(reply.get("image"), dict):
            self.errors.append(f"object not kept: {reply.get('image', 'no image in the reply')}")
            return False
        if not self._dir_ok():
            return False
        entry = {"version": IMAGE_VERSION, "key": key, "maps": reply["maps"], "programs": reply["programs"],
                 "program_errors": reply["program_errors"], "attached": reply["attached"], "image": reply["image"]}
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)
        except OSError as e:
            self.errors.append(f"{path}: {e.strerror}")
            tmp.unlink(missing_ok=True)
            return False
        self._trim()
        return True

    def _trim(self) -> None:
        kept = []
        for p in self.dir.glob("*.json"):
            try:
                kept.append((p.lstat().st_mtime_ns, p))
            except FileNotFoundError:  # another collector's trim
                continue
        for _, p in sorted(kept, reverse=True)[KEEP_IMAGES:]:
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                self.errors.append(f"{p}: not removed: {e.strerror}")

    def drop(self, key: str) -> None:
        """An image that did not load: removed, so that the next compile writes it anew."""
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as e:
            self.errors.append(f"{self.path(key)}: {e.strerror}")


# --- the load ----------------------------------------------------------------------------------------
def load_image(entry: dict[str, Any], tail_calls: list[tuple[str, int, str]]) -> tuple[dict[str, Any], list[int]]:
    """The object of an image: (reply, descriptors) as the compile child gives them (its maps, its
    programs the collector attaches, its tracepoint attachments, in that order). BpfError naming
    the map, program or tracepoint when the kernel refuses one; nothing is left open then."""
    image = entry["image"]
    made: list[int] = []
    try:
        map_fds: dict[str, int] = {}
        for m in entry["maps"]:
            map_fds[m["name"]] = fd = create_map(m["type"], m["name"], m["key_size"], m["value_size"],
                                                 m["max_entries"], m["flags"])
            made.append(fd)
        prog_fds: dict[str, int] = {}
        attachments: dict[str, int] = {}
        for prog in image["programs"]:
            fd = load_program(prog["type"], prog["name"], _with_maps(prog, map_fds), image["license"].encode(),
                              int(image["kern_version"]))
            made.append(fd)
            if prog["attach"]:  # autoloaded: attached now; the attachment holds the program
                how, point = next(iter(prog["attach"].items()))
                made.append(open_raw_tracepoint(point, fd) if how == "raw_tracepoint" else attach_tracepoint(point, fd))
                attachments[point] = made[-1]
            else:
                prog_fds[prog["name"]] = fd
        for array_name, index, prog_name in tail_calls:
            if prog_name in prog_fds and array_name in map_fds:
                key, value = ctypes.c_int(index), ctypes.c_int(prog_fds[prog_name])
                rc = libbpf().bpf_map_update_elem(map_fds[array_name], ctypes.byref(key), ctypes.byref(value), 0)
                if rc < 0:
                    raise BpfError(f"tail call {array_name}[{index}] = {prog_name}: {os.strerror(-rc)}")
        missing = [p for p in entry["programs"] if p not in prog_fds]
        missing += [t for t in entry["attached"] if t not in attachments]
        if missing:
            raise BpfError(f"the image has no program for {', '.join(missing)}")
        fds = ([map_fds[m["name"]] for m in entry["maps"]] + [prog_fds[p] for p in entry["programs"]]
               + [attachments[t] for t in entry["attached"]])
    except (BpfError, KeyError, TypeError, ValueError) as e:
        for fd in made:
            os.close(fd)
        raise BpfError(str(e) if isinstance(e, BpfError) else f"malformed image: {type(e).__name__}: {e}") from None
    held = set(fds)
    for fd in made:  # the autoloaded programs' own descriptors
        if fd not in held:
            os.close(fd)
    reply = {"maps": entry["maps"], "programs": entry["programs"], "program_errors": entry["program_errors"],
             "attached": entry["attached"]}
    return reply, fds


def _with_maps(prog: dict[str, Any], map_fds: dict[str, int]) -> bytes:
    """The program's instructions with this load's map descriptors in its map loads."""
    insns = bytearray(base64.b64decode(prog["insns"], validate=True))
    if len(insns) % 8:
        raise BpfError(f"program {prog['name']}: {len(insns)} bytes of instructions, not whole instructions")
    for index, map_name in prog["map_loads"]:
        if map_name not in map_fds or not 0 <= index < len(insns) // 8:
            raise BpfError(f"program {prog['name']}: instruction {index} names map {map_name}, not in the image")
        insns[index * 8 + 4 : index * 8 + 8] = map_fds[map_name].to_bytes(4, "little", signed=True)
    return bytes(insns)
