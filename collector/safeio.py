"""Reading files that users control, as root: never through a symlink, never blocking, bounded.

The collector runs as root and reads a few files that live in the job user's space: the perf maps
of JIT code (/tmp/perf-PID.map, collector/symbolize.py), the ELF files a job process maps
(collector/bpf_support.py) and the fast path's rings (collector/sources/fastpath.py, which does the
same checks on its own descriptor). A user who controls such a path could point it at a file only
root may read (a symlink to /etc/shadow), make it a FIFO that blocks the reader forever, or a sparse
file of terabytes. So every such open here is O_NOFOLLOW | O_NONBLOCK, the descriptor's fstat must
say a regular file (and, where the file must be the user's own, owned by that uid), and its size is
capped before a byte is read. docs/probes.md ("Files the collector reads as root") lists them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection

PERF_MAP_MAX_BYTES = 16 << 20
ELF_MAX_BYTES = 1 << 30


class UnsafeFile(ValueError):
    """A user-controlled file refused (symlink, not a regular file, foreign owner, too big); the
    message names the file and why."""


def open_user_file(path: str, *, owners: Collection[int] | None, max_bytes: int,
                   magic_link: bool = False) -> tuple[int, os.stat_result]:
    """(descriptor, fstat) of path opened read-only without following a symlink in its last
    component or blocking on a FIFO. Raises UnsafeFile when it is not a regular file, not owned by
    one of owners (None: any owner) or larger than max_bytes; OSError when it cannot be opened.
    magic_link: path is a /proc link the kernel resolves to the object itself (map_files/START-END:
    the file a process maps, whatever its path now names), so it is followed."""
    nofollow = 0 if magic_link else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{path}: is a symlink; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)})")
        if owners is not None and st.st_uid not in owners:
            raise UnsafeFile(f"{path}: owned by uid {st.st_uid}, not by {sorted(owners)}")
        if st.st_size > max_bytes:
            raise UnsafeFile(f"{path}: {st.st_size} bytes, more than the {max_bytes} read")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_user_file(path: str, *, owners: Collection[int] | None, max_bytes: int) -> bytes:
    """The whole file, checked as open_user_file does; at most max_bytes even if it grows meanwhile."""
    fd, _ = open_user_file(path, owners=owners, max_bytes=max_bytes)
    try:
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{path}: grew past the {max_bytes} bytes read")
    return data
