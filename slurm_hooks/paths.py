"""Where results go, and how they get there safely.

- Slurm filename patterns (%j %x %u %N %A %a ...) expanded ourselves: the prolog and epilog see the
  job's StdOut unexpanded on 22.05.
- The node file of a job whose stdout is slurm-123.out goes to slurm-123.gpuprof.d/<node>.h5; the
  merged job file and reports to slurm-123.gpuprof.{h5,txt,json,html}.
- Files land where the job's user can write, so they are written *as that user* (a forked child
  that dropped root) and never through a symlink in the last two components.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuprof.collector.errors import GpuprofError


class PlacementError(GpuprofError):
    """A result could not be placed for the job's user; the message names the path."""


@dataclass(frozen=True)
class PatternContext:
    job_id: str
    job_name: str
    user: str
    first_node: str
    array_job_id: str | None = None
    array_task_id: str | None = None


_PATTERN = re.compile(r"%(\d*)([%AajJNnstux])")


def expand_stdout_pattern(pattern: str, ctx: PatternContext) -> str:
    """Expand Slurm's filename pattern as sbatch documents it for the batch step's output.

    %A/%a fall back to %j and "4294967294" (NO_VAL) the way Slurm does for non-array jobs.
    A number after % pads with zeros (%5j)."""

    def value(letter: str) -> str:
        match letter:
            case "%":
                return "%"
            case "j" | "J":
                return ctx.job_id if letter == "j" else f"{ctx.job_id}.batch"
            case "A":
                return ctx.array_job_id or ctx.job_id
            case "a":
                return ctx.array_task_id if ctx.array_task_id is not None else "4294967294"
            case "x":
                return ctx.job_name
            case "u":
                return ctx.user
            case "N":
                return ctx.first_node
            case "n" | "t":
                return "0"
            case "s":
                return "batch"
        raise AssertionError(letter)

    def repl(m: re.Match[str]) -> str:
        width, letter = m.group(1), m.group(2)
        v = value(letter)
        if width and letter != "%" and v.isdigit():
            v = v.zfill(int(width))
        return v

    return _PATTERN.sub(repl, pattern)


def default_stdout(work_dir: str, array: bool) -> str:
    return os.path.join(work_dir, "slurm-%A_%a.out" if array else "slurm-%j.out")


def stdout_stem(stdout_path: str | os.PathLike[str]) -> tuple[Path, str]:
    """(directory, stem): /w/slurm-123.out -> (/w, 'slurm-123')."""
    p = Path(stdout_path)
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return p.parent, stem


def node_dir_for_stdout(stdout_path: str | os.PathLike[str], template: str = "{stdout_dir}/{stdout_stem}.gpuprof.d",
                        **fields: str) -> Path:
    d, stem = stdout_stem(stdout_path)
    return Path(template.format(stdout_dir=str(d), stdout_stem=stem, **fields))


def job_result_paths(stdout_path: str | os.PathLike[str]) -> dict[str, Path]:
    """The merged job file and the reports, next to the job's stdout."""
    d, stem = stdout_stem(stdout_path)
    return {ext: d / f"{stem}.gpuprof.{ext}" for ext in ("h5", "txt", "json", "html")}


# --- writing as the job's user -------------------------------------------------------------------

def _open_dir_nofollow(parent_fd: int, name: str, create: bool) -> int:
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except NotADirectoryError:
        # O_NOFOLLOW|O_DIRECTORY on a symlink says ENOTDIR; tell the operator what it really is.
        if stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode):
            raise OSError(errno.ELOOP, "is a symlink", name) from None
        raise


def _copy_into(src_fd: int, dest_dir: Path, file_name: str, subdir: str | None) -> None:
    """In the (already unprivileged) child: dest_dir[/subdir]/file_name, atomically, no symlinks
    followed in subdir or file_name. dest_dir itself is resolved with the user's own rights."""
    dfd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if subdir is not None:
            sub = _open_dir_nofollow(dfd, subdir, create=True)
            os.close(dfd)
            dfd = sub
        tmp = f".{file_name}.tmp.{os.getpid()}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
        try:
            os.lseek(src_fd, 0, os.SEEK_SET)
            while True:
                chunk = os.read(src_fd, 1 << 20)
                if not chunk:
                    break
                os.write(out, chunk)
            os.fsync(out)
        finally:
            os.close(out)
        # rename() replaces a symlink at the target name itself; it never writes through it.
        os.rename(tmp, file_name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def place_as_user(src: Path, dest_dir: Path, file_name: str, *, uid: int, gid: int,
                  subdir: str | None = None) -> Path:
    """Copy src (readable by root) to dest_dir[/subdir]/file_name, written by uid:gid.

    The source is opened by root before the fork; the child drops to the user, so the user's own
    permissions decide what may be written, and a symlink planted at subdir or file_name is never
    followed. Raises PlacementError naming the path."""
    target = dest_dir / subdir / file_name if subdir else dest_dir / file_name
    src_fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                os.close(r)
                if os.getuid() == 0 and uid != 0:
                    import pwd

                    try:
                        name = pwd.getpwuid(uid).pw_name
                        groups = os.getgrouplist(name, gid)
                    except KeyError:
                        groups = [gid]
                    os.setgroups(groups)
                    os.setgid(gid)
                    os.setuid(uid)
                _copy_into(src_fd, dest_dir, file_name, subdir)
            except OSError as e:
                code = 1
                msg = f"{e.filename or target}: {e.strerror or e}"
                if e.errno == errno.ELOOP:
                    msg = f"{target}: refusing to write through a symlink"
                os.write(w, msg.encode()[:4000])
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        _, status = os.waitpid(pid, 0)
        err = os.read(r, 4096).decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            raise PlacementError(f"cannot place {target} as uid {uid}: {err or 'child failed'}")
        return target
    finally:
        os.close(r)
        if w != -1:
            os.close(w)
        os.close(src_fd)


def make_private_dir(path: Path) -> Path:
    """A root-only directory (0700); refuses an existing one that is a symlink or not ours, and one
    whose parent others could rename it in or out of (group/other-writable and not sticky)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    pst = os.stat(path.parent)
    if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
        raise PlacementError(f"{path}: its parent {path.parent} is writable by others; use a root-only state_dir")
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PlacementError(f"{path}: state directory is not a plain directory")
    if st.st_uid != os.getuid():
        raise PlacementError(f"{path}: state directory owned by uid {st.st_uid}, not by us")
    os.chmod(path, 0o700)
    return path


# --- the fast path's per-job ring directory (root makes it for the job's user) ------------------

def _remove_entry(parent_fd: int, name: str) -> None:
    """Remove parent/name, whatever it is, never following a symlink (a link is removed itself,
    a directory with shutil.rmtree's descriptor-based walk, which does not follow links inside)."""
    st = os.lstat(name, dir_fd=parent_fd)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)
    else:
        os.unlink(name, dir_fd=parent_fd)


def _check_job_dir_name(path: Path) -> None:
    if not path.name.startswith("gpuprof-") or path.name in (".", "..") or "/" in path.name:
        raise PlacementError(f"{path}: not a gpuprof job directory name")


def make_job_dir(path: Path, uid: int, gid: int) -> Path:
    """As root: path as a fresh directory owned by uid:gid, mode 0700 (the fast path's rings).

    The parent (/dev/shm: sticky, world-writable) is opened once and every step is relative to it,
    so no symlink is followed. An entry already at the name that is not exactly that (a symlink, a
    file, a directory of another owner or with another mode, i.e. planted before the job) is
    removed first; the directory is made by root with mode 0700 and only then handed to the user
    (fchown on the opened directory, checked to be the one just made). Raises PlacementError."""
    _check_job_dir_name(path)
    try:
        parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise PlacementError(f"{path.parent}: cannot open: {e.strerror}") from None
    try:
        for _ in range(3):
            try:
                os.mkdir(path.name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                st = os.lstat(path.name, dir_fd=parent_fd)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700:
                    return path  # ours already (a prolog run again for the same job)
                _remove_entry(parent_fd, path.name)
                continue
            except OSError as e:
                raise PlacementError(f"{path}: cannot create: {e.strerror}") from None
            fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    raise PlacementError(f"{path}: replaced while being created (owner uid {st.st_uid})")
                os.fchmod(fd, 0o700)
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)
            return path
        raise PlacementError(f"{path}: keeps being re-created by someone else")
    except OSError as e:
        raise PlacementError(f"{path}: {e.strerror or e}") from None
    finally:
        os.close(parent_fd)


def remove_job_dir(path: Path) -> bool:
    """As root: remove the job directory made by make_job_dir and everything in it, never following
    a symlink (a link planted at the name is removed, not its target). False when it was not there."""
    _check_job_dir_name(path)
    try:
        parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        _remove_entry(parent_fd, path.name)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        raise PlacementError(f"{path}: cannot remove: {e.strerror or e}") from None
    finally:
        os.close(parent_fd)


# --- the job's task plan (root writes it, the job's TaskProlog reads it) ------------------------

def write_task_plan(path: Path, lines: list[str], uid: int) -> None:
    """As root: path (in a directory only root writes, 0755, made here) holding lines, readable by
    uid alone (0400, owned by uid: a file of another user cannot be read, nor this one written by
    anyone but root, since its directory is root's). Written aside and renamed over. Raises
    PlacementError when the directory is not root's alone, or on a write error."""
    d = path.parent
    try:
        d.mkdir(mode=0o755, exist_ok=True)
        st = os.lstat(d)
    except OSError as e:
        raise PlacementError(f"{d}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PlacementError(f"{d}: not a directory of root's that only root writes")
    tmp = d / f".{path.name}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
        try:
            os.write(fd, "".join(f"{line}\n" for line in lines).encode())
            os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PlacementError(f"{path}: {e.strerror}") from None


def remove_task_plan(path: Path) -> bool:
    """The plan write_task_plan made; False when it was not there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        raise PlacementError(f"{path}: cannot remove: {e.strerror}") from None
