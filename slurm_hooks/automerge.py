"""The merge at job end, without touching the user's job script.

Mechanism (docs/slurm.md, "The merge at job end"): the Epilog of the job's first node runs as root
once the job has ended there, with the job's user and the --profile-gpu option in its environment.
It submits, as the job's user (runuser) and with a clean environment (sbatch --export with only
PATH and HOME, never slurmd's), a small job `gpuprof-merge-<id>` that depends on the profiled job
(afterany). That job waits until every node's epilog has placed its trace, then runs the MPI merge
with up to `merge.max_ranks` ranks, with the launcher of `merge.mpirun` (mpirun, or srun with the
site's PMI), and writes `<stdout stem>.gpuprof.{h5,txt,json,html}` beside the job's output.
Why the node Epilog and not EpilogSlurmctld: with the usual SlurmUser=slurm, EpilogSlurmctld runs as
`slurm`, which cannot become the job's user; slurmd's Epilog runs as root on every site
(`merge.submit_from = "epilog_slurmctld"` keeps the old way for sites with SlurmUser=root). Why not
a final step of the batch script: the script is the user's and stays unmodified.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuprof.collector import environment as env
from gpuprof.collector.errors import GpuprofError, JobLookupError
from gpuprof.slurm_hooks.job import JobInfo, expand_hostlist, job_source
from gpuprof.slurm_hooks.paths import node_dir_for_stdout, stdout_stem


def merge_job_command(job: JobInfo, cfg: dict[str, Any], python: str) -> list[str]:
    """The sbatch command line that submits the merge job (run as the job's user)."""
    node_dir = node_dir_for_stdout(job.stdout, cfg["hooks"]["output_dir_template"], work_dir=job.work_dir,
                                   job_id=job.job_id, user=job.user)
    ranks = max(1, min(int(cfg["merge"]["max_ranks"]), len(job.nodes) or 1))
    body = shlex.join([python, "-m", "gpuprof.slurm_hooks.automerge", "run", "--job", job.job_id, "--dir", str(node_dir),
                       "--stdout", job.stdout, "--nodes", ",".join(job.nodes), "--ranks", str(ranks),
                       "--mpirun", cfg["merge"]["mpirun"]])
    return [
        "sbatch", "--parsable", f"--job-name=gpuprof-merge-{job.job_id}",
        # the merge job's environment: these and Slurm's own variables, nothing of the submitter's
        f"--export=PATH={CLEAN_PATH},HOME={_home_of(job.user)}",
        f"--dependency=afterany:{job.job_id}", "--nodes=1", f"--ntasks={ranks}", "--overcommit",
        f"--chdir={job.work_dir}", f"--output={node_dir.parent}/{stdout_stem(job.stdout)[1]}.gpuprof-merge.log",
        f"--time={int(cfg['merge']['time_limit_min'])}", f"--wrap={body}",
    ]


CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"


def submit(job_id: str, cfg: dict[str, Any], job: JobInfo | None = None) -> str:
    """Submit the merge job as the job's user; returns its id. The submission and the merge job get a
    clean environment (PATH, HOME, SLURM_CONF), not the hook's."""
    job = job or job_source().lookup(job_id)
    cmd = merge_job_command(job, cfg, sys.executable)
    if os.geteuid() == 0 and job.uid != 0:
        cmd = ["runuser", "-u", job.user, "--", *cmd]
    home = _home_of(job.user)
    # runuser lives in sbin; the merge job itself gets CLEAN_PATH (merge_job_command's --export)
    environ = {"PATH": f"/usr/local/sbin:/usr/sbin:/sbin:{CLEAN_PATH}", "HOME": home, "LANG": "C.UTF-8"}
    if env.get(env.SLURM_CONF):
        environ["SLURM_CONF"] = env.get(env.SLURM_CONF) or ""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False, env=environ)
    if p.returncode != 0:
        raise GpuprofError(f"job {job_id}: merge job not submitted: {p.stderr.strip()}")
    return p.stdout.strip()


def _home_of(user: str) -> str:
    import pwd

    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        return "/"


def launcher_flavour(launcher: str) -> str:
    """"openmpi", "hydra" (MPICH's and Intel MPI's mpiexec) or "unknown", from `launcher --version`:
    the two take different options (hydra rejects Open MPI's --oversubscribe and needs none)."""
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "hydra" in text:
        return "hydra"
    return "unknown"


def launch_command(mpirun: str, ranks: int, python: str) -> list[str]:
    """The merge's MPI launch: `merge.mpirun` is an mpirun (Open MPI, MPICH's hydra) or srun with the
    site's PMI (e.g. 'srun --mpi=pmix'), inside the merge job's allocation. The merge job may get
    fewer CPUs than ranks: Open MPI then needs --oversubscribe, srun --overcommit; hydra places
    any number of ranks as it is."""
    words = shlex.split(mpirun) or ["mpirun"]
    tail = [python, "-m", "mpi4py", "-m", "gpuprof.slurm_hooks.cli"]
    if Path(words[0]).name == "srun":
        return [*words, "-n", str(ranks), "--overcommit", *tail]
    extra = ["--oversubscribe"] if launcher_flavour(words[0]) == "openmpi" else []
    return [*words, "-n", str(ranks), *extra, *tail]


def wait_for_node_files(job_id: str, node_dir: Path, nodes: list[str], timeout_s: float) -> list[str]:
    """Wait until every node's trace is placed, or the job has left COMPLETING and nothing new came
    for a while, or the timeout; returns the nodes still missing (the merge reports them)."""
    deadline = time.monotonic() + timeout_s
    last_change, last_count = time.monotonic(), -1
    while True:
        missing = [n for n in nodes if not (node_dir / f"{n}.h5").exists()]
        if not missing:
            return []
        if len(missing) != last_count:
            last_count, last_change = len(missing), time.monotonic()
        if time.monotonic() > deadline:
            return missing
        if time.monotonic() - last_change > 15 and not _completing(job_id):
            return missing
        time.sleep(0.5)


def _completing(job_id: str) -> bool:
    try:
        return "COMPLETING" in job_source().lookup(job_id).state
    except JobLookupError:
        return False


def run(job_id: str, node_dir: Path, stdout: str, nodes: list[str], ranks: int, mpirun: str = "mpirun") -> int:
    """Body of the merge job."""
    missing = wait_for_node_files(job_id, node_dir, nodes, timeout_s=300)
    if missing:
        print(f"gpuprof merge: job {job_id}: no trace from {', '.join(missing)} after waiting", flush=True)
    d, stem = stdout_stem(stdout)
    cmd = [*launch_command(mpirun, ranks, sys.executable),
           "merge", str(node_dir), "--output-stem", str(d / stem), "--expect-nodes", ",".join(nodes), "--progress"]
    environ = dict(os.environ)
    if os.geteuid() == 0:
        environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print("gpuprof merge:", shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env=environ, check=False).returncode


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gpuprof.slurm_hooks.automerge")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--job", required=True)
    r.add_argument("--dir", required=True)
    r.add_argument("--stdout", required=True)
    r.add_argument("--nodes", required=True)
    r.add_argument("--ranks", type=int, required=True)
    r.add_argument("--mpirun", default="mpirun")
    a = ap.parse_args(argv)
    return run(a.job, Path(a.dir), a.stdout, [n for n in a.nodes.split(",") if n], a.ranks, a.mpirun)


def allocated_nodes(job: JobInfo) -> list[str]:
    """The job's nodes as allocated, from the Epilog's SLURM_JOB_NODELIST (Slurm 23.02 on) or
    SLURM_NODELIST (22.05: slurmd sets it from the job's credential); the lookup's when neither is
    set. The lookup's NodeList of a completing job loses each node whose epilog has finished (seen
    on Slurm 22.05: node[1-4], then node1,node[3-4], then node3): a later node then took itself for
    the first, and the local cluster had up to three merge jobs for one job, each expecting fewer
    nodes."""
    listed = env.get(env.SLURM_JOB_NODELIST) or env.get(env.SLURM_NODELIST)
    return expand_hostlist(listed) if listed else job.nodes


def from_node_epilog(cfg: dict[str, Any], job_id: str, node: str, log: Any) -> None:
    """The node Epilog's part (merge.submit_from = "node_epilog"): on the job's first node only,
    submit the merge job. Never raises: a merge not submitted is logged, the job is already done."""
    if not cfg["merge"]["auto"] or cfg["merge"]["submit_from"] != "node_epilog":
        return
    try:
        job = job_source().lookup(job_id)
        job = dataclasses.replace(job, nodes=allocated_nodes(job))
        if not job.nodes or job.nodes[0] != node:
            return
        merge_id = submit(job_id, cfg, job)
        log.info("merge job %s submitted (first node of the job)", merge_id)
    except (GpuprofError, OSError, subprocess.SubprocessError) as e:
        log.error("automatic merge not started: %s (run `mpirun gpuprof merge DIR` by hand)", e)


def epilog_slurmctld(config_path: str | None = None) -> int:
    """EpilogSlurmctld (only with merge.submit_from = "epilog_slurmctld" and SlurmUser=root): submit
    the merge job for a profiled job. Always returns 0."""
    from gpuprof.collector import config as config_mod
    from gpuprof.slurm_hooks import log as log_mod

    job_id = env.get(env.SLURM_JOB_ID) or "?"
    log = log_mod.setup("epilog-slurmctld", job_id, "slurmctld")
    if env.get(env.SPANK_OPTION_HOOK) is None:
        return 0
    try:
        cfg = config_mod.load(config_path)
        log = log_mod.setup("epilog-slurmctld", job_id, "slurmctld", cfg["paths"]["log_file"])
        if not cfg["merge"]["auto"] or cfg["merge"]["submit_from"] != "epilog_slurmctld":
            return 0  # the node Epilog submits it (merge.submit_from)
        if os.geteuid() != 0:
            log.error("EpilogSlurmctld runs as uid %d (SlurmUser is not root): it cannot submit the merge as "
                      "the job's user; set merge.submit_from = \"node_epilog\"", os.geteuid())
            return 0
        merge_id = submit(job_id, cfg)
        log.info("merge job %s submitted", merge_id)
    except (GpuprofError, OSError, subprocess.SubprocessError) as e:
        log.error("automatic merge not started: %s (run `mpirun gpuprof merge DIR` by hand)", e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
