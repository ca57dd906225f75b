"""Every environment variable the suite reads, in one place.

Slurm hands the hooks their context through the environment; the names differ by hook and by
Slurm version, so nothing else in the suite reads os.environ directly.
"""

import os

# The suite's own.
GPUPROF_CONFIG = "GPUPROF_CONFIG"  # path of the TOML config (lookup order: docs/config.md)
GPUPROF_NVML_LIBRARY = "GPUPROF_NVML_LIBRARY"  # explicit libnvidia-ml.so path (tests load a double)
GPUPROF_MODES = "GPUPROF_MODES"  # modes exported to the job by the TaskProlog
GPUPROF_MERGE_TIMING = "GPUPROF_MERGE_TIMING"  # "1": each merge rank prints its seconds per step to stderr

# The collectives fast path (bpf/fastpath interposers), exported to the job by the TaskProlog.
LD_PRELOAD = "LD_PRELOAD"
GPUPROF_FASTPATH_JOB = "GPUPROF_FASTPATH_JOB"  # job id: names the rings /dev/shm/gpuprof-<job>-<pid>
GPUPROF_FASTPATH_DIR = "GPUPROF_FASTPATH_DIR"  # where the rings are created
GPUPROF_FASTPATH_RECORDS = "GPUPROF_FASTPATH_RECORDS"  # ring size in records (interposer side)
# Set by the TaskProlog for the GPU side (docs/probes.md): NCCL's profiler plugin, NVTX's and CUDA's
# injection libraries; each steps aside when the job sets its own.
NCCL_PROFILER_PLUGIN = "NCCL_PROFILER_PLUGIN"
NVTX_INJECTION64_PATH = "NVTX_INJECTION64_PATH"
CUDA_INJECTION64_PATH = "CUDA_INJECTION64_PATH"
GPUPROF_NVTX = "GPUPROF_NVTX"  # "1" in the job's environment: it asks for its NVTX ranges (sources.nvtx.inject = job)
# read by libgpuprof_cupti.so: the libcupti to load (tests name a double; default: CUDA's own)
GPUPROF_CUPTI_LIBRARY = "GPUPROF_CUPTI_LIBRARY"
# Read by the interposers (C) to identify the MPI launch, so COMM_WORLD gets the same id on all ranks.
PMIX_NAMESPACE = "PMIX_NAMESPACE"
OMPI_MCA_ESS_BASE_JOBID = "OMPI_MCA_ess_base_jobid"
PMI_KVSNAME = "PMI_KVSNAME"

# The --profile-gpu option as Slurm forwards it, value as typed (plugin "gpuprof", option
# "profile-gpu"); with no value Slurm forwards the literal string "(null)". Set only when given.
SPANK_OPTION_HOOK = "SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu"  # Prolog, Epilog, EpilogSlurmctld
SPANK_OPTION_JOB = "SLURM_SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu"  # the job, TaskProlog
# The plugin's canonical copy (validated, de-duplicated, default filled in): read this first.
SPANK_MODES_HOOK = "SPANK_GPUPROF_MODES"  # Prolog, Epilog, EpilogSlurmctld
SPANK_MODES_JOB = "SLURM_SPANK_GPUPROF_MODES"  # the job, TaskProlog

# Slurm's hook environment (Prolog, Epilog, TaskProlog).
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_USER = "SLURM_JOB_USER"
SLURM_JOB_UID = "SLURM_JOB_UID"
SLURM_JOB_GID = "SLURM_JOB_GID"
SLURM_JOB_WORK_DIR = "SLURM_JOB_WORK_DIR"
SLURM_JOB_STDOUT = "SLURM_JOB_STDOUT"
SLURM_JOB_NAME = "SLURM_JOB_NAME"
SLURM_NODELIST = "SLURM_NODELIST"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_JOB_NUM_NODES = "SLURM_JOB_NUM_NODES"
SLURM_JOB_GPUS = "SLURM_JOB_GPUS"
SLURM_ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
SLURM_ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
SLURMD_NODENAME = "SLURMD_NODENAME"
SLURM_SCRIPT_CONTEXT = "SLURM_SCRIPT_CONTEXT"
SLURM_CONF = "SLURM_CONF"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


# Set by MPI launchers in each rank (Open MPI's mpirun; PMI-based launchers such as srun, MPICH).
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
PMI_SIZE = "PMI_SIZE"


# The thread counts of numpy's BLAS (OpenBLAS in numpy's wheels; OpenMP or MKL builds read the
# others). OpenBLAS starts a thread per core when numpy is imported, and each spins for about 0.1 s
# after it starts and after every BLAS call: 124 ms of CPU for the one extra thread of a bare
# `import numpy` on this 2-core VM, and in a collector of a meep job (metrics only) 119 ms, on the
# cores the job's ranks run on.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded_blas() -> None:
    """One BLAS thread in this process, whatever the environment said: call before numpy is
    imported (the library reads the variables when it loads). The collector and the merge's ranks
    work on small arrays; neither has a core to spare for spinning threads."""
    for name in BLAS_THREADS:
        os.environ[name] = "1"


def launched_by_mpirun() -> bool:
    return get(OMPI_COMM_WORLD_SIZE) is not None or get(PMI_SIZE) is not None


def get(name: str) -> str | None:
    """The variable's value, or None when it is unset (never a made-up default)."""
    return os.environ.get(name)


def profile_modes_hook() -> str | None:
    """The job's --profile-gpu value in a Prolog/Epilog, or None when it did not ask for profiling."""
    if get(SPANK_OPTION_HOOK) is None:
        return None
    return get(SPANK_MODES_HOOK) or get(SPANK_OPTION_HOOK)


def profile_modes_job() -> str | None:
    """The same, as the job's tasks and the TaskProlog see it."""
    if get(SPANK_OPTION_JOB) is None and get(SPANK_OPTION_HOOK) is None:
        return None
    return get(SPANK_MODES_JOB) or get(SPANK_OPTION_JOB) or get(SPANK_OPTION_HOOK)


def snapshot() -> dict[str, str]:
    """A copy of the environment, for hooks that record their context."""
    return dict(os.environ)
