"""An mpi4py program shaped like data-parallel training (written here; the other applications of the
suite are Debian's).

Per step: a data-loading phase (CPU decode of a batch plus an optional sleep, as an input pipeline
waiting on storage), a compute phase (numpy matmuls, the forward and backward pass), then an
`MPI_Allreduce` of the gradient buffer with the buffer API. `--load-extra-s` adds that many seconds of
sleep to the data loading of `--slow-rank` only (the fault class "extra sleep in one rank's data
loading"; ground truth: that rank, cause host).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--load-s", type=float, default=0.01, help="sleep of every rank's data loading per step")
    p.add_argument("--load-extra-s", type=float, default=0.0, help="extra sleep of --slow-rank's data loading")
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--matmul-n", type=int, default=160, help="size of the square matrices of the compute phase")
    p.add_argument("--matmuls", type=int, default=4, help="matmuls per step")
    p.add_argument("--grad-floats", type=int, default=256 * 1024, help="gradient buffer length (float32)")
    return p.parse_args(argv)


def load_batch(rng: np.random.Generator, n: int, sleep_s: float) -> np.ndarray:
    """Data loading: wait for 'storage', then decode (CPU work) a batch."""
    if sleep_s > 0:
        time.sleep(sleep_s)
    raw = rng.integers(0, 255, size=(n, n), dtype=np.uint8)
    return raw.astype(np.float64) / 255.0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    slow = args.slow_rank % size
    rng = np.random.default_rng(rank)
    weights = rng.standard_normal((args.matmul_n, args.matmul_n)) / args.matmul_n
    grad = np.zeros(args.grad_floats, dtype=np.float32)
    summed = np.empty_like(grad)
    comm.Barrier()
    t0 = time.time()
    for _ in range(args.steps):
        extra = args.load_extra_s if rank == slow else 0.0
        x = load_batch(rng, args.matmul_n, args.load_s + extra)
        for _ in range(args.matmuls):
            x = np.tanh(x @ weights)
        grad[: x.size] = x.ravel()[: grad.size].astype(np.float32)
        comm.Allreduce(grad, summed, op=MPI.SUM)
        weights -= 1e-6 * summed[: weights.size].reshape(weights.shape[0], -1)[:, : weights.shape[1]]
    comm.Barrier()
    if rank == 0:
        print(f"train_app: {args.steps} steps on {size} ranks in {time.time() - t0:.2f} s; "
              f"slow rank {slow} +{args.load_extra_s} s per step", flush=True)


if __name__ == "__main__":
    main()
