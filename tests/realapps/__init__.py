"""The real-application fault-injection suite (issue 10, item 7): Debian's MPI applications and one
data-parallel-shaped mpi4py program, run under real `sbatch --profile-gpu` on the local cluster with
faults injected from outside, ground truth recorded, merged and scored.

Modules: `apps` (the catalogue), `faults` (the injectors and their ground truth), `slurm` (submitting
and waiting), `runner` (record, merge, score; `python -m tests.realapps.runner --help`), `scoring`,
`retime` (re-timed copies of recordings with known clock errors, and their scoring).
"""
