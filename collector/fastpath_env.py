"""What a job's tasks are given to reach the fast path: the interposer libraries, NCCL's profiler
plugin, the NVTX and CUPTI injections, the per-job ring directory, and the `export` lines of the
TaskProlog that sets them (`fastpath_exports`).

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


def _step_aside(var: str, ours: Path, job_env: Mapping[str, str]) -> list[str]:
    """`export var=ours`, or, when the job set var itself, a line the job's output shows instead
    (a TaskProlog `print` line): the job's own plugin wins."""
    theirs = job_env.get(var, "")
    if theirs and theirs != str(ours):
        return [(f"print gpuprof: {var} is already set by the job ({theirs[:200]}): gpuprof's stays out "
                 "and records nothing through it")]
    return [f"export {var}={ours}"]


def fastpath_exports(modes: tuple[str, ...], config: dict[str, dict[str, Any]], job_id: str | None = None,
                     existing_ld_preload: str | None = None, ring_dir: str | os.PathLike[str] | None = None,
                     node: str | None = None, job_env: Mapping[str, str] | None = None) -> list[str]:
    """`export NAME=value` lines for the TaskProlog: the interposers of the libraries whose path is
    'fastpath' for this job (sources.collectives.mpi_path / nccl_path; auto = fast path when built).
    Empty when mode `collectives` is off or no library uses the fast path. job_id and the task's
    LD_PRELOAD default to the TaskProlog's environment (SLURM_JOB_ID, LD_PRELOAD); ring_dir to the
    per-job directory of this node (`job_ring_dir`, node from SLURMD_NODENAME). Also
    NCCL_PROFILER_PLUGIN (`nccl_profiler_on`), NVTX_INJECTION64_PATH (`nvtx_on`) and, in mode
    kernels, CUDA_INJECTION64_PATH (`cupti_on`; then without the interposers), each unless the
    job's environment (job_env, default the TaskProlog's) sets it already: then a `print` line
    says so to the job's output, and the collector reports it too (/diagnostics/errors)."""
    if "collectives" not in modes and "kernels" not in modes:
        return []
    if job_env is None:
        job_env = os.environ
    if job_id is None:
        job_id = env.get(env.SLURM_JOB_ID)
        if not job_id:
            return []  # no job to name the rings after: the uprobe path still sees the calls
    if existing_ld_preload is None:
        existing_ld_preload = env.get(env.LD_PRELOAD) or ""
    paths = resolve_paths(config)
    built = built_libraries()
    libs = [str(built[lib]) for lib in ("mpi", "nccl") if paths[lib] == "fastpath" and built[lib] is not None]
    if "collectives" not in modes:
        libs = []
    plugin = "collectives" in modes and nccl_profiler_on(config)
    nvtx = "collectives" in modes and nvtx_on(config, job_env)
    cupti = cupti_on(modes, config)
    if not libs and not plugin and not nvtx and not cupti:
        return []
    if ring_dir is None:
        try:
            ring_dir = job_ring_dir(job_id, node or env.get(env.SLURMD_NODENAME) or os.uname().nodename)
        except ValueError:
            return []
    lines = []
    if libs:
        preload = ":".join([*libs, *[p for p in existing_ld_preload.split(":") if p]])
        lines.append(f"export LD_PRELOAD={preload}")
    lines += [
        f"export GPUPROF_FASTPATH_JOB={job_id}",
        f"export GPUPROF_FASTPATH_DIR={os.fspath(ring_dir)}",
    ]
    if plugin:
        lines += _step_aside(NCCL_PROFILER_PLUGIN, NCCL_PROFILER, job_env)
    if nvtx:
        lines += _step_aside(NVTX_INJECTION64_PATH, NVTX_INJECTION, job_env)
    if cupti:
        lines += _step_aside(CUDA_INJECTION64_PATH, CUPTI_INJECTION, job_env)
    return lines
