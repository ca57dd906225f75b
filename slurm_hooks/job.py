"""Job lookup behind one interface: pyslurm when a version-matched one is importable, else Slurm's
own commands (scontrol) completed by the hook environment. The command path is the tested one:
no pyslurm on PyPI matches Slurm 22.05/24.11 (docs/slurm.md)."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from typing import Protocol

from gpuprof.collector import environment as env
from gpuprof.collector.errors import JobLookupError
from gpuprof.slurm_hooks.paths import PatternContext, default_stdout, expand_stdout_pattern

SCONTROL_TIMEOUT_S = 10.0


@dataclass
class JobInfo:
    job_id: str
    user: str
    uid: int
    gid: int
    nodes: list[str]
    work_dir: str
    stdout: str  # expanded path
    state: str
    name: str = ""
    gpus: list[str] = field(default_factory=list)
    array_job_id: str | None = None
    array_task_id: str | None = None
    spank_modes: str | None = None


class JobSource(Protocol):
    def lookup(self, job_id: str) -> JobInfo: ...


def _run(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, check=False, timeout=SCONTROL_TIMEOUT_S)
    except FileNotFoundError:
        raise JobLookupError(f"{args[0]} not found: is Slurm installed and on PATH?") from None
    except subprocess.TimeoutExpired:
        raise JobLookupError(f"{shlex.join(args)} timed out after {SCONTROL_TIMEOUT_S} s") from None
    if p.returncode != 0:
        raise JobLookupError(f"{shlex.join(args)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def expand_hostlist(hostlist: str) -> list[str]:
    if not hostlist or hostlist in ("(null)", "None"):
        return []
    return _run(["scontrol", "show", "hostnames", hostlist]).split()


_ID_IN_PARENS = re.compile(r"^(?P<name>[^()]*)\((?P<id>\d+)\)$")


def parse_scontrol_record(text: str) -> dict[str, str]:
    """`scontrol show job -o` prints Key=Value pairs separated by spaces; values may contain spaces
    only in a few known keys (Command, Comment...), which come as the rest of the line segment."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z:/_]+)=(.*?)(?=\s[A-Za-z:/_]+=|$)", text.strip()):
        out[m.group(1)] = m.group(2)
    return out


class ScontrolJobs:
    """Slurm's own commands: `scontrol show job -o ID`."""

    def lookup(self, job_id: str) -> JobInfo:
        text = _run(["scontrol", "show", "job", "-o", job_id])
        rec = parse_scontrol_record(text.splitlines()[0] if text else "")
        for key in ("JobId", "UserId", "GroupId", "JobState", "WorkDir"):
            if key not in rec:
                raise JobLookupError(f"scontrol show job {job_id}: field {key} missing in its output")
        user_m = _ID_IN_PARENS.match(rec["UserId"])
        group_m = _ID_IN_PARENS.match(rec["GroupId"])
        if not user_m or not group_m:
            raise JobLookupError(f"scontrol show job {job_id}: cannot parse UserId/GroupId {rec['UserId']!r}")
        nodes = expand_hostlist(rec.get("NodeList", ""))
        stdout = rec.get("StdOut", "")
        array_job = rec.get("ArrayJobId")
        array_task = rec.get("ArrayTaskId")
        if not stdout:
            stdout = default_stdout(rec["WorkDir"], array=array_job is not None)
        if "%" in stdout:  # scontrol expands it for running jobs; be safe on every version
            stdout = expand_stdout_pattern(
                stdout,
                PatternContext(job_id, rec.get("JobName", ""), user_m.group("name"), nodes[0] if nodes else "",
                               array_job, array_task),
            )
        gpus = []
        tres = rec.get("AllocTRES", "") + "," + rec.get("TresPerNode", "")
        if "gpu" in tres and env.get(env.SLURM_JOB_GPUS):
            gpus = (env.get(env.SLURM_JOB_GPUS) or "").split(",")
        return JobInfo(
            job_id=rec["JobId"],
            user=user_m.group("name"),
            uid=int(user_m.group("id")),
            gid=int(group_m.group("id")),
            nodes=nodes,
            work_dir=rec["WorkDir"],
            stdout=stdout,
            state=rec["JobState"],
            name=rec.get("JobName", ""),
            gpus=gpus,
            array_job_id=array_job,
            array_task_id=array_task,
        )


class PyslurmJobs:
    """pyslurm, used only when a build matching the running Slurm is importable."""

    def __init__(self) -> None:
        import pyslurm

        self._pyslurm = pyslurm

    def lookup(self, job_id: str) -> JobInfo:
        try:
            job = self._pyslurm.Job.load(int(job_id))
        except (self._pyslurm.RPCError, ValueError) as e:
            raise JobLookupError(f"pyslurm: job {job_id}: {e}") from None
        return JobInfo(
            job_id=str(job.id),
            user=job.user_name,
            uid=int(job.user_id),
            gid=int(job.group_id),
            nodes=list(self._pyslurm.utils.expand_hostlist(job.nodes or "")) if job.nodes else [],
            work_dir=job.working_directory,
            stdout=job.standard_output or default_stdout(job.working_directory, False),
            state=job.state,
            name=job.name or "",
        )


def job_source() -> JobSource:
    """pyslurm when one matching this Slurm imports, else scontrol."""
    try:
        return PyslurmJobs()
    except ImportError:
        return ScontrolJobs()


def from_hook_environment() -> JobInfo:
    """What the Prolog/Epilog environment alone says (no RPC): used when scontrol is unavailable
    and to fill in the modes. Fields Slurm did not give raise JobLookupError naming them."""
    missing = [v for v in (env.SLURM_JOB_ID, env.SLURM_JOB_UID, env.SLURM_JOB_GID) if env.get(v) is None]
    if missing:
        raise JobLookupError(f"hook environment lacks {', '.join(missing)}")
    job_id = env.get(env.SLURM_JOB_ID) or ""
    uid = int(env.get(env.SLURM_JOB_UID) or "")
    user = env.get(env.SLURM_JOB_USER)
    if user is None:
        import pwd

        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            raise JobLookupError(f"job {job_id}: SLURM_JOB_USER unset and uid {uid} unknown") from None
    work_dir = env.get(env.SLURM_JOB_WORK_DIR) or ""
    nodelist = env.get(env.SLURM_JOB_NODELIST) or env.get(env.SLURM_NODELIST) or ""
    node = env.get(env.SLURMD_NODENAME) or ""
    stdout = env.get(env.SLURM_JOB_STDOUT) or (default_stdout(work_dir, False) if work_dir else "")
    array_job = env.get(env.SLURM_ARRAY_JOB_ID)
    array_task = env.get(env.SLURM_ARRAY_TASK_ID)
    if stdout and "%" in stdout:
        first = nodelist.split(",")[0].split("[")[0] if nodelist else node
        if "[" in nodelist:
            try:
                first = expand_hostlist(nodelist)[0]
            except JobLookupError:
                first = node
        stdout = expand_stdout_pattern(
            stdout, PatternContext(job_id, env.get(env.SLURM_JOB_NAME) or "", user, first, array_job, array_task)
        )
    return JobInfo(
        job_id=job_id,
        user=user,
        uid=uid,
        gid=int(env.get(env.SLURM_JOB_GID) or ""),
        nodes=[],
        work_dir=work_dir,
        stdout=stdout,
        state="UNKNOWN",
        gpus=[g for g in (env.get(env.SLURM_JOB_GPUS) or "").split(",") if g],
        array_job_id=array_job,
        array_task_id=array_task,
        spank_modes=env.profile_modes_hook(),
    )
