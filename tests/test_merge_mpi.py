"""The merge under mpirun with 1, 2, 3 and 4 ranks gives identical job files and reports (the analysis
dealt over the ranks: blocks of the wait states, ranges of the delay analysis's sweep, the windows of
the straggler scores); one rank's error aborts the whole job with its message instead of hanging it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from gpuprof.mpi_merge import synthetic as syn
from gpuprof.mpi_merge.jobfile import compare_job_files
from gpuprof.mpi_merge.matching import P2P_OPS

ROOT = Path(__file__).resolve().parent.parent
RECORDINGS = ROOT / "tests" / "recordings"
SMALL_BLOCK = 2048  # cells: a few blocks per communicator even in these small jobs, dealt over the ranks
MPIRUN = shutil.which("mpirun")
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (mpi marker)")]


def mpirun(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    assert MPIRUN is not None
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mpi") / "job.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=5, duration_s=10, ranks_per_node=2, gpus_per_node=2, seed=8,
                                 stragglers=[syn.Straggler(1, "gpu", 2.0, 8.0)]), d)
    return d


def test_same_job_file_for_1_2_4_ranks(job: Path, tmp_path: Path) -> None:
    outs = {}
    for n in (1, 2, 4):
        stem = tmp_path / f"k{n}"
        p = mpirun(n, "-m", "gpuprof.slurm_hooks.cli", "merge", str(job), "--output-stem", str(stem), "--quiet")
        assert p.returncode == 0, p.stderr[-3000:]
        outs[n] = Path(f"{stem}.gpuprof.h5")
    assert compare_job_files(outs[1], outs[2]) == []
    assert compare_job_files(outs[1], outs[4]) == []
    reps = [json.loads(Path(f"{tmp_path}/k{n}.gpuprof.json").read_text()) for n in (1, 2, 4)]
    assert reps[0] == reps[1] == reps[2]
    assert [s["node"] for s in reps[0]["stragglers"]] == ["node001"]


def _merge_script(tmp_path: Path, name: str, job: Path, patch: str) -> Path:
    """A merge of `job` on the ranks of mpirun, with `patch` (Python lines) run first on every rank."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import sys, time\n"
        f"{patch}"
        "from gpuprof.slurm_hooks.cli import main\n"
        f"sys.argv = ['gpuprof', 'merge', {str(job)!r}, '--output-stem', {str(tmp_path / name)!r}, '--quiet']\n"
        "main()\n")
    return script


@pytest.mark.parametrize("patch", ["no_waits", "slow_steps"])
def test_the_writers_copies_in_its_waits_give_the_single_ranks_file(patch: str, job: Path, tmp_path: Path) -> None:
    """The writer copies the node tables and aligned times while it waits for rank 0 and the rest at
    the end: with no copy in any wait (all at the end), or with every copy 30 ms long (messages taken
    late), the job file and the reports are the single rank's, every node in it, and the writer's
    timing line says how much it copied in its waits."""
    one = mpirun(1, "-m", "gpuprof.slurm_hooks.cli", "merge", str(job), "--output-stem", str(tmp_path / "k1"),
                 "--quiet")
    assert one.returncode == 0, one.stderr[-3000:]
    lines = {
        "no_waits": "from gpuprof.mpi_merge import common\n"
                    "common.ChoresComm._work_until = lambda self, arrived: None\n",
        "slow_steps": "from gpuprof.mpi_merge import jobfile\n"
                      "real = jobfile.JobFileCopies.step\n"
                      "def slow(self):\n"
                      "    time.sleep(0.03)\n"
                      "    return real(self)\n"
                      "jobfile.JobFileCopies.step = slow\n",
    }[patch]
    script = _merge_script(tmp_path, "w", job, lines)
    p = subprocess.run(
        [MPIRUN or "mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py",
         str(script)], capture_output=True, text=True, timeout=180, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), GPUPROF_MERGE_TIMING="1"), check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    in_waits = re.search(r"timing rank 1: .*copies_in_waits=([\d.]+) copies_left=", p.stderr)
    assert in_waits, p.stderr[-2000:]
    if patch == "no_waits":
        assert float(in_waits.group(1)) == 0.0
    else:  # 30 ms a step, 5 nodes and their aligned times: some of it ran in the waits
        assert float(in_waits.group(1)) >= 0.03
    assert compare_job_files(tmp_path / "k1.gpuprof.h5", tmp_path / "w.gpuprof.h5") == []
    for ext in ("txt", "json"):
        assert (tmp_path / f"k1.gpuprof.{ext}").read_bytes() == (tmp_path / f"w.gpuprof.{ext}").read_bytes()
    with h5py.File(tmp_path / "w.gpuprof.h5", "r") as f:
        assert len(f["nodes"]) == len(list(job.glob("*.h5")))
        assert all("calls_aligned" in f[f"nodes/{n}/collectives"] for n in f["nodes"])


def test_the_writer_removes_the_node_parts_in_its_waits(job: Path, tmp_path: Path) -> None:
    """With other ranks, the writer removes each node's parts (claim, read marker, calls, aligned
    times) while it waits for the page's items, so rank 0's removal of the parts directory at the end
    finds none of them; the outputs are the single rank's, and no parts directory is left."""
    one = mpirun(1, "-m", "gpuprof.slurm_hooks.cli", "merge", str(job), "--output-stem", str(tmp_path / "k1"),
                 "--quiet")
    assert one.returncode == 0, one.stderr[-3000:]
    # rank 0 says what is left when it removes the directory; its job file waits 0.5 s, so the
    # writer is in its waits before the page's passes begin
    lines = ("from gpuprof.mpi_merge import merge as m\n"
             "real_rmtree, real_finish = m.shutil.rmtree, m.finish_job_file\n"
             "def rmtree(d, **kw):\n"
             "    print('LEFT', sorted(p.name for p in m.Path(d).iterdir()), file=sys.stderr, flush=True)\n"
             "    real_rmtree(d, **kw)\n"
             "def finish(*a, **kw):\n"
             "    time.sleep(0.5)\n"
             "    return real_finish(*a, **kw)\n"
             "m.shutil.rmtree, m.finish_job_file = rmtree, finish\n")
    script = _merge_script(tmp_path, "w", job, lines)
    p = mpirun(2, str(script))
    assert p.returncode == 0, p.stderr[-3000:]
    left = re.search(r"LEFT (\[.*\])", p.stderr)
    assert left, p.stderr[-2000:]
    names = eval(left.group(1))  # a list of file names, printed by the patch above
    assert names, "rank 0's own files (the scratch tables) are still there"
    assert not [n for n in names if n.endswith((".claim", ".read", ".calls.npy", ".aligned.h5"))], names
    assert not list(tmp_path.glob(".*.gpuprof.parts-*"))
    assert compare_job_files(tmp_path / "k1.gpuprof.h5", tmp_path / "w.gpuprof.h5") == []
    for ext in ("txt", "json", "html"):
        assert (tmp_path / f"k1.gpuprof.{ext}").read_bytes() == (tmp_path / f"w.gpuprof.{ext}").read_bytes()


def test_broadcast_of_a_rank_with_chores(tmp_path: Path) -> None:
    """ChoresComm's broadcast (in two parts, so a waiting rank works) gives what mpi4py's bcast gives,
    on 3 ranks and from every root, for small and large objects; the rank with chores runs them
    while it waits for a late root, and stops asking in a wait once they say there is nothing to do."""
    script = tmp_path / "chores_bcast.py"
    script.write_text(
        "import time\n"
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from gpuprof.mpi_merge.common import ChoresComm\n"
        "w = MPI.COMM_WORLD\n"
        "c = ChoresComm(w)\n"
        "done, calls = [], []\n"
        "def chore():\n"
        "    calls.append(1)\n"
        "    if len(done) == 40:\n"
        "        return False  # nothing to do now\n"
        "    done.append(1)\n"
        "    time.sleep(0.002)\n"
        "    return True\n"
        "if w.Get_rank() == 2:\n"
        "    c.chores = chore\n"
        "objs = [None, 7, {'a': [1, 2.5, 'x']}, np.arange(300000, dtype=np.int64), 'z' * 100000]\n"
        "for root in range(3):\n"
        "    for o in objs:\n"
        "        if w.Get_rank() == root:\n"
        "            time.sleep(0.05)  # the others wait\n"
        "        got = c.bcast(o if w.Get_rank() == root else None, root=root)\n"
        "        ref = w.bcast(o if w.Get_rank() == root else None, root=root)\n"
        "        same = np.array_equal(got, ref) if isinstance(ref, np.ndarray) else got == ref\n"
        "        assert same, (w.Get_rank(), root, type(o))\n"
        "if w.Get_rank() == 2:\n"
        "    print('CHORES', len(done), len(calls), round(c.chore_seconds, 3), flush=True)\n")
    p = mpirun(3, str(script))
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"CHORES (\d+) (\d+) ([\d.]+)", p.stdout)
    assert m, p.stdout + p.stderr[-2000:]
    assert int(m.group(1)) == 40  # every step of work done in the waits
    # after "nothing to do now", asked once more per wait only: 10 broadcasts from the other roots
    assert int(m.group(2)) <= 40 + 10
    assert float(m.group(3)) >= 40 * 0.002


def merge_with_small_blocks(n: int, src: Path, stem: Path) -> subprocess.CompletedProcess[str]:
    """The merge on n ranks with blocks of SMALL_BLOCK cells (the same on every rank)."""
    script = stem.parent / "small_blocks.py"
    script.write_text(
        "import sys\n"
        "from gpuprof.mpi_merge import common\n"
        f"common.BLOCK_CELLS = {SMALL_BLOCK}\n"
        "from gpuprof.slurm_hooks.cli import main\n"
        f"sys.argv = ['gpuprof', 'merge', {str(src)!r}, '--output-stem', {str(stem)!r}, '--quiet']\n"
        "main()\n"
    )
    return mpirun(n, str(script))


@pytest.fixture(scope="module")
def cut_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node whose collector died at 6 s (its ranks left out of the later instances), a slow host."""
    d = tmp_path_factory.mktemp("mpi_cut") / "cut.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=10, ranks_per_node=2, seed=5, cutoff_nodes={3: 6.0},
                                 stragglers=[syn.Straggler(0, "host", 1.0, 5.0)]), d)
    return d


@pytest.fixture(scope="module")
def nccl_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An NCCL-only job on device times whose node001 enqueues on time and starts its kernels late."""
    d = tmp_path_factory.mktemp("mpi_nccl") / "nccl.gpuprof.d"
    syn.generate(syn.SynthConfig(nodes=4, duration_s=10, ranks_per_node=2, seed=9, nccl=True,
                                 stragglers=[syn.Straggler(1, "gpu", 2.0, 8.0)]), d)
    return d


@pytest.mark.parametrize("which", ["straggler", "sub_communicators", "cut_node", "nccl_device_times"])
def test_distributed_analysis_is_the_same_on_1_2_3_ranks(which: str, job: Path, cut_job: Path, nccl_job: Path,
                                                         tmp_path: Path) -> None:
    """Findings, blame, metrics, wait states and every table of the job file, bit for bit, with the
    blocks, the sweep's ranges and the score windows dealt over 1, 2 and 3 ranks. The real demo
    recording has 2-rank sub-communicators beside the world and one slow rank (node3)."""
    src = {"straggler": job, "cut_node": cut_job, "nccl_device_times": nccl_job}.get(which)
    if src is None:
        src = tmp_path / "demo.gpuprof.d"
        shutil.copytree(RECORDINGS / "demo-4nodes", src)
    for n in (1, 2, 3):
        p = merge_with_small_blocks(n, src, tmp_path / f"k{n}")
        assert p.returncode in (0, 3), p.stderr[-3000:]
    for n in (2, 3):
        assert compare_job_files(tmp_path / "k1.gpuprof.h5", tmp_path / f"k{n}.gpuprof.h5") == [], n
        for ext in ("json", "txt", "html"):
            assert (tmp_path / f"k{n}.gpuprof.{ext}").read_text() == (tmp_path / f"k1.gpuprof.{ext}").read_text(), (n, ext)
    rep = json.loads((tmp_path / "k1.gpuprof.json").read_text())
    summary = rep["straggler_summary"]
    assert summary["tests"] > 0 and summary["wait_ns_by_split"]["own compute"] > 0
    if which == "straggler":
        assert [s["node"] for s in rep["stragglers"]] == ["node001"]
    elif which == "nccl_device_times":
        assert [(f["node"], f["cause"]) for f in rep["stragglers"]] == [("node001", "gpu")]
        assert rep["stragglers"][0]["metrics"]["device_timed_instances"] > 0
        assert rep["clock"]["instances_used"] > 0 and rep["clock"]["causality_violations"] == 0
    elif which == "sub_communicators":
        assert len(rep["communicators"]) > 1
        assert [(f["node"], f["ranks"]) for f in rep["stragglers"]] == [("node3", [2])]
    else:
        assert rep["status"] == "partial" and summary["windows_judged"] > 0


def test_error_on_one_rank_aborts_all(job: Path, tmp_path: Path) -> None:
    script = tmp_path / "failing_rank.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "import gpuprof.mpi_merge.merge as m\n"
        "real = m.summarize_node\n"
        "def broken(path, *args):\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        raise OSError('injected read failure on rank 1')\n"
        "    return real(path, *args)\n"
        "m.summarize_node = broken\n"
        "from gpuprof.slurm_hooks.cli import main\n"
        f"import sys; sys.argv = ['gpuprof', 'merge', {str(job)!r}, '--output-stem', {str(tmp_path / 'x')!r}]\n"
        "main()\n"
    )
    p = mpirun(3, str(script), timeout=120)
    assert p.returncode != 0
    assert "injected read failure on rank 1" in p.stderr
    assert not (tmp_path / "x.gpuprof.h5").exists()


@pytest.fixture(scope="module")
def p2p_only_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real HPCC recording with every collective call removed: point to point only."""
    d = tmp_path_factory.mktemp("mpi_p2p") / "p2p.gpuprof.d"
    shutil.copytree(RECORDINGS / "hpcc-4nodes", d)
    for node_file in sorted(d.glob("*.h5")):
        with h5py.File(node_file, "a") as f:
            old = f["collectives/calls"]
            rows = old[()]
            attrs = dict(old.attrs)
            chunks, compression = old.chunks, old.compression
            del f["collectives/calls"]
            new = f.create_dataset("collectives/calls", data=rows[np.isin(rows["op"], list(P2P_OPS))],
                                   chunks=chunks, compression=compression, maxshape=(None,))
            for k, v in attrs.items():
                new.attrs[k] = v
    return d


def test_point_to_point_only_is_the_same_on_1_2_3_ranks(p2p_only_job: Path, tmp_path: Path) -> None:
    for n in (1, 2, 3):
        p = merge_with_small_blocks(n, p2p_only_job, tmp_path / f"k{n}")
        assert p.returncode in (0, 3), p.stderr[-3000:]
    for n in (2, 3):
        assert compare_job_files(tmp_path / "k1.gpuprof.h5", tmp_path / f"k{n}.gpuprof.h5") == [], n
        assert (tmp_path / f"k{n}.gpuprof.json").read_text() == (tmp_path / "k1.gpuprof.json").read_text(), n
    rep = json.loads((tmp_path / "k1.gpuprof.json").read_text())
    assert rep["communicators"] == [] and rep["p2p"]["pairs"] > 0


def test_rank_killed_mid_analysis_aborts_without_a_job_file(job: Path, tmp_path: Path) -> None:
    """A merge rank that dies (SIGKILL: no exception, no message of its own) while it sweeps its range
    of the delay analysis: mpirun ends the whole job with a message naming the rank and the signal,
    nothing hangs, and no job file or report appears under the final name."""
    script = tmp_path / "killed_rank.py"
    script.write_text(
        "import os, signal\n"
        "from mpi4py import MPI\n"
        "from gpuprof.mpi_merge import rootcause\n"
        "real = rootcause._Sweep.__call__\n"
        "def dying(self, ctx, i):\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(self, ctx, i)\n"
        "rootcause._Sweep.__call__ = dying\n"
        "from gpuprof.slurm_hooks.cli import main\n"
        f"import sys; sys.argv = ['gpuprof', 'merge', {str(job)!r}, '--output-stem', {str(tmp_path / 'x')!r}]\n"
        "main()\n"
    )
    p = mpirun(2, str(script), timeout=120)
    assert p.returncode != 0
    assert "signal 9" in p.stderr or "Killed" in p.stderr, p.stderr[-2000:]
    assert not list(tmp_path.glob("x.gpuprof.*"))


POOL_SCRIPT = '''
import time
from mpi4py import MPI
from gpuprof.mpi_merge.common import CommSpread, RankPool

SLOW_RANK = 1

class SleepsLongerOnOneRank:
    """A test double's task: the item's value, after a sleep 20x longer on SLOW_RANK (a rank that
    other load slows down)."""
    def __call__(self, ctx, i):
        time.sleep(0.2 if MPI.COMM_WORLD.Get_rank() == SLOW_RANK else 0.01)
        return (ctx, i, i * i)

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
pool = RankPool(comm, "ctx")
if rank == 0:
    t0 = time.monotonic()
    got = list(pool.map(SleepsLongerOnOneRank(), 60))
    seconds = time.monotonic() - t0
    assert list(pool.map(SleepsLongerOnOneRank(), 0)) == []
    assert list(pool.map(SleepsLongerOnOneRank(), 1)) == [("ctx", 0, 0)]
    pool.close()
    assert got == [("ctx", i, i * i) for i in range(60)], got
    print("POOL", seconds, pool.stats.items_by_rank, pool.stats.recomputed, pool.stats.most_held, pool.window)
else:
    pool.serve()

def sleeps_longer(i):
    time.sleep(0.1 if rank == SLOW_RANK else 0.005)
    return i * 3

spread = CommSpread(comm)
assert spread.map(sleeps_longer, 40) == [i * 3 for i in range(40)]
assert spread.map(sleeps_longer, 0) == []
if rank == 0:
    print("SPREAD", spread.stats.items_by_rank, spread.stats.recomputed)
# ordered: rank 0 takes the items in order (a loop whose step needs the last), the others only compute
before = list(spread.stats.items_by_rank)
taken = list(spread.ordered(sleeps_longer, 30))
assert taken == ([i * 3 for i in range(30)] if rank == 0 else []), taken
assert spread.share(sum(taken) if rank == 0 else None) == 3 * sum(range(30))
assert list(spread.ordered(sleeps_longer, 0)) == []
if rank == 0:
    print("ORDERED", [a - b for a, b in zip(spread.stats.items_by_rank, before)])
'''


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_slow_rank_does_not_hold_the_others_back(ranks: int, tmp_path: Path) -> None:
    """Items are dealt on demand: a rank 20x slower than the others computes a few of them, rank 0
    computes again an item that rank has held too long, and the results come in item order, the
    same as computed on one rank; rank 0 never holds more than its window of results. The
    spread's ordered map (the clock fit's repair loop) gives rank 0 every result in order and the
    slow rank few items."""
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    p = mpirun(ranks, str(script), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    pool_line = next(x for x in p.stdout.splitlines() if x.startswith("POOL")).split(maxsplit=2)
    seconds = float(pool_line[1])
    by_rank_s, recomputed, most_held, window = pool_line[2].rsplit(maxsplit=3)
    by_rank = json.loads(by_rank_s)
    # the slow rank's share by a round robin: 60 / ranks items of 0.2 s, at least 4 s
    assert by_rank[1] <= 6, by_rank
    assert sum(by_rank) >= 61 and int(recomputed) >= 1
    assert int(most_held) <= int(window)
    assert seconds < 0.75 * (60 / ranks) * 0.2, seconds
    spread_line = next(x for x in p.stdout.splitlines() if x.startswith("SPREAD"))
    spread_by_rank = json.loads(spread_line.split(maxsplit=1)[1].rsplit(maxsplit=1)[0])
    assert spread_by_rank[1] <= 8 and sum(spread_by_rank) == 40, spread_line
    ordered_line = next(x for x in p.stdout.splitlines() if x.startswith("ORDERED"))
    ordered_by_rank = json.loads(ordered_line.split(maxsplit=1)[1])
    assert sum(ordered_by_rank) == 30 and ordered_by_rank[1] <= 8, ordered_line
    assert all(n > 0 for n in ordered_by_rank[2:]), ordered_line  # the other, fast ranks computed some


@pytest.mark.parametrize("which", ["straggler", "sub_communicators"])
def test_merge_with_a_slow_rank_is_the_same(which: str, job: Path, tmp_path: Path) -> None:
    """Rank 1 of 2 sleeps before every item it computes (as if other work held its core): it
    computes fewer of them, results come back out of item order, rank 0 computes blocks ahead of
    the one it writes (of the next communicator, in the demo recording's sub-communicators), and
    the job file and reports are the same bit for bit as on one rank."""
    if which == "sub_communicators":
        job = tmp_path / "demo.gpuprof.d"
        shutil.copytree(RECORDINGS / "demo-4nodes", job)
    script = tmp_path / "slow_rank.py"
    script.write_text(
        "import sys, time\n"
        "from mpi4py import MPI\n"
        "from gpuprof.mpi_merge import common\n"
        f"common.BLOCK_CELLS = {SMALL_BLOCK}\n"
        "real = common._serve_items\n"
        "def slow(comm, compute, pending):\n"
        "    def late(i):\n"
        "        time.sleep(0.05)\n"
        "        return compute(i)\n"
        "    return real(comm, late, pending)\n"
        "common._serve_items = slow\n"
        "from gpuprof.slurm_hooks.cli import main\n"
        "sys.argv = ['gpuprof', 'merge', sys.argv[1], '--output-stem', sys.argv[2], '--quiet']\n"
        "main()\n"
    )
    one = merge_with_small_blocks(1, job, tmp_path / "k1")
    assert one.returncode == 0, one.stderr[-3000:]
    assert MPIRUN is not None
    p = subprocess.run(
        [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py", str(script),
         str(job), str(tmp_path / "slow")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), GPUPROF_MERGE_TIMING="1"), check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert compare_job_files(tmp_path / "k1.gpuprof.h5", tmp_path / "slow.gpuprof.h5") == []
    for ext in ("json", "txt", "html"):
        assert (tmp_path / f"slow.gpuprof.{ext}").read_text() == (tmp_path / f"k1.gpuprof.{ext}").read_text(), ext
    dealt = {line.split()[3].rstrip(":"): json.loads(line.split("by rank ")[1].split("]")[0] + "]")
             for line in p.stderr.splitlines() if line.startswith("gpuprof merge items")}
    assert set(dealt) == {"scan", "fit_clocks", "finish_analysis", "page"}, p.stderr[-2000:]
    # the slow rank computed fewer items than rank 0 in every step (none at all where rank 0 had
    # computed every item again before the slow rank's copy came), but some
    assert all(by_rank[1] < by_rank[0] for by_rank in dealt.values()), dealt
    assert sum(by_rank[1] for by_rank in dealt.values()) > 0, dealt


def test_blocks_of_a_communicator_of_10000_ranks_are_packed_on_other_ranks() -> None:
    """The other ranks' blocks of pass 2 go through an in-memory HDF5 file whose communicator group
    carries a JSON list of every rank's node and a pid per rank: beyond about 8000 ranks those
    attributes exceed the oldest format's 64 KB (the 2-rank merge of the 4096 x 8-rank job failed
    there); the packer writes the newest format, as rank 0's part file does."""
    from gpuprof.mpi_merge.matching import CommStore
    from gpuprof.mpi_merge.merge import ChunkPacker
    from gpuprof.mpi_merge.waitstates import compute_waits

    n_ranks, n_seq = 10000, 4
    store = CommStore({7: (n_ranks, n_seq)}, 0)
    c = store.comms[0]
    c.node_of_rank[:] = np.arange(n_ranks) // 8
    for name in ("enter", "exit"):
        c.data[name][:] = np.arange(n_seq)[None, :] * 1e6 + np.arange(n_ranks)[:, None]
    c.data["op"][:] = 1
    blk = store.block(0, 0, n_seq)
    chunks = ChunkPacker(store, [f"node{i:05d}" for i in range(n_ranks // 8)], 0).block(
        blk, blk.enter, blk.exit, compute_waits(blk, blk.enter, blk.exit))
    assert set(chunks) == {"enter_aligned_ns", "exit_aligned_ns", "enter_raw_ns", "exit_raw_ns", "op", "bytes",
                           "wait_ns"}
    assert all(len(data) > 0 for _mask, data in chunks.values())
