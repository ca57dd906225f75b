"""What a job's tasks are given to reach the fast path: the interposer libraries, NCCL's profiler
plugin, the NVTX and CUPTI injections, the per-job ring directory; the job's task plan that the
prolog writes for the TaskProlog, and the `export` lines the TaskProlog makes of it.

The standard library only (and the suite's environment names): the TaskProlog runs this for every
task of every step of a profiled job, inside the job's own time, so it must not import numpy or
h5py (a task's TaskProlog went from about 190 to about 40 ms of CPU: docs/collector.md, "What a
job pays at each step"). The fast path's source (sources/fastpath.py) reads what this names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuprof.collector import environment as env

# bpf/fastpath/build of the install (bpf_support.BPF_DIR / "fastpath" / "build"; not imported
# from there: bpf_support brings numpy)
BUILD_DIR = Path(__file__).resolve().parent.parent / "bpf" / "fastpath" / "build"
LIBRARIES = {"mpi": BUILD_DIR / "libgpuprof_pmpi.so", "nccl": BUILD_DIR / "libgpuprof_nccl.so"}
LAYOUT = BUILD_DIR / "layout.json"
# NCCL's profiler plugin interface and NVTX's injection (bpf/fastpath/gpuprof_nccl_profiler.c,
# gpuprof_nvtx.c): loaded by libnccl and by the application's NVTX headers, not preloaded.
NCCL_PROFILER = BUILD_DIR / "libnccl-profiler-gpuprof.so"
NVTX_INJECTION = BUILD_DIR / "libgpuprof_nvtx.so"
CUPTI_INJECTION = BUILD_DIR / "libgpuprof_cupti.so"  # CUDA_INJECTION64_PATH: CUPTI activity (mode kernels)
CUDA_INJECTION64_PATH = env.CUDA_INJECTION64_PATH
NCCL_PROFILER_PLUGIN = env.NCCL_PROFILER_PLUGIN
NVTX_INJECTION64_PATH = env.NVTX_INJECTION64_PATH
GPUPROF_NVTX = env.GPUPROF_NVTX
RING_DIR = "/dev/shm"


def job_ring_dir(job_id: str, node: str, base: str = RING_DIR) -> Path:
    """The per-job, per-node ring directory the prolog creates: /dev/shm/gpuprof-<job>@<node>.
    Per node because several virtual Slurm nodes of one host share /dev/shm, each with its own
    prolog, epilog and collector."""
    if not job_id or "/" in job_id or "/" in node or node in (".", ".."):
        raise ValueError(f"job id {job_id!r} / node {node!r} cannot name a ring directory")
    return Path(base) / f"gpuprof-{job_id}@{node}"


def built_libraries() -> dict[str, Path | None]:
    """The interposer libraries that are built (make -C bpf/fastpath), by library."""
    ok = LAYOUT.exists()
    return {lib: (p if ok and p.exists() else None) for lib, p in LIBRARIES.items()}


def resolve_paths(config: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per library: 'uprobe' or 'fastpath' (auto = fast path when its library is built)."""
    built = built_libraries()
    out = {}
    for lib in ("mpi", "nccl"):
        want = config.get("sources.collectives", {}).get(f"{lib}_path", "auto")
        if want == "auto":
            want = "fastpath" if built.get(lib) else "uprobe"
        out[lib] = want
    return out


def nccl_profiler_on(config: dict[str, dict[str, Any]]) -> bool:
    """NCCL's profiler plugin for this job: sources.collectives.nccl_profiler = auto and it is built.
    A hand-made config without the key (tests) does not get it: config.load always has it."""
    want = config.get("sources.collectives", {}).get("nccl_profiler", "off")
    if want not in ("auto", "off"):
        raise ValueError(f"sources.collectives.nccl_profiler: {want!r} is neither 'auto' nor 'off'")
    return want == "auto" and NCCL_PROFILER.exists() and LAYOUT.exists()


def nvtx_on(config: dict[str, dict[str, Any]], job_env: Mapping[str, str]) -> bool:
    """NVTX injection for this job: sources.nvtx.inject = on, or job and the job's environment has
    GPUPROF_NVTX=1; and the library is built. A config without the key: off (as nccl_profiler_on)."""
    want = config.get("sources.nvtx", {}).get("inject", "off")
    if want not in ("job", "on", "off"):
        raise ValueError(f"sources.nvtx.inject: {want!r} is not one of job, on, off")
    asked = want == "on" or (want == "job" and job_env.get(GPUPROF_NVTX, "") == "1")
    return asked and NVTX_INJECTION.exists() and LAYOUT.exists()


def cupti_on(modes: tuple[str, ...], config: dict[str, dict[str, Any]]) -> bool:
    """CUPTI kernel times for this job: mode kernels, sources.kernels.cupti = auto and built. A
    config without the key: off (as nccl_profiler_on)."""
    want = config.get("sources.kernels", {}).get("cupti", "off")
    if want not in ("auto", "off"):
        raise ValueError(f"sources.kernels.cupti: {want!r} is neither 'auto' nor 'off'")
    return "kernels" in modes and want == "auto" and CUPTI_INJECTION.exists() and LAYOUT.exists()


# The job's task plan (`job_task_plan`): what the prolog decides once per job and node, written for
# the TaskProlog into TASK_PLAN_DIR/<job>@<node> (`write_task_plan`), so that the TaskProlog, which
# runs for every task of every step inside the job's time, is a shell script that reads it
# (etc/task-prolog: about 1 ms of CPU a task, where starting Python took 37 to 90). The directory
# is root's (0755) and each plan the job's user's alone to read (0400): no user can write one. The
# shell and `render_task_plan` here give the same lines (tests/test_task_prolog.py).
TASK_PLAN_DIR = Path("/run/gpuprof-tasks")
# a plan's keys, in the order of its lines; the per-task part is the task's own environment:
#   preload: prepended to the task's LD_PRELOAD; plugin, nvtx, cupti: set unless the job set the
#   variable to something else (then a `print` line says so); nvtx_asked: nvtx, only for a task
#   whose environment has GPUPROF_NVTX=1 (sources.nvtx.inject = job)
PLAN_KEYS = ("modes", "preload", "job", "dir", "plugin", "nvtx", "nvtx_asked", "cupti")
PLAN_VARIABLES = {"plugin": NCCL_PROFILER_PLUGIN, "nvtx": NVTX_INJECTION64_PATH,
                  "nvtx_asked": NVTX_INJECTION64_PATH, "cupti": CUDA_INJECTION64_PATH}


def job_task_plan(modes: tuple[str, ...], config: dict[str, dict[str, Any]], job_id: str,
                  ring_dir: str | os.PathLike[str] | None) -> list[tuple[str, str]]:
    """(key, value) pairs of PLAN_KEYS: the job's modes, and, when the job has a ring directory,
    what of the fast path its tasks get (the interposers of the libraries whose path is 'fastpath':
    sources.collectives.mpi_path / nccl_path, auto = when built; NCCL's profiler plugin,
    `nccl_profiler_on`; NVTX's injection, `nvtx_on`; CUPTI's in mode kernels, `cupti_on`, then
    without the interposers)."""
    plan = [("modes", ",".join(modes))]
    if ring_dir is None or ("collectives" not in modes and "kernels" not in modes):
        return plan
    paths = resolve_paths(config)
    built = built_libraries()
    libs = [str(built[lib]) for lib in ("mpi", "nccl") if paths[lib] == "fastpath" and built[lib] is not None]
    if "collectives" not in modes:
        libs = []
    plugin = "collectives" in modes and nccl_profiler_on(config)
    nvtx_when = config.get("sources.nvtx", {}).get("inject", "off")
    nvtx = "collectives" in modes and nvtx_on(config, {GPUPROF_NVTX: "1"})  # built, and on or job
    cupti = cupti_on(modes, config)
    if not libs and not plugin and not nvtx and not cupti:
        return plan
    if libs:
        plan.append(("preload", ":".join(libs)))
    plan += [("job", job_id), ("dir", os.fspath(ring_dir))]
    if plugin:
        plan.append(("plugin", str(NCCL_PROFILER)))
    if nvtx:
        plan.append(("nvtx" if nvtx_when == "on" else "nvtx_asked", str(NVTX_INJECTION)))
    if cupti:
        plan.append(("cupti", str(CUPTI_INJECTION)))
    return plan


def render_task_plan(plan: list[tuple[str, str]], task_env: Mapping[str, str]) -> list[str]:
    """The TaskProlog's lines for one task: `export NAME=value`, and `print ...` where the job set
    a variable of ours to something else (the job's own plugin wins; the collector reports it
    too, /diagnostics/errors). etc/task-prolog does the same in shell."""
    asked_nvtx = task_env.get(GPUPROF_NVTX, "") == "1"
    # the ring's job and directory only for a task that gets something writing to it
    active = any(k in ("preload", "plugin", "nvtx", "cupti") or (k == "nvtx_asked" and asked_nvtx) for k, _ in plan)
    lines = []
    for key, value in plan:
        if key in ("job", "dir") and not active:
            continue
        if key == "modes":
            lines.append(f"export {env.GPUPROF_MODES}={value}")
        elif key == "preload":
            theirs = task_env.get(env.LD_PRELOAD, "")
            lines.append(f"export LD_PRELOAD={':'.join([value, *[p for p in theirs.split(':') if p]])}")
        elif key == "job":
            lines.append(f"export GPUPROF_FASTPATH_JOB={value}")
        elif key == "dir":
            lines.append(f"export GPUPROF_FASTPATH_DIR={value}")
        elif key == "nvtx_asked" and not asked_nvtx:
            continue
        elif key in PLAN_VARIABLES:
            var = PLAN_VARIABLES[key]
            theirs = task_env.get(var, "")
            if theirs and theirs != value:
                lines.append(f"print gpuprof: {var} is already set by the job ({theirs[:200]}): gpuprof's stays "
                             "out and records nothing through it")
            else:
                lines.append(f"export {var}={value}")
        else:  # every key of PLAN_KEYS is one of the branches above
            raise ValueError(f"task plan: unknown key {key!r}")
    return lines


def fastpath_exports(modes: tuple[str, ...], config: dict[str, dict[str, Any]], job_id: str | None = None,
                     existing_ld_preload: str | None = None, ring_dir: str | os.PathLike[str] | None = None,
                     node: str | None = None, job_env: Mapping[str, str] | None = None) -> list[str]:
    """The fast path's `export` lines of one task (`job_task_plan` rendered, without the modes'
    line); empty when mode `collectives` is off or no library uses the fast path. job_id and the
    task's LD_PRELOAD default to this process's environment (SLURM_JOB_ID, LD_PRELOAD); ring_dir to
    the per-job directory of this node (`job_ring_dir`, node from SLURMD_NODENAME); job_env (the
    task's environment, for the variables the job may have set itself) to os.environ."""
    if job_env is None:
        job_env = os.environ
    if job_id is None:
        job_id = env.get(env.SLURM_JOB_ID)
        if not job_id:
            return []  # no job to name the rings after: the uprobe path still sees the calls
    if ring_dir is None:
        try:
            ring_dir = job_ring_dir(job_id, node or env.get(env.SLURMD_NODENAME) or os.uname().nodename)
        except ValueError:
            return []
    if existing_ld_preload is None:
        existing_ld_preload = env.get(env.LD_PRELOAD) or ""
    task_env = {**job_env, env.LD_PRELOAD: existing_ld_preload}
    plan = [(k, v) for k, v in job_task_plan(modes, config, job_id, ring_dir) if k != "modes"]
    return render_task_plan(plan, task_env)


def task_plan_path(job_id: str, node: str, base: Path = TASK_PLAN_DIR) -> Path:
    """TASK_PLAN_DIR/<job>@<node> (per node as job_ring_dir is)."""
    return base / job_ring_dir(job_id, node, "/").name.removeprefix("gpuprof-")
