"""Rank 0's memory does not grow with the node count (docs/merge.md, "Rank 0's memory", "At scale").

Structural checks, no timing: the job-wide tables are read back in blocks of at most BLOCK_CELLS
cells whatever the node count, the analysis's peak allocations stay flat when the nodes quadruple,
and under MPI the largest message rank 0 receives is one node's worth.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from gpuprof.mpi_merge import analysis, common, matching
from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.merge import merge

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = shutil.which("mpirun")
BLOCK = 2048  # small blocks, so that 2000 instances fill several of them at 4 nodes already


def make_job(base: Path, nodes: int) -> Path:
    d = base / f"n{nodes}.gpuprof.d"
    # the same per-node data at every node count: 2000 collectives, one rank and one GPU per node
    syn.generate(syn.SynthConfig(nodes=nodes, duration_s=20, period_ms=10, seed=3, metric_rate_hz=5), d)
    return d


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("mem")
    return {n: make_job(base, n) for n in (4, 16)}


class Recorder:
    """Wraps methods to record the cells of the arrays they return, and the traced peak of others."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.mp = monkeypatch
        self.cells: dict[str, int] = {}
        self.peak = 0
        self.stores: list[matching.CommStore] = []

    def cells_of(self, cls: type, name: str) -> None:
        real = getattr(cls, name)

        def spy(obj: Any, *a: Any, **k: Any) -> Any:
            out = real(obj, *a, **k)
            arrays = [out] if isinstance(out, np.ndarray) else [
                v for v in (out if isinstance(out, tuple) else vars(out).values()) if isinstance(v, np.ndarray)]
            key = f"{cls.__name__}.{name}"
            self.cells[key] = max([self.cells.get(key, 0)] + [x.size for x in arrays if x.ndim == 2])
            return out

        self.mp.setattr(cls, name, spy)

    def rows_of(self, cls: type, name: str) -> None:
        """The largest array argument a method gets (rows): what one call hands over."""
        real = getattr(cls, name)

        def spy(obj: Any, *a: Any, **k: Any) -> Any:
            key = f"{cls.__name__}.{name}"
            self.cells[key] = max([self.cells.get(key, 0)] + [len(x) for x in a if isinstance(x, np.ndarray)])
            return real(obj, *a, **k)

        self.mp.setattr(cls, name, spy)

    def traced(self, cls: type, name: str) -> None:
        real: Callable[..., Any] = getattr(cls, name)

        def spy(obj: Any, *a: Any, **k: Any) -> Any:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            out = real(obj, *a, **k)
            self.peak = max(self.peak, tracemalloc.get_traced_memory()[1] - base)
            return out

        self.mp.setattr(cls, name, spy)


def run_recorded(d: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    with monkeypatch.context() as mp:
        mp.setattr(common, "BLOCK_CELLS", BLOCK)
        rec = Recorder(mp)
        rec.cells_of(matching.CommStore, "block")
        rec.rows_of(matching.CommStore, "add_node")
        rec.cells_of(matching.InstanceTable, "take")
        rec.traced(analysis.JobAnalyzer, "scan")
        rec.traced(analysis.ClockInput, "fit")
        rec.traced(analysis.JobAnalyzer, "finish")
        real_init = matching.CommStore.__init__

        def keep(store: matching.CommStore, *a: Any, **k: Any) -> None:
            real_init(store, *a, **k)
            rec.stores.append(store)

        mp.setattr(matching.CommStore, "__init__", keep)
        tracemalloc.start()
        try:
            res = merge(str(d), output_stem=str(out))
        finally:
            tracemalloc.stop()
    assert res is not None and res.status == "complete", res and res.partial_reasons
    return rec


def test_tables_are_read_in_bounded_blocks_from_the_scratch_file(jobs: dict[int, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls_per_load = {}
    for n, d in jobs.items():
        rec = run_recorded(d, tmp_path / f"o{n}", monkeypatch)
        calls_per_load[n] = rec.cells["CommStore.add_node"]
        # every block of the [seq x rank] and [instance x node] tables fits in BLOCK_CELLS cells
        assert 0 < rec.cells["CommStore.block"] <= BLOCK, (n, rec.cells)
        assert 0 < rec.cells["InstanceTable.take"] <= BLOCK, (n, rec.cells)
        # and the tables themselves live in the scratch file, not in rank 0's memory: the store the
        # calls are loaded into, and the view of it every rank reads after the scan
        assert len(rec.stores) == 2
        assert all(isinstance(a, h5py.Dataset) for store in rec.stores for c in store.comms for a in c.data.values())
    # the calls reach the tables one node at a time: 2000 calls (one node's), at 4 as at 16 nodes
    assert calls_per_load == {4: 2000, 16: 2000}


def test_analysis_peak_does_not_grow_with_nodes(jobs: dict[int, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = {n: run_recorded(d, tmp_path / f"o{n}", monkeypatch).peak for n, d in jobs.items()}
    # 4x the nodes (and 4x the [instance x node] cells): what the analysis allocates at its peak is
    # blocks, per-instance vectors and per-node summaries of a few hundred bytes, so it hardly moves
    # (the whole-table analysis this replaced grew 3.7x here)
    assert peaks[16] <= 1.5 * peaks[4], peaks


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (mpi marker)")
def test_largest_message_to_rank0_does_not_grow_with_nodes(jobs: dict[int, Path], tmp_path: Path) -> None:
    script = tmp_path / "sizes.py"
    script.write_text(
        "import pickle, sys\n"
        "from mpi4py import MPI\n"
        "from gpuprof.mpi_merge.merge import merge\n"
        "class Recording:\n"
        "    '''COMM_WORLD, recording the pickled size of everything rank 0 receives.'''\n"
        "    def __init__(self, c): self.c, self.largest = c, 0\n"
        "    def Get_rank(self): return self.c.Get_rank()\n"
        "    def Get_size(self): return self.c.Get_size()\n"
        "    def bcast(self, obj, root=0):\n"
        "        out = self.c.bcast(obj, root=root)\n"
        "        self.broadcast = max(getattr(self, 'broadcast', 0), len(pickle.dumps(out)))\n"
        "        return out\n"
        "    def iprobe(self, source=0, tag=0): return self.c.iprobe(source=source, tag=tag)\n"
        "    def send(self, obj, dest, tag=0): self.c.send(obj, dest=dest, tag=tag)\n"
        "    def isend(self, obj, dest, tag=0): return self.c.isend(obj, dest=dest, tag=tag)\n"
        "    def recv(self, buf=None, source=0, tag=0):\n"
        "        obj = self.c.recv(buf, source=source, tag=tag)\n"
        "        self.largest = max(self.largest, len(pickle.dumps(obj)))\n"
        "        return obj\n"
        "    def allgather(self, obj):\n"
        "        out = self.c.allgather(obj)\n"
        "        self.gathered = max(getattr(self, 'gathered', 0), max(len(pickle.dumps(o)) for o in out))\n"
        "        return out\n"
        "c = Recording(MPI.COMM_WORLD)\n"
        "merge(sys.argv[1], comm=c, output_stem=sys.argv[2])\n"
        "if c.Get_rank() == 0: print('LARGEST', c.largest, getattr(c, 'broadcast', 0))\n"
    )
    largest, gathered = {}, {}
    for n, d in jobs.items():
        assert MPIRUN is not None
        p = subprocess.run(
            [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py", str(script),
             str(d), str(tmp_path / f"m{n}")],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            check=False,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        line = next(x for x in p.stdout.splitlines() if x.startswith("LARGEST")).split()
        largest[n], gathered[n] = int(line[1]), int(line[2])
    # one node's summary (its calls go through a file, one node at a time), or one result of the
    # analysis's items (a block, a range of the sweep's per-instance vectors, one window of the clock
    # fit): the same at 4 and 16 nodes
    assert 1000 < largest[4] and largest[16] <= 1.05 * largest[4], largest
    # the largest broadcast (the clock fit's pieces of every window, per node; the tables' layout,
    # per rank): grows with the nodes, no more
    assert 0 < gathered[4] and gathered[16] <= 4.5 * gathered[4], gathered
