"""The BPF objects a process holds, as the kernel describes them (/proc/PID/fdinfo): for the benches
that account for a collector from outside it (its maps' kernel memory, its programs' run time)."""

from __future__ import annotations

import os


def bpf_fdinfos(pid: int, kind: str) -> list[dict[str, str]]:
    """The fdinfo fields of each descriptor of `kind` ("map" or "prog") the process holds, values
    stripped; [] when the process is gone. Descriptors closed meanwhile are left out."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"anon_inode:bpf-{kind}":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                out.append({k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)})
        except OSError:
            continue
    return out
