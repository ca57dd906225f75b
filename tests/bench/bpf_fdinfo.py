"""The BPF objects a process holds, as the kernel describes them (/proc/PID/fdinfo): for the benches
that account for a collector from outside it (its maps' kernel memory, its programs' run time)."""

from __future__ import annotations

import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)


def bpf_fdinfos(pid: int, kind: str) -> list[dict[str, str]]:
    """The fdinfo fields of each descriptor of `kind` ("map", "prog" or "link") the process holds, values
    stripped; [] when the process is gone. Descriptors closed meanwhile are left out."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    inode = "anon_inode:bpf_link" if kind == "link" else f"anon_inode:bpf-{kind}"  # the kernel's names
    out = []
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != inode:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                out.append({k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)})
        except OSError:
            continue
    return out


_SYS_BPF = 321  # x86_64
_BPF_PROG_GET_FD_BY_ID = 13


def program_fdinfo(prog_id: int) -> dict[str, str]:
    """The fdinfo fields of the program with this id, through a descriptor of this process's own
    (root): for a program a process holds only through a link (a raw tracepoint BCC attached, whose
    link names its prog_id), whose own descriptor it may not keep. {} when the program is gone."""
    attr = ctypes.create_string_buffer(struct.pack("=III", prog_id, 0, 0), 128)
    fd = _libc.syscall(_SYS_BPF, _BPF_PROG_GET_FD_BY_ID, attr, 128)
    if fd < 0:
        return {}
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    finally:
        os.close(fd)
