"""Is the collector's job still there? Asked of Slurm (`scontrol show job -o JOB`) only while the
job has no process on this node: a collector whose epilog never came (the prolog's state was lost,
slurmd was down at job end) stops by itself once Slurm says the job is over.

Why Slurm and not the processes alone: between the steps of a batch job the other nodes of the job
run nothing, and a job without PrologFlags=Contain has no process there at all; an empty pid set
is not the end of the job. A final state is: the job leaves COMPLETING only after every node's
epilog has run, so a collector that sees it was missed by its epilog.
"""

from __future__ import annotations

import re
import shutil
import subprocess

# Job states in which a job still holds its nodes (scontrol's JobState, flags stripped).
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING",
                         "REQUEUED", "SIGNALING", "STAGE_OUT"})
_STATE = re.compile(r"(?:^|\s)JobState=(\S+)")


def job_state(job_id: str, timeout_s: float = 5.0) -> tuple[str, str]:
    """("gone", why) when Slurm says definitely that the job is over, ("live", state) while it
    holds its nodes, ("unknown", why) when Slurm cannot tell (scontrol missing, slurmctld
    unreachable): in doubt the job is not gone."""
    exe = shutil.which("scontrol")
    if exe is None:
        return "unknown", "scontrol not found"
    try:
        p = subprocess.run([exe, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=timeout_s,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "unknown", f"scontrol: {e}"
    if p.returncode != 0:
        if "Invalid job id" in p.stderr + p.stdout:
            return "gone", f"Slurm does not know job {job_id} any more"
        return "unknown", (p.stderr or p.stdout).strip()[:200]
    m = _STATE.search(p.stdout)
    if m is None:
        return "unknown", f"no JobState in scontrol's answer for job {job_id}"
    state = m.group(1).split("+")[0]
    return ("live", state) if state in LIVE_STATES else ("gone", f"job {job_id} is {state}")
