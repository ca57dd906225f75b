"""The collector process end to end: `gpuprof collect`, signals, kill -9, control socket, output faults."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "nvml_double"))
import double

from gpuprof.collector import schema
from gpuprof.collector.control import request
from gpuprof.collector.errors import CollectorError
from gpuprof.collector.reader import open_node_trace, summarize
from gpuprof.collector.writer import recover

GPUPROF = [sys.executable, "-m", "gpuprof.slurm_hooks.cli"]
ROOT = Path(__file__).resolve().parents[1]
is_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts a tmpfs)")


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return double.build()
    except double.DoubleUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in job: a shell with a busy and a sleeping child."""
    p = subprocess.Popen(["sh", "-c", "sleep 60 & (while :; do :; done) & wait"])
    time.sleep(0.2)
    yield p
    subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
    p.kill()
    p.wait()


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE", "GPUPROF_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def start(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*GPUPROF, "collect", "--modes", "metrics", "--output", str(out), *args],
        env=env or env_with(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def wait_state(sock: Path, want: str, timeout: float = 15.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    last: dict[str, object] = {}
    while time.monotonic() < deadline:
        try:
            last = request(sock, "status", 2.0)
            if last["state"] == want:
                return last
        except CollectorError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"state {want!r} not reached: {last}")


def test_collect_duration_with_nvml_double_end_to_end(tmp_path: Path, job: subprocess.Popen[bytes],
                                                      library: Path) -> None:
    conf = double.write_config(tmp_path / "fake.conf", gpus=2, gpu1__unsupported="power")
    # the double loaded through pynvml's own loading: libnvidia-ml.so.1 on LD_LIBRARY_PATH
    env = env_with(LD_LIBRARY_PATH=str(library.parent), GPUPROF_FAKE_NVML_CONFIG=str(conf))
    out = tmp_path / "n1.h5"
    p = start(out, "--pid", str(job.pid), "--duration", "2.5", "--gpus", "all", env=env)
    assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    s = summarize(open_node_trace(out))
    assert s["sealed"] and not s["partial_reasons"] and 2.3 < s["span_s"] < 4
    r = s["records"]
    assert r["/clock/pairs"] >= 4 and r["/host/node"] >= 20 and r["/host/procs"] >= 40
    assert r["/gpu/samples"] >= 40 and r["/gpu/devices"] == 2
    assert {"source": "nvml", "device": 1, "metric": "power_w", "reason": "NVML_ERROR_NOT_SUPPORTED"} \
        in s["missing_metrics"]
    with h5py.File(out, "r") as f:
        assert f.attrs["emulated_gpus"]  # emulated values are labelled as such
        # the 10 Hz sources sampled on their native threads, and the file says so and at what rate
        assert f["/gpu/samples"].attrs["sampler"] == "native thread"
        assert f["/host/procs"].attrs["reader"] == "native"
        rates = json.loads(f.attrs["rates_json"])
        assert rates["host"] == rates["nvml"] == 10.0
        # both on the common grid: just after multiples of 100 ms of the monotonic clock (the last
        # rows, taken at the seal, fall where the seal did)
        for table in ("/gpu/samples", "/host/node"):
            phase = f[table]["t_ns"][:-4].astype(np.int64) % 100_000_000
            assert np.median(phase) < 5_000_000, (table, phase)
        # what the collector itself cost, start-up and recording apart, by thread (kernel names)
        cpu = json.loads(f.attrs["collector_cpu_json"])
        assert 0 < cpu["startup_s"] <= cpu["total_s"]
        assert abs(cpu["after_startup_s"] - (cpu["total_s"] - cpu["startup_s"])) <= 0.002 and cpu["after_startup_s"] > 0
        # the host's and the clock's drains share one thread (they ran once a second, each woken on
        # its own); the CPU of each source's samples on it is counted apart
        assert {"writer", "drains-1s", "gp-tick-100ms", "gp-nvml-tick"} <= set(cpu["by_thread_s"])
        assert "source-host" not in cpu["by_thread_s"] and "source-nvml" in cpu["by_thread_s"]
        assert set(cpu["drain_s"]) == {"host", "clock"} and all(v > 0 for v in cpu["drain_s"].values())
        assert sum(cpu["drain_s"].values()) <= cpu["by_thread_s"]["drains-1s"] + 0.002
        assert sum(cpu["by_thread_s"].values()) <= cpu["total_s"] + 0.05
    t = open_node_trace(out)
    pids = set(t.table("/host/procs")["pid"])
    assert job.pid in pids and len(pids) >= 3
    text = subprocess.run([*GPUPROF, "inspect", str(out)], env=env_with(), capture_output=True, text=True, check=False)
    assert text.returncode == 0 and "sealed" in text.stdout and "/host/procs" in text.stdout
    assert "emulated NVML" in text.stdout
    js = subprocess.run([*GPUPROF, "inspect", "--json", str(out)], env=env_with(), capture_output=True, text=True, check=False)
    assert json.loads(js.stdout)["records"] == r


def test_nvml_absent_other_sources_go_on(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    env = env_with(GPUPROF_NVML_LIBRARY=str(tmp_path / "absent" / "libnvidia-ml.so.1"))
    out = tmp_path / "n.h5"
    p = start(out, "--pid", str(job.pid), "--duration", "1.5", "--gpus", "all", env=env)
    assert p.wait(30) == 0
    s = summarize(open_node_trace(out))
    assert s["records"]["/gpu/samples"] == 0 and s["records"]["/host/procs"] > 0
    assert any(e["source"] == "nvml" and "unavailable" in e["message"] and "cannot be loaded" in e["message"]
               for e in s["errors"])


def test_control_socket_status_flush_seal(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    out, sock = tmp_path / "n.h5", tmp_path / "n.sock"
    p = start(out, "--pid", str(job.pid), "--control-socket", str(sock))
    st = wait_state(sock, "recording")
    assert out.exists() and st["file"] == str(out) and st["pid"] == p.pid
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert set(st) >= {"records", "drops", "errors", "sources"}
    time.sleep(0.5)
    fl = request(sock, "flush", 10)
    assert fl["ok"] and fl["records"]["/host/node"] >= 3
    # a reader sees the flushed rows while the collector is still running (SWMR)
    assert len(open_node_trace(out).table("/host/node")) >= 3
    bad = subprocess.run([sys.executable, "-c", f"""
import socket; s=socket.socket(socket.AF_UNIX); s.connect({str(sock)!r}); s.sendall(b'nonsense\\n')
print(s.recv(999).decode())"""], capture_output=True, text=True, check=False)
    assert '"ok": false' in bad.stdout
    sealed = request(sock, "seal", 30)
    assert sealed == {"ok": True, "file": str(out), "sealed": True}
    assert p.wait(10) == 0
    assert open_node_trace(out).sealed and not sock.exists()
    with pytest.raises(CollectorError, match="no collector socket"):
        request(sock, "status", 1)


def test_sigterm_seals(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    out, sock = tmp_path / "n.h5", tmp_path / "n.sock"
    p = start(out, "--pid", str(job.pid), "--control-socket", str(sock))
    wait_state(sock, "recording")
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0
    t = open_node_trace(out)
    assert t.sealed and "end_monotonic_ns" in t.attrs
    clk = t.table("/clock/pairs")
    assert int(clk["monotonic_ns"][-1]) > int(clk["monotonic_ns"][0])  # start and end pairs


def test_kill_9_keeps_flushed_data_and_recovers(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    out, sock = tmp_path / "n.h5", tmp_path / "n.sock"
    p = start(out, "--pid", str(job.pid), "--control-socket", str(sock))
    wait_state(sock, "recording")
    time.sleep(0.6)
    flushed = request(sock, "flush", 10)["records"]
    p.kill()
    p.wait()
    t = open_node_trace(out)
    assert not t.sealed and t.partial
    assert len(t.table("/host/node")) >= flushed["/host/node"] > 0
    plain = tmp_path / "recovered.h5"
    recover(out, plain, "collector killed (test)")
    with h5py.File(plain, "r") as f:  # a plain open, no SWMR needed
        assert f.attrs["partial_reason"] == "collector killed (test)"
        assert len(f["/host/node"]) == len(t.table("/host/node"))
    assert open_node_trace(plain).partial_reasons == ["collector killed (test)"]


def test_output_dir_missing(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    out, sock = tmp_path / "nope" / "n.h5", tmp_path / "n.sock"
    p = start(out, "--pid", str(job.pid), "--control-socket", str(sock))
    st = wait_state(sock, "error")
    assert "cannot create node file" in str(st["error"]) and "ENOENT" in str(st["error"])
    assert request(sock, "seal", 10)["ok"] is False
    assert p.wait(10) == 1
    assert b"cannot create node file" in p.stderr.read()  # type: ignore[union-attr]
    assert job.poll() is None  # the job is unaffected


def mount_tmpfs(path: Path, opts: str) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "gpuprof-test", str(path)], check=True)


@is_root
def test_output_dir_read_only(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, "ro,size=1m")  # root ignores mode bits: a read-only mount is the real case
    try:
        sock = tmp_path / "n.sock"
        p = start(mnt / "n.h5", "--pid", str(job.pid), "--control-socket", str(sock))
        st = wait_state(sock, "error")
        assert "EROFS" in str(st["error"])
        request(sock, "seal", 10)
        assert p.wait(10) == 1 and job.poll() is None
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@is_root
def test_disk_full_mid_run_keeps_flushed_data(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=2m")
    try:
        out, sock = mnt / "n.h5", tmp_path / "n.sock"
        p = start(out, "--pid", str(job.pid), "--control-socket", str(sock))
        wait_state(sock, "recording")
        time.sleep(0.5)
        flushed = request(sock, "flush", 10)["records"]
        # fill the file system to the last byte
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64k"], capture_output=True, check=False)
        st = wait_state(sock, "error", timeout=20)
        assert "ENOSPC" in str(st["error"]), st
        request(sock, "seal", 10)
        assert p.wait(10) == 1 and job.poll() is None
        (mnt / "filler").unlink()
        t = open_node_trace(out)
        assert t.partial and len(t.table("/host/node")) >= flushed["/host/node"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_stale_socket_is_replaced_but_live_one_refused(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    import socket as so

    sock = tmp_path / "n.sock"
    s = so.socket(so.AF_UNIX)
    s.bind(str(sock))
    s.close()  # a dead collector's leftover
    p = start(tmp_path / "a.h5", "--pid", str(job.pid), "--control-socket", str(sock))
    wait_state(sock, "recording")
    q = start(tmp_path / "b.h5", "--pid", str(job.pid), "--control-socket", str(sock))
    assert q.wait(10) == 2 and b"another collector" in q.stderr.read()  # type: ignore[union-attr]
    request(sock, "seal", 20)
    assert p.wait(10) == 0


def test_usage_errors() -> None:
    r = subprocess.run([*GPUPROF, "collect", "--output", "/tmp/x.h5"], env=env_with(), capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "give --job JOBID or --pid PID" in r.stderr
    r = subprocess.run([*GPUPROF, "collect", "--pid", "1", "--modes", "bogus", "--output", "/tmp/x.h5"],
                       env=env_with(), capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "unknown mode" in r.stderr


def test_host_rows_are_plausible(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    out = tmp_path / "n.h5"
    assert start(out, "--pid", str(job.pid), "--duration", "1.5").wait(30) == 0
    procs = open_node_trace(out).table("/host/procs")
    cpu = {}
    for pid in np.unique(procs["pid"]):
        r = procs[procs["pid"] == pid]
        cpu[int(pid)] = (int(r["cpu_time_ns"][-1]) - int(r["cpu_time_ns"][0])) / 1e9
    assert max(cpu.values()) > 0.5  # the spinning child
    assert schema.HOST_PROCS.path in open_node_trace(out).tables


FAKE_SCONTROL = """#!/bin/sh
# scontrol double: `show job -o ID` answers from $FAKE_SCONTROL_STATE (absent: an unknown job)
case "$1" in
show)
    if [ -s "$FAKE_SCONTROL_STATE" ]; then echo "JobId=$4 JobName=x JobState=$(cat "$FAKE_SCONTROL_STATE") Reason=None"; exit 0; fi
    echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
*) exit 1;;
esac
"""


def test_collector_stops_by_itself_when_slurm_says_the_job_is_over(tmp_path: Path) -> None:
    """No epilog ever comes (its state was lost): while the job has no process on the node the
    collector asks Slurm; RUNNING keeps it recording, a final state makes it seal and exit."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    state = tmp_path / "job-state"
    state.write_text("RUNNING")
    conf = tmp_path / "gpuprof.toml"
    conf.write_text("[collector]\njob_check_interval_s = 0.3\nprocess_scan_interval_s = 0.2\n")
    out, sock = tmp_path / "n.h5", tmp_path / "n.sock"
    env = env_with(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_SCONTROL_STATE=str(state))
    p = subprocess.Popen([*GPUPROF, "--config", str(conf), "collect", "--job", "4242", "--node", "nodeX",
                          "--modes", "metrics", "--output", str(out), "--control-socket", str(sock)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_state(sock, "recording")
        time.sleep(1.5)  # several checks, each answered RUNNING
        assert p.poll() is None and request(sock, "status", 2.0)["state"] == "recording"
        state.write_text("COMPLETED")
        assert p.wait(20) == 0, p.stderr.read()  # type: ignore[union-attr]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    t = open_node_trace(out)
    assert t.sealed
    msgs = [e["message"] for e in summarize(t)["errors"] if e["source"] == "job"]
    assert any("job 4242 is COMPLETED and no epilog sealed this collector" in m for m in msgs), msgs


@is_root
def test_collector_in_error_still_stops_when_the_job_is_gone(tmp_path: Path) -> None:
    """A collector whose disk filled stays up to tell the epilog why; with no epilog it still
    ends once Slurm no longer knows the job."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    conf = tmp_path / "gpuprof.toml"
    conf.write_text("[collector]\njob_check_interval_s = 0.3\n")
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=64k")
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/filler", "bs=4k"], capture_output=True, check=False)
        sock = tmp_path / "n.sock"
        env = env_with(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_SCONTROL_STATE=str(tmp_path / "absent"))
        p = subprocess.Popen([*GPUPROF, "--config", str(conf), "collect", "--job", "4243", "--node", "nodeX",
                              "--modes", "metrics", "--output", str(mnt / "n.h5"), "--control-socket", str(sock)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert p.wait(20) == 1
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err = p.stderr.read().decode()  # type: ignore[union-attr]
        assert "ENOSPC" in err and "Slurm does not know job 4243" in err, err
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


EXIT_WITH_H5PY_LOCK_HELD = """
import sys, threading, time
import h5py
from h5py._objects import phil
fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)  # an h5py object the finalization releases
held = threading.Event()
def hold():  # a daemon thread inside h5py when the process ends (a triggered export)
    with phil:
        held.set()
        time.sleep(100)
threading.Thread(target=hold, daemon=True).start()
held.wait()
if sys.argv[1] == "leave":
    from gpuprof.collector.cli import _leave
    _leave(3)
"""


@pytest.mark.parametrize("how", ["plain", "leave"])
def test_collector_leaves_while_a_daemon_thread_holds_h5pys_lock(how: str) -> None:
    """How a continuous collector's exit hung under load (gdb: Py_FinalizeEx -> an h5py object's
    dealloc -> h5py's lock, held by a frozen daemon thread): a plain interpreter exit waits forever;
    the collector's way out (cli._leave, after the seal) does not run the finalization."""
    cmd = [sys.executable, "-c", EXIT_WITH_H5PY_LOCK_HELD, how]
    if how == "plain":
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(cmd, check=False, timeout=5, capture_output=True)
    else:
        assert subprocess.run(cmd, check=False, timeout=30, capture_output=True).returncode == 3


# A busy loop pinned to CPU 0 for SPIN_S, in a session of its own, lowered by lower_priority when
# asked; it prints the share of the CPU it got and its autogroup line.
SPINNER = """
import os, sys, time
from gpuprof.collector.daemon import lower_priority
os.sched_setaffinity(0, {0})
nice = int(sys.argv[1])
if nice:
    problems = lower_priority(nice)
    assert not problems, problems
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < float(sys.argv[2]):
    pass
auto = open("/proc/self/autogroup").read().strip() if os.path.exists("/proc/self/autogroup") else "-"
print(f"{(time.process_time() - c0) / (time.monotonic() - t0):.3f} {os.getpriority(os.PRIO_PROCESS, 0)} {auto}")
"""


def test_the_lowered_collector_yields_its_core_to_a_job_in_another_session() -> None:
    """The prolog starts the collector in a session of its own (hooks._start_collector): with
    the kernel's autogroups on, a nice value alone weighs nothing against the job's session."""
    procs = [subprocess.Popen([sys.executable, "-c", SPINNER, str(nice), "2.0"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True) for nice in (0, 10)]
    (job_share, job_nice, _), (collector_share, collector_nice, collector_group) = (
        (float(out.split()[0]), int(out.split()[1]), out.split(maxsplit=2)[2].strip())
        for out in (p.communicate(timeout=30)[0] for p in procs))
    assert (job_nice, collector_nice) == (0, 10)
    if collector_group != "-":
        assert collector_group.endswith(" nice 10"), collector_group
    # nice 10 against 0 is a weight of 110 against 1024: about a tenth; the same weight, a half
    assert collector_share < job_share / 3, (collector_share, job_share)


@pytest.mark.parametrize("batch", [True, False])
def test_every_collector_thread_runs_under_sched_batch(tmp_path: Path, job: subprocess.Popen[bytes],
                                                       batch: bool) -> None:
    """collector.sched_batch (on by default): every thread of the collector, the native ticks'
    included, runs under SCHED_BATCH (a thread that wakes never preempts a running rank), its nice
    kept; off, under the policy it was started with (SCHED_OTHER here). An in-process collector
    (the other tests') must not have put this test process under SCHED_BATCH, as it once did."""
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "an earlier test left the test process under another policy"
    env = env_with()
    if not batch:
        conf = tmp_path / "gpuprof.toml"
        conf.write_text("[collector]\nsched_batch = false\n")
        env["GPUPROF_CONFIG"] = str(conf)
    p = start(tmp_path / "n1.h5", "--pid", str(job.pid), "--duration", "4", "--nice", "7", env=env)
    try:
        policies: dict[str, tuple[int, int]] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not {"gp-writer", "gp-tick-100ms"} <= set(policies):
            time.sleep(0.2)
            for task in Path(f"/proc/{p.pid}/task").iterdir():
                try:
                    name = (task / "comm").read_text().strip()
                    policies[name] = (os.sched_getscheduler(int(task.name)),
                                      os.getpriority(os.PRIO_PROCESS, int(task.name)))
                except (FileNotFoundError, ProcessLookupError):
                    continue
        assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
    assert {"gp-writer", "gp-tick-100ms"} <= set(policies), policies
    want = os.SCHED_BATCH if batch else os.SCHED_OTHER
    assert set(policies.values()) == {(want, 7)}, policies


def test_the_collector_runs_no_thread_it_did_not_start(tmp_path: Path, job: subprocess.Popen[bytes]) -> None:
    """numpy's OpenBLAS starts a thread per core at import, which spins on the job's cores (0.12 s
    of CPU here): the collector asks for one BLAS thread, whatever the environment says, so every
    thread it has is one of its own (named) or the main thread."""
    out = tmp_path / "n1.h5"
    p = start(out, "--pid", str(job.pid), "--duration", "1.5", env=env_with(OPENBLAS_NUM_THREADS="4",
                                                                          OMP_NUM_THREADS="4"))
    assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    with h5py.File(out, "r") as f:
        threads = json.loads(f.attrs["collector_cpu_json"])["by_thread_s"]
    assert "MainThread" in threads and "writer" in threads
    assert not [name for name in threads if name.startswith("python/")], threads


def test_lower_priority_leaves_the_session_it_was_started_from_alone() -> None:
    """Not a session leader (run by hand from a shell): the shell's autogroup keeps its nice. The
    child leads a session of its own, so that a failure cannot lower the test run's."""
    if not os.path.exists("/proc/self/autogroup"):
        pytest.skip("kernel without autogroups (CONFIG_SCHED_AUTOGROUP)")
    code = """
import os, sys
from gpuprof.collector.daemon import lower_priority
before = open("/proc/self/autogroup").read().strip()
pid = os.fork()
if pid == 0:
    problems = lower_priority(5)
    os._exit(0 if not problems and os.getpriority(os.PRIO_PROCESS, 0) == 5 else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), before, "|", open("/proc/self/autogroup").read().strip())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         start_new_session=True, check=True).stdout
    rc, groups = out.split(maxsplit=1)
    before, after = (g.strip() for g in groups.split("|"))
    assert rc == "0"
    assert before == after and before.endswith(" nice 0"), (before, after)
