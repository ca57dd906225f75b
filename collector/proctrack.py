"""Finds the job's processes: its cgroup, else Slurm (`scontrol listpids`), else a process tree.

Why this order: the cgroup is exact and cheap to read (Slurm puts every task of the job there); the
Slurm command works without proctrack/cgroup but costs a fork per scan; a process tree from a
given pid is what a hand-started `gpuprof collect --pid` means, and catches daemonized children
only while they stay below that pid.

Cgroup paths Slurm creates (slurm.schedmd.com/cgroups.html, cgroup_v2.html):
  v1:  /sys/fs/cgroup/<controller>/slurm/uid_<uid>/job_<id>/step_*/task_*
       with several slurmd on one host (multiple-slurmd builds, our local cluster):
       /sys/fs/cgroup/<controller>/slurm_<node>/uid_<uid>/job_<id>/
  v2:  /sys/fs/cgroup/system.slice/slurmstepd.scope/job_<id>/   (<node>_slurmstepd.scope with several)
Every controller is searched, because a site may mount only some of them (freezer is the one
proctrack/cgroup always uses on v1).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from gpuprof.collector import schema

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    comm: str
    cmdline: str


# The job's cgroup directories, once found, are kept and checked with a stat a scan; globbed again
# (ten patterns over the cgroup root, most of a scan's time) when one went away or every
# CGROUP_REFIND_S, for a controller hierarchy the job was put in later than the first.
CGROUP_REFIND_S = 10.0
# Pids gone from the job are still answered by `recent_pids` this long (and at most this many):
# a fast-path ring outlives its writer, and a process that lived between two of the fast path's
# drains (2 s apart) was seen only by the tracker (1 s scans).
RECENTLY_GONE_S = 60.0
RECENTLY_GONE_MAX = 65536


def find_job_cgroups(job_id: str, node: str | None, uid: int | None, root: str = CGROUP_ROOT) -> tuple[str, ...]:
    """Every cgroup directory of the job, one per controller hierarchy (v1) or the v2 one."""
    uid_part = f"uid_{uid}" if uid is not None else "uid_*"
    slurm_dirs = [f"slurm_{node}", "slurm"] if node else ["slurm", "slurm_*"]
    patterns: list[str] = []
    for sd in slurm_dirs:
        patterns.append(f"{root}/*/{sd}/{uid_part}/job_{job_id}")  # v1, one per controller
        patterns.append(f"{root}/{sd}/{uid_part}/job_{job_id}")  # v1 with a single hierarchy mount
    scopes = [f"{node}_slurmstepd.scope", "slurmstepd.scope"] if node else ["*slurmstepd.scope"]
    for sc in scopes:
        patterns.append(f"{root}/system.slice/{sc}/job_{job_id}")
        patterns.append(f"{root}/unified/system.slice/{sc}/job_{job_id}")  # hybrid mounts
    found: list[str] = []
    for p in patterns:
        for d in sorted(glob.glob(p)):
            if os.path.isdir(d) and d not in found:
                found.append(d)
    return tuple(found)


def pids_in_cgroups(dirs: tuple[str, ...]) -> set[int]:
    """All pids in the given cgroups and their descendants (step_*/task_* sub-cgroups)."""
    pids: set[int] = set()
    for top in dirs:
        for dirpath, _dirnames, filenames in os.walk(top):
            if "cgroup.procs" not in filenames:
                continue
            try:
                with open(os.path.join(dirpath, "cgroup.procs"), "rb") as f:
                    pids.update(int(x) for x in f.read().split())
            except OSError:
                continue  # the step's cgroup went away between the walk and the read
    return pids


class CgroupPids:
    """pids_in_cgroups of the same cgroup directories scan after scan, without listing every
    directory each time: the directories found below the tops are kept with their link counts,
    and walked again only when one's count changed (a cgroup file system counts a directory's
    subdirectories in it: a step or task cgroup made or removed below), one is gone, or a count
    does not say (1: a file system that does not count them). A scan is then a stat and a
    cgroup.procs read a directory, where os.walk also listed each directory's files (about 30 on
    cgroup v2): a GROMACS job's tracker took 0.34 ms of CPU a scan there, once a second."""

    def __init__(self, tops: tuple[str, ...]) -> None:
        self.tops = tops
        self._dirs: dict[str, int] = {}  # cgroup directory -> its st_nlink at the last walk
        self.walks = 0

    def _walk(self) -> None:
        self.walks += 1
        self._dirs = {}
        for top in self.tops:
            for dirpath, _dirnames, filenames in os.walk(top):
                if "cgroup.procs" not in filenames:
                    continue
                try:
                    self._dirs[dirpath] = os.stat(dirpath).st_nlink
                except OSError:
                    continue  # gone between the walk and the stat: the next scan walks again

    def _changed(self) -> bool:
        for d, links in self._dirs.items():
            try:
                now = os.stat(d).st_nlink
            except OSError:
                return True
            if now != links or now < 2:
                return True
        return not self._dirs

    def pids(self) -> set[int]:
        if self._changed():
            self._walk()
        pids: set[int] = set()
        for d in self._dirs:
            try:
                with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                    pids.update(int(x) for x in f.read().split())
            except OSError:
                self._dirs = {}  # went away since the stat: walked again at the next scan
                continue
        return pids


def in_cgroups(pid: int, dirs: tuple[str, ...]) -> bool:
    """Whether live process pid is in one of the cgroup directories dirs (or below one), read
    from /proc/PID/cgroup: one read, where pids_in_cgroups walks every step's directory. A line
    names the cgroup below its hierarchy's mount (v1 `N:freezer:/slurm_n1/uid_0/job_7/step_0`, v2
    `0::/system.slice/n1_slurmstepd.scope/job_7/step_0`), so a directory matches when it ends with
    that path cut after the directory's own last component. False when pid is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        parts = line.split(":", 2)[-1].strip("/").split("/")
        for d in dirs:
            leaf = os.path.basename(d)
            if leaf in parts and d.endswith("/" + "/".join(parts[:parts.index(leaf) + 1])):
                return True
    return False


def scontrol_listpids(job_id: str, node: str | None, timeout_s: float = 5.0) -> set[int] | None:
    """pids Slurm's slurmd knows for the job on this node; None when scontrol is absent or fails."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    cmd = [exe, "listpids", job_id] + ([node] if node else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    pids: set[int] = set()
    for line in out.stdout.splitlines()[1:]:  # header: PID JOBID STEPID LOCALID GLOBALID
        parts = line.split()
        if parts and parts[0].isdigit():
            pids.add(int(parts[0]))
    return pids


class ChildrenFiles:
    """/proc/PID/task/TID/children (CONFIG_PROC_CHILDREN) of the tree's threads, kept open between
    scans and re-read with pread: a scan then costs a listdir and a pread per thread instead of an
    open, a read and a close (the tracker's share of the collector's CPU halved). A descriptor
    names its task, not its number: a task that exited answers ESRCH, never a reused pid's data."""

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], int] = {}

    def _read(self, pid: int, tid: int) -> bytes:
        key = (pid, tid)
        fd = self._fds.get(key)
        if fd is not None:
            try:
                return os.pread(fd, 65536, 0)
            except ProcessLookupError:
                self._close(key)  # that task exited; a new task may have the same numbers
        fd = self._fds[key] = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, 65536, 0)

    def children(self, pid: int) -> list[int] | None:
        """Direct children of pid, None when the kernel has no children files."""
        out: list[int] = []
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return []
        for tid in tids:
            try:
                out.extend(int(x) for x in self._read(pid, int(tid)).split())
            except FileNotFoundError:
                if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                    continue  # thread exited
                return None  # kernel without the children file
            except OSError:
                continue
        return out

    def retain(self, pids: set[int]) -> None:
        """Close the descriptors of processes no longer in the tree."""
        for key in [k for k in self._fds if k[0] not in pids]:
            self._close(key)

    def _close(self, key: tuple[int, int]) -> None:
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for key in list(self._fds):
            self._close(key)


def _ppid_map() -> dict[int, int]:
    m: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        m[int(name)] = int(rest[1])
    return m


def process_tree(root_pid: int, files: ChildrenFiles | None = None) -> set[int]:
    """root_pid and all its descendants that are alive now (files: descriptors kept between calls)."""
    if not os.path.exists(f"/proc/{root_pid}"):
        return set()
    reader = files if files is not None else ChildrenFiles()
    try:
        return _walk(root_pid, reader)
    finally:
        if files is None:
            reader.close()


def _walk(root_pid: int, files: ChildrenFiles) -> set[int]:
    out = {root_pid}
    stack = [root_pid]
    while stack:
        kids = files.children(stack.pop())
        if kids is None:  # fall back to a full /proc scan
            ppids = _ppid_map()
            out = {root_pid}
            frontier = [root_pid]
            while frontier:
                p = frontier.pop()
                for c, pp in ppids.items():
                    if pp == p and c not in out:
                        out.add(c)
                        frontier.append(c)
            return out
        for k in kids:
            if k not in out:
                out.add(k)
                stack.append(k)
    return out


def read_proc_info(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read(512)
    except OSError:
        return None
    comm = stat[stat.find(b"(") + 1: stat.rfind(b")")].decode("utf-8", "replace")
    ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
    return ProcInfo(pid, ppid, comm, cmdline.replace(b"\0", b" ").strip().decode("utf-8", "replace"))


class ProcessTracker:
    """Keeps the job's pid set current and emits /processes/events rows for appeared and gone pids.

    `method` is how the pids are found: "cgroup", "scontrol", "tree" or "fixed"; chosen once at start
    (the first that finds anything), re-chosen while nothing has been found (a job's cgroup may be
    created after the prolog started us)."""

    def __init__(
        self,
        *,
        job_id: str | None,
        node: str | None,
        uid: int | None,
        root_pid: int | None,
        cgroup_root: str = CGROUP_ROOT,
        use_scontrol: bool = True,
    ) -> None:
        self.job_id = job_id
        self.node = node
        self.uid = uid
        self.root_pid = root_pid
        self.cgroup_root = cgroup_root
        self.use_scontrol = use_scontrol
        self.method = "none"
        self._cgroups: tuple[str, ...] = ()
        self._cgroup_pids = CgroupPids(())  # reads the pids of _cgroups and the cgroups below them
        self._cgroups_refind_at = 0.0  # time.monotonic() after which the job's cgroups are globbed again
        self._lock = threading.Lock()
        self._pids: frozenset[int] = frozenset()
        self._gone_at: dict[int, float] = {}  # pid -> time.monotonic() of the scan that found it gone
        self._recent: frozenset[int] = frozenset()
        self._info: dict[int, ProcInfo] = {}
        self._children_files = ChildrenFiles()  # tree mode's descriptors, kept between scans
        self._scan_lock = threading.Lock()

    def pids(self) -> frozenset[int]:
        with self._lock:
            return self._pids

    def recent_pids(self) -> frozenset[int]:
        """The job's pids now and those gone within RECENTLY_GONE_S."""
        with self._lock:
            return self._recent

    def cgroup_dirs(self) -> tuple[str, ...]:
        return self._cgroups

    def _discover(self) -> set[int]:
        if self.job_id is not None:
            if self.method in ("none", "cgroup"):
                now = time.monotonic()
                if (not self._cgroups or now >= self._cgroups_refind_at
                        or not all(os.path.isdir(d) for d in self._cgroups)):
                    self._cgroups = find_job_cgroups(self.job_id, self.node, self.uid, self.cgroup_root)
                    self._cgroups_refind_at = now + CGROUP_REFIND_S
                    self._cgroup_pids = CgroupPids(self._cgroups)  # walked anew: the refind's safety net
                if self._cgroups:
                    self.method = "cgroup"
                    return self._cgroup_pids.pids()
            if self.use_scontrol and self.method in ("none", "scontrol"):
                pids = scontrol_listpids(self.job_id, self.node)
                if pids:
                    self.method = "scontrol"
                    return pids
        if self.root_pid is not None:
            self.method = "tree"
            pids = process_tree(self.root_pid, self._children_files)
            self._children_files.retain(pids)
            return pids
        return set()

    def scan(self, now_ns: int) -> np.ndarray:
        """Refresh the pid set; rows for /processes/events (appeared, gone)."""
        with self._scan_lock:  # the collector's final scan may meet the tracker thread's last one
            current = self._discover()
        current.discard(os.getpid())  # never observe ourselves, even when started inside the job
        with self._lock:
            before = self._pids
            if current != before:
                # a new object only when the set changes: the sources compare by identity to
                # skip their own re-sync (HostSource._sync_procs)
                self._pids = frozenset(current)
            self._remember_gone(before - current)
        appeared = sorted(current - before)
        gone = sorted(before - current)
        rows = schema.PROCESS_EVENTS.empty(len(appeared) + len(gone))
        i = 0
        for pid in appeared:
            info = read_proc_info(pid)
            if info is None:
                continue  # gone already: it never really was seen
            self._info[pid] = info
            rows[i] = (now_ns, pid, info.ppid, 0, info.comm.encode()[:16], info.cmdline.encode()[:128])
            i += 1
        for pid in gone:
            info = self._info.pop(pid, None)
            ppid, comm = (info.ppid, info.comm) if info else (0, "")
            rows[i] = (now_ns, pid, ppid, 1, comm.encode()[:16], b"")
            i += 1
        return rows[:i]

    def _remember_gone(self, gone: AbstractSet[int]) -> None:
        """Keep gone pids for RECENTLY_GONE_S (the oldest dropped first past RECENTLY_GONE_MAX) and
        renew recent_pids' answer; called under _lock."""
        now = time.monotonic()
        for pid in gone:
            self._gone_at.pop(pid, None)
            self._gone_at[pid] = now  # insertion order: the order they went
        while self._gone_at:
            pid, at = next(iter(self._gone_at.items()))
            if now - at < RECENTLY_GONE_S and len(self._gone_at) <= RECENTLY_GONE_MAX:
                break
            del self._gone_at[pid]
        recent = self._pids | self._gone_at.keys()
        if recent != self._recent:
            self._recent = frozenset(recent)

    def close(self) -> None:
        """Release the tree mode's descriptors (after the last scan)."""
        with self._scan_lock:
            self._children_files.close()

    def wait_for(self, predicate: Callable[[frozenset[int]], bool], timeout_s: float) -> bool:
        """For tests: poll until predicate(pids) holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.pids()):
                return True
            time.sleep(0.05)
        return False
