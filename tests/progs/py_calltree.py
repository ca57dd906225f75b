"""A Python program with a known call tree, for the Python stack tests and the stack_quality bench.

    main -> train_step -> forward -> layer -> (numpy) matmul    about half of the CPU time
                                  -> activation                pure Python loop, the other half

`python py_calltree.py SECONDS [THREADS]`: with THREADS > 0 the tree runs in that many threads
(named worker-N, started from `spawn_workers`) while the main thread waits in `join_workers`.
PY_CALLTREE_N (default 96) sets the matrices' size: with a reference BLAS (Debian 13's root in
tests/test_python_stacks_313.py) 96 x 96 products take nearly all the time, 32 x 32 about half.
PY_CALLTREE_LEAF (default numpy) = zlib: for an interpreter without numpy (pyenv's builds in
tests/test_python_stacks_pyenv.py), `layer` calls zlib.crc32 over N * N * 8 bytes instead of the
product, C code under the same Python frame; anything else is refused.
It sleeps 1 s first: the collector looks for an interpreter in a new pid (or one that exec'd) at
its next drain, so samples of the first moments of a process have no Python frames.
Prints one JSON line at the end: pid, native thread ids of the workers, CPU seconds, train steps
done (all threads), when the work started (CLOCK_MONOTONIC ns: samples of windows starting later
are all of the work), and each leaf's share of the work's CPU time (the threads' own clocks, read
around each call): the "about half" above depends on the machine's BLAS and CPU, so the tests
compare the samples with these, not with a fixed share.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

# One BLAS thread per caller: OpenBLAS's own threads spin between calls, and on a small machine
# their spinning, not this program's code, would decide how fast it runs (and what is sampled).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

N = int(os.environ.get("PY_CALLTREE_N", "96"))
LEAF = os.environ.get("PY_CALLTREE_LEAF", "numpy")

if LEAF == "numpy":
    import numpy as np  # after the BLAS setting, which numpy reads at import

    A = np.random.default_rng(0).random((N, N))

    def layer(x: Any) -> Any:
        return np.matmul(x, A)  # numpy's C code under a Python frame (the leaf of the known tree)

    def start() -> Any:
        return np.ones((N, N))
elif LEAF == "zlib":
    import zlib

    DATA = bytes(range(256)) * (N * N * 8 // 256)

    def layer(x: Any) -> Any:
        return zlib.crc32(DATA, int(x))  # zlib's C code under a Python frame (the leaf of the known tree)

    def start() -> Any:
        return 1.0
else:
    sys.exit(f"PY_CALLTREE_LEAF={LEAF!r}: numpy or zlib")


def activation(n: int) -> int:
    total = 0
    for i in range(n):  # pure Python: the interpreter's own loop
        total += i * i % 7
    return total


class LeafTimes(threading.local):
    """This thread's CPU time in each leaf of the tree (ns): what the samples' shares should match."""

    layer_ns = 0
    activation_ns = 0


LEAF_TIMES = LeafTimes()


def forward(x: Any) -> Any:
    for _ in range(40):
        t0 = time.thread_time_ns()
        y = layer(x)
        LEAF_TIMES.layer_ns += time.thread_time_ns() - t0
        x = y / float(N)
    t0 = time.thread_time_ns()
    activation(6000)
    LEAF_TIMES.activation_ns += time.thread_time_ns() - t0
    return x


def train_step(x: Any) -> Any:
    return forward(x)


STEPS: list[int] = []  # train steps done, one entry per thread (the bench's measure of speed)
CPU_NS: list[tuple[int, int, int]] = []  # per thread: CPU ns in run_for, in layer, in activation


def run_for(seconds: float) -> None:
    x = start()
    t0 = time.thread_time_ns()
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        x = train_step(x)
        steps += 1
    STEPS.append(steps)
    CPU_NS.append((time.thread_time_ns() - t0, LEAF_TIMES.layer_ns, LEAF_TIMES.activation_ns))


def spawn_workers(n: int, seconds: float, tids: list[int]) -> list[threading.Thread]:
    def work() -> None:
        tids.append(threading.get_native_id())
        run_for(seconds)

    threads = [threading.Thread(target=work, name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    return threads


def join_workers(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    nthreads = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    tids: list[int] = []
    time.sleep(1.0)
    t_work_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # the clock of /stacks/samples t_ns
    if nthreads:
        join_workers(spawn_workers(nthreads, seconds, tids))
    else:
        tids.append(threading.get_native_id())
        run_for(seconds)
    t = os.times()
    work_ns = sum(c[0] for c in CPU_NS)
    print(json.dumps({"pid": os.getpid(), "tids": tids, "cpu_s": t.user + t.system, "t_work_ns": t_work_ns,
                      "steps": sum(STEPS),
                      "leaf_shares": {"py::layer": sum(c[1] for c in CPU_NS) / work_ns,
                                      "py::activation": sum(c[2] for c in CPU_NS) / work_ns}}),
          flush=True)


if __name__ == "__main__":
    main()
