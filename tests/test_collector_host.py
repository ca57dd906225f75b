"""Host metrics of real processes, and how the job's processes are found."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import own_cgroup_dir

from gpuprof.collector import native, schema
from gpuprof.collector.proctrack import (
    CgroupPids,
    ProcessTracker,
    find_job_cgroups,
    in_cgroups,
    pids_in_cgroups,
    process_tree,
)
from gpuprof.collector.sources.base import SourceContext
from gpuprof.collector.sources.host import HostSource

BUSY = "import time\nt=time.time()\nwhile time.time()-t<30: pass\n"


@pytest.fixture
def family() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A parent shell with a busy child and a sleeping child."""
    parent = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    sleeper = subprocess.Popen(["sleep", "60"])
    yield parent, busy, sleeper
    for p in (parent, busy, sleeper):
        p.kill()
        p.wait()


THREADED = ("import threading, time\n"
            "def f():\n    while True: time.sleep(0.01)\n"
            "for _ in range(3): threading.Thread(target=f, daemon=True).start()\n"
            "time.sleep(60)\n")


@pytest.fixture(params=["native", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both per-process readers: C (collector/native, built by make setup) and the Python fallback."""
    if request.param == "python":
        def unavailable() -> None:
            raise native.NativeUnavailable("disabled by the test")
        monkeypatch.setattr(native, "sampler", unavailable)
    else:
        native.sampler()  # built by make setup: its absence is a failure here, not a skip
    return str(request.param)


def ctx_for(pids: frozenset[int], missing: list[tuple[str, int, str, str]] | None = None) -> SourceContext:
    return SourceContext(
        job_id="1", node="n", modes=("metrics",), config={}, pids=lambda: pids, recent_pids=lambda: pids,
        cgroup_dirs=lambda: (),
        report_error=lambda s, m: None,
        report_missing=lambda *a: (missing.append(a) if missing is not None else None),
    )


def table(batches: object, t: schema.Table) -> np.ndarray:
    return next(rows for tt, rows in batches if tt is t)  # type: ignore[attr-defined]


def test_host_metrics_of_real_processes(family: tuple[subprocess.Popen[bytes], ...], reader: str) -> None:
    _, busy, sleeper = family
    src = HostSource(rate_hz=10)
    src.start(ctx_for(frozenset({busy.pid, sleeper.pid})))
    assert src.proc_reader.startswith(reader)
    try:
        first = src.sample(time.monotonic_ns())
        time.sleep(1.0)
        second = src.sample(time.monotonic_ns())
    finally:
        src.stop()
    p1, p2 = table(first, schema.HOST_PROCS), table(second, schema.HOST_PROCS)
    by1 = {int(r["pid"]): r for r in p1}
    by2 = {int(r["pid"]): r for r in p2}
    busy_cpu = (int(by2[busy.pid]["cpu_time_ns"]) - int(by1[busy.pid]["cpu_time_ns"])) / 1e9
    sleep_cpu = (int(by2[sleeper.pid]["cpu_time_ns"]) - int(by1[sleeper.pid]["cpu_time_ns"])) / 1e9
    assert busy_cpu > 0.5, busy_cpu  # a spinning process: most of one second of CPU
    assert sleep_cpu < 0.05, sleep_cpu
    for r in p2:
        assert 100_000 < int(r["rss_bytes"]) < 2 * 1024**3
        assert int(r["num_threads"]) >= 1
    assert int(by2[sleeper.pid]["voluntary_ctxsw"]) >= 1  # sleep blocks at least once
    assert int(by2[busy.pid]["involuntary_ctxsw"]) >= int(by1[busy.pid]["involuntary_ctxsw"])
    node = table(second, schema.HOST_NODE)[0]
    assert 0.0 <= node["cpu_busy"] <= 1.0 and node["cpu_busy"] > 0.2  # the busy child runs
    assert 0 < node["mem_used_bytes"] < node["mem_total_bytes"]
    assert np.isnan(table(first, schema.HOST_NODE)[0]["cpu_busy"])  # no previous sample: not a zero


def test_exited_process_is_dropped(family: tuple[subprocess.Popen[bytes], ...], reader: str) -> None:
    _, busy, sleeper = family
    src = HostSource()
    src.start(ctx_for(frozenset({busy.pid, sleeper.pid})))
    assert src.proc_reader.startswith(reader)
    src.sample(time.monotonic_ns())
    sleeper.kill()
    sleeper.wait()
    pids = {int(p) for p in table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)["pid"]}
    src.stop()
    assert pids == {busy.pid}


def test_readers_agree_on_a_threaded_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C reader and the Python one give the same columns; context switches are summed over
    all threads (the leader's status alone counts only itself)."""
    proc = subprocess.Popen([sys.executable, "-c", THREADED])
    try:
        time.sleep(0.5)
        ctx = ctx_for(frozenset({proc.pid}))
        c_src, py_src = HostSource(), HostSource()
        c_src.start(ctx)
        with monkeypatch.context() as m:
            def unavailable() -> None:
                raise native.NativeUnavailable("disabled by the test")
            m.setattr(native, "sampler", unavailable)
            py_src.start(ctx)
        assert c_src.proc_reader == "native" and py_src.proc_reader.startswith("python")
        now = time.monotonic_ns()
        a = table(c_src.sample(now), schema.HOST_PROCS)[0]
        b = table(py_src.sample(now), schema.HOST_PROCS)[0]
        c_src.stop()
        py_src.stop()
    finally:
        proc.kill()
        proc.wait()
    assert int(a["num_threads"]) == int(b["num_threads"]) == 4
    assert abs(int(a["cpu_time_ns"]) - int(b["cpu_time_ns"])) <= 50_000_000
    assert abs(int(a["rss_bytes"]) - int(b["rss_bytes"])) <= 1024**2
    # 3 threads sleeping 10 ms for 0.5 s: well over 100 voluntary switches in all
    assert int(a["voluntary_ctxsw"]) > 100 and abs(int(a["voluntary_ctxsw"]) - int(b["voluntary_ctxsw"])) <= 20
    assert int(a["read_bytes"]) == int(b["read_bytes"]) and int(a["write_bytes"]) == int(b["write_bytes"])


def test_switch_counts_move_once_a_second_in_c_and_at_every_tick_in_python(reader: str) -> None:
    """Context switches come from each thread's status, the dearest read: the C reader reads them
    once a second (FULL_READ_INTERVAL_S; a thread whose run time has not moved since keeps its
    counts), repeating them in the ticks between; the Python reader at every tick. A process
    that wakes every 10 ms shows its new switches at each such read, and one that sleeps
    throughout keeps the same counts."""
    waker = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)\n"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.3)
        src = HostSource()
        src.start(ctx_for(frozenset({waker.pid, idle.pid})))
        ticks = []
        for _ in range(13):
            rows = table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)
            ticks.append((time.monotonic(), {int(r["pid"]): int(r["voluntary_ctxsw"]) for r in rows}))
            time.sleep(0.2)
        src.stop()
    finally:
        for p in (waker, idle):
            p.kill()
            p.wait()
    moved = [i for i in range(1, len(ticks)) if ticks[i][1][waker.pid] != ticks[i - 1][1][waker.pid]]
    assert all(b[idle.pid] == a[idle.pid] >= 1 for (_, a), (_, b) in itertools.pairwise(ticks)), ticks
    if reader == "python":
        assert moved == list(range(1, len(ticks))), ticks
        return
    # the C reader: a read at the first tick, then one a second (the ticks are 0.2 s and a bit apart)
    assert len(moved) >= 2, ticks
    reads = [0, *moved]
    assert all(ticks[b][0] - ticks[a][0] >= 0.99 for a, b in itertools.pairwise(reads)), (reads, ticks)
    assert all(ticks[b][1][waker.pid] - ticks[a][1][waker.pid] >= 25 for a, b in itertools.pairwise(reads)), ticks


def reads_so_far() -> int:
    """This process's read system calls so far (/proc/self/io syscr; this read counts too)."""
    with open("/proc/self/io", "rb") as f:
        return int(f.read().split(b"syscr:")[1].split()[0])


def test_node_files_are_read_once_a_second_in_c(reader: str) -> None:
    """The node row reads /proc/stat's CPU line, meminfo, net/dev and loadavg, in C, once a second
    (FULL_READ_INTERVAL_S; the ticks between repeat that read's figures, the CPU fractions
    included), in Python at every tick. Counted as the read calls of each tick (no process
    followed: the node's files only), on the caller's thread."""
    src = HostSource()
    src.start(ctx_for(frozenset()))
    ticks = []
    try:
        for _ in range(13):
            before = reads_so_far()
            node = table(src.sample(time.monotonic_ns()), schema.HOST_NODE)[0]
            ticks.append((time.monotonic(), reads_so_far() - before - 1, int(node["mem_total_bytes"]),
                          float(node["cpu_busy"])))
            time.sleep(0.15)
    finally:
        src.stop()
    assert all(total > 0 for *_, total, _ in ticks), ticks  # a figure in every row, repeated or read
    fewest = min(n for _, n, _, _ in ticks)  # what a sample reads besides the node's files
    extra = [n - fewest for _, n, _, _ in ticks]
    if reader == "python":
        assert extra == [0] * len(ticks), ticks
        return
    assert set(extra) == {0, 4}, ticks  # /proc/stat, meminfo, net/dev and loadavg, or none of them
    full = [i for i, n in enumerate(extra) if n == 4]
    assert full[0] == 0 and len(full) >= 2, ticks  # the first tick, then once a second (13 ticks: ~2 s)
    assert all(0.99 <= ticks[b][0] - ticks[a][0] <= 1.5 for a, b in itertools.pairwise(full)), ticks
    # the CPU fraction: none before the second read of /proc/stat, then that read's, repeated until the next
    busy = [b for *_, b in ticks]
    assert all(math.isnan(b) for b in busy[:full[1]]), ticks
    for a, b in itertools.pairwise(full[1:] + [len(ticks)]):
        assert len({busy[i] for i in range(a, b)}) == 1 and not math.isnan(busy[a]), ticks


@contextmanager
def native_source_following(proc: subprocess.Popen[bytes], settle_s: float = 0.2) -> Iterator[HostSource]:
    """A HostSource (one tick per sample, C reader) following process proc, started settle_s
    after it; proc is killed and reaped at the end."""
    try:
        time.sleep(settle_s)
        src = HostSource()
        src.start(ctx_for(frozenset({proc.pid})))
        try:
            assert src.proc_reader == "native"
            yield src
        finally:
            src.stop()
    finally:
        proc.kill()
        proc.wait()


def native_source_on(script: str) -> AbstractContextManager[HostSource]:
    """native_source_following a Python process running script."""
    return native_source_following(subprocess.Popen([sys.executable, "-c", script]))


def test_native_reader_follows_threads_that_come_later() -> None:
    """Threads started after the process was first read are listed after the next full read (the
    count in /proc/PID/stat differs from the threads listed) and their switches are summed from
    then on."""
    late = ("import threading, time\n"
            "def f():\n    while True: time.sleep(0.005)\n"
            "time.sleep(0.6)\n"
            "for _ in range(5): threading.Thread(target=f, daemon=True).start()\n"
            "time.sleep(60)\n")
    with native_source_on(late) as src:
        first = table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)[0]
        time.sleep(1.0)
        src.sample(time.monotonic_ns())  # a full read: sees 6 threads, 1 listed: relists
        time.sleep(1.0)  # the next full read (the statuses, once a second) reads the new threads'
        last = table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)[0]
        listed = int(src._fds["n_threads"][0])
    assert int(first["num_threads"]) == 1 and int(last["num_threads"]) == 6 and listed == 6
    # 5 threads sleeping 5 ms for 1 s: far more switches than the sleeping leader alone makes
    assert int(last["voluntary_ctxsw"]) - int(first["voluntary_ctxsw"]) > 100


def test_cpu_time_is_the_threads_run_time_at_every_tick() -> None:
    """The C reader's CPU time is the sum of the threads' run times (schedstat, ns) read at every
    tick, while stat and io are read once a second: it stays exactly the same while the process
    sleeps, grows at every tick once it spins, in ns rather than stat's 10 ms clock ticks, and
    agrees with stat's utime + stime."""
    late = "import time\ntime.sleep(0.6)\nt = time.time()\nwhile time.time() - t < 30: pass\n"
    cpu, full = [], []
    with native_source_on(late) as src:
        for _ in range(12):
            cpu.append(int(table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)["cpu_time_ns"][0]))
            full.append(int(src._fds["last_full_ns"][0]))
            time.sleep(0.1)
        pid = int(src._fds["pid"][0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        stat_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        now = int(table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)["cpu_time_ns"][0])
    sleeping = [i for i in range(1, 4)]  # the first 0.3 s of its 0.6 s sleep
    assert all(cpu[i] == cpu[i - 1] for i in sleeping), cpu
    assert cpu[-1] - cpu[-4] >= 50_000_000, cpu  # spinning: up to 0.3 s of CPU in the last 3 ticks
    assert all(b > a for a, b in itertools.pairwise(cpu[-4:])), cpu  # growing at every tick
    assert any(c % 10_000_000 for c in cpu[-4:]), cpu  # not in 10 ms clock ticks
    assert abs(now - stat_ns) <= 30_000_000, (now, stat_ns)
    # the full reads: at the first tick, then one a second, not at every tick
    assert 2 <= len(set(full)) <= 3, full


IDLE_THEN_SPIN = """
import sys, threading, time
def spin(go):
    go.wait()
    t = time.thread_time()
    while time.thread_time() - t < 3:
        pass
go = threading.Event()
threading.Thread(target=spin, args=(go,), daemon=True).start()
sys.stdin.readline()
go.set()
time.sleep(60)
"""


def test_an_idle_thread_is_read_with_the_full_reads_until_it_runs() -> None:
    """A thread asleep for over a second is not read at every tick: when it starts to spin right
    after a full read, the ticks until the next full read (a second) repeat its old run time; that
    full read counts all it ran since, and from then on it is read at every tick again. The process
    total stays within stat's clock ticks of utime + stime throughout the end."""
    proc = subprocess.Popen([sys.executable, "-c", IDLE_THEN_SPIN], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    with native_source_following(proc, settle_s=0.3) as src:

        def tick() -> tuple[int, int]:
            cpu = int(table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)["cpu_time_ns"][0])
            return cpu, int(src._fds["last_full_ns"][0])

        ticks = [tick()]
        while len(ticks) < 40 and (len(ticks) < 16 or ticks[-1][1] == ticks[-2][1]):
            time.sleep(0.1)  # past a second asleep, up to the tick of a full read
            ticks.append(tick())
        assert ticks[-1][1] != ticks[-2][1], ticks  # the last tick was a full read
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        after = []
        for _ in range(16):
            time.sleep(0.1)
            after.append(tick())
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        stat_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    start_cpu, start_full = ticks[-1]
    before_full = [c for c, f in after if f == start_full]
    since_full = [c for c, f in after if f != start_full]
    # spinning since the first of these ticks, but both threads idle: the old run times stand
    assert len(before_full) >= 5 and set(before_full) == {start_cpu}, (ticks, after)
    # the full read counts what the spinning thread ran (up to a second), then every tick grows
    assert since_full and since_full[0] - start_cpu >= 300_000_000, (start_cpu, after)
    assert all(b > a for a, b in itertools.pairwise(since_full)), after
    assert abs(since_full[-1] - stat_ns) <= 50_000_000, (since_full[-1], stat_ns)


EXITING_THREAD = """
import sys, threading, time
def spin(go, cpu_s):
    go.wait()
    t = time.thread_time()
    while time.thread_time() - t < cpu_s:
        pass
go = threading.Event()
early = sys.argv[1] == "early"
th = threading.Thread(target=spin, args=(go, float(sys.argv[2])))
if early:
    th.start()  # exists (waiting) before the reader first lists the threads
sys.stdin.readline()
go.set()
if not early:
    th.start()
th.join()
time.sleep(60)
"""


@pytest.mark.parametrize("listed", [True, False])
def test_cpu_time_keeps_what_an_exited_thread_ran(listed: bool) -> None:
    """A thread spins for some CPU time, then exits. Listed (it exists when the reader first lists
    the process's threads): its run time stays in the process's CPU time after it is gone and the
    threads are listed again. Not listed (it starts after a full read and ends before the next):
    its time comes in from stat at the next full read. Either way the CPU time never goes back."""
    spin_s = 0.5 if listed else 0.2  # unlisted: done well within the second between full reads
    proc = subprocess.Popen([sys.executable, "-c", EXITING_THREAD, "early" if listed else "late", str(spin_s)],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < (2 if listed else 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        src = HostSource()
        src.start(ctx_for(frozenset({proc.pid})))
        cpu, n_listed = [], []
        try:
            for i in range(30):
                cpu.append(int(table(src.sample(time.monotonic_ns()), schema.HOST_PROCS)["cpu_time_ns"][0]))
                n_listed.append(int(src._fds["n_threads"][0]))
                if i == 0:
                    proc.stdin.write(b"go\n")
                    proc.stdin.flush()
                time.sleep(0.1)
        finally:
            src.stop()
    finally:
        proc.kill()
        proc.wait()
    assert all(b >= a for a, b in itertools.pairwise(cpu)), cpu
    assert n_listed[-1] == 1, n_listed
    if listed:
        assert n_listed[0] == 2, n_listed
    else:
        assert set(n_listed) == {1}, n_listed
    assert cpu[-1] - cpu[0] >= 0.9 * spin_s * 1e9, (cpu, n_listed)  # all its spinning, kept


def test_threaded_ticks_on_the_grid_and_follows_the_pid_set(family: tuple[subprocess.Popen[bytes], ...]) -> None:
    """What the collector runs: the ticks in a native thread at the source's rate, on the grid
    of multiples of its interval, drained by sample(); a process added to the job is read from
    the next drain on, one that exits is dropped, and final() stops the thread and adds a tick."""
    _, busy, sleeper = family
    pids = [frozenset({busy.pid})]
    ctx = SourceContext(job_id="1", node="n", modes=("metrics",), config={}, pids=lambda: pids[0],
                        recent_pids=lambda: pids[0], cgroup_dirs=lambda: (), report_error=lambda s, m: None,
                        report_missing=lambda *a: None)
    src = HostSource(rate_hz=20, threaded=True)
    src.start(ctx)
    try:
        assert src.proc_reader == "native" and src.interval_s == 1.0 and src.sample_interval_s == 0.05
        src.sample(time.monotonic_ns())  # the ticks so far; from here on the pid set is read
        time.sleep(1.0)
        first = src.sample(time.monotonic_ns())
        pids[0] = frozenset({busy.pid, sleeper.pid})
        time.sleep(0.5)
        second = src.sample(time.monotonic_ns())  # ticks on the old set, then the new set handed over
        time.sleep(0.5)
        third = src.sample(time.monotonic_ns())
        sleeper.kill()
        sleeper.wait()
        time.sleep(0.3)
        src.sample(time.monotonic_ns())  # sees it gone
        time.sleep(0.3)
        end = time.monotonic_ns()
        last = src.final(end)
    finally:
        src.stop()
    node = table(first, schema.HOST_NODE)
    t = node["t_ns"].astype(np.int64)
    assert len(t) >= 15 and np.all(np.diff(t) > 0), t  # 20 Hz for about 1 s
    assert abs(np.median(np.diff(t)) - 50_000_000) < 2_000_000, np.diff(t)  # at the rate
    assert len(t) >= 0.9 * ((t[-1] - t[0]) / 50_000_000 + 1)  # no tick missing on a quiet machine
    assert np.median(t % 50_000_000) < 5_000_000, t % 50_000_000  # on the grid: just after multiples of 50 ms
    procs = table(first, schema.HOST_PROCS)
    assert set(procs["pid"].tolist()) == {busy.pid} and len(procs) == len(node)
    assert set(table(second, schema.HOST_PROCS)["pid"].tolist()) == {busy.pid}
    assert set(table(third, schema.HOST_PROCS)["pid"].tolist()) == {busy.pid, sleeper.pid}
    cpu = table(third, schema.HOST_PROCS)
    b = cpu[cpu["pid"] == busy.pid]["cpu_time_ns"].astype(np.int64)
    assert np.all(np.diff(b) >= 0) and b[-1] - b[0] > 200_000_000  # spinning for ~0.5 s
    lp = table(last, schema.HOST_PROCS)
    assert set(lp["pid"].tolist()) == {busy.pid}
    assert int(table(last, schema.HOST_NODE)["t_ns"][-1]) == end  # final adds a tick at its time
    assert src.drops() == 0


def test_threaded_buffer_is_bounded_and_counts_drops(family: tuple[subprocess.Popen[bytes], ...]) -> None:
    """Undrained ticks beyond the buffer are counted as dropped, not kept: memory stays bounded
    when the daemon's source thread is late."""
    _, busy, _ = family
    src = HostSource(rate_hz=50, threaded=True)
    src._ticks_cap = 5  # instead of BUFFER_S of ticks, so that a second overflows it
    src.start(ctx_for(frozenset({busy.pid})))
    try:
        src.sample(time.monotonic_ns())
        time.sleep(1.0)
        rows = src.sample(time.monotonic_ns())
    finally:
        src.stop()
    assert len(table(rows, schema.HOST_NODE)) == 5
    assert len(table(rows, schema.HOST_PROCS)) == 5
    assert 35 <= src.drops() <= 2 * 55, src.drops()  # ~45 node and as many process rows


def test_process_tree_and_tracker_events(family: tuple[subprocess.Popen[bytes], ...]) -> None:
    me = os.getpid()
    parent, busy, sleeper = family
    assert {parent.pid, busy.pid, sleeper.pid} <= process_tree(me)
    tr = ProcessTracker(job_id=None, node=None, uid=None, root_pid=me)
    ev = tr.scan(1)
    assert tr.method == "tree"
    assert {busy.pid, sleeper.pid} <= {int(p) for p in ev["pid"][ev["event"] == 0]}
    sleeper.kill()
    sleeper.wait()
    ev = tr.scan(2)
    assert list(ev["pid"][ev["event"] == 1]) == [sleeper.pid]
    assert ev["comm"][ev["event"] == 1][0] == b"sleep"


def make_cgroup(root: Path, rel: str, pids: list[int]) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return d


def test_cgroup_v1_multiple_slurmd(tmp_path: Path) -> None:
    # several virtual nodes on one host: freezer/slurm_<node>/uid_<uid>/job_<id>/step_*/task_*
    a = make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42", [])
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_0/task_0", [11, 12])
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_batch", [10])
    make_cgroup(tmp_path, "freezer/slurm_node2/uid_1000/job_42/step_0", [99])  # same job, other node
    make_cgroup(tmp_path, "memory/slurm_node1/uid_1000/job_42", [])
    dirs = find_job_cgroups("42", "node1", 1000, str(tmp_path))
    assert str(a) in dirs and all("slurm_node2" not in d for d in dirs)
    assert pids_in_cgroups(dirs) == {10, 11, 12}
    assert find_job_cgroups("42", "node1", 7, str(tmp_path)) == ()


def test_cgroup_pids_walk_again_only_when_a_cgroup_came_or_went(tmp_path: Path) -> None:
    """CgroupPids lists the job's cgroups once and then reads their pids scan after scan; a step
    or task cgroup made below one (its parent's link count changes) or removed is walked into at
    the next scan, and the pids are pids_in_cgroups' every time."""
    top = make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42", [])
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_batch", [10])
    cg = CgroupPids((str(top),))
    assert cg.pids() == {10} and cg.walks == 1
    (top / "step_batch" / "cgroup.procs").write_text("10\n13\n")
    assert cg.pids() == {10, 13} and cg.walks == 1  # the same cgroups: read, not listed again
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_0", [])
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_0/task_0", [11, 12])
    assert cg.pids() == {10, 11, 12, 13} == pids_in_cgroups((str(top),)) and cg.walks == 2
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_0/task_1", [14])  # below a kept one
    assert cg.pids() == {10, 11, 12, 13, 14} and cg.walks == 3
    shutil.rmtree(top / "step_0")
    assert cg.pids() == {10, 13} == pids_in_cgroups((str(top),)) and cg.walks == 4
    assert cg.pids() == {10, 13} and cg.walks == 4


def test_tracker_keeps_the_found_cgroups_and_finds_them_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's cgroups are globbed once and then only checked; a hierarchy the job joins later is
    found at the next refind (every CGROUP_REFIND_S), and one that went away makes the next scan
    glob again."""
    from gpuprof.collector import proctrack

    globs: list[str] = []
    real_glob = proctrack.glob.glob
    monkeypatch.setattr(proctrack.glob, "glob", lambda p: globs.append(p) or real_glob(p))
    monkeypatch.setattr(proctrack, "CGROUP_REFIND_S", 0.5)
    make_cgroup(tmp_path, "freezer/slurm_node1/uid_1000/job_42/step_0", [11])
    tracker = ProcessTracker(job_id="42", node="node1", uid=1000, root_pid=None, cgroup_root=str(tmp_path),
                             use_scontrol=False)
    tracker.scan(0)
    assert tracker.pids() == {11} and tracker.method == "cgroup"
    n = len(globs)
    tracker.scan(0)
    assert len(globs) == n  # kept: no glob
    make_cgroup(tmp_path, "cpuset/slurm_node1/uid_1000/job_42/step_1", [12])
    tracker.scan(0)
    assert tracker.pids() == {11}  # not before the refind
    time.sleep(0.6)
    tracker.scan(0)
    assert tracker.pids() == {11, 12} and len(globs) > n
    n = len(globs)
    shutil.rmtree(tmp_path / "cpuset")
    tracker.scan(0)
    assert tracker.pids() == {11} and len(globs) > n  # a directory gone: globbed again at once


def test_cgroup_v2(tmp_path: Path) -> None:
    make_cgroup(tmp_path, "system.slice/slurmstepd.scope/job_7/step_0/user/task_0", [5])
    dirs = find_job_cgroups("7", "n1", None, str(tmp_path))
    assert pids_in_cgroups(dirs) == {5}
    tr = ProcessTracker(job_id="7", node="n1", uid=None, root_pid=None, cgroup_root=str(tmp_path),
                        use_scontrol=False)
    tr.scan(1)
    assert tr.method == "cgroup" and tr.pids() == frozenset({5})


def test_gone_pids_are_recent_for_a_while_and_not_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recent_pids keeps a pid that left the job for RECENTLY_GONE_S, at most RECENTLY_GONE_MAX of
    them, oldest out first; pids() is the job's pids now."""
    from gpuprof.collector import proctrack

    procs = make_cgroup(tmp_path, "freezer/slurm_n1/uid_0/job_7/step_0", []) / "cgroup.procs"

    def job_has(*pids: int) -> None:
        procs.write_text("".join(f"{p}\n" for p in pids))
        tr.scan(0)

    tr = ProcessTracker(job_id="7", node="n1", uid=0, root_pid=None, cgroup_root=str(tmp_path), use_scontrol=False)
    job_has(1, 2, 3)
    job_has(3)
    assert tr.pids() == {3} and tr.recent_pids() == {1, 2, 3}
    monkeypatch.setattr(proctrack, "RECENTLY_GONE_MAX", 1)
    job_has(4)  # 3 goes too: of 1, 2, 3 only the last to go stays
    assert tr.recent_pids() == {3, 4}
    monkeypatch.setattr(proctrack, "RECENTLY_GONE_S", 0.0)
    job_has(4)
    assert tr.recent_pids() == tr.pids() == {4}


def test_a_process_is_found_in_its_cgroup_by_its_own_line() -> None:
    mine = own_cgroup_dir()
    if mine is None:
        pytest.skip("this process is in no cgroup but the roots")
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert in_cgroups(child.pid, (mine,))  # a child is in its parent's cgroup
        assert in_cgroups(child.pid, ("/elsewhere", mine))
        assert not in_cgroups(child.pid, (mine + "x",))  # a sibling whose name starts the same
        assert not in_cgroups(child.pid, (os.path.dirname(mine) + "/job_0",))
        assert not in_cgroups(child.pid, ())
    finally:
        child.kill()
        child.wait()
    assert not in_cgroups(child.pid, (mine,))  # gone


def test_scontrol_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           family: tuple[subprocess.Popen[bytes], ...]) -> None:
    _, busy, _ = family
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho 'PID JOBID STEPID LOCALID GLOBALID'\necho '{busy.pid} 9 0 0 0'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    tr = ProcessTracker(job_id="9", node="n1", uid=None, root_pid=None, cgroup_root=str(tmp_path / "none"))
    tr.scan(1)
    assert tr.method == "scontrol" and tr.pids() == frozenset({busy.pid})
