"""Every environment variable the suite reads, in one place.

Slurm hands the hooks their context through the environment; the names differ by hook and by
Slurm version, so nothing else in the suite reads os.environ directly.
"""

import os

# The suite's own.
GPUPROF_CONFIG = "GPUPROF_CONFIG"  # path of the TOML config (lookup order: docs/config.md)
GPUPROF_NVML_LIBRARY = "GPUPROF_NVML_LIBRARY"  # explicit libnvidia-ml.so path (tests load a double)
GPUPROF_MODES = "GPUPROF_MODES"  # modes exported to the job by the TaskProlog

# SPANK option as the Prolog/Epilog see it (plugin "gpuprof", option "profile-gpu").
SPANK_OPTION_HOOK = "SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu"
# The same option as the job's own processes (and the TaskProlog) see it.
SPANK_OPTION_JOB = "SLURM_SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu"

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


def get(name: str) -> str | None:
    """The variable's value, or None when it is unset (never a made-up default)."""
    return os.environ.get(name)


def snapshot() -> dict[str, str]:
    """A copy of the environment, for hooks that record their context."""
    return dict(os.environ)
