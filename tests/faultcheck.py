"""What every fault case of the suite checks afterwards, and the record the bench counts
(tests/test_hook_faults.py, tests/test_faults.py, tests/bench/bench_faults.py).

After a fault: 0 drained nodes (a hook that failed drains its node: every hook exit status is 0,
and on the cluster no node is drained or down), 0 DCGM pauses left (the test double's calls: as
many resumes as pauses, and the holder file empty), 0 collectors left running, the job's own
output intact, and the node's result complete, or partial with the reason where the user looks
(the node file's partial_reason, or <node>.problem.txt next to the node files).

A case appends its outcome to $GPUPROF_FAULTS_RESULTS (one JSON object per line) when set: the
bench runs the tests and adds them up, so the figures come from the same checks the tests assert.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuprof.slurm_hooks.hooks import collector_pids

RESULTS_ENV = "GPUPROF_FAULTS_RESULTS"


@dataclass
class FaultOutcome:
    case: str
    drained: int = 0  # nodes drained or down, or hook runs that exited non-zero
    paused_left: int = 0  # DCGM pauses not resumed (pauses - resumes, plus holders left)
    collectors_left: int = 0  # collectors of the case's jobs still running
    lost_outputs: int = 0  # job output files changed or missing
    result: str = ""  # "complete", "partial: <reason>", "missing: <reason>"
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.drained or self.paused_left or self.collectors_left or self.lost_outputs)

    def record(self) -> None:
        path = os.environ.get(RESULTS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")

    def check(self) -> None:
        """Record, then assert the case left nothing behind and told the user what happened."""
        self.record()
        assert self.clean, f"{self.case}: {asdict(self)}"
        assert self.result == "complete" or (self.result.startswith(("partial: ", "missing: "))
                                             and len(self.result.split(": ", 1)[1]) > 10), self.result


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dcgm_left(calls_file: Path, state_dir: Path) -> int:
    """Pauses of the DCGM double not resumed, plus holders still in the holder file."""
    calls = calls_file.read_text().splitlines() if calls_file.exists() else []
    left = calls.count("profile --pause") - calls.count("profile --resume")
    holders_file = state_dir / "dcgm" / "holders.json"
    holders = json.loads(holders_file.read_text())["holders"] if holders_file.exists() else {}
    return max(0, left) + len(holders)


def collectors_left(jobs: list[str], nodes: list[str], wait_s: float = 10.0) -> int:
    """Collectors of these jobs on these nodes still running after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        n = sum(len(collector_pids(j, node)) for j in jobs for node in nodes)
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def node_result(node_dir: Path, node: str) -> str:
    """'complete', 'partial: why' or 'missing: why' for one node of a job, from what reached the
    user: the node file and <node>.problem.txt."""
    from gpuprof.collector.errors import GpuprofError
    from gpuprof.collector.reader import open_node_trace

    note = node_dir / f"{node}.problem.txt"
    why = note.read_text().strip().replace("\n", " ") if note.is_file() else ""
    f = node_dir / f"{node}.h5"
    if not f.is_file():
        return f"missing: {why}" if why else "missing: (no reason given)"
    try:
        t = open_node_trace(f)
    except GpuprofError as e:
        return f"missing: unreadable node file {e}; {why}"
    if t.sealed and not why:
        return "complete"
    reasons = "; ".join(t.partial_reasons) if not t.sealed else ""
    return f"partial: {'; '.join(x for x in (reasons, why) if x)}"


def mount_tmpfs(path: Path, size: str, owner: pwd.struct_passwd | None = None) -> None:
    """A small file system at path (disk-full cases), owned by `owner` when given."""
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "gpuprof-fault", str(path)], check=True)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
        path.chmod(0o755)


def mount_quota(path: Path, limit: str, owner: pwd.struct_passwd) -> Path:
    """A directory under a quota of `limit` bytes, owned by `owner`, at path/quota: a btrfs file
    system in a file (loop device) with quota groups, the directory one subvolume limited to
    `limit` (btrfs' quota: writes beyond it fail with EDQUOT, "Disk quota exceeded", not ENOSPC).
    Unmounted by the caller (path is the mount point); the image file is removed at once (the
    mount keeps it)."""
    path.mkdir(exist_ok=True)
    image = path.with_name(path.name + ".img")
    with open(image, "wb") as f:
        f.truncate(128 << 20)  # btrfs' smallest useful size; sparse
    try:
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True, capture_output=True)
    finally:
        image.unlink()
    try:
        subprocess.run(["btrfs", "quota", "enable", str(path)], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        subprocess.run(["umount", str(path)], check=False)
        raise
    sub = path / "quota"
    subprocess.run(["btrfs", "subvolume", "create", str(sub)], check=True, capture_output=True)
    subprocess.run(["btrfs", "qgroup", "limit", limit, str(sub)], check=True, capture_output=True)
    os.chown(sub, owner.pw_uid, owner.pw_gid)
    sub.chmod(0o755)
    return sub


def fill(path: Path) -> None:
    """Fill the file system of path to its last byte."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path / '.filler'}", "bs=4k"], capture_output=True, check=False)
