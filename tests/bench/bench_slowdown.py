"""What profiling costs a real MPI job (issue 11): the applications of tests/realapps (real codes
from Debian, and the training program) run as the test user through sbatch on the local cluster,
each with and without `--profile-gpu` (the default modes: metrics, stacks, collectives), runs
interleaved in pairs whose order alternates (plain, profiled; profiled, plain; ...) so that the
machine's drift hits both alike. The time is the application's own: the batch script (realapps'
job_script, fault "balanced") times its mpirun line, so queueing, the prolog's wait for the probes
and the epilog are not in it (the bench of the hooks measures those), and the automatic merge job
of a profiled run is waited for before the next run starts.

The applications by default: the training program, hpcc (13 000 MPI calls a second on 2 ranks,
and a million polls), meep (a halo exchange: 84 000 calls a second on 2 ranks, the most
call-intensive of the realapps) and gromacs (molecular dynamics, the commonest HPC job: 12 000
calls a second on 2 ranks, Sendrecv halos and PME's Alltoall, and compute between them).

Three layouts, all printed by default (--layouts):
- "node": one Slurm node, one rank per core (2 here): one collector for the machine, no core
  shared by two ranks; what a job pays on a site's node (smaller than theirs).
- "shared": the application's 4 ranks on that one node, two per core: one collector, but ranks
  that yield to each other at every poll (a context switch each, which the off-CPU probe sees).
- "nodes": one rank per virtual node of the local cluster (4 nodes on this one machine, so four
  collectors on its 2 cores, and ranks sharing cores): the layout of the other benches, an upper
  bound.

    .venv/bin/python tests/bench/bench_slowdown.py [--quick] [--apps train,hpcc,meep,gromacs] [--pairs 3] [--modes stacks]
        [--layouts node,shared,nodes] [--control] [--hpcc-n 3600,1200] [--no-displaced] [--no-bpf-time]

hpcc runs at two sizes, one line each (--hpcc-n, HPL's N; every other part of HPCC sizes itself
from it): N=3600, a run of about 30 s in the node layout on this VM on a slow day (10 s on a fast
one), the job the 1 % goal is read on; and N=1200, 3 to 6 s (1.6 s on a fast day), a job so short
that what the collector does once, when the job's processes start (it registers them, reads
their maps, writes their first rows), is most of what it costs. From the two sizes a
job_slowdown_split line tells the collector's CPU in the run as a cost per job plus a cost per
second (a line fitted through the sizes' medians), so a site can work out what its own job
lengths pay. Real jobs run minutes to hours; a run of 3 s is the worst case, printed beside the
figure, not instead of it.

--control runs every pair plain twice (the same alternation, nothing profiled): the spread the
bench itself has on this machine, the floor under which a `median_percent` says nothing.

One line per application (and hpcc size) and layout:
    {"bench": "job_slowdown", "app": ..., "hpl_n": ..., "median_percent": (median profiled / median plain - 1) * 100,
     "median_percent_ci95": [low, high] (a bootstrap over the pairs: what the median can resolve here),
     "pair_percent": {"median", "min", "max"}, "plain_s": [...], "profiled_s": [...],
     "collector_cpu_ms_in_run": {"median", "min", "max"}, "collector_cpu_percent_of_run": ..., ...}
and, for hpcc at two sizes or more in a layout:
    {"bench": "job_slowdown_split", "app": "hpcc", "layout": ..., "collector_cpu_ms_once": ...,
     "collector_cpu_ms_per_s": ..., "sizes": [{"hpl_n", "profiled_s_median", "collector_cpu_ms_in_run_median"}, ...]}

collector_cpu_ms_in_run: the CPU the job's collectors on this host used inside the timed mpirun
line (read from here when the batch script marks the line's start and end, CollectorCpu),
collector_cpu_ms_in_run_by_thread_median the same by thread name (between the samples inside the
line, so a little less), and collector_cpu_percent_of_run its median over the median profiled
run, in % of one core. bench_self_cpu_ms_in_run: this bench's own CPU inside the line, by arm (its
sampling reads more in a profiled run, on the ranks' cores: that much of median_percent is the
bench's). On a node whose every core runs a rank, that is
about what the collector takes from the job directly; the rest of median_percent is the
interposer in the ranks and this machine's noise (the slowdown's pairs spread over several
points here; this figure does not).

--displaced (on by default) adds collector_displaced_ms_in_run: the collector threads' run time
inside the timed line split by what each displaced when it ran (tests/bench/displaced.py: a rank
running its own code, a rank polling in sched_yield, an idle CPU, anything else), from a BCC
program on sched_switch attached for the whole bench (both arms alike). The first is what the collector takes
from the job's compute, which the slowdown's noise hides. A rank that yielded loses only if its
message arrived meanwhile: collector_yielded_rank_ms_by_outcome splits that time by what the rank
did when it got its core back (went on polling, or had work: an upper bound of its loss), and
collector_taken_from_ranks_percent_of_run adds the second to the preempted time: what the ranks may
have lost to the collector, at most. A job_slowdown_displaced_control line comes first: the same
program on a rank that only polls (displaced.control), whose time should all come out "polled".

Every profiled run also reads its own node file: interposer_percent_of_rank_samples is the share
of the ranks' CPU samples (the stacks mode's, of the processes with the application's comm) whose
innermost frame is in the MPI interposer, which runs in the ranks. With --displaced and --bpf-time,
profiler_cost_bound_percent adds up, per run, what profiling can have taken from the ranks at most:
the collector's time taken from them, the BPF programs' time, and the interposer's share.

--bpf-time (on by default) adds bpf_programs_ms_in_run: the run time of the collectors' BPF
programs inside the timed line (run_time_ns of each program the collector holds, from its fdinfo
at each of its samples, with kernel.bpf_stats_enabled on for the bench and restored after). The programs run
in the job's own context (samples, switches, forks), so the collector's threads do not show them.
The counting costs the programs a little (--no-bpf-time leaves it off, and the bound out).

Needs root, the local cluster and the applications (apt packages named in tests/realapps/apps.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np
from bpf_fdinfo import bpf_fdinfos, program_fdinfo  # beside this file
from displaced import CLASSES, OUTCOMES, Displacement
from displaced import control as displaced_control
from realapps import apps as apps_mod
from realapps import faults as faults_mod
from realapps import runner, slurm
from slowdown_stats import median_percent_interval

from gpuprof.collector import modes as modes_mod
from gpuprof.collector import schema
from gpuprof.collector.fastpath_env import LIBRARIES
from gpuprof.collector.reader import open_node_trace

DEFAULT_MODES = ",".join(modes_mod.DEFAULT_MODES)  # what plain --profile-gpu profiles
TIMED = re.compile(r"^bench_app_seconds (\d+(?:\.\d+)?)$", re.MULTILINE)
WINDOW = re.compile(r"^bench_app_window (\d+\.\d+) (\d+\.\d+)$", re.MULTILINE)
# The figures of a run are read when the batch script marks its timed line's start and end
# (MARKS, files in the run's work directory, looked for every MARK_POLL_S), plus every SAMPLE_S for
# the series between. The sampling runs on the ranks' cores and reads more in a profiled run (the
# collectors' threads, about 70 programs' fdinfo): sampled every 0.5 s it cost the bench 239 ms of
# CPU in a profiled GROMACS run against 109 in a plain one, a bias of the profiled arm of about
# half a point on a job that loses whatever preempts a rank. A look for a mark is one stat() in
# both arms alike.
MARKS = ("bench_t0.mark", "bench_t1.mark")
MARK_POLL_S = 0.1
SAMPLE_S = 5.0
BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
# a run whose job failed or whose figures could not be read is run again (in its place in the
# alternation) rather than losing the pairs before it: at most this many tries each
RUN_ATTEMPTS = 2


class CollectorCpu:
    """The CPU the collectors of one job on this host used, sampled from here when the batch script
    marks its timed line's start and end (files in `work`, MARKS) and every SAMPLE_S between, while
    the job runs (the job cannot see them: its PID namespace is the virtual node's): the run time
    of each of their threads (/proc/PID/task/TID/schedstat, ns), a thread that ends keeping its
    last figure. Compile children are not counted. The profiled arm's sampling reads more than the
    plain arm's (the collectors' threads and programs): the bench's own CPU in each run
    (self_samples, bench_self_cpu_ms_in_run in the line) shows how much that tilts the slowdown.

    bpf_time: also the run time of the collectors' BPF programs (run_time_ns in the fdinfo of each
    program they hold, kernel.bpf_stats_enabled on), at every sample: the time the
    programs took in the job's own context (sampling, switches, forks), which the collector's
    threads do not show."""

    def __init__(self, job: str, work: Path, bpf_time: bool = False, displacement: Displacement | None = None) -> None:
        self.needle = b"\0collect\0--job\0" + job.encode() + b"\0"
        self._marks = [work / name for name in MARKS]
        self.mark_times: dict[str, float] = {}  # MARKS seen -> the time of the sample taken on seeing it
        self.samples: list[tuple[float, int]] = []  # (time.time(), total ns so far)
        # (time.time(), thread name -> its threads' ns so far): which thread took the job's time
        self.by_thread: list[tuple[float, dict[str, int]]] = []
        self._names: dict[tuple[int, int], str] = {}
        self.bpf_samples: list[tuple[float, int]] = []  # (time.time(), the programs' total ns so far)
        self.self_samples: list[tuple[float, int]] = []  # (time.time(), this bench process's CPU ns so far)
        self._bpf_time = bpf_time
        self._displacement = displacement
        # (time.time(), (thread name, class) -> ns so far)
        self.displaced_samples: list[tuple[float, dict[tuple[str, str], int]]] = []
        self.outcome_samples: list[tuple[float, dict[str, int]]] = []  # (time.time(), OUTCOMES -> ns so far)
        self._last: dict[tuple[int, int], int] = {}  # (pid, tid) -> its last run time
        self._last_prog: dict[str, int] = {}  # prog_id -> its run_time_ns
        self._pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _find(self) -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/cmdline", "rb") as f:
                        if self.needle in f.read():
                            found.append(int(name))
                except OSError:
                    continue
        return found

    def _run(self) -> None:
        next_sample = 0.0
        while not self._stop.is_set():
            marked = [m for m in self._marks if m.name not in self.mark_times and m.exists()]
            if marked or time.monotonic() >= next_sample:
                self._sample()
                for m in marked:
                    self.mark_times[m.name] = self.samples[-1][0]
                next_sample = time.monotonic() + SAMPLE_S
            self._stop.wait(MARK_POLL_S)

    def _sample(self) -> None:
        """One sample of every series, all stamped with one time taken after the reads."""
        self._pids = self._find()  # a job's collectors may start (one per node) while it runs
        for pid in self._pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    if (pid, int(tid)) not in self._names:
                        with open(f"/proc/{pid}/task/{tid}/comm") as f:
                            self._names[(pid, int(tid))] = f.read().strip()
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        self._last[(pid, int(tid))] = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
        named: dict[str, int] = {}
        for key, ns in self._last.items():
            name = self._names.get(key, "?")
            named[name] = named.get(name, 0) + ns
        displaced = self._displacement.by_thread() if self._displacement is not None else None
        outcomes = self._displacement.yield_outcomes() if self._displacement is not None else None
        if self._bpf_time:
            for pid in self._pids:
                self._read_programs(pid)
        now = time.time()
        self.samples.append((now, sum(self._last.values())))
        self.by_thread.append((now, named))
        if displaced is not None and outcomes is not None:
            self.displaced_samples.append((now, displaced))
            self.outcome_samples.append((now, outcomes))
        if self._bpf_time:
            self.bpf_samples.append((now, sum(self._last_prog.values())))
        self.self_samples.append((now, time.process_time_ns()))

    def _read_programs(self, pid: int) -> None:
        for info in bpf_fdinfos(pid, "prog"):
            if "run_time_ns" in info:
                self._last_prog[info["prog_id"]] = int(info["run_time_ns"])
        # a program attached by a link the collector holds without the program's own descriptor
        # (the off-CPU source's raw tracepoint on sched_switch: BCC attaches it in the compile helper)
        for link in bpf_fdinfos(pid, "link"):
            if "prog_id" in link:
                info = program_fdinfo(int(link["prog_id"]))
                if "run_time_ns" in info:
                    self._last_prog[link["prog_id"]] = int(info["run_time_ns"])

    def stop(self) -> None:
        """Stops sampling after one last sample, now: the job has ended, so every figure of its
        timed line lies between two samples even when the sampling thread fell behind on a busy
        machine (a 9-pair bench once lost every run to a line that ended after the last sample)."""
        self._stop.set()
        self._thread.join()
        self._sample()

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """The times to read a timed line's figures at: the samples taken on seeing its marks (a
        poll after its start and its end, both late alike), or the line's own t0 and t1 (the series
        interpolated) where a mark was not seen while the job ran."""
        return self.mark_times.get(MARKS[0], t0), self.mark_times.get(MARKS[1], t1)

    def by_thread_ms(self, t0: float, t1: float) -> dict[str, float]:
        """CPU ms of each collector thread name between t0 and t1 (the samples nearest inside)."""
        inside = [(ts, d) for ts, d in self.by_thread if t0 <= ts <= t1]
        if len(inside) < 2:
            return {}
        first, last = inside[0][1], inside[-1][1]
        return {n: round((v - first.get(n, 0)) / 1e6, 1) for n, v in last.items() if v - first.get(n, 0) >= 500_000}

    def _between_ms(self, t0: float, t1: float, series: list[tuple[float, int]]) -> float:
        """A series of ns totals' growth between t0 and t1, in ms."""
        return round((self.at(t1, series) - self.at(t0, series)) / 1e6, 1)

    def _displaced_ms(self, t0: float, t1: float, keys: set[tuple[str, str]]) -> float:
        return self._between_ms(t0, t1, [(ts, sum(ns for key, ns in d.items() if key in keys))
                                         for ts, d in self.displaced_samples])

    def displaced_ms(self, t0: float, t1: float) -> dict[str, float]:
        """The collector's run time between t0 and t1 (ms) by what it displaced (--displaced)."""
        seen = {key for _, d in self.displaced_samples for key in d}
        return {c: self._displaced_ms(t0, t1, {key for key in seen if key[1] == c}) for c in CLASSES}

    def yield_outcomes_ms(self, t0: float, t1: float) -> dict[str, float]:
        """The collector's run time on a yielded rank's core between t0 and t1 (ms), by what the rank
        did on its return (displaced.OUTCOMES; counted when decided, so a little after it ran)."""
        return {name: self._between_ms(t0, t1, [(ts, d[name]) for ts, d in self.outcome_samples])
                for name in OUTCOMES}

    def preempting_ms_by_thread(self, t0: float, t1: float) -> dict[str, float]:
        """The collector's run time between t0 and t1 (ms) on a computing rank's core, by thread
        name, 0.5 ms and more (--displaced)."""
        names = {key[0] for _, d in self.displaced_samples for key in d if key[1] == "preempted_rank"}
        by_name = {n: self._displaced_ms(t0, t1, {(n, "preempted_rank")}) for n in names}
        return {n: ms for n, ms in sorted(by_name.items()) if ms >= 0.5}

    def at(self, t: float, samples: list[tuple[float, int]] | None = None) -> float:
        """The total (ns) at time t, linear between the samples around it (of the collectors' CPU,
        or of the samples given: the programs', a class of displaced time)."""
        samples = self.samples if samples is None else samples
        before = [(ts, v) for ts, v in samples if ts <= t]
        after = [(ts, v) for ts, v in samples if ts > t]
        if not before or not after:
            raise RuntimeError(f"collector CPU not sampled around {t} ({len(self.samples)} samples)")
        (t0, v0), (t1, v1) = before[-1], after[0]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def timed_script(app: apps_mod.App, layout: str) -> str:
    """realapps' batch script for the app (no fault), its mpirun line timed; on one node without
    its one task per node (placement() gives the tasks)."""
    text = runner.job_script(runner.RunSpec(app, faults_mod.FAULTS["balanced"], 0))
    lines = [f"#SBATCH --job-name=bench-slowdown-{app.name}" if line.startswith("#SBATCH --job-name=") else line
             for line in text.splitlines()
             if not (layout != "nodes" and line.startswith("#SBATCH --ntasks-per-node="))]
    i = next(k for k, line in enumerate(lines) if line.startswith("mpirun "))
    lines[i:i + 1] = ["t0=$(date +%s.%N)", f": > {MARKS[0]}", lines[i], "t1=$(date +%s.%N)", f": > {MARKS[1]}",
                      'awk -v a="$t0" -v b="$t1" \'BEGIN { printf "bench_app_seconds %.3f\\n", b - a }\'',
                      'echo "bench_app_window $t0 $t1"']
    return "\n".join(lines) + "\n"


LAYOUTS = ("node", "shared", "nodes")
# GROMACS's steps here: a run of about 30 s in the node layout, as hpcc's first size
GROMACS_STEPS = 12000
# hpcc's sizes by default (HPL's N): a job of about 30 s in the node layout here on a slow day,
# and a job of 3 to 6 s (module docstring)
HPCC_SIZES = (3600, apps_mod.HPCC_N)


def ranks(app: apps_mod.App, layout: str) -> int:
    return (os.cpu_count() or 1) if layout == "node" else app.nodes


def placement(app: apps_mod.App, layout: str) -> list[str]:
    """sbatch's arguments for the layout."""
    if layout == "nodes":
        return [f"-N{app.nodes}"]
    if layout in ("node", "shared"):  # --overcommit: more tasks than the node's CPUs (shared)
        return ["-N1", f"--ntasks={ranks(app, layout)}", "--overcommit"]
    raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")


@dataclass
class Run:
    seconds: float  # the mpirun line's
    collector_ms: float  # the CPU the job's collectors used inside it
    bpf_ms: float | None  # with bpf_time, their BPF programs' run time inside it
    by_thread_ms: dict[str, float]  # the collectors' CPU by thread name, 0.5 ms and more, between the samples inside it
    displaced_ms: dict[str, float] | None  # with a displacement, the collectors' run time by what it displaced
    preempting_ms: dict[str, float] | None  # and of it, on a computing rank's core, by thread name
    outcomes_ms: dict[str, float] | None  # and of it, on a yielded rank's core, by what the rank did on its return
    interposer: tuple[int, int] | None  # profiled: (the ranks' CPU samples in the interposer, all their samples)
    stacks_rate_hz: float | None  # profiled: the stack sampling rate its node files were recorded with (None: no stacks)
    bench_self_ms: float  # this bench process's CPU inside it (its sampling runs on the ranks' cores)


def one_run(app: apps_mod.App, profiled: bool, base: Path, k: int, modes: str = "", layout: str = "nodes",
            hpcc_n: int | None = None, bpf_time: bool = False, displacement: Displacement | None = None) -> Run:
    """One run of the application, profiled or plain, timed inside its batch script."""
    pw = pwd.getpwnam(slurm.TEST_USER)
    work = base / f"{app.name}-{layout}-{k}-{'prof' if profiled else 'plain'}"
    work.mkdir(mode=0o755)
    app.prepare(work)
    if app.name == "hpcc" and ranks(app, layout) != app.nodes:
        apps_mod.hpcc_grid(work, 1, ranks(app, layout))
    if app.name == "hpcc" and hpcc_n is not None:
        apps_mod.hpcc_size(work, hpcc_n)
    (work / "job.sh").write_text(timed_script(app, layout))
    for p in [work, *work.iterdir()]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    flag = f"--profile-gpu={modes}" if modes else "--profile-gpu"
    args = [*placement(app, layout), f"--chdir={work}", *([flag] if profiled else []), str(work / "job.sh")]
    job = slurm.sbatch(args, user=slurm.TEST_USER, cwd=work)
    cpu = CollectorCpu(job, work, bpf_time, displacement)
    try:
        info = slurm.wait_final(job, runner.JOB_TIMEOUT_S)
    finally:
        cpu.stop()
    out = work / f"slurm-{job}.out"
    text = out.read_text(errors="replace") if out.is_file() else ""
    if info.get("JobState") != "COMPLETED":
        raise RuntimeError(f"{app.name} job {job} ended {info.get('JobState')}: {text[-1500:]}")
    m = TIMED.search(text)
    if m is None:
        raise RuntimeError(f"{out}: no bench_app_seconds line:\n{text[-1500:]}")
    w = WINDOW.search(text)
    if w is None:
        raise RuntimeError(f"{out}: no bench_app_window line:\n{text[-1500:]}")
    t0, t1 = cpu.window(float(w.group(1)), float(w.group(2)))
    ms = (cpu.at(t1) - cpu.at(t0)) / 1e6
    bench_self_ms = (cpu.at(t1, cpu.self_samples) - cpu.at(t0, cpu.self_samples)) / 1e6
    bpf_ms = (cpu.at(t1, cpu.bpf_samples) - cpu.at(t0, cpu.bpf_samples)) / 1e6 if bpf_time and profiled else None
    threads = cpu.by_thread_ms(t0, t1)
    displaced = cpu.displaced_ms(t0, t1) if displacement is not None and profiled else None
    preempting = cpu.preempting_ms_by_thread(t0, t1) if displacement is not None and profiled else None
    outcomes = cpu.yield_outcomes_ms(t0, t1) if displacement is not None and profiled else None
    interposer = stacks_rate_hz = None
    if profiled:
        runner.wait_automerge(job, 300)  # its merge job must not share the cores with the next run
        nodes = sorted((work / f"slurm-{job}.gpuprof.d").glob("*.h5"))
        if not nodes:
            raise RuntimeError(f"{work}: profiled job {job} left no node file in slurm-{job}.gpuprof.d")
        interposer = interposer_samples(nodes, app.comm)
        stacks_rate_hz = sampled_rate(nodes)
    shutil.rmtree(work, ignore_errors=True)
    return Run(float(m.group(1)), ms, bpf_ms, threads, displaced, preempting, outcomes, interposer, stacks_rate_hz,
               bench_self_ms)


def sampled_rate(node_files: list[Path]) -> float | None:
    """The stack sampling rate (Hz per CPU) the node files were recorded with: their config's
    sources.stacks.rate_hz (config_json; rates_json's "stacks" is the drain's rate), None where
    the modes took no stacks. A bench run with the cluster's gpuprof.toml changed must not pass for
    the default."""
    rates = set()
    for p in node_files:
        attrs = open_node_trace(p, tables=()).attrs
        if "stacks" not in str(attrs.get("modes", "")).split(","):
            rates.add(None)
            continue
        rates.add(float(json.loads(attrs["config_json"])["sources.stacks"]["rate_hz"]))
    if len(rates) != 1:
        raise RuntimeError(f"node files {[p.name for p in node_files]} say different stack rates: {sorted(map(str, rates))}")
    return rates.pop()


@functools.cache
def code_version() -> dict[str, Any]:
    """The commit the bench measured, and whether the tree had changes (a line pooled with others
    must be of the same code: tests/bench/pool_slowdown.py); read once, as the bench starts (main),
    so that a commit made while it runs is not taken for what it ran."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return {"commit": None, "commit_unknown": str(e)[:200]}
    return {"commit": head.stdout.strip(), "tree_changed": bool(status.stdout.strip())}


def interposer_samples(node_files: list[Path], rank_comm: str) -> tuple[int, int] | None:
    """(CPU samples of the ranks whose innermost user frame is in the MPI interposer, all the ranks'
    CPU samples), from the profiled job's own node files (the stacks mode's samples, at the config's
    rate, of the processes whose comm is rank_comm, from /processes/events). The interposer runs in
    the ranks, so its share of their samples is what it costs them; its polls' share is in it,
    though a rank that only polls loses nothing to them. None when the modes recorded no stacks."""
    mine = total = 0
    interposer = LIBRARIES["mpi"].name.encode()
    tables = (schema.STACK_SAMPLES.path, schema.STACK_FRAMES.path, schema.STACK_SYMBOLS.path,
              schema.PROCESS_EVENTS.path)
    for path in node_files:
        t = open_node_trace(path, tables=tables)
        if not all(t.has(p) for p in tables):
            return None  # --modes without stacks
        samples, frames, symbols, procs = (t.table(p) for p in tables)
        ranks = np.unique(procs["pid"][procs["comm"] == rank_comm[:15].encode()])
        module_of = dict(zip(symbols["symbol_id"].tolist(), symbols["module"].tolist(), strict=True))
        leaf_in = [sid for sid, d, sym in zip(frames["stack_id"].tolist(), frames["depth"].tolist(),
                                              frames["symbol_id"].tolist(), strict=True)
                   if d == 0 and module_of.get(sym) == interposer]
        is_rank = np.isin(samples["pid"], ranks)
        total += int(samples["count"][is_rank].sum())
        mine += int(samples["count"][is_rank & np.isin(samples["user_stack"], leaf_in)].sum())
    return mine, total


def run_retried(app: apps_mod.App, profiled: bool, base: Path, index: int, stride: int, modes: str, layout: str,
                hpcc_n: int | None, bpf_time: bool, displacement: Displacement | None) -> tuple[Run, int]:
    """one_run, run again when it is lost (its job failed, or its figures could not be read), up to
    RUN_ATTEMPTS tries; each try's work directory is index + stride * try. (the run, the failed tries)"""
    for attempt in range(RUN_ATTEMPTS):
        try:
            return one_run(app, profiled, base, index + stride * attempt, modes, layout, hpcc_n, bpf_time,
                           displacement), attempt
        except RuntimeError as e:
            if attempt + 1 == RUN_ATTEMPTS:
                raise
            print(json.dumps({"progress": "job_slowdown run failed, run again", "app": app.name, "layout": layout,
                              "error": str(e)[:500]}), file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last try returns or raises")


def bench_app(app: apps_mod.App, pairs: int, base: Path, modes: str = "", layout: str = "nodes",
              control: bool = False, hpcc_n: int | None = None, bpf_time: bool = False,
              displacement: Displacement | None = None) -> dict[str, Any]:
    """control: the second arm runs plain too (its runs in a work directory of their own)."""
    plain: list[float] = []
    prof: list[float] = []
    collector_ms: list[float] = []
    bpf_ms: list[float] = []
    by_thread: list[dict[str, float]] = []
    displaced: list[dict[str, float]] = []
    preempting: list[dict[str, float]] = []
    outcomes: list[dict[str, float]] = []
    interposer: list[tuple[int, int]] = []
    rates: set[float | None] = set()
    self_ms: dict[bool, list[float]] = {False: [], True: []}  # this bench's CPU in each run, by arm
    retried = 0
    for k in range(pairs):
        order = (False, True) if k % 2 == 0 else (True, False)
        for second_arm in order:
            index = k if not (control and second_arm) else pairs + k
            run, failed = run_retried(app, second_arm and not control, base, index, 2 * pairs, modes, layout, hpcc_n,
                                      bpf_time, displacement)
            retried += failed
            t = run.seconds
            (prof if second_arm else plain).append(t)
            self_ms[second_arm].append(run.bench_self_ms)
            if second_arm and not control:
                collector_ms.append(round(run.collector_ms, 1))
                if run.interposer is not None:
                    interposer.append(run.interposer)
                rates.add(run.stacks_rate_hz)
                by_thread.append(run.by_thread_ms)
                if run.bpf_ms is not None:
                    bpf_ms.append(round(run.bpf_ms, 1))
                if run.displaced_ms is not None and run.preempting_ms is not None and run.outcomes_ms is not None:
                    displaced.append(run.displaced_ms)
                    preempting.append(run.preempting_ms)
                    outcomes.append(run.outcomes_ms)
            print(json.dumps({"progress": "job_slowdown run", "app": app.name, "layout": layout,
                              "profiled": second_arm and not control, "seconds": t}),
                  file=sys.stderr, flush=True)
    per_pair = [(p / q - 1) * 100 for p, q in zip(prof, plain, strict=True)]
    nodes = app.nodes if layout == "nodes" else 1
    n = ranks(app, layout)
    size = {"hpl_n": hpcc_n or apps_mod.HPCC_N} if app.name == "hpcc" else {}
    if control:
        return {"bench": "job_slowdown_control", "app": app.name, **size, "layout": layout,
                "modes": "none (plain vs plain)",
                "median_percent": round((statistics.median(prof) / statistics.median(plain) - 1) * 100, 2),
                "median_percent_ci95": median_percent_interval(plain, prof),
                "pair_percent": {"median": round(statistics.median(per_pair), 2), "min": round(min(per_pair), 2),
                                 "max": round(max(per_pair), 2)},
                "plain_s": plain, "second_plain_s": prof, "pairs": pairs, "runs_retried": retried,
                "bench_self_cpu_ms_in_run": {"plain": spread_of(self_ms[False], 1), "second": spread_of(self_ms[True], 1)}, "interleaved": "alternating order",
                "cores": os.cpu_count(),
                "what": "two unprofiled arms: the bench's own spread on this machine"}
    return {"bench": "job_slowdown", "app": app.name, **size, "layout": layout, "modes": modes or DEFAULT_MODES,
            **code_version(), "stacks_rate_hz": sorted(rates, key=str) if len(rates) > 1 else rates.pop(),
            "median_percent": round((statistics.median(prof) / statistics.median(plain) - 1) * 100, 2),
            "median_percent_ci95": median_percent_interval(plain, prof),
            "pair_percent": {"median": round(statistics.median(per_pair), 2), "min": round(min(per_pair), 2),
                             "max": round(max(per_pair), 2)},
            "plain_s": plain, "profiled_s": prof, "pairs": pairs, "runs_retried": retried,
            "interleaved": "alternating order",
            # its sampling reads more in a profiled run, on the ranks' cores: a bias against profiling
            "bench_self_cpu_ms_in_run": {"plain": spread_of(self_ms[False], 1), "profiled": spread_of(self_ms[True], 1)},
            "collector_cpu_ms_in_run": {"median": round(statistics.median(collector_ms), 1), "min": min(collector_ms),
                                        "max": max(collector_ms)},
            "collector_cpu_ms_each_run": collector_ms,  # in profiled_s's order: a slow run beside its collector's
            "collector_cpu_ms_in_run_by_thread_median": {
                n: round(statistics.median(t.get(n, 0.0) for t in by_thread), 1)
                for n in sorted({n for t in by_thread for n in t})},
            "collector_cpu_percent_of_run": round(100 * statistics.median(collector_ms)
                                                  / (1000 * statistics.median(prof)), 2),
            **({"bpf_programs_ms_in_run": {"median": round(statistics.median(bpf_ms), 1), "min": min(bpf_ms),
                                           "max": max(bpf_ms)},
                "bpf_stats": "kernel.bpf_stats_enabled=1 (--bpf-time): the programs' own time, a little more "
                             "with the counting on"} if bpf_ms else {}),
            **({"collector_displaced_ms_in_run": {
                c: {"median": round(statistics.median(d[c] for d in displaced), 1),
                    "min": min(d[c] for d in displaced), "max": max(d[c] for d in displaced)} for c in CLASSES},
                "collector_displaced_ms_each_run": displaced,
                "collector_preempted_rank_ms_by_thread_median": {
                    n: round(statistics.median(t.get(n, 0.0) for t in preempting), 1)
                    for n in sorted({n for t in preempting for n in t})},
                "collector_preempted_rank_percent_of_run": round(
                    100 * statistics.median(d["preempted_rank"] for d in displaced) / (1000 * statistics.median(prof)), 3),
                "collector_yielded_rank_ms_by_outcome": {o: spread_of([d[o] for d in outcomes], 1) for o in OUTCOMES},
                # the evidence for displaced.RETURN_POLL_NS: since the bench started, all runs
                "collector_yielded_rank_ms_by_return_gap": {
                    k: round(ns / 1e6, 1) for k, ns in displacement.return_gaps().items()} if displacement else {},
                # what the ranks may have lost to the collector: its run time on a computing rank's
                # core, and on a yielded rank's core when the rank had work on its return
                "collector_taken_from_ranks_percent_of_run": round(
                    100 * statistics.median(d["preempted_rank"] + o["worked"] for d, o in zip(displaced, outcomes, strict=True))
                    / (1000 * statistics.median(prof)), 3),
                "displaced": "tests/bench/displaced.py: the collector threads' run time by what was on the CPU "
                             "before them; preempted_rank is what the job's compute lost; of yielded_rank, "
                             "'worked' where the rank had work on its return (an upper bound of what it "
                             "lost), 'polled' where it went on polling"} if displaced else {}),
            **({"interposer_percent_of_rank_samples": spread_of([100 * a / b for a, b in interposer if b], 3),
                "interposer_rank_samples_each_run": [list(x) for x in interposer],
                "interposer": "the share of the ranks' CPU samples (the profiled run's own /stacks/samples, at "
                              "sources.stacks.rate_hz) whose innermost frame is in the MPI interposer"}
               if interposer else {}),
            **cost_bound(prof, bpf_ms, displaced, outcomes, interposer),
            "nodes": nodes, "ranks": n, "ranks_per_core": round(n / (os.cpu_count() or 1), 2),
            "collectors_on_this_host": nodes, "goal_percent": 1.0,
            "cores": os.cpu_count(),
            "what": "the application's mpirun line, timed inside the batch script"}


def spread_of(values: list[float], digits: int = 2) -> dict[str, float] | None:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)} if values else None


def cost_bound(prof: list[float], bpf_ms: list[float], displaced: list[dict[str, float]],
               outcomes: list[dict[str, float]], interposer: list[tuple[int, int]]) -> dict[str, Any]:
    """What profiling can have cost each profiled run at most, from what was measured in it (with
    --displaced and --bpf-time): the collector's time on the ranks' cores that they may have lost
    (preempted computing, or yielded and then working), the BPF programs' time (in the ranks'
    context: counted whole, as if every rank waited for all of it), and the interposer's share of
    the ranks' samples. Measured, where the slowdown's median is inside this machine's noise."""
    if not (len(prof) == len(bpf_ms) == len(displaced) == len(outcomes) == len(interposer)) or not prof:
        return {}
    each = [100 * (d["preempted_rank"] + o["worked"] + b) / (1000 * s) + 100 * i / max(t, 1)
            for s, b, d, o, (i, t) in zip(prof, bpf_ms, displaced, outcomes, interposer, strict=True)]
    return {"profiler_cost_bound_percent": spread_of(each, 3),
            "profiler_cost_bound": "per profiled run: (collector ms on computing ranks' cores + on yielded ranks' "
                                   "cores that then worked + BPF programs' ms) / the run, + the interposer's share "
                                   "of the ranks' samples: an upper bound of what profiling cost the job"}


def split_line(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The collector's CPU inside the run as once + per_s * seconds: the least-squares line through
    the sizes' (median profiled run, median collector CPU in it); None with fewer than two sizes
    measured (or a control run, which profiles nothing)."""
    sizes = [line for line in lines if line.get("bench") == "job_slowdown" and line.get("median_percent") is not None
             and "hpl_n" in line]
    if len(sizes) < 2:
        return None
    xs = [statistics.median(line["profiled_s"]) for line in sizes]
    ys = [line["collector_cpu_ms_in_run"]["median"] for line in sizes]
    if max(xs) - min(xs) < 1.0:
        return None  # runs of the same length: nothing to split
    per_s, once = statistics.linear_regression(xs, ys)
    return {"bench": "job_slowdown_split", "app": sizes[0]["app"], "layout": sizes[0]["layout"],
            "modes": sizes[0]["modes"],
            "collector_cpu_ms_once": round(once, 1), "collector_cpu_ms_per_s": round(per_s, 2),
            "sizes": [{"hpl_n": line["hpl_n"], "profiled_s_median": round(x, 3), "collector_cpu_ms_in_run_median": y,
                       "median_percent": line["median_percent"]} for line, x, y in zip(sizes, xs, ys, strict=True)],
            "what": "the collector's CPU inside the timed run as a cost per job (once) and per second of the "
                    "application, a line through the sizes' medians"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one pair of one application")
    ap.add_argument("--apps", default=None, help="comma list (default train,hpcc,meep,gromacs; quick: train)")
    ap.add_argument("--pairs", type=int, default=None, help="pairs of runs per application (default 3, quick 1)")
    ap.add_argument("--modes", default="", help="--profile-gpu=MODES for the profiled runs (default: the default "
                    "modes, plain --profile-gpu): what one mode costs")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of node (one node, a rank per core), "
                    "shared (the application's 4 ranks on one node) and nodes (one rank per virtual node: four "
                    "collectors on this host); default all three")
    ap.add_argument("--control", action="store_true", help="both arms plain: the bench's own spread (an A/A run)")
    ap.add_argument("--hpcc-n", default=",".join(map(str, HPCC_SIZES)),
                    help="HPL's N for hpcc, a comma list, one line each (default %(default)s: a run of about 30 s "
                    "and one of 3 to 6 s in the node layout): two sizes or more also print job_slowdown_split")
    # both on by default: together with the profiled run's own samples they give
    # profiler_cost_bound_percent, the figure that resolves 1 % where the slowdown's median cannot
    ap.add_argument("--bpf-time", action=argparse.BooleanOptionalAction, default=True,
                    help="the run time of the collectors' BPF programs inside the timed line (turns "
                    "kernel.bpf_stats_enabled on for the bench, which costs the programs a little; default on)")
    ap.add_argument("--displaced", action=argparse.BooleanOptionalAction, default=True,
                    help="the collector threads' run time inside the timed line by what each displaced (a rank "
                    "computing, a rank yielding, an idle CPU, other): a BCC program on every context switch, in "
                    "both arms (default on)")
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    try:
        hpcc_sizes = [int(n) for n in a.hpcc_n.split(",")]
    except ValueError:
        ap.error(f"--hpcc-n: {a.hpcc_n!r} is not a comma list of integers")
    for layout in layouts:
        if layout not in LAYOUTS:
            ap.error(f"--layouts: {layout!r} is not one of {', '.join(LAYOUTS)}")
    names = (a.apps or ("train" if a.quick else "train,hpcc,meep,gromacs")).split(",")
    pairs = a.pairs or (1 if a.quick else 3)
    if os.geteuid() != 0:
        print(json.dumps({"bench": "job_slowdown", "app": None, "median_percent": None, "missing": "needs root"}))
        return 0
    code_version()  # what the runs below run, before any of them
    base = Path(tempfile.mkdtemp(prefix="gpuprof-slowdown-", dir="/var/tmp"))
    base.chmod(0o755)
    stats_before = BPF_STATS.read_text() if a.bpf_time else None
    if a.bpf_time:
        BPF_STATS.write_text("1\n")
    displacement = None
    try:
        if a.displaced:  # the classifier checked where the answer is known, before it is used
            print(json.dumps(displaced_control()), flush=True)
        for name in names:
            app = apps_mod.get(name)
            if app.name == "gromacs":
                app = apps_mod.gromacs_steps(app, GROMACS_STEPS)
            if a.displaced:
                if displacement is not None:
                    displacement.close()
                displacement = Displacement(Path(app.argv[0]).name)
            for layout in layouts:
                lines = []
                for n in (hpcc_sizes if app.name == "hpcc" else [None]):
                    try:
                        app.check()
                        line = bench_app(app, pairs, base, a.modes, layout, a.control, n, a.bpf_time, displacement)
                    except (apps_mod.AppUnavailable, slurm.SlurmError, RuntimeError, TimeoutError) as e:
                        line = {"bench": "job_slowdown", "app": name, "layout": layout, "median_percent": None,
                                "missing": str(e)[:500], **({"hpl_n": n} if n else {})}
                    print(json.dumps(line), flush=True)
                    lines.append(line)
                split = split_line(lines)
                if split is not None:
                    print(json.dumps(split), flush=True)
    finally:
        if displacement is not None:
            displacement.close()
        shutil.rmtree(base, ignore_errors=True)
        if stats_before is not None:
            BPF_STATS.write_text(stats_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
