"""The demo's MPI program: a data-parallel training loop in miniature.

Each rank computes for a while, then all ranks meet in an MPI_Allreduce of a gradient buffer.
One rank (DEMO_SLOW_RANK, default 2) is made slow on purpose: it burns extra CPU before each
allreduce, as a rank with a slow data loader would. The profiler should name that rank, and say
"host" (its CPU was busy) as the cause. Runs on a CPU; no GPU needed.
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI


def busy(seconds: float) -> float:
    end = time.perf_counter() + seconds
    x = 0.0
    while time.perf_counter() < end:
        x += sum(i * i for i in range(200))
    return x


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    steps = int(os.environ.get("DEMO_STEPS", "150"))
    slow_rank = int(os.environ.get("DEMO_SLOW_RANK", "2")) % size
    compute_s = float(os.environ.get("DEMO_COMPUTE_S", "0.02"))
    extra_s = float(os.environ.get("DEMO_EXTRA_S", "0.03"))
    grad = np.full(256 * 1024, float(rank), dtype=np.float32)  # 1 MiB
    out = np.empty_like(grad)
    # Sub-communicators as a tensor/data-parallel job would have them.
    pairs = comm.Split(color=rank // 2, key=rank)
    comm.Barrier()
    t0 = time.time()
    for _ in range(steps):
        busy(compute_s + (extra_s if rank == slow_rank else 0.0))
        comm.Allreduce(grad, out, op=MPI.SUM)
        pairs.Allreduce(grad[:1024], out[:1024], op=MPI.SUM)
    comm.Barrier()
    if rank == 0:
        print(f"{steps} steps on {size} ranks in {time.time() - t0:.2f} s; slow rank {slow_rank}", flush=True)
    pairs.Free()


if __name__ == "__main__":
    main()
