"""slurm-gpuprof: the Slurm side of the suite (hooks, DCGM lock, job lookup, CLI, config)."""

__version__ = "0.1.0"
