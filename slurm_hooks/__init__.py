"""slurm-gpuprof: the Slurm side of the suite (hooks, DCGM lock, job lookup, CLI)."""
