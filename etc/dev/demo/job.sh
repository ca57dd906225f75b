#!/bin/bash
# The demo's batch script: an ordinary MPI job. Nothing in it knows about the profiler; the only
# change a user makes is `sbatch --profile-gpu`.
#SBATCH --job-name=gpuprof-demo
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --time=10
set -euo pipefail
echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"
mpirun --oversubscribe "$GPUPROF_DEMO_PYTHON" "$GPUPROF_DEMO_APP"
