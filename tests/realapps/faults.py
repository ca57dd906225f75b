"""Fault injectors, applied from outside the application, each with its ground truth.

| fault | how | truth cause |
| --- | --- | --- |
| `balanced` | nothing | (no finding expected) |
| `sigstop` | a helper process finds the rank's pid in its node's Slurm job cgroup and stops it (SIGSTOP) for `duty` of every `period_s`, SIGCONT otherwise | host |
| `cpu_quota` | the processes of one node's Slurm job cgroup are moved into a cpu-controller cgroup of ours with a CFS quota (see below) | host |
| `corunner` | the rank is pinned with taskset to CPU 1, the job's other ranks to the other CPU, and a `stress-ng --cpu 6` co-runner to CPU 1, in its own session whose autogroup has the weight of nice -10 (see corunner()); the injector prints the effect it measured (the rank's run-queue waits against the others'), and a run without effect is scored apart | host |
| `load_sleep` | the training program's `--load-extra-s` on one rank (inside the app, by its own knob) | host |
| `slow_collectives` | tests/realapps/slow_collectives.c, LD_PRELOADed on every rank, busy-waits `delay_us` after each collective returns on one rank | network |

cgroups: the local cluster runs cgroup v1 with proctrack/cgroup and ConstrainCores=no, so Slurm makes
a per-node job cgroup only under the freezer controller (`/sys/fs/cgroup/freezer/slurm_<node>/uid_<uid>/
job_<id>/`) and none under `cpu`. The quota injector therefore takes the node's job processes from that
freezer cgroup (kernel-owned, root-only, not a user path) and moves them into
`/sys/fs/cgroup/cpu/gpuprof-realapps/job<id>_<node>/` with `cpu.cfs_quota_us`, which is what a site's
Slurm cpu cgroup limit does; on a host without a v1 cpu controller the fault is skipped (FaultUnavailable).

Every injector runs as a separate helper process (`python -m tests.realapps.faults FAULT ...`, as root
on the node, which here is this host), ends when the rank exits or on SIGTERM, and always undoes what
it did (SIGCONT, processes moved back, co-runner killed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_CONTROLLER = CGROUP_ROOT / "cpu"
OUR_CPU_GROUP = CPU_CONTROLLER / "gpuprof-realapps"


class FaultUnavailable(RuntimeError):
    """The fault cannot be injected on this host (named why)."""


@dataclass(frozen=True)
class Fault:
    name: str
    cause: str | None  # the cause the report should name; None for balanced
    outside: bool  # applied by a helper process (else through the job's environment or arguments)
    doc: str


FAULTS: dict[str, Fault] = {
    "balanced": Fault("balanced", None, False, "no fault"),
    "sigstop": Fault("sigstop", "host", True, "rank stopped 30 % of every 200 ms (SIGSTOP/SIGCONT)"),
    "cpu_quota": Fault("cpu_quota", "host", True, "the node's job processes limited to a fraction of a CPU (CFS quota)"),
    "corunner": Fault("corunner", "host", True, "stress-ng pinned to the rank's CPU (taskset)"),
    "load_sleep": Fault("load_sleep", "host", False, "extra sleep in the rank's data loading"),
    "slow_collectives": Fault("slow_collectives", "network", False,
                              "busy wait after every collective on the rank (LD_PRELOAD shim)"),
}

STOP = False


def _on_term(signum: int, frame: object) -> None:
    global STOP
    STOP = True


def job_cgroup(node: str, uid: int, jobid: str) -> Path:
    """The node's Slurm job cgroup (cgroup v1: whichever controller Slurm made it under)."""
    for ctrl in ("freezer", "cpuset", "cpu", "cpu,cpuacct", "memory", "pids"):
        p = CGROUP_ROOT / ctrl / f"slurm_{node}" / f"uid_{uid}" / f"job_{jobid}"
        if p.is_dir():
            return p
    unified = CGROUP_ROOT / "unified"
    raise FaultUnavailable(f"no Slurm job cgroup slurm_{node}/uid_{uid}/job_{jobid} under {CGROUP_ROOT} "
                           f"(cgroup v1 controllers; v2 at {unified} is not searched)")


def job_pids(cgroup: Path) -> list[int]:
    """Every process of the job cgroup and its step cgroups."""
    pids: list[int] = []
    for procs in [cgroup / "cgroup.procs", *sorted(cgroup.glob("step_*/cgroup.procs"))]:
        try:
            pids += [int(x) for x in procs.read_text().split()]
        except FileNotFoundError:  # a step ended meanwhile
            continue
    return pids


def comm_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None


def world_rank_of(pid: int) -> int | None:
    """OMPI_COMM_WORLD_RANK from the process's environment (/proc, kernel-provided): set by Open
    MPI's orted for application ranks only, not for the job's other processes (the TaskProlog's
    Python, orted itself, shells)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for kv in env:
        if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
            try:
                return int(kv.split(b"=", 1)[1])
            except ValueError:
                return None
    return None


def find_rank(node: str, uid: int, jobid: str, comm: str, timeout: float) -> tuple[int, int]:
    """(pid, world rank) of the application's rank on the node: the process of the node's job cgroup
    whose /proc/PID/comm is the application's (15 characters at most) and that has an MPI world
    rank in its environment."""
    deadline = time.monotonic() + timeout
    want = comm[:15]
    last: list[int] = []
    while time.monotonic() < deadline and not STOP:
        with contextlib.suppress(FaultUnavailable):
            last = job_pids(job_cgroup(node, uid, jobid))
            for pid in last:
                if comm_of(pid) == want:
                    rank = world_rank_of(pid)
                    if rank is not None and alive(pid):
                        return pid, rank
        time.sleep(0.1)
    raise FaultUnavailable(f"{node}: no MPI rank {want!r} in job {jobid}'s cgroup after {timeout:.0f} s "
                           f"(saw {[comm_of(p) for p in last]})")


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def sigstop_duty(pid: int, duty: float, period_s: float) -> None:
    stopped_s, running_s = duty * period_s, (1 - duty) * period_s
    try:
        while not STOP and alive(pid):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def cpu_group(name: str, quota_cpus: float) -> Iterator[Path]:
    if not (CPU_CONTROLLER / "cpu.cfs_quota_us").exists():
        raise FaultUnavailable(f"no cgroup v1 cpu controller at {CPU_CONTROLLER} (cpu.cfs_quota_us missing)")
    group = OUR_CPU_GROUP / name
    group.mkdir(parents=True, exist_ok=True)
    period = 100_000
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(int(quota_cpus * period)))
    try:
        yield group
    finally:
        # back to the cpu controller's root, where slurmd and its job processes are on this host
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (CPU_CONTROLLER / "cgroup.procs").write_text(pid)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:  # EBUSY while the last process leaves
                time.sleep(0.1)
        with contextlib.suppress(OSError):  # busy while another run's group is in it
            OUR_CPU_GROUP.rmdir()


def cpu_quota(node: str, uid: int, jobid: str, quota_cpus: float) -> None:
    cg = job_cgroup(node, uid, jobid)
    with cpu_group(f"job{jobid}_{node}", quota_cpus) as group:
        while not STOP:
            try:
                pids = job_pids(cg)
            except FileNotFoundError:
                return
            if not pids and not cg.exists():
                return
            mine = set((group / "cgroup.procs").read_text().split())
            for pid in pids:
                if str(pid) not in mine:
                    with contextlib.suppress(ProcessLookupError, OSError):
                        (group / "cgroup.procs").write_text(str(pid))
            if not cg.exists():
                return
            time.sleep(0.2)


# A co-runner took effect when the rank waited for its CPU a larger share of the time it wanted
# it than the job's other ranks did, by this much at least (the rank's main thread's run queue
# wait over its wait and run time, /proc/PID/schedstat, against the median of the others'). Its
# CPU a second alone does not tell: in a lock-step code of 2 ranks (NetPIPE) the other rank runs
# as little as the stressed one. A run of 2026-12-06 left its stressed rank 581 CPU samples
# against 529-600 for the others: that fault was scored as missed.
CORUNNER_EFFECT_MIN_WAIT_GAP = 0.2


def sched_ns(pid: int) -> tuple[int, int] | None:
    """(run ns, run-queue wait ns) of a process's main thread (/proc/PID/schedstat); None when gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            run, wait = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(run), int(wait)


class SchedShares:
    """Each watched process's main thread since it was first seen (its first and last reads): its
    CPU a second, and the share of the time it wanted a CPU that it waited for one."""

    def __init__(self) -> None:
        self.first: dict[int, tuple[float, int, int]] = {}
        self.last: dict[int, tuple[float, int, int]] = {}

    def read(self, pids: list[int]) -> None:
        now = time.monotonic()
        for p in pids:
            ns = sched_ns(p)
            if ns is not None:
                self.first.setdefault(p, (now, *ns))
                self.last[p] = (now, *ns)

    def of(self, pid: int) -> tuple[float, float] | None:
        """(CPU seconds a second, wait share); None when read over less than a second or never run."""
        if pid not in self.first:
            return None
        (t0, r0, w0), (t1, r1, w1) = self.first[pid], self.last[pid]
        if t1 - t0 < 1.0 or r1 - r0 + w1 - w0 <= 0:
            return None
        return (r1 - r0) / 1e9 / (t1 - t0), (w1 - w0) / (r1 - r0 + w1 - w0)


def effect_line(shares: SchedShares, pid: int, others: list[int]) -> str:
    """`inject: effect ...`: the rank's CPU a second and wait share against the medians of the
    job's other ranks', which runner.record keeps in the ground truth (and scoring reads)."""
    mine = shares.of(pid)
    theirs = [x for x in (shares.of(o) for o in others) if x is not None]
    if mine is None or not theirs:
        return f"inject: effect unmeasured (rank read {mine is not None}, {len(theirs)} other ranks read)"
    cpu = statistics.median(c for c, _ in theirs)
    wait = statistics.median(w for _, w in theirs)
    return (f"inject: effect rank_cpu_per_s {mine[0]:.3f} others_cpu_per_s {cpu:.3f} "
            f"rank_wait_share {mine[1]:.3f} others_wait_share {wait:.3f}")


def corunner(pid: int, cpu: int, workers: int, others: Callable[[], list[int]]) -> None:
    """The rank pinned to `cpu` with a stress-ng co-runner there; the job's other ranks (`others`,
    polled: they may start later) pinned to the other CPU(s), as Slurm's core binding gives each rank
    CPUs of its own. Without that, on 2 cores the scheduler moves the other ranks around the crowded
    CPU and the co-runner slows whichever rank it meets, not the one the truth names."""
    rest = sorted(set(range(os.cpu_count() or 2)) - {cpu}) or [cpu]
    rest_list = ",".join(str(c) for c in rest)
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)
    hog = subprocess.Popen(["taskset", "-c", str(cpu), "stress-ng", "--cpu", str(workers), "--cpu-method", "int64",
                            "--quiet", "--timeout", "600"], stdout=subprocess.DEVNULL, start_new_session=True)
    # With autogroup scheduling (kernel.sched_autogroup_enabled=1, Debian's default) CFS shares a CPU
    # between sessions first: a co-runner of any size in its own session takes half of the rank's CPU
    # and no more. Its session's group gets the weight of nice -10 (about 9x the job's), as a
    # co-runner of higher priority would: the rank keeps about a tenth of its CPU.
    autogroup = Path(f"/proc/{hog.pid}/autogroup")
    if autogroup.exists():
        with contextlib.suppress(OSError):
            autogroup.write_text("-10")
    pinned: set[int] = set()
    shares = SchedShares()  # whether the co-runner took CPU from the rank: read, not assumed
    try:
        while not STOP and alive(pid) and hog.poll() is None:
            for other in others():
                if other != pid and other not in pinned:
                    pinned.add(other)
                    subprocess.run(["taskset", "-a", "-p", "-c", rest_list, str(other)], check=False,
                                   capture_output=True)
            shares.read([pid, *sorted(pinned)])
            time.sleep(0.2)
    finally:
        if hog.poll() is not None:
            print(f"inject: corunner: stress-ng exited {hog.returncode} while the rank ran", flush=True)
        print(effect_line(shares, pid, sorted(pinned)), flush=True)
        hog.terminate()
        try:
            hog.wait(10)
        except subprocess.TimeoutExpired:
            hog.kill()
            hog.wait()


def other_ranks(node: str, uid: int, jobid: str, comm: str) -> list[int]:
    """The application's processes (by /proc/PID/comm) in the job cgroups of the job's other nodes."""
    out: list[int] = []
    for cg in sorted(CGROUP_ROOT.glob(f"freezer/slurm_*/uid_{uid}/job_{jobid}")):
        if cg.parts[-3] == f"slurm_{node}":
            continue
        out += [p for p in job_pids(cg) if comm_of(p) == comm]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Inject one fault into one node's rank of a running job.")
    ap.add_argument("fault", choices=[f for f, d in FAULTS.items() if d.outside])
    ap.add_argument("--node", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--uid", type=int, required=True)
    ap.add_argument("--comm", required=True, help="/proc/PID/comm of the rank process")
    ap.add_argument("--find-timeout", type=float, default=180)
    ap.add_argument("--duty", type=float, default=0.3)
    ap.add_argument("--period-s", type=float, default=0.2)
    ap.add_argument("--quota-cpus", type=float, default=0.15)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--workers", type=int, default=6, help="stress-ng workers on that CPU")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    try:
        if a.fault == "cpu_quota":
            find_rank(a.node, a.uid, a.job, a.comm, a.find_timeout)
            print(f"inject: cpu_quota {a.quota_cpus} CPU on {a.node} job {a.job}", flush=True)
            cpu_quota(a.node, a.uid, a.job, a.quota_cpus)
            return 0
        pid, rank = find_rank(a.node, a.uid, a.job, a.comm, a.find_timeout)
        print(f"inject: {a.fault} on {a.node} pid {pid} rank {rank}", flush=True)
        if a.fault == "sigstop":
            sigstop_duty(pid, a.duty, a.period_s)
        elif a.fault == "corunner":
            corunner(pid, a.cpu, a.workers, lambda: other_ranks(a.node, a.uid, a.job, a.comm))
    except FaultUnavailable as e:
        print(f"inject: {a.fault}: {e}", file=sys.stderr, flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
