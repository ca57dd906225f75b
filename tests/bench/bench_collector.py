"""Collector figures, one JSON object per line (issues 3 and 11). GPU values come from the NVML test
double (tests/nvml_double), so every line says "emulated": true: they are costs, not GPU measurements.

    .venv/bin/python tests/bench/bench_collector.py            full run (3 interleaved runs per mode)
    .venv/bin/python tests/bench/bench_collector.py --quick    smoke run (one short run per mode)
    .venv/bin/python tests/bench/bench_collector.py --filters  also compare gzip/lzf/none on a
                                                               10-minute default-rate file
    .venv/bin/python tests/bench/bench_collector.py --chunks   also the calls table's chunk rows
                                                               at call rates of 1 to 13 000 a second
    .venv/bin/python tests/bench/bench_collector.py --per-call only collector_per_call (the full run
                                                               prints it too): the collector's CPU
                                                               per MPI call recorded (the busy job
                                                               at 3 call periods, interleaved)
    .venv/bin/python tests/bench/bench_collector.py --prepared `gpuprof prepare` on the bench's fresh
                                                               state directory first: every run is a
                                                               job of a node prepared at boot

collector_cpu: `gpuprof collect` as the prolog starts it (--job --node --uid, the config's nice
value, a control socket; 8 emulated GPUs) on a busy job of 16 processes: `mpirun -n 16
mpi_bench selfpaced` (tests/progs/mpi_bench.c), every process burning CPU and calling
MPI_Allreduce on MPI_COMM_SELF every PERIOD_US, through the fast path's interposer (LD_PRELOAD,
rings in the job's /dev/shm directory, as the TaskProlog sets up). The job's processes live in a
cgroup of their own, /sys/fs/cgroup/freezer/slurm_<node>/uid_0/job_<id>, where Slurm puts a job on
the local cluster, so the collector finds them as it does under Slurm. One line for the default
modes (metrics, stacks, collectives: BPF compile and attach included) and one for metrics only,
runs interleaved (default, metrics, default, ...), each figure the median with min and max:
  cpu_percent_of_core  the collector's CPU (utime+stime of all its threads, /proc/PID/stat) over
                       the measured window, which starts when every source is attached and the
                       job has run for WARM_S, as a share of one core
  startup_cpu_s        CPU until every source was attached (imports, BPF compile or image load,
                       attach); split into startup_cpu_s_compiling (the bench's first default-modes
                       run: a node's first profiled job, which compiles the BPF object) and
                       startup_cpu_s_from_image (the runs after it, as every later job on the node:
                       the object loaded from the image the first kept, collector/bpf_image.py)
  peak_rss_mb          VmHWM of the collector over its whole life. BCC's compile runs in a child
                       process that exits before the job starts (collector/bpf_object.py): its
                       peak and CPU are printed beside, as bpf_compile_child_peak_rss_mb and
                       bpf_compile_child_cpu_s; startup_cpu_s includes its CPU. A run that loads
                       the image has no child (bpf_image_load_cpu_s: mostly the kernel's verifier)
  rss_after_start_mb   VmRSS at the end of the window
  bpf_maps_kernel_mb   kernel memory of the BPF maps the collector holds (memlock in their fdinfo;
                       the CFI rows map is most of it): not in its resident set, which maps
                       none of it for good
  drops                read back from the sealed node file (/diagnostics/drops, the last value of
                       each counter: rings of ours, BPF ring buffers, the interposers' rings)
  prepared             with --prepared: what `gpuprof prepare` did and cost (wall, CPU of it and its
                       children) before the first run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
import double
from bpf_fdinfo import bpf_fdinfos

from gpuprof.collector import schema
from gpuprof.collector.writer import NodeMeta, NodeTraceWriter

TICK = os.sysconf("SC_CLK_TCK")
MPI_BENCH = ROOT / "tests" / "progs" / "build" / "mpi_bench"
FREEZER = Path("/sys/fs/cgroup/freezer")
BUSY = 16
PERIOD_US = 10_000  # one collective per 10 ms of wall time per process, at most (oversubscribed: fewer)
WARM_S = 3.0  # after the sources are attached and the job released: mpirun spawns its ranks
GOAL_CPU_PERCENT = 1.0
GOAL_RSS_MB = 100.0
DEFAULT_MODES = "metrics,stacks,collectives"


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of pid (and of its children it has waited for)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return sum(int(x) for x in rest[11:15]) / TICK


def bpf_maps_kernel_mb(pid: int) -> float:
    """Kernel memory of the BPF maps the process holds (memlock of each map's fdinfo, once per map):
    not in its resident set unless it maps them."""
    by_map = {info["map_id"]: int(info.get("memlock", "0")) for info in bpf_fdinfos(pid, "map") if "map_id" in info}
    return sum(by_map.values()) / 2**20


def status_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def build() -> None:
    MPI_BENCH.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mpicc", "-O2", "-o", str(MPI_BENCH), str(ROOT / "tests" / "progs" / "mpi_bench.c")], check=True)
    subprocess.run(["make", "-s", "-C", str(ROOT / "bpf" / "fastpath")], check=True)


class BusyJob:
    """16 busy MPI processes in a job cgroup of their own, released on go()."""

    def __init__(self, job: str, node: str, tmp: Path, seconds: float, fastpath_env: dict[str, str],
                 period_us: int = PERIOD_US) -> None:
        if not FREEZER.is_dir():
            raise RuntimeError(f"{FREEZER} missing: this bench needs the cgroup v1 freezer (as the local cluster)")
        self.made: list[Path] = []
        d = FREEZER
        for part in (f"slurm_{node}", "uid_0", f"job_{job}"):
            d = d / part
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        self.cgroup = d
        self.gate = tmp / f"go-{job}"
        calls = int(seconds * 1e6 / period_us)
        mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(BUSY), "--mca", "mpi_yield_when_idle",
                  "1", *[a for k in fastpath_env for a in ("-x", k)], str(MPI_BENCH), "selfpaced", str(calls),
                  str(period_us)]
        script = (f'echo $$ > {d}/cgroup.procs; while [ ! -e {self.gate} ]; do sleep 0.05; done; '
                  f'exec {" ".join(mpirun)}')
        self.proc = subprocess.Popen(["sh", "-c", script], env=dict(os.environ, **fastpath_env),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while str(self.proc.pid) not in (d / "cgroup.procs").read_text().split():
            if time.monotonic() > deadline:
                raise RuntimeError(f"job shell {self.proc.pid} never joined {d}")
            time.sleep(0.02)

    def go(self) -> None:
        self.gate.touch()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 20
        while (self.cgroup / "cgroup.procs").read_text().split():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.cgroup} still holds processes after the job was killed")
            time.sleep(0.1)
        for d in reversed(self.made):
            d.rmdir()
        self.gate.unlink(missing_ok=True)


def wait_attached(sock: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    from gpuprof.collector.control import request
    from gpuprof.collector.errors import GpuprofError

    deadline = time.monotonic() + timeout_s
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode} before recording")
        if sock.exists():
            try:
                st = request(str(sock), "status", timeout_s=1.0)
            except GpuprofError:
                st = {}
            if st.get("state") == "recording" and st.get("attached"):
                return st
            if st.get("state") == "error":
                raise RuntimeError(f"collector failed: {st.get('error')}")
        time.sleep(0.05)
    raise RuntimeError(f"collector not attached after {timeout_s} s: {st}")


def one_run(modes: str, window_s: float, tmp: Path, k: int, base_env: dict[str, str],
            period_us: int = PERIOD_US) -> dict[str, Any]:
    """Collector for one busy job (each process calling every period_us); the figures of that run."""
    from gpuprof.collector.config import defaults
    from gpuprof.collector.control import request
    from gpuprof.collector.fastpath_env import fastpath_exports, job_ring_dir
    from gpuprof.collector.reader import open_node_trace, summarize
    from gpuprof.slurm_hooks.paths import make_job_dir, remove_job_dir

    job, node = f"bench{os.getpid()}x{k}", "benchnode"
    out, sock = tmp / f"{job}.h5", tmp / f"{job}.sock"
    ring_dir = job_ring_dir(job, node)
    fp_env: dict[str, str] = {}
    if "collectives" in modes:
        make_job_dir(ring_dir, 0, 0)  # as the prolog does
        for line in fastpath_exports(tuple(modes.split(",")), defaults(), job_id=job, existing_ld_preload="",
                                     node=node):
            key, _, value = line.removeprefix("export ").partition("=")
            fp_env[key] = value
    busy = BusyJob(job, node, tmp, window_s + WARM_S + 120, fp_env, period_us)
    with open(tmp / f"{job}.log", "wb") as log:
        coll = subprocess.Popen(
            [sys.executable, "-m", "gpuprof.slurm_hooks.cli", "collect", "--job", job, "--node", node, "--uid", "0",
             "--modes", modes, "--gpus", "all", "--output", str(out), "--control-socket", str(sock)],
            env=base_env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        t_start = time.monotonic()
        wait_attached(sock, coll, 120)
        startup_cpu, startup_s = cpu_s(coll.pid), time.monotonic() - t_start
        busy.go()
        t_go = time.monotonic()
        time.sleep(WARM_S)
        threads0 = request(str(sock), "status", timeout_s=5.0).get("thread_cpu_s", {})
        c0, t0 = cpu_s(coll.pid), time.monotonic()
        peak = 0.0
        while time.monotonic() - t0 < window_s:
            peak = max(peak, status_mb(coll.pid, "VmHWM"))
            time.sleep(0.5)
        c1, t1 = cpu_s(coll.pid), time.monotonic()
        peak = max(peak, status_mb(coll.pid, "VmHWM"))
        rss = status_mb(coll.pid, "VmRSS")
        maps_mb = bpf_maps_kernel_mb(coll.pid)
        st1 = request(str(sock), "status", timeout_s=5.0)
        pids = st1.get("pids", 0)
        # the BPF compile's child (a BPF source's status; none in the metrics-only mode)
        compile_child = next((info["bpf_compile"] for info in st1.get("source_info", {}).values()
                              if isinstance(info, dict) and "bpf_compile" in info), None)
        by_thread = {k: 100 * (v - threads0.get(k, 0.0)) / (t1 - t0) for k, v in st1.get("thread_cpu_s", {}).items()}
        t_seal = time.monotonic()
        reply = request(str(sock), "seal", timeout_s=60.0)
        if not reply.get("sealed"):
            raise RuntimeError(f"collector did not seal: {reply}")
        _, status, usage = os.wait4(coll.pid, 0)
        coll.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if coll.returncode is None:
            coll.kill()
            coll.wait()
        busy.stop()
        if ring_dir.exists():
            remove_job_dir(ring_dir)
    s = summarize(open_node_trace(out))
    size = out.stat().st_size
    out.unlink()
    calls = s["records"].get(schema.COLLECTIVE_CALLS.path, 0)
    return {"cpu_percent": 100 * (c1 - c0) / (t1 - t0), "peak_rss_mb": peak, "rss_mb": rss,
            "startup_cpu_s": startup_cpu, "startup_s": startup_s, "window_s": t1 - t0,
            "total_cpu_s": usage.ru_utime + usage.ru_stime, "drops": s["drops"], "pids_seen": pids,
            "collective_calls": calls, "calls_per_s": calls / (t_seal - t_go), "stack_samples": s["records"].get(schema.STACK_SAMPLES.path, 0),
            "file_mb": size / 1e6, "by_thread": by_thread, "compile_child": compile_child,
            "bpf_maps_kernel_mb": maps_mb, "errors": [e["message"] for e in s["errors"]][:5]}


def spread(values: list[float], nd: int = 3) -> dict[str, float]:
    return {"median": round(statistics.median(values), nd), "min": round(min(values), nd),
            "max": round(max(values), nd)}


def prepare_node(config: Path, base_env: dict[str, str]) -> dict[str, Any]:
    """`gpuprof prepare` as etc/gpuprof-prepare.service runs it at boot, on the bench's state directory."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(config), "prepare", "--json"],
                       env=base_env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"gpuprof prepare failed ({p.returncode}): {p.stderr[-2000:]}")
    done = json.loads(p.stdout)
    return {"state": done["state"], "cfi_prewarm": done.get("cfi_prewarm"),
            "cfi_tables_compiled": done.get("cfi_tables_compiled"), "wall_s": round(wall, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)}


def collector_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """(the collectors' environment, their config file): the programs built, 8 emulated GPUs and
    a state directory of the bench's own: its first default-modes run is a node's first profiled
    job (the BPF object compiled, the CFI tables built), the others every job after it (both
    loaded from what the first kept there)."""
    build()
    lib = double.build()
    conf = double.write_config(tmp / "fake.conf", gpus=8, pids=[])
    state = tmp / "state"
    state.mkdir(mode=0o700, exist_ok=True)  # a second bench of the same run finds the first's kept objects
    config = tmp / "gpuprof.toml"
    config.write_text(f'[paths]\nstate_dir = "{state}"\n')
    base_env = dict(os.environ)
    base_env.update(PYTHONPATH=str(ROOT), GPUPROF_NVML_LIBRARY=str(lib), GPUPROF_FAKE_NVML_CONFIG=str(conf),
                    GPUPROF_CONFIG=str(config))
    return base_env, config


def bench_collector(window_s: float, runs: int, tmp: Path, prepared: bool = False) -> None:
    base_env, config = collector_env(tmp)
    from gpuprof.collector.config import defaults

    prepare = prepare_node(config, base_env) if prepared else None
    nice = int(defaults()["hooks"]["collector_nice"])
    results: dict[str, list[dict[str, Any]]] = {DEFAULT_MODES: [], "metrics": []}
    for k in range(runs):  # interleaved: the machine's other load hits both alike
        for i, (modes, rs) in enumerate(results.items()):
            r = one_run(modes, window_s, tmp, len(results) * k + i, base_env)
            print(json.dumps({"progress": "collector_cpu run", "modes": modes, **r}), file=sys.stderr, flush=True)
            rs.append(r)
    lines = []
    for modes, rs in results.items():
        drops_total = [sum(r["drops"].values()) for r in rs]
        nonzero: dict[str, int] = {}
        for r in rs:
            for src, n in r["drops"].items():
                if n:
                    nonzero[src] = max(nonzero.get(src, 0), n)
        cpu = spread([r["cpu_percent"] for r in rs])
        rss = spread([r["peak_rss_mb"] for r in rs], 1)
        line = {
            "bench": "collector_cpu", "modes": modes, "busy_processes": BUSY,
            "cpu_percent_of_core": cpu, "peak_rss_mb": rss,
            "rss_after_start_mb": spread([r["rss_mb"] for r in rs], 1),
            "bpf_maps_kernel_mb": spread([r["bpf_maps_kernel_mb"] for r in rs], 1),
            "startup_cpu_s": spread([r["startup_cpu_s"] for r in rs]),
            "startup_s": spread([r["startup_s"] for r in rs]),
            "drops_total": spread([float(d) for d in drops_total], 0), "drops_max_by_source": nonzero,
            "drops_from": "sealed node file, /diagnostics/drops",
            "collective_calls_recorded": spread([float(r["collective_calls"]) for r in rs], 0),
            "collective_calls_per_s_recorded": spread([r["calls_per_s"] for r in rs], 0),
            "collective_period_us": PERIOD_US,
            "stack_samples": spread([float(r["stack_samples"]) for r in rs], 0),
            "job_pids_seen": max(r["pids_seen"] for r in rs),
            "file_mb": spread([r["file_mb"] for r in rs]),
            "goal_cpu_percent": GOAL_CPU_PERCENT, "goal_peak_rss_mb": GOAL_RSS_MB,
            "goal_met": cpu["median"] <= GOAL_CPU_PERCENT and rss["median"] <= GOAL_RSS_MB,
            "runs": len(rs), "interleaved": True, "window_s": round(statistics.median(r["window_s"] for r in rs), 1),
            "nice": nice, "cores": os.cpu_count(), "emulated": True, "gpus": 8,
            "node": "prepared at boot (gpuprof prepare)" if prepared else "fresh: its first profiled job is this bench's first run",
        }
        if prepare is not None:
            line["prepared"] = prepare
        threads = sorted({k for r in rs for k in r["by_thread"]})
        by_thread = {k: round(statistics.median(r["by_thread"].get(k, 0.0) for r in rs), 3) for k in threads}
        line["cpu_percent_by_thread_median"] = {k: v for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1])
                                                if v >= 0.05}
        compiled = [r for r in rs if r["compile_child"] and not r["compile_child"]["from_image"]]
        loaded = [r for r in rs if r["compile_child"] and r["compile_child"]["from_image"]]
        if compiled:  # the child's peak and CPU are not the collector's: said beside them
            line["bpf_compile_child_peak_rss_mb"] = spread([r["compile_child"]["peak_rss_mb"] for r in compiled], 1)
            line["bpf_compile_child_cpu_s"] = spread([r["compile_child"]["cpu_s"] for r in compiled])
            line["startup_cpu_s_compiling"] = spread([r["startup_cpu_s"] for r in compiled])
            line["startup_s_compiling"] = spread([r["startup_s"] for r in compiled])
        if loaded:  # every job of a node after its first: the object from its kept image, no child
            line["bpf_image_load_cpu_s"] = spread([r["compile_child"]["cpu_s"] for r in loaded])
            line["startup_cpu_s_from_image"] = spread([r["startup_cpu_s"] for r in loaded])
            line["startup_s_from_image"] = spread([r["startup_s"] for r in loaded])
        line["bpf_object_runs"] = {"compiled": len(compiled), "from_image": len(loaded)}
        if rs[0]["errors"]:
            line["node_file_errors_first_run"] = rs[0]["errors"]
        lines.append(line)
    lines[0]["metrics_only_cpu_percent_median"] = lines[1]["cpu_percent_of_core"]["median"]
    for line in lines:
        print(json.dumps(line), flush=True)


# the threads whose work is per call recorded, by the names `status` gives them (thread_cpu_s)
PER_CALL_THREADS = {"writer": "writer", "fastpath": "source-collectives_fastpath"}
PER_CALL_PERIODS_US = (10_000, 1_000, 300)


def bench_per_call(periods_us: tuple[int, ...], runs: int, window_s: float, tmp: Path) -> None:
    """collector_per_call: what one MPI call recorded costs the collector. The busy job of
    collector_cpu (default modes) at several call periods, interleaved (runs rounds, the order
    reversed every other round); the slope of the writer's and the fast path's CPU (their own
    threads', from status) against the calls recorded a second, and of the whole collector's, which
    its other threads' noise blurs. In a job whose ranks fill every CPU, the job pays this per call
    (docs/collector.md, "What this means on a larger node")."""
    base_env, _ = collector_env(tmp)
    one_run(DEFAULT_MODES, 5.0, tmp, 0, base_env, periods_us[0])  # the BPF compile and CFI tables: not measured
    results: dict[int, list[dict[str, Any]]] = {p: [] for p in periods_us}
    k = 1
    for r in range(runs):
        for period in (periods_us if r % 2 == 0 else periods_us[::-1]):
            res = one_run(DEFAULT_MODES, window_s, tmp, k, base_env, period)
            k += 1
            print(json.dumps({"progress": "collector_per_call run", "period_us": period, "cpu_percent": res["cpu_percent"],
                              "calls_per_s": res["calls_per_s"]}), file=sys.stderr, flush=True)
            results[period].append(res)
    rates = [statistics.median(x["calls_per_s"] for x in results[p]) for p in periods_us]

    def per_call_ns(percent_of: Any) -> tuple[list[float], float]:
        ys = [statistics.median(percent_of(x) for x in results[p]) for p in periods_us]
        slope, _ = statistics.linear_regression(rates, ys)
        return [round(y, 3) for y in ys], round(slope / 100 * 1e9, 1)  # % of a core per call/s -> ns per call

    threads = {name: per_call_ns(lambda x, t=t: x["by_thread"].get(t, 0.0)) for name, t in PER_CALL_THREADS.items()}
    total = per_call_ns(lambda x: x["cpu_percent"])
    print(json.dumps({
        "bench": "collector_per_call", "modes": DEFAULT_MODES, "busy_processes": BUSY,
        "period_us": list(periods_us), "calls_per_s_recorded": [round(x) for x in rates],
        **{f"{name}_cpu_percent_of_core": ys for name, (ys, _) in threads.items()},
        **{f"{name}_ns_per_call": ns for name, (_, ns) in threads.items()},
        "per_call_ns": round(sum(ns for _, ns in threads.values()), 1),
        "cpu_percent_of_core": total[0], "collector_ns_per_call": total[1],
        "drops_total": sum(sum(x["drops"].values()) for rs in results.values() for x in rs),
        "runs": runs, "interleaved": "the periods' order reversed every other round",
        "window_s": window_s, "cores": os.cpu_count(), "emulated": True,
        "what": "least-squares slope of each thread's CPU (medians over the runs) against the calls recorded a second",
    }), flush=True)


def bench_bytes(duration: float, tmp: Path) -> None:
    """MB per minute of a metrics-only node file at the default rates (8 emulated GPUs, 16 processes)."""
    lib = double.build()
    jobs = [subprocess.Popen(["sleep", str(duration + 60)]) for _ in range(16)]
    conf = double.write_config(tmp / "fake-bytes.conf", gpus=8, pids=[p.pid for p in jobs[:4]])
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPUPROF_NVML_LIBRARY=str(lib), GPUPROF_FAKE_NVML_CONFIG=str(conf))
    env.pop("GPUPROF_CONFIG", None)
    out = tmp / "bytes.h5"
    try:
        subprocess.run(
            [sys.executable, "-m", "gpuprof.slurm_hooks.cli", "collect", "--pid", str(os.getpid()), "--modes",
             "metrics", "--gpus", "all", "--output", str(out), "--duration", str(duration)],
            env=env, stderr=subprocess.DEVNULL, check=True)
    finally:
        for p in jobs:
            p.kill()
            p.wait()
    size_mb = out.stat().st_size / 1e6
    print(json.dumps({"bench": "collector_bytes", "mb_per_min": round(size_mb / (duration / 60), 4),
                      "filter": "gzip", "file_mb": round(size_mb, 3), "duration_s": duration,
                      "emulated": True}), flush=True)


def synthetic_minute_rows(rng: np.random.Generator, t0: int, seconds: float) -> dict[str, np.ndarray]:
    """Default-rate rows with realistic variation (noisy utilization, growing counters)."""
    n = int(seconds * 10)
    t = t0 + (np.arange(n) * 100_000_000).astype(np.uint64)
    out: dict[str, np.ndarray] = {}  # table path -> rows
    s = schema.GPU_SAMPLES.empty(n * 8)
    s["t_ns"] = np.repeat(t, 8)
    s["gpu"] = np.tile(np.arange(8), n)
    s["util_gpu"] = np.clip(rng.normal(85, 10, n * 8), 0, 100).round()
    s["util_mem"] = np.clip(rng.normal(40, 8, n * 8), 0, 100).round()
    s["mem_used_bytes"] = 60e9 + rng.integers(0, 2**20, n * 8)
    s["power_w"] = rng.normal(550, 40, n * 8).round(3)
    s["temp_c"] = rng.integers(55, 70, n * 8)
    s["sm_clock_mhz"] = rng.choice([1755, 1980], n * 8)
    s["mem_clock_mhz"] = 2619
    s["pcie_tx_kbps"] = rng.normal(2e6, 3e5, n * 8)
    s["pcie_rx_kbps"] = rng.normal(4e6, 5e5, n * 8)
    s["nvlink_tx_kbps"] = rng.normal(1.5e8, 2e7, n * 8)
    s["nvlink_rx_kbps"] = rng.normal(1.5e8, 2e7, n * 8)
    s["throttle_reasons"] = 0
    out[schema.GPU_SAMPLES.path] = s
    g = schema.GPU_GPM.empty(n * 8)
    g["t_ns"], g["gpu"], g["interval_ns"] = s["t_ns"], s["gpu"], 100_000_000 + rng.integers(0, 50_000, n * 8)
    for col in ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bw_util"):
        g[col] = np.clip(rng.normal(60, 15, n * 8), 0, 100)
    out[schema.GPU_GPM.path] = g
    p = schema.HOST_PROCS.empty(n * 16)
    p["t_ns"], p["pid"] = np.repeat(t, 16), np.tile(np.arange(1000, 1016), n)
    p["cpu_time_ns"] = np.repeat(np.arange(n), 16) * 100_000_000 + rng.integers(0, 10_000_000, n * 16)
    p["rss_bytes"] = 4e9 + rng.integers(0, 2**16, n * 16) * 4096
    p["num_threads"] = 48
    p["voluntary_ctxsw"] = np.repeat(np.arange(n), 16) * 50
    p["involuntary_ctxsw"] = np.repeat(np.arange(n), 16) * 5
    p["read_bytes"] = p["write_bytes"] = 0
    out[schema.HOST_PROCS.path] = p
    h = schema.HOST_NODE.empty(n)
    h["t_ns"], h["cpu_busy"] = t, rng.uniform(0.6, 0.9, n)
    h["mem_used_bytes"], h["mem_total_bytes"] = 500e9 + rng.integers(0, 2**30, n), 2e12
    h["net_rx_bytes"] = np.cumsum(rng.integers(0, 10**7, n))
    h["net_tx_bytes"] = np.cumsum(rng.integers(0, 10**7, n))
    h["load1"] = rng.uniform(30, 40, n)
    out[schema.HOST_NODE.path] = h
    c = schema.CLOCK_PAIRS.empty(int(seconds))
    c["monotonic_ns"] = t0 + np.arange(int(seconds)) * 10**9
    c["realtime_ns"] = c["monotonic_ns"].astype(np.int64) + 1_700_000_000 * 10**9
    c["uncertainty_ns"] = rng.integers(20, 80, int(seconds))
    out[schema.CLOCK_PAIRS.path] = c
    return out


def bench_filters(tmp: Path, minutes: float) -> None:
    """Same 10-minute default-rate data through the writer with each filter, flushed every
    collector.flush_interval_s, as the collector does."""
    from gpuprof.collector.config import defaults

    every = float(defaults()["collector"]["flush_interval_s"])
    for filt in ("gzip", "lzf", "none"):
        rng = np.random.default_rng(1)
        path = tmp / f"f-{filt}.h5"
        meta = NodeMeta(job_id="bench", node="n", modes=("metrics",), synthetic=True)
        c0 = time.process_time()
        w = NodeTraceWriter(path, meta, schema.tables_for_modes(("metrics",)), compression=filt)
        for k in range(int(minutes * 60 / every)):
            for tpath, rows in synthetic_minute_rows(rng, int(k * every * 1e9), every).items():
                w.append(tpath, rows)
            w.flush()
        w.seal(drops={})
        cpu = time.process_time() - c0
        print(json.dumps({"bench": "trace_filter", "filter": filt, "minutes": minutes,
                          "mb_per_min": round(path.stat().st_size / 1e6 / minutes, 4),
                          "writer_cpu_s": round(cpu, 3), "flush_interval_s": every, "synthetic": True}), flush=True)


HPCC_CALLS = Path(__file__).resolve().parents[1] / "recordings" / "hpcc-4nodes" / "node1.h5"


def hpcc_call_rows() -> np.ndarray:
    """hpcc's recorded /collectives/calls rows (HPCC_CALLS), in the schema's dtype."""
    import h5py

    with h5py.File(HPCC_CALLS, "r") as f:
        return f[schema.COLLECTIVE_CALLS.path][()].astype(schema.COLLECTIVE_CALLS.dtype)


def bench_chunks(tmp: Path) -> None:
    """/collectives/calls in 64-row chunks (every other table's) against BUSY_CHUNK_ROWS (the
    busy tables'): hpcc's recorded calls (tests/recordings/hpcc-4nodes, real rows, taken in turn)
    appended at a steady rate in collector.flush_interval_s flushes for 10 minutes (1 minute at
    the highest rate), with the writer's filter; file growth and writer CPU a minute, median of 3
    interleaved runs with min and max. Only the chunking differs between the two."""
    import h5py

    from gpuprof.collector.config import defaults
    from gpuprof.collector.writer import BUSY_CHUNK_ROWS, CHUNK_ROWS, GZIP_LEVEL, compression_kwargs

    every = float(defaults()["collector"]["flush_interval_s"])
    real = hpcc_call_rows()

    def one(chunk: int, rate: int, minutes: float) -> tuple[float, float]:
        path = tmp / f"chunks-{chunk}-{rate}.h5"
        per, pos = max(1, round(rate * every)), 0
        with h5py.File(path, "w", libver="latest") as f:
            d = f.create_dataset("calls", shape=(0,), maxshape=(None,), dtype=real.dtype, chunks=(chunk,),
                                 **compression_kwargs("gzip"))
            f.swmr_mode = True
            c0 = time.process_time()
            for _ in range(int(minutes * 60 / every)):
                n = d.shape[0]
                d.resize((n + per,))
                d[n:] = np.take(real, np.arange(pos, pos + per) % len(real))
                pos += per
                d.flush()
                f.flush()
            cpu = time.process_time() - c0
        size = path.stat().st_size
        path.unlink()
        return size / 1e3 / minutes, 1e3 * cpu / minutes

    for rate in (1, 10, 100, 1000, 13000):
        minutes = 1.0 if rate > 5000 else 10.0
        got: dict[int, list[tuple[float, float]]] = {CHUNK_ROWS: [], BUSY_CHUNK_ROWS: []}
        for _ in range(3):
            for chunk, runs in got.items():
                runs.append(one(chunk, rate, minutes))
        print(json.dumps({"bench": "trace_chunks", "table": schema.COLLECTIVE_CALLS.path, "calls_per_s": rate,
                          "filter": f"gzip {GZIP_LEVEL} + shuffle", "flush_interval_s": every, "minutes": minutes,
                          "data": f"real rows of {HPCC_CALLS.parent.name}, repeated",
                          **{f"kb_per_min_{c}_rows": spread([k for k, _ in r], 1) for c, r in got.items()},
                          **{f"writer_ms_per_min_{c}_rows": spread([m for _, m in r], 1) for c, r in got.items()}}),
              flush=True)


BUSY_CHUNK_CHOICES = ((1, 512), (0, 512), (0, 1024))  # (ISA-L level, rows a chunk): the writer's before and now


def bench_busy_chunks(tmp: Path, rounds: int) -> None:
    """The busy tables' chunks as the writer writes them (DirectChunks: shuffled, deflated by
    ISA-L, written whole), at each (ISA-L level, chunk rows) of BUSY_CHUNK_CHOICES: hpcc's recorded
    call rows (tests/recordings/hpcc-4nodes, taken in turn) appended and flushed in
    collector.flush_interval_s batches. Writer CPU a row at 13 000 calls a second (thread time,
    median of interleaved rounds, with min and max) and the file's growth a minute at 1 to 13 000
    calls a second (the same bytes every round: computed once). One writer_busy_chunks line."""
    import h5py

    from gpuprof.collector import writer
    from gpuprof.collector.config import defaults

    every = float(defaults()["collector"]["flush_interval_s"])
    real = hpcc_call_rows()

    def one(level: int, chunk: int, rate: int, minutes: float) -> tuple[float, float]:
        """(writer ns a row, file kB a minute)"""
        path = tmp / f"busy-{level}-{chunk}-{rate}.h5"
        per = max(1, round(rate * every))
        with h5py.File(path, "w", libver="latest") as f:
            ds = f.create_dataset("calls", shape=(0,), maxshape=(None,), dtype=real.dtype, chunks=(chunk,),
                                  **writer.compression_kwargs("gzip"))
            f.swmr_mode = True
            direct = writer.DirectChunks(ds.id, real.dtype, chunk, level)
            batches = [np.take(real, np.arange(k * per, (k + 1) * per) % len(real))
                       for k in range(int(minutes * 60 / every))]
            t0 = time.thread_time_ns()
            for rows in batches:
                direct.append(rows)
                direct.flush()
                f.flush()
            ns = (time.thread_time_ns() - t0) / (per * len(batches))
        size = path.stat().st_size
        path.unlink()
        return ns, size / 1e3 / minutes

    ns_row: dict[tuple[int, int], list[float]] = {c: [] for c in BUSY_CHUNK_CHOICES}
    for _ in range(rounds):
        for level, chunk in BUSY_CHUNK_CHOICES:
            ns_row[(level, chunk)].append(one(level, chunk, 13000, 0.5)[0])
    kb_min = {rate: {f"level{lv}_{ch}_rows": round(one(lv, ch, rate, 1.0 if rate > 5000 else 10.0)[1], 1)
                     for lv, ch in BUSY_CHUNK_CHOICES} for rate in (1, 10, 100, 1000, 13000)}
    print(json.dumps({"bench": "writer_busy_chunks", "table": schema.COLLECTIVE_CALLS.path,
                      "data": f"real rows of {HPCC_CALLS.parent.name}, repeated", "flush_interval_s": every,
                      "now": {"isal_level": writer.ISAL_LEVEL, "chunk_rows": writer.BUSY_CHUNK_ROWS},
                      "rounds": rounds,
                      "writer_ns_per_row_at_13000_per_s": {f"level{lv}_{ch}_rows": spread(v, 1)
                                                          for (lv, ch), v in ns_row.items()},
                      "file_kb_per_min_by_calls_per_s": kb_min}), flush=True)


def bench_writer(tmp: Path, seconds: float) -> None:
    """Records per second the writer thread's drain+append+flush path absorbs (host/procs rows)."""
    meta = NodeMeta(job_id="bench", node="n", modes=("metrics",), synthetic=True)
    w = NodeTraceWriter(tmp / "w.h5", meta, schema.tables_for_modes(("metrics",)), compression="gzip")
    batch = synthetic_minute_rows(np.random.default_rng(2), 0, 60.0)[schema.HOST_PROCS.path]  # 9600 rows
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        w.append(schema.HOST_PROCS.path, batch)
        w.flush()
        n += len(batch)
    dt = time.monotonic() - t0
    w.seal(drops={})
    print(json.dumps({"bench": "writer_throughput", "records_per_s": int(n / dt), "filter": "gzip",
                      "batch_rows": len(batch)}), flush=True)


def bench_shuffle(rounds: int) -> None:
    """The busy tables' shuffle before the deflate (byte k of every row together): numpy's
    transpose of the rows' bytes against collector/native/shuffle.c, on hpcc's recorded call rows
    (tests/recordings/hpcc-4nodes) in the writer's 512-row chunks; ns a row, medians of
    interleaved rounds with min and max. The two give the same bytes (tests/test_writer.py)."""

    from gpuprof.collector.writer import BUSY_CHUNK_ROWS, native_shuffle, numpy_shuffle

    shuffle = native_shuffle()
    if shuffle is None:
        print(json.dumps({"bench": "writer_shuffle", "missing": "collector/native not built"}), flush=True)
        return
    real = hpcc_call_rows()
    c, size = BUSY_CHUNK_ROWS, real.dtype.itemsize
    chunks = [real[k:k + c] for k in range(0, len(real) - c + 1, c)]
    out = np.empty(c * size, np.uint8)

    def numpy_way(rows: np.ndarray) -> None:
        numpy_shuffle(rows)

    def native_way(rows: np.ndarray) -> None:
        shuffle(rows.ctypes.data, out.ctypes.data, c, size)

    got: dict[str, list[float]] = {"numpy": [], "native": []}
    for _ in range(rounds):
        for name, fn in (("numpy", numpy_way), ("native", native_way)):
            t0 = time.thread_time_ns()
            for rows in chunks:
                fn(rows)
            got[name].append((time.thread_time_ns() - t0) / (len(chunks) * c))

    print(json.dumps({"bench": "writer_shuffle", "table": schema.COLLECTIVE_CALLS.path, "row_bytes": size,
                      "chunk_rows": c, "rows": len(chunks) * c, "data": f"real rows of {HPCC_CALLS.parent.name}",
                      "rounds": rounds, "numpy_ns_per_row": spread(got["numpy"], 1),
                      "native_ns_per_row": spread(got["native"], 1),
                      "ratio": round(statistics.median(got["numpy"]) / statistics.median(got["native"]), 2)}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--window", type=float, default=None, help="measured seconds per run (default 40, quick 8)")
    ap.add_argument("--runs", type=int, default=None, help="runs per mode, interleaved (default 3, quick 1)")
    ap.add_argument("--filters", action="store_true", help="compare HDF5 filters on a 10-minute file")
    ap.add_argument("--chunks", action="store_true", help="only the calls table's chunk rows, by call rate")
    ap.add_argument("--per-call", action="store_true",
                    help="only collector_per_call (the full run prints it too): the collector's CPU per MPI call "
                         "recorded, at call periods of "
                         f"{', '.join(map(str, PER_CALL_PERIODS_US))} us")
    ap.add_argument("--prepared", action="store_true",
                    help="run `gpuprof prepare` on the fresh state directory first (a node prepared at boot)")
    a = ap.parse_args()
    bench_shuffle(3 if a.quick else 9)  # no root, no MPI
    if a.chunks:  # no root, no MPI: the writer's files only
        with tempfile.TemporaryDirectory(prefix="gpuprof-bench-") as d:
            bench_busy_chunks(Path(d), 3 if a.quick else 7)
            bench_chunks(Path(d))
        return
    if os.geteuid() != 0 or shutil.which("mpirun") is None:
        print(json.dumps({"bench": "collector_cpu", "modes": DEFAULT_MODES, "busy_processes": BUSY,
                          "cpu_percent_of_core": None, "missing": "needs root (BPF, cgroups) and mpirun"}), flush=True)
        return
    window = a.window or (8.0 if a.quick else 40.0)
    if a.per_call:
        with tempfile.TemporaryDirectory(prefix="gpuprof-bench-") as d:
            bench_per_call(PER_CALL_PERIODS_US, a.runs or (1 if a.quick else 3), a.window or (8.0 if a.quick else 20.0),
                           Path(d))
        return
    with tempfile.TemporaryDirectory(prefix="gpuprof-bench-") as d:
        tmp = Path(d)
        bench_collector(window, a.runs or (1 if a.quick else 3), tmp, a.prepared)
        bench_per_call(PER_CALL_PERIODS_US, a.runs or (1 if a.quick else 3), 8.0 if a.quick else 20.0, tmp)
        bench_bytes(10.0 if a.quick else 60.0, tmp)
        bench_writer(tmp, 1.0 if a.quick else 5.0)
        bench_busy_chunks(tmp, 3 if a.quick else 7)
        if a.filters:
            bench_filters(tmp, 1.0 if a.quick else 10.0)


if __name__ == "__main__":
    main()
