"""Continuous mode figures (issue 16), one JSON object per line. GPU values come from the NVML test
double (8 emulated GPUs): every line says "emulated": true, they are costs, not GPU measurements.

    .venv/bin/python tests/bench/bench_continuous.py           3 interleaved runs of 40 s each
    .venv/bin/python tests/bench/bench_continuous.py --quick   one run of 8 s each (smoke)

continuous_cpu: `gpuprof collect --continuous` (config [continuous] defaults: metrics at 1 Hz,
retention_min 10) on a node running one busy job of 16 MPI processes
(tests/progs/mpi_bench selfpaced, an MPI_Allreduce every 10 ms each, in a real freezer cgroup where
Slurm puts a job). Interleaved with the baseline measured in the same run: the job mode's collector
(`gpuprof collect --job`, same modes, its default 10 Hz) on the same job. Each figure is the median
of the runs with min and max:
  cpu_percent_of_core   utime+stime of the collector over the window (after WARM_S), per core
  rss_mb                VmRSS at the end of the window
continuous_cpu_with_collectives: the same with modes metrics,collectives (collectives from the
uprobes, every call of the 16 ranks decoded in Python: the opt-in's cost; no baseline, see cpu_line).
  retained_mb_per_min   what retention holds in memory per minute recorded (its status), so the
                        10-minute figure is this x 10 (projected_retention_mb), capped by
                        continuous.memory_limit_mb (the spill takes the rest)
time_to_detect: a real MPI job on the local cluster's 4 nodes (STEP_APP: 4 mpi4py ranks, each step
20 ms of waiting, then MPI_Allreduce), one continuous collector per node (modes metrics,collectives; sockets and spills per node
through {node}), `gpuprof watch`'s refresh (collector/watch.py watch_once) every second from the
start; at a random time 12-25 s in, one random rank is stopped 50 ms of every 200 ms until the
watch names its node. median_s/max_s over the trials (5; --quick 1), and the findings before the
fault (false_positives_before_fault, goal 0). `--only cpu|export|detect` runs one figure.
export_window: 5 minutes of one node exported with `gpuprof export --last 5m`: the spill directory
is filled with 5 minutes of rows at the continuous rates and 16 ranks' collectives (100 calls/s
each; synthetic rows, written by this script), a continuous collector restores it at start, and the
export (restore, window cut, HDF5 write, copy to the caller's descriptor) is timed end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "nvml_double"))
sys.path.insert(0, str(Path(__file__).parent))
import bench_collector as bc  # the busy job and the /proc readers are the job-mode bench's
import double

from gpuprof.collector import schema

WARM_S = 4.0
GOAL_CPU_PERCENT = 1.0
S = 1_000_000_000


def write_config(tmp: Path) -> Path:
    (tmp / "run").mkdir(exist_ok=True)
    f = tmp / "c.toml"
    f.write_text("[continuous]\n"
                 f'spill_dir = "{tmp / "spill"}"\nexport_dir = "{tmp / "exports"}"\nsocket = "{tmp / "run" / "c.sock"}"\n')
    return f


def wait_socket(sock: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    from gpuprof.collector.continuous import client_request
    from gpuprof.collector.errors import GpuprofError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode}")
        if sock.exists():
            try:
                st = client_request(sock, {"cmd": "status"}, timeout_s=2.0)
                if st.get("state") == "recording" and st.get("attached"):
                    return
            except GpuprofError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"continuous collector not recording after {timeout_s} s")


def one_run(kind: str, modes: str, window_s: float, tmp: Path, k: int, env: dict[str, str]) -> dict[str, Any]:
    from gpuprof.collector.continuous import client_request

    job, node = f"{os.getpid()}{k}", "benchcont"
    run_dir = tmp / f"run{k}"
    run_dir.mkdir()
    busy = bc.BusyJob(job, node, run_dir, window_s + WARM_S + 120, {})
    conf = write_config(run_dir)
    sock = run_dir / ("run/c.sock" if kind == "continuous" else "job.sock")
    args = (["--config", str(conf), "collect", "--continuous", "--node", node, "--modes", modes]
            if kind == "continuous" else
            ["collect", "--job", job, "--node", node, "--uid", "0", "--modes", modes, "--gpus", "all",
             "--output", str(run_dir / "n.h5"), "--control-socket", str(sock)])
    with open(run_dir / "log", "wb") as log:
        coll = subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        if kind == "continuous":
            wait_socket(sock, coll, 120)
        else:
            bc.wait_attached(sock, coll, 120)
        busy.go()
        time.sleep(WARM_S)
        c0, t0 = bc.cpu_s(coll.pid), time.monotonic()
        time.sleep(window_s)
        c1, t1 = bc.cpu_s(coll.pid), time.monotonic()
        out = {"cpu_percent_of_core": 100.0 * (c1 - c0) / (t1 - t0), "rss_mb": bc.status_mb(coll.pid, "VmRSS")}
        if kind == "continuous":
            st = client_request(sock, {"cmd": "status"})["continuous"]["retention"]
            minutes = max(1e-9, st["retained_s"] / 60)
            out["retained_mb_per_min"] = st["memory_bytes"] / 1e6 / minutes
            out["memory_limit_mb"] = st["memory_limit_bytes"] / 2**20
            out["pids"] = len(busy_pids(busy))
        return out
    finally:
        coll.send_signal(signal.SIGTERM)
        try:
            coll.wait(30)
        except subprocess.TimeoutExpired:
            coll.kill()
            coll.wait()
        busy.stop()


def busy_pids(busy: bc.BusyJob) -> list[str]:
    return (busy.cgroup / "cgroup.procs").read_text().split()


def spill_five_minutes(spill: Path, ranks: int = 16, calls_per_s: int = 100, gpus: int = 8) -> int:
    """5 minutes of one node, ending now, as spilled 30-s segments of the current boot."""
    from gpuprof.collector.continuous import Retention

    tables = schema.tables_for_modes(("metrics", "collectives"))
    r = Retention(tables, retention_s=600, memory_limit_bytes=1 << 30, segment_s=30, spill_dir=spill,
                  spill_limit_bytes=1 << 32)
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    rt = time.clock_gettime_ns(time.CLOCK_REALTIME)
    t0 = now - 300 * S
    rng = np.random.default_rng(1)
    total = 0
    for seg in range(10):
        a = t0 + seg * 30 * S
        secs = np.arange(30, dtype=np.int64) * S + a
        cp = schema.CLOCK_PAIRS.empty(30)
        cp["monotonic_ns"], cp["realtime_ns"], cp["uncertainty_ns"] = secs, secs - now + rt, 1000
        host = schema.HOST_NODE.empty(30)
        host["t_ns"], host["cpu_busy"] = secs, 0.5
        gs = schema.GPU_SAMPLES.empty(30 * gpus)
        gs["t_ns"], gs["gpu"], gs["util_gpu"] = np.repeat(secs, gpus), np.tile(np.arange(gpus), 30), 90.0
        procs = schema.HOST_PROCS.empty(30 * ranks)
        procs["t_ns"], procs["pid"] = np.repeat(secs, ranks), np.tile(np.arange(ranks) + 1000, 30)
        n = 30 * calls_per_s
        calls = schema.COLLECTIVE_CALLS.empty(n * ranks)
        enter = np.repeat(a + np.arange(n, dtype=np.int64) * (S // calls_per_s), ranks)
        calls["t_enter_ns"] = enter + rng.integers(0, 200_000, len(enter))
        calls["t_exit_ns"] = calls["t_enter_ns"] + 300_000
        calls["pid"] = np.tile(np.arange(ranks) + 1000, n)
        calls["comm_rank"], calls["comm_size"], calls["comm_id"] = np.tile(np.arange(ranks), n), ranks, 7
        calls["seq"] = np.repeat(np.arange(n) + seg * n, ranks)
        calls["op"] = schema.COLLECTIVE_OPS.index("MPI_Allreduce")
        for table, rows in ((schema.CLOCK_PAIRS, cp), (schema.HOST_NODE, host), (schema.GPU_SAMPLES, gs),
                            (schema.HOST_PROCS, procs), (schema.COLLECTIVE_CALLS, calls)):
            r.append(table.path, rows, now_ns=a)
            total += rows.nbytes
        r.rotate(force=True, now_ns=a + 30 * S)
    return total


def export_run(tmp: Path, k: int, env: dict[str, str]) -> dict[str, Any]:
    from gpuprof.collector.continuous import client_request

    d = tmp / f"export{k}"
    d.mkdir()
    conf = write_config(d)
    spill = d / "spill"
    spill.mkdir(mode=0o700)
    raw = spill_five_minutes(spill)
    coll = subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf), "collect",
                             "--continuous", "--node", "benchexport", "--modes", "metrics,collectives"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_socket(d / "run" / "c.sock", coll, 120)
        restored = client_request(d / "run" / "c.sock", {"cmd": "status"})["continuous"]["retention"]
        out = d / "five.h5"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf), "export",
                            "--last", "5m", "-o", str(out), "--json"], env=env, capture_output=True, text=True,
                           check=False)
        s = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"export failed: {r.stderr}")
        reply = json.loads(r.stdout)
        return {"s": s, "collector_s": reply["seconds"], "mb": out.stat().st_size / 1e6, "raw_mb": raw / 1e6,
                "have_s": reply["window"]["have_s"], "restored_segments": restored["restored_segments"]}
    finally:
        coll.send_signal(signal.SIGTERM)
        coll.wait(30)


NODES = ("node1", "node2", "node3", "node4")
TEST_USER = "gpuprof-test"
# Python ranks (mpi_bench's MPI_COMM_WORLD is the executable's copy-relocated one, which the uprobe
# path does not resolve to the world communicator yet: comm_size -1, reported to the lead). Each step
# waits 20 ms (a GPU step the host waits for: the CPU stays free, so on this 2-core VM the ranks are
# not descheduled by each other and the injected fault is the only straggler), then an
# MPI_Allreduce of 64 KB on MPI_COMM_WORLD.
STEP_APP = """\
import time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = np.ones(16384, np.float32); out = np.empty_like(buf)
comm.Barrier()
for _ in range(int(__import__("os").environ.get("STEPS", "4000"))):
    time.sleep(0.02)
    comm.Allreduce(buf, out, op=MPI.SUM)
"""
APP_NAME = "gpuprof_ttd_app.py"
STOP_MS, EVERY_MS = 50, 200  # the fault: the rank is stopped 50 ms of every 200 ms (SIGSTOP/SIGCONT)


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    for line in (ROOT / ".cluster" / "env").read_text().splitlines():
        if line.startswith("export ") and "=" in line and "$" not in line:
            k, _, v = line[len("export "):].partition("=")
            env[k] = v.strip().strip('"')
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def rank_pid(node: str, job: str) -> int | None:
    """The job's rank on the node (the step app's python), from the node's job cgroup."""
    for d in Path("/sys/fs/cgroup/freezer").glob(f"slurm_{node}/uid_*/job_{job}"):
        for procs in d.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    # the rank itself: python APP (not the batch script or mpirun, which name it too)
                    if len(argv) >= 2 and argv[0].endswith(b"python") and argv[1].endswith(APP_NAME.encode()):
                        return int(pid)
                except OSError:
                    continue
    return None


def detect_trial(tmp: Path, k: int, env: dict[str, str], socket_template: str, rng: np.random.Generator
                 ) -> dict[str, Any]:
    """One real MPI job on the local cluster's 4 nodes (mpi_bench paced: an MPI_Allreduce on
    MPI_COMM_WORLD after 20 ms of computation, 60 s), a continuous collector per node; at a random
    time 12-25 s into the watch one random rank is stopped STOP_MS of every EVERY_MS until the watch
    names its node. Detection = the first refresh whose findings name that node; a finding before
    the fault is a false positive (counted, the trial goes on)."""
    import pwd

    from gpuprof.mpi_merge.live_watch import watch_once

    work = tmp / f"ttd{k}"
    work.mkdir()
    os.chown(work, pwd.getpwnam(TEST_USER).pw_uid, -1)
    cenv = cluster_env()
    app = work / APP_NAME
    app.write_text(STEP_APP)
    cmd = f"mpirun --oversubscribe --mca mpi_yield_when_idle 1 {sys.executable} {app}"
    job_env = {"SLURM_CONF": cenv["SLURM_CONF"], "PATH": cenv["PATH"], "STEPS": "4000"}
    sub = subprocess.run(["runuser", "-u", TEST_USER, "--", "env", *[f"{a}={b}" for a, b in job_env.items()],
                          "sbatch", "--parsable", "-N4", "--ntasks-per-node=1", f"--chdir={work}", "--wrap", cmd],
                         capture_output=True, text=True, check=True, env=cenv)
    job = sub.stdout.strip().split(";")[0]
    out: dict[str, Any] = {"job": job}
    try:
        deadline = time.monotonic() + 120
        while True:  # until every rank runs and every node's summary has its instances
            view = watch_once(job, socket_template)
            comms = [c for c in view.get("communicators", []) if c.get("instances", 0) >= 20]
            if comms:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job}: no communicator seen by every node's collector: {view}")
            time.sleep(1.0)
        victim = NODES[int(rng.integers(len(NODES)))]
        pid = rank_pid(victim, job)
        if pid is None:
            raise RuntimeError(f"job {job}: no rank process on {victim}")
        fault_after = float(rng.uniform(12, 25))
        t_watch = time.monotonic()
        t_fault: float | None = None
        false_positives = 0
        next_stop = 0.0
        last_refresh = 0.0
        while time.monotonic() - t_watch < fault_after + 60:
            now = time.monotonic()
            if t_fault is None and now - t_watch >= fault_after:
                t_fault = now
            if t_fault is not None and now >= next_stop:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(STOP_MS / 1000)
                os.kill(pid, signal.SIGCONT)
                next_stop = now + EVERY_MS / 1000
            if now - last_refresh >= 1.0:
                last_refresh = now
                view = watch_once(job, socket_template)
                if view["state"] != "live":
                    raise RuntimeError(f"job {job} ended before detection: {view.get('reason')}")
                named = {f["unit"] for f in view["findings"]}
                if t_fault is None and named:
                    false_positives += 1
                elif t_fault is not None and victim in named:
                    out.update(detect_s=time.monotonic() - t_fault, victim=victim, false_positives=false_positives,
                               fault_after_s=round(fault_after, 1))
                    return out
            time.sleep(0.01)
        out.update(detect_s=None, victim=victim, false_positives=false_positives)
        return out
    finally:
        subprocess.run(["scancel", job], env=cenv, check=False, capture_output=True)


def time_to_detect(tmp: Path, trials: int, env: dict[str, str]) -> None:
    import pwd

    if not (ROOT / ".cluster" / "env").exists():
        print(json.dumps({"bench": "time_to_detect", "skipped": "no local cluster (make cluster)"}))
        return
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        print(json.dumps({"bench": "time_to_detect", "skipped": f"no user {TEST_USER} (make setup)"}))
        return
    template = str(tmp / "c-{node}.sock")
    conf = tmp / "ttd.toml"
    conf.write_text("[collector]\nflush_interval_s = 1.0\n[continuous]\n"
                    f'socket = "{template}"\nspill_dir = "{tmp}/spill-{{node}}"\nexport_dir = "{tmp}/exp-{{node}}"\n'
                    'modes = "metrics,collectives"\nprocess_scan_interval_s = 1.0\n')
    colls = []
    try:
        for n in NODES:
            with open(tmp / f"ttd-{n}.log", "wb") as log:  # the child keeps its own descriptor
                colls.append(subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf),
                                               "collect", "--continuous", "--node", n], env=env,
                                              stdout=subprocess.DEVNULL, stderr=log))
        for n, c in zip(NODES, colls, strict=True):
            wait_socket(Path(template.replace("{node}", n)), c, 180)
        rng = np.random.default_rng(int(time.time()))
        res = [detect_trial(tmp, k, env, template, rng) for k in range(trials)]
    finally:
        for c in colls:
            c.send_signal(signal.SIGTERM)
        for c in colls:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
    found = [r["detect_s"] for r in res if r["detect_s"] is not None]
    print(json.dumps({
        "bench": "time_to_detect", "median_s": round(statistics.median(found), 2) if found else None,
        "max_s": round(max(found), 2) if found else None, "min_s": round(min(found), 2) if found else None,
        "detected": len(found), "trials": trials,
        "trials_with_a_finding_before_fault": sum(1 for r in res if r["false_positives"]),
        "refreshes_with_a_finding_before_fault": sum(r["false_positives"] for r in res),
        "fault": f"one random rank SIGSTOPped {STOP_MS} ms every {EVERY_MS} ms from a random time 12-25 s in",
        "job": "4 mpi4py ranks on 4 nodes, each step 20 ms of waiting then MPI_Allreduce of 64 KB",
        "refresh_s": 1.0, "goal_median_s": 30, "trials_detail": res,
    }), flush=True)


def stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one short run of each (smoke)")
    ap.add_argument("--only", choices=("cpu", "export", "detect"), default=None, help="one of the figures")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"bench": "continuous_cpu", "skipped": "needs root (job cgroups, probes)"}))
        return
    runs, window = (1, 8.0) if args.quick else (3, 40.0)
    lib = double.build()
    with tempfile.TemporaryDirectory(prefix="gpuprof-bench-cont-") as t:
        tmp = Path(t)
        conf = double.write_config(tmp / "fake.conf", gpus=8)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPROF_"))}
        env.update(PYTHONPATH=str(ROOT), LD_LIBRARY_PATH=str(lib.parent), GPUPROF_FAKE_NVML_CONFIG=str(conf))
        if not bc.MPI_BENCH.exists():
            bc.build()
        if args.only in (None, "cpu"):
            cpu_line("continuous_cpu", "metrics", runs, window, tmp, env, baseline=True)
            cpu_line("continuous_cpu_with_collectives", "metrics,collectives", runs, window, tmp, env,
                     baseline=False)
        if args.only in (None, "detect"):
            tmp.chmod(0o755)  # the job's user reaches its work directory
            time_to_detect(tmp, 1 if args.quick else 5, env)
        if args.only not in (None, "export"):
            return
        ex = [export_run(tmp, k, env) for k in range(1 if args.quick else 3)]
        print(json.dumps({
            "bench": "export_window", "s": stats([e["s"] for e in ex]), "mb": stats([e["mb"] for e in ex]),
            "collector_s": stats([e["collector_s"] for e in ex]), "raw_mb": round(ex[0]["raw_mb"], 3),
            "window_s": 300, "have_s": ex[0]["have_s"], "restored_segments": ex[0]["restored_segments"],
            "ranks": 16, "calls_per_s_per_rank": 100, "synthetic_rows": True, "runs": len(ex),
        }))


def cpu_line(bench: str, modes: str, runs: int, window: float, tmp: Path, env: dict[str, str], *,
             baseline: bool) -> None:
    """One line: the continuous collector in `modes`, interleaved with the job mode's in the same modes
    (baseline; not for collectives: the job mode's come from the fast path, whose rings the
    TaskProlog sets up per job, bench_collector.py measures it; here they come from the uprobes)."""
    res: dict[str, list[dict[str, Any]]] = {"continuous": [], "job": []}
    base = len(list(tmp.glob("run*")))
    for k in range(runs):  # interleaved: continuous, job mode, continuous, ...
        for kind in ("continuous", "job") if baseline else ("continuous",):
            res[kind].append(one_run(kind, modes, window, tmp, base + 2 * k + (kind == "job"), env))
    cont, job = res["continuous"], res["job"]
    cpu = [r["cpu_percent_of_core"] for r in cont]
    per_min = [r["retained_mb_per_min"] for r in cont]
    print(json.dumps({
        "bench": bench, "modes": modes, "cpu_percent_of_core": stats(cpu),
        "rss_mb": stats([r["rss_mb"] for r in cont]), "retention_min": 10,
        "retained_mb_per_min": stats(per_min),
        "projected_retention_mb": round(min(10 * statistics.median(per_min), cont[0]["memory_limit_mb"]), 3),
        "memory_limit_mb": cont[0]["memory_limit_mb"],
        **({"baseline_job_mode_cpu_percent_of_core": stats([r["cpu_percent_of_core"] for r in job]),
            "ratio_to_job_mode": round(statistics.median(cpu) / max(1e-9, statistics.median(
                [r["cpu_percent_of_core"] for r in job])), 3)} if job else {}),
        "goal_cpu_percent": GOAL_CPU_PERCENT, "meets_goal": statistics.median(cpu) <= GOAL_CPU_PERCENT,
        "runs": runs, "window_s": window, "job_processes": cont[0]["pids"], "emulated": True,
    }), flush=True)


if __name__ == "__main__":
    main()
