"""Record, merge and score the real-application fault-injection runs.

One run = one (app, fault, index): a real `sbatch -N<nodes> --profile-gpu` job of the application on
the local cluster, submitted as the unprivileged test user, the fault applied (from outside by a
helper process, or through the job's environment), the job waited for, its node files (the recording)
copied into the cache with the ground truth, then `gpuprof merge` on the copy and the report scored.

Cache layout (default /var/tmp/gpuprof-realapps, or $GPUPROF_REALAPPS_CACHE, or --cache):

    <cache>/<app>-<fault>-<index>/
        ground_truth.json     app, fault, node, rank, cause, the job, the rank -> node map, parameters
        recording/nodeN.h5    the node files as the epilog placed them (copied, root-owned)
        merged.gpuprof.*      the merge of recording/ (rewritten by every --rescore)
        score.json            this run's score
        work/                 the job's working directory (the user's: job script, inputs, output)
        inject.log            the injector helper's output (outside faults)

`--rescore` only re-merges the recordings already in the cache (seconds per run), for when the
analysis changed. Without it, a run whose recording is already complete is re-merged, not re-run,
unless --force.

    .venv/bin/python -m realapps.runner --apps train,hpcc --faults balanced,sigstop --runs 1   (cwd tests/)
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import apps as apps_mod
from . import faults as faults_mod
from . import scoring, slurm

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GPUPROF = REPO / ".venv" / "bin" / "gpuprof"
PYTHON = REPO / ".venv" / "bin" / "python"
LAUNCH = HERE / "launch.sh"
SHIM = HERE / "build" / "libslow_collectives.so"
DEFAULT_CACHE = Path(os.environ.get("GPUPROF_REALAPPS_CACHE", "/var/tmp/gpuprof-realapps"))
# Per application: the busy wait of slow_collectives after each collective (us), sized to the
# application's collective rate so that the run stays well under a minute.
SLOW_COLLECTIVE_US = {"train": 4000, "hpcc": 300, "meep": 1000, "netpipe": 2000}
RANK_LINE = re.compile(r"^realapps: rank (\d+) node (\S+) pid (\d+)$", re.MULTILINE)
JOB_TIMEOUT_S = 600  # from submission: includes time pending behind other jobs


class RunError(RuntimeError):
    """A run could not be recorded or merged (the message names the run and what failed)."""


@dataclass(frozen=True)
class RunSpec:
    app: apps_mod.App
    fault: faults_mod.Fault
    index: int

    @property
    def name(self) -> str:
        return f"{self.app.name}-{self.fault.name}-{self.index}"

    @property
    def target_rank(self) -> int:
        """The rank the fault is aimed at: rank nodes/2 for index 0, then the next ones."""
        return (self.app.nodes // 2 + self.index) % self.app.nodes

    @property
    def target_node(self) -> str:
        """Its node under mpirun's default mapping (one rank per node, in node order); the truth is
        taken from the job's own output afterwards."""
        return f"node{self.target_rank + 1}"


def build_shim() -> Path:
    """Build the LD_PRELOAD library (make -C tests/realapps) when it is missing or older than its source."""
    src = HERE / "slow_collectives.c"
    if not SHIM.exists() or SHIM.stat().st_mtime < src.stat().st_mtime:
        p = subprocess.run(["make", "-s", "-C", str(HERE)], capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RunError(f"building {SHIM} from {src} failed:\n{p.stderr.strip()}")
    return SHIM


def job_script(spec: RunSpec) -> str:
    """The batch script: an ordinary MPI job script, one rank per node, as the demo's."""
    env = ["export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1"]
    xs = ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"]
    argv = list(spec.app.argv)
    if spec.fault.name == "slow_collectives":
        env.append(f"export REALAPPS_PRELOAD={SHIM} REALAPPS_SLOW_RANK={spec.target_rank} "
                   f"REALAPPS_DELAY_US={SLOW_COLLECTIVE_US.get(spec.app.name, 1000)}")
        xs += ["REALAPPS_PRELOAD", "REALAPPS_SLOW_RANK", "REALAPPS_DELAY_US"]
    if spec.fault.name == "load_sleep":
        argv += [*spec.app.load_sleep_argv, "--slow-rank", str(spec.target_rank)]
    # Ranks share 2 cores: without yield_when_idle every rank's orted sees one rank on a 2-CPU node
    # and Open MPI busy-polls, which makes a 30 s job take minutes.
    mpirun = ["mpirun", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
              *[a for x in xs for a in ("-x", x)], str(LAUNCH), *argv]
    return "\n".join([
        "#!/bin/bash",
        f"# tests/realapps run {spec.name}: {spec.app.doc}; fault: {spec.fault.doc}",
        f"#SBATCH --job-name=realapps-{spec.name}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --time=10",
        "set -euo pipefail",
        *env,
        'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        " ".join(mpirun),
        "",
    ])


def _open_dir_nofollow(path: Path, parent_fd: int | None = None) -> int:
    return os.open(path.name if parent_fd is not None else path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                   dir_fd=parent_fd)


def copy_user_files(work: Path, node_dir_name: str, names: list[str], dest: Path, uid: int) -> None:
    """Copy node files out of the job user's directory into root-owned dest without following a
    link anywhere (each component opened with O_NOFOLLOW relative to its parent, regular files of
    the user only)."""
    dest.mkdir(parents=True, exist_ok=True)
    wfd = _open_dir_nofollow(work)
    try:
        dfd = os.open(node_dir_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=wfd)
        try:
            for name in names:
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                except OSError as e:
                    raise RunError(f"{work / node_dir_name / name}: cannot open ({e.strerror})") from e
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (uid, 0):
                        raise RunError(f"{work / node_dir_name / name}: not a regular file of uid {uid}")
                    tmp = dest / f".{name}.part"
                    with open(tmp, "wb") as out:
                        while chunk := os.read(fd, 1 << 20):
                            out.write(chunk)
                    os.replace(tmp, dest / name)
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
    finally:
        os.close(wfd)


def wait_node_files(node_dir: Path, nodes: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((node_dir / f"{n}.h5").is_file() and (node_dir / f"{n}.h5").stat().st_size > 0 for n in nodes):
            return
        time.sleep(0.5)
    missing = [n for n in nodes if not (node_dir / f"{n}.h5").is_file()]
    raise RunError(f"{node_dir}: no node file from {', '.join(missing)} after {timeout:.0f} s")


def wait_automerge(jobid: str, timeout: float) -> None:
    """Let the merge job that EpilogSlurmctld submits finish first, so that it does not share the two
    cores with the next run (its result in work/ is the product's own; ours is re-merged)."""
    deadline = time.monotonic() + timeout
    name = f"gpuprof-merge-{jobid}"
    # EpilogSlurmctld submits it a moment after the job ends: give it 15 s to show up.
    appear = time.monotonic() + 15
    while time.monotonic() < appear and not slurm.queued(name):
        time.sleep(0.5)
    # Only while it runs: pending behind other users' jobs, it would hold this run up for nothing.
    while time.monotonic() < deadline and slurm.queued(name, "R,CG"):
        time.sleep(1)


def rank_map(out_text: str, out_path: Path) -> dict[int, str]:
    m = {int(r): node for r, node, _ in RANK_LINE.findall(out_text)}
    if not m:
        raise RunError(f"{out_path}: no 'realapps: rank R node N pid P' line from tests/realapps/launch.sh")
    return m


def check_injected(log_path: Path, out_text: str, out_path: Path, node: str) -> None:
    """The helper's target is the rank that the launcher reported on that node (same pid)."""
    log_text = log_path.read_text(errors="replace")
    m = re.search(r"^inject: \S+ on (\S+) pid (\d+)", log_text, re.MULTILINE)
    if m is None:
        if "inject: cpu_quota" in log_text:
            return
        raise RunError(f"{log_path}: the injector never found its rank:\n{log_text[-1000:]}")
    pids = {n: int(pid) for _, n, pid in RANK_LINE.findall(out_text)}
    if m.group(1) != node or pids.get(node) != int(m.group(2)):
        raise RunError(f"{log_path}: injected into {m.group(1)} pid {m.group(2)}, but {out_path} has the rank "
                       f"of {node} as pid {pids.get(node)}")


EFFECT_LINE = re.compile(r"^inject: effect rank_cpu_per_s (\S+) others_cpu_per_s (\S+) "
                         r"rank_wait_share (\S+) others_wait_share (\S+)$", re.MULTILINE)


def fault_effect(log_path: Path, fault: str) -> dict[str, Any] | None:
    """What the injector measured of its fault's effect (the co-runner's: how much more of the time
    it wanted a CPU the rank waited for one than the job's other ranks did), with whether it took
    effect; None for a fault that measures none. A co-runner that measured nothing counts as without
    effect: nothing shows it took CPU."""
    if fault != "corunner":
        return None
    text = log_path.read_text(errors="replace")
    m = EFFECT_LINE.search(text)
    if m is None:
        return {"took_effect": False, "why": "the injector printed no effect line", "log": text[-500:]}
    rank_cpu, others_cpu, rank_wait, others_wait = (float(g) for g in m.groups())
    gap = rank_wait - others_wait
    return {"rank_cpu_per_s": rank_cpu, "others_cpu_per_s": others_cpu, "rank_wait_share": rank_wait,
            "others_wait_share": others_wait, "wait_gap": round(gap, 3),
            "min_wait_gap": faults_mod.CORUNNER_EFFECT_MIN_WAIT_GAP,
            "took_effect": gap >= faults_mod.CORUNNER_EFFECT_MIN_WAIT_GAP}


def world_rank_in_file(path: Path, world: int) -> int | None:
    """The rank that the node's calls on a communicator of the job's size carry (None: no such call)."""
    import numpy as np

    from gpuprof.collector.reader import open_node_trace
    from gpuprof.collector.schema import COLLECTIVE_CALLS

    calls = open_node_trace(path).table(COLLECTIVE_CALLS.path)
    sel = calls[calls["comm_size"] == world]
    if len(sel) == 0:
        return None
    vals, counts = np.unique(sel["comm_rank"], return_counts=True)
    return int(vals[np.argmax(counts)])


def record(spec: RunSpec, cache: Path, user: str = slurm.TEST_USER) -> Path:
    """Run the job, inject, wait, copy the recording and write ground_truth.json; returns the run dir."""
    spec.app.check()
    run_dir = cache / spec.name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, mode=0o755)
    run_dir.chmod(0o755)
    for p in (cache, *cache.parents):
        if p == Path("/"):
            break
        if not p.stat().st_mode & 0o001:
            raise RunError(f"{p}: not traversable by {user} (mode {oct(p.stat().st_mode)})")
    pw = pwd.getpwnam(user)
    work = run_dir / "work"
    work.mkdir(mode=0o755)
    spec.app.prepare(work)
    (work / "job.sh").write_text(job_script(spec))
    for p in [work, *work.iterdir()]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    if spec.fault.name == "slow_collectives":
        build_shim()
    nodes = [f"node{i + 1}" for i in range(spec.app.nodes)]
    t0 = time.time()
    jobid = slurm.sbatch([f"-N{spec.app.nodes}", "--profile-gpu", f"--chdir={work}", str(work / "job.sh")],
                         user=user, cwd=work)
    injector: subprocess.Popen[bytes] | None = None
    inject_args: list[str] = []
    if spec.fault.outside:
        inject_args = [str(PYTHON), "-m", "realapps.faults", spec.fault.name, "--node", spec.target_node,
                       "--job", jobid, "--uid", str(pw.pw_uid), "--comm", spec.app.comm,
                       "--quota-cpus", str(spec.app.quota_cpus), "--find-timeout", str(JOB_TIMEOUT_S)]
        with open(run_dir / "inject.log", "wb") as log:
            injector = subprocess.Popen(inject_args, cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT)
    try:
        info = slurm.wait_final(jobid, JOB_TIMEOUT_S)
    finally:
        inject_rc = None
        if injector is not None:
            injector.terminate()
            try:
                inject_rc = injector.wait(20)
            except subprocess.TimeoutExpired:
                injector.kill()
                inject_rc = injector.wait()
    t1 = time.time()
    out_path = work / f"slurm-{jobid}.out"
    out_text = out_path.read_text(errors="replace") if out_path.is_file() and not out_path.is_symlink() else ""
    if info.get("JobState") != "COMPLETED":
        raise RunError(f"{spec.name}: job {jobid} ended {info.get('JobState')} ({info.get('ExitCode')}); "
                       f"{out_path}:\n{out_text[-2000:]}")
    if injector is not None and inject_rc not in (0, -15):
        log_text = (run_dir / "inject.log").read_text(errors="replace")
        raise RunError(f"{spec.name}: injector {' '.join(inject_args)} exited {inject_rc}:\n{log_text[-2000:]}")
    node_dir_name = f"slurm-{jobid}.gpuprof.d"
    wait_node_files(work / node_dir_name, nodes, 120)
    wait_automerge(jobid, 300)
    copy_user_files(work, node_dir_name, [f"{n}.h5" for n in nodes], run_dir / "recording", pw.pw_uid)
    ranks = rank_map(out_text, out_path)
    if injector is not None:
        check_injected(run_dir / "inject.log", out_text, out_path, spec.target_node)
    node_of_rank = {r: n for r, n in ranks.items()}
    rank_of_node = {n: r for r, n in ranks.items()}
    if spec.fault.cause is None:
        node, rank = None, None
    elif spec.fault.outside:
        node = spec.target_node
        rank = rank_of_node.get(node)
    else:
        rank = spec.target_rank
        node = node_of_rank.get(rank)
    file_ranks = {n: world_rank_in_file(run_dir / "recording" / f"{n}.h5", spec.app.nodes) for n in nodes}
    truth: dict[str, Any] = {
        "app": spec.app.name, "fault": spec.fault.name, "index": spec.index, "cause": spec.fault.cause,
        "node": node, "rank": rank, "fault_doc": spec.fault.doc, "job_id": jobid, "nodes": nodes,
        "rank_of_node": rank_of_node, "world_rank_in_node_file": file_ranks,
        "job_started_realtime_s": t0, "job_ended_realtime_s": t1, "job_state": info.get("JobState"),
        "elapsed": info.get("RunTime"), "job_script": job_script(spec), "injector": inject_args,
        "slow_collective_us": SLOW_COLLECTIVE_US.get(spec.app.name) if spec.fault.name == "slow_collectives"
        else None,
        "fault_effect": fault_effect(run_dir / "inject.log", spec.fault.name) if injector is not None else None,
    }
    (run_dir / "ground_truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    return run_dir


def merge(run_dir: Path) -> dict[str, Any]:
    """`gpuprof merge` of the recording (one plain process); returns the JSON report."""
    truth = load_truth(run_dir)
    rec = run_dir / "recording"
    stem = run_dir / "merged"
    p = subprocess.run([str(GPUPROF), "merge", str(rec), "--output-stem", str(stem), "--quiet",
                        "--expect-nodes", ",".join(truth["nodes"])],
                       env=slurm.cluster_env(), capture_output=True, text=True, check=False, timeout=600)
    report = Path(f"{stem}.gpuprof.json")
    if p.returncode not in (0, 3) or not report.exists():
        raise RunError(f"gpuprof merge {rec} -> rc {p.returncode}: {p.stderr.strip()[-2000:]}")
    return json.loads(report.read_text())


def load_truth(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "ground_truth.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: no readable ground truth ({e})") from e


def recorded(run_dir: Path) -> bool:
    if not (run_dir / "ground_truth.json").exists():
        return False
    nodes = load_truth(run_dir)["nodes"]
    return all((run_dir / "recording" / f"{n}.h5").is_file() for n in nodes)


def score(run_dir: Path) -> scoring.RunScore:
    truth = load_truth(run_dir)
    s = scoring.score_run(merge(run_dir), truth, run_dir.name)
    (run_dir / "score.json").write_text(json.dumps(s.as_dict(), indent=1) + "\n")
    return s


def plan(app_names: list[str], fault_names: list[str], runs: int) -> list[RunSpec]:
    specs = []
    for a in app_names:
        app = apps_mod.get(a)
        for f in fault_names:
            if f not in faults_mod.FAULTS:
                raise RunError(f"unknown fault {f!r}; known: {', '.join(faults_mod.FAULTS)}")
            if f not in app.faults:
                continue
            specs += [RunSpec(app, faults_mod.FAULTS[f], i) for i in range(runs)]
    return specs


def run_all(specs: list[RunSpec], cache: Path, rescore: bool = False, force: bool = False,
            log: Any = sys.stderr) -> list[scoring.RunScore]:
    """Record (unless already recorded, or --rescore), merge and score every run; a failed run is
    scored as an error with its message, the others go on."""
    out = []
    for spec in specs:
        run_dir = cache / spec.name
        t = time.monotonic()
        try:
            if rescore:
                if not recorded(run_dir):
                    print(f"realapps: {spec.name}: not recorded in {cache}, skipped", file=log, flush=True)
                    continue
            elif force or not recorded(run_dir):
                print(f"realapps: {spec.name}: recording", file=log, flush=True)
                record(spec, cache)
            s = score(run_dir)
        except (RunError, slurm.SlurmError, apps_mod.AppUnavailable, TimeoutError, OSError) as e:
            s = scoring.RunScore(app=spec.app.name, fault=spec.fault.name, run=spec.name,
                                 balanced=spec.fault.cause is None, error=str(e))
        print(f"realapps: {spec.name}: {s.findings} findings, {s.true_positive} true, "
              f"{s.error or s.merge_status} ({time.monotonic() - t:.0f} s)", file=log, flush=True)
        out.append(s)
    return out


def bench_lines(scores: list[scoring.RunScore]) -> list[dict[str, Any]]:
    keys = sorted({(s.app, s.fault) for s in scores})
    lines = [scoring.aggregate([s for s in scores if (s.app, s.fault) == k], *k) for k in keys]
    lines.append(scoring.aggregate(scores, "all", "all"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--apps", default=",".join(apps_mod.APPS))
    ap.add_argument("--faults", default=",".join(faults_mod.FAULTS))
    ap.add_argument("--runs", type=int, default=1, help="runs per (app, fault)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--rescore", action="store_true", help="only re-merge and score recorded runs")
    ap.add_argument("--force", action="store_true", help="record again even when recorded")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("realapps: needs root (submits as the test user, injects faults into its processes)", file=sys.stderr)
        return 2
    a.cache.mkdir(parents=True, exist_ok=True)
    a.cache.chmod(0o755)
    specs = plan([x for x in a.apps.split(",") if x], [x for x in a.faults.split(",") if x], a.runs)
    scores = run_all(specs, a.cache, rescore=a.rescore, force=a.force)
    for line in bench_lines(scores):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
