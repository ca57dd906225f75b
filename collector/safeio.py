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

import ctypes
import errno
import os
import re
import stat
from collections.abc import Collection
from typing import Any

PERF_MAP_MAX_BYTES = 16 << 20
ELF_MAX_BYTES = 1 << 30


class UnsafeFile(ValueError):
    """A user-controlled file refused (symlink, not a regular file, foreign owner, too big); the
    message names the file and why."""


# openat2(2) (Linux 5.6): RESOLVE_NO_SYMLINKS refuses a symlink in *any* component of the path
_SYS_OPENAT2 = 437  # x86-64 and the generic table alike
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_IN_ROOT = 0x10
_AT_FDCWD = -100
# a file of another mount namespace, as the collector reaches it (bpf_support.attach_path)
_PROC_ROOT = re.compile(r"^(/proc/\d+/root)(/.*)$")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: Any = None
_openat2_missing = False  # the kernel said ENOSYS once: O_NOFOLLOW on the last component only


def _open_no_symlinks(path: str, flags: int) -> int:
    """os.open(path, flags) refusing a symlink anywhere on the path (openat2 RESOLVE_NO_SYMLINKS);
    where the kernel has no openat2, O_NOFOLLOW (the last component only)."""
    global _libc, _openat2_missing
    if not _openat2_missing:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syscall.restype = ctypes.c_long
        # /proc/PID/root/REST (a container's file): the root is a magic link the kernel resolves to
        # the process's root directory; REST is then resolved inside it, no symlink allowed
        m = _PROC_ROOT.match(path)
        dirfd, rel, resolve = _AT_FDCWD, path, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        if m is not None:
            dirfd = os.open(m[1], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            rel, resolve = m[2].lstrip("/"), resolve | _RESOLVE_IN_ROOT
        try:
            how = _OpenHow(flags, 0, resolve)
            fd = int(_libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), os.fsencode(rel),
                                   ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))))
            err = ctypes.get_errno()
        finally:
            if dirfd != _AT_FDCWD:
                os.close(dirfd)
        if fd >= 0:
            return fd
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), path)
        _openat2_missing = True
    return os.open(path, flags | os.O_NOFOLLOW)


def open_user_file(path: str, *, owners: Collection[int] | None, max_bytes: int,
                   magic_link: bool = False, no_symlinks: bool = False) -> tuple[int, os.stat_result]:
    """(descriptor, fstat) of path opened read-only without following a symlink in its last
    component or blocking on a FIFO. Raises UnsafeFile when it is not a regular file, not owned by
    one of owners (None: any owner) or larger than max_bytes; OSError when it cannot be opened.
    magic_link: path is a /proc link the kernel resolves to the object itself (map_files/START-END:
    the file a process maps, whatever its path now names), so it is followed.
    no_symlinks: a symlink in any component of the path is refused too (openat2's
    RESOLVE_NO_SYMLINKS; for paths the kernel gave in /proc/PID/maps, which are already resolved,
    so a symlink on one means the path was changed since)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        if no_symlinks and not magic_link:
            fd = _open_no_symlinks(path, flags)
        else:
            fd = os.open(path, flags | (0 if magic_link else os.O_NOFOLLOW))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{path}: is or passes through a symlink; not followed") from None
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


def read_user_file(path: str, *, owners: Collection[int] | None, max_bytes: int,
                   no_symlinks: bool = False) -> bytes:
    """The whole file, checked as open_user_file does; at most max_bytes even if it grows meanwhile."""
    fd, _ = open_user_file(path, owners=owners, max_bytes=max_bytes, no_symlinks=no_symlinks)
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


def own_directory_problem(path: str | os.PathLike[str], foreign_mode_bits: int) -> str:
    """Why the collector's own cache directory at path cannot be trusted ('' when it can): made
    0700 when missing; it must be a directory (not a symlink) of this uid with none of
    foreign_mode_bits set (0o022: writable by it alone; 0o077: private)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & foreign_mode_bits:
        want = "mode 0700: only it reads or writes" if foreign_mode_bits & 0o044 else "writable by it alone"
        return f"{path}: not a directory of uid {os.geteuid()} with {want}"
    return ""
