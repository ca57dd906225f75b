"""Continuous mode (collector/continuous.py, docs/continuous.md): retention bounds, the spill across
a restart and a full disk, export windows (whole node, one job), the local API's authentication,
rules and their rate limit, and an exported window through the ordinary merge."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuprof.collector import schema
from gpuprof.collector.continuous import (
    ContinuousError,
    RateLimiter,
    Retention,
    client_request,
    end_job,
    join_job,
    parse_duration,
    parse_rule,
    running_collector,
)
from gpuprof.collector.daemon import monotonic_ns
from gpuprof.collector.errors import CollectorError, ConfigError
from gpuprof.collector.reader import open_node_trace, summarize

ROOT = Path(__file__).resolve().parents[1]
GPUPROF = [sys.executable, "-m", "gpuprof.slurm_hooks.cli"]
FREEZER = Path("/sys/fs/cgroup/freezer")
is_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (real job cgroups, a tmpfs, other uids)")
needs_freezer = pytest.mark.skipif(not FREEZER.is_dir(), reason="needs the cgroup v1 freezer hierarchy")
TABLES = (schema.CLOCK_PAIRS, schema.HOST_NODE, schema.HOST_PROCS, schema.GPU_DEVICES)
S = 1_000_000_000


def host_rows(t_ns: list[int]) -> np.ndarray:
    rows = schema.HOST_NODE.empty(len(t_ns))
    rows["t_ns"] = t_ns
    rows["cpu_busy"] = 0.5
    return rows


def proc_rows(t_ns: int, pids: list[int]) -> np.ndarray:
    rows = schema.HOST_PROCS.empty(len(pids))
    rows["t_ns"] = t_ns
    rows["pid"] = pids
    return rows


def pair(t_ns: int) -> np.ndarray:
    rows = schema.CLOCK_PAIRS.empty(1)
    rows[0] = (t_ns, t_ns + 1_700_000_000 * S, 10)
    return rows


def retention(tmp: Path | None, **kw: float) -> Retention:
    args = {"retention_s": 60.0, "memory_limit_bytes": 1 << 20, "segment_s": 1.0, "spill_limit_bytes": 1 << 24}
    args.update(kw)
    return Retention(TABLES, spill_dir=tmp, retention_s=args["retention_s"],
                     memory_limit_bytes=int(args["memory_limit_bytes"]), segment_s=args["segment_s"],
                     spill_limit_bytes=int(args["spill_limit_bytes"]))


def fill(r: Retention, t0: int, seconds: int, pids: list[int]) -> None:
    """One clock pair, 10 host rows and one procs row per pid each second, a segment per second."""
    for s in range(seconds):
        t = t0 + s * S
        r.append(schema.CLOCK_PAIRS.path, pair(t), now_ns=t)
        r.append(schema.HOST_NODE.path, host_rows([t + i * S // 10 for i in range(10)]), now_ns=t)
        r.append(schema.HOST_PROCS.path, proc_rows(t, pids), now_ns=t)
        r.rotate(now_ns=t + S)


def spill_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spill"
    d.mkdir(mode=0o700, parents=True)
    return d


def test_window_cuts_time_and_pids(tmp_path: Path) -> None:
    r = retention(spill_dir(tmp_path))
    t0 = monotonic_ns() - 30 * S
    fill(r, t0, 20, [100, 200])
    dev = schema.GPU_DEVICES.empty(1)
    dev["uuid"] = b"GPU-x"
    r.append(schema.GPU_DEVICES.path, dev)
    w = r.window(t0 + 5 * S, t0 + 10 * S, pids={200})
    host = w[schema.HOST_NODE.path]["t_ns"]
    assert host.min() == t0 + 5 * S and host.max() == t0 + 10 * S and len(host) == 51
    procs = w[schema.HOST_PROCS.path]
    assert set(procs["pid"]) == {200} and len(procs) == 6
    # the clock pair before the window comes with it, so its first rows map to realtime
    assert w[schema.CLOCK_PAIRS.path]["monotonic_ns"][0] == t0 + 4 * S
    assert w[schema.GPU_DEVICES.path]["uuid"][0] == b"GPU-x"  # tables without a time column: whole
    assert r.rows(schema.HOST_NODE.path) == 200


def test_eviction_by_age_and_the_memory_and_spill_caps(tmp_path: Path) -> None:
    d = spill_dir(tmp_path)
    now = monotonic_ns()
    r = retention(d, retention_s=10.0, memory_limit_bytes=2000, spill_limit_bytes=1 << 24)
    fill(r, now - 30 * S, 30, [1])
    st = r.status()
    # 10 s retained (by age), memory under its cap, the rest read back from the spill
    assert st["evicted_by_age"] >= 19 and st["segments"] <= 11
    assert st["memory_bytes"] <= 2000 and st["evicted_from_memory"] > 0
    w = r.window(now - 9 * S, now)
    assert len(w[schema.HOST_NODE.path]) >= 80  # from memory and from the spill together
    assert len(list(d.glob("seg-*.npz"))) == st["segments"]
    # the spill's own cap: the oldest files go, and a segment in neither place is counted as lost
    r2 = retention(spill_dir(tmp_path / "b"), retention_s=60.0, memory_limit_bytes=1000, spill_limit_bytes=6000)
    fill(r2, now - 30 * S, 30, [1])
    st2 = r2.status()
    assert st2["spill_bytes"] <= 6000 and st2["evicted_from_spill"] > 0
    assert st2["lost_segments"] > 0 and st2["lost_rows"] > 0


def test_spill_survives_a_restart_and_another_boot_is_discarded(tmp_path: Path) -> None:
    d = spill_dir(tmp_path)
    now = monotonic_ns()
    fill(retention(d), now - 20 * S, 10, [7])
    again = retention(d)  # a restarted collector on the same boot
    assert again.status()["restored_segments"] == 10
    w = again.window(now - 20 * S, now)
    assert len(w[schema.HOST_NODE.path]) == 100 and set(w[schema.HOST_PROCS.path]["pid"]) == {7}
    other = Retention(TABLES, spill_dir=d, retention_s=60, memory_limit_bytes=1 << 20, segment_s=1,
                      spill_limit_bytes=1 << 24, boot_id="another-boot")
    assert other.status()["discarded_other_boot"] == 10 and not list(d.glob("seg-*"))


def test_spill_dir_must_be_private(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(CollectorError, match="reachable by others"):
        retention(d)


@is_root
def test_disk_full_spill_is_counted_and_memory_stays_bounded(tmp_path: Path) -> None:
    d = tmp_path / "small"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(d)], check=True)
    try:
        now = monotonic_ns()
        r = retention(d, memory_limit_bytes=3000)
        fill(r, now - 40 * S, 40, [1, 2, 3])
        st = r.status()
        assert st["spill_errors"] > 0 and "ENOSPC" in st["last_spill_error"]
        assert st["memory_bytes"] <= 3000 and st["lost_segments"] > 0
        assert not list(d.glob(".tmp-*"))  # no half-written segment left
        assert len(r.window(now - 5 * S, now)[schema.HOST_NODE.path]) >= 40  # the newest still there
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_rule_grammar_and_durations() -> None:
    rule = parse_rule("gpu_util_percent < 10 for 300 s")
    assert (rule.metric, rule.op, rule.threshold, rule.for_s) == ("gpu_util_percent", "<", 10.0, 300.0)
    assert rule.holds(5.0) and not rule.holds(10.0)
    with pytest.raises(ConfigError, match="unknown metric 'gpu_fun'"):
        parse_rule("gpu_fun < 1 for 2 s")
    with pytest.raises(ConfigError, match="cannot parse 'gpu_util_percent below 3'"):
        parse_rule("gpu_util_percent below 3")
    assert parse_duration("5m") == 300 and parse_duration("90s") == 90 and parse_duration("1h") == 3600
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("5 minutes please")


def test_a_trigger_storm_is_counted_not_obeyed() -> None:
    lim = RateLimiter(60.0)
    allowed = sum(lim.allow("rules", now=1000.0 + i * 0.01) for i in range(500))
    assert allowed == 1 and lim.refused_total() == 499
    assert lim.allow("rules", now=1061.0)  # after the interval, the next one is obeyed


# --- the collector end to end -------------------------------------------------------------------
@dataclass
class CgroupJob:
    job_id: str
    uid: int
    dir: Path
    procs: list[subprocess.Popen[bytes]]

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs}


def make_job(node: str, job_id: str, uid: int) -> CgroupJob:
    """A real freezer cgroup where Slurm puts a job (freezer/slurm_<node>/uid_<uid>/job_<id>) with a
    busy and a sleeping process in it."""
    d = FREEZER / f"slurm_{node}" / f"uid_{uid}" / f"job_{job_id}"
    d.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]), subprocess.Popen(["sleep", "120"])]
    for p in procs:
        (d / "cgroup.procs").write_text(f"{p.pid}\n")
    return CgroupJob(job_id, uid, d, procs)


def remove_job(job: CgroupJob) -> None:
    for p in job.procs:
        p.kill()
        p.wait()
    for sub in (job.dir, job.dir.parent, job.dir.parent.parent):
        try:
            sub.rmdir()
        except OSError:
            pass  # not empty (another job of the test) or gone already


@pytest.fixture
def node() -> str:
    return f"gpuproftestd{os.getpid()}"


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is root's alone): the socket's and the
    user's output directory are in it; the spill inside stays 0700."""
    d = Path(tempfile.mkdtemp(prefix="gpuprof-continuous-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def unprivileged() -> pwd.struct_passwd:
    for name in ("gpuprof-test", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip("no unprivileged user (make setup creates gpuprof-test)")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPROF_", "CUDA_VISIBLE"))}
    e["PYTHONPATH"] = str(ROOT)
    e["GPUPROF_NVML_LIBRARY"] = "/nonexistent/libnvidia-ml.so.1"  # no GPU here: NVML is said to be missing
    return e


def write_config(tmp: Path, **continuous: object) -> Path:
    run = tmp / "run"
    run.mkdir(mode=0o755, exist_ok=True)
    prom = tmp / "prom"
    prom.mkdir(exist_ok=True)
    keys = {"spill_dir": str(tmp / "spill"), "export_dir": str(tmp / "exports"), "socket": str(run / "c.sock"),
            "segment_s": 1.0, "retention_min": 2.0, "request_min_interval_s": 30.0, **continuous}
    lines = ["[collector]", "flush_interval_s = 1.0", "[continuous]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    lines += ["[prometheus]", f'textfile_dir = "{prom}"', "interval_s = 1.0"]
    f = tmp / "c.toml"
    f.write_text("\n".join(lines) + "\n")
    f.chmod(0o644)
    return f


def start_collector(conf: Path, node: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([*GPUPROF, "--config", str(conf), "collect", "--continuous", "--node", node],
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sock = conf.parent / "run" / "c.sock"
    deadline = time.monotonic() + 20
    while not sock.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"collector did not start: {p.communicate()[1].decode()[-2000:]}")
        time.sleep(0.1)
    return p


def stop_collector(p: subprocess.Popen[bytes]) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err.decode()[-2000:]
    return err.decode()


def gpuprof(conf: Path, *args: str, user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess[str]:
    # the user has no access to root's config: they name the socket, as docs/continuous.md says
    cmd = [*GPUPROF, "--config", str(conf), *args] if user is None else \
        [*GPUPROF, *args, "--socket", str(conf.parent / "run" / "c.sock")]
    if user is not None:
        cmd = ["runuser", "-u", user.pw_name, "--", "env", f"PYTHONPATH={ROOT}", *cmd]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, check=False, timeout=120)


def status(conf: Path) -> dict[str, object]:
    return client_request(conf.parent / "run" / "c.sock", {"cmd": "status"})


@is_root
@needs_freezer
def test_export_auth_rules_restart_and_merge(open_tmp: Path, node: str, unprivileged: pwd.struct_passwd) -> None:
    tmp_path = open_tmp
    conf = write_config(tmp_path, rules=["cpu_busy_ratio > -1 for 0 s"], trigger_min_interval_s=3600.0)
    mine = make_job(node, "9001", unprivileged.pw_uid)
    other = make_job(node, "9002", 0)
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    os.chown(user_dir, unprivileged.pw_uid, unprivileged.pw_gid)
    p = start_collector(conf, node)
    try:
        time.sleep(4.5)
        # root: the whole node; a window larger than retained is exported with what there is, and said
        out = tmp_path / "node.h5"
        r = gpuprof(conf, "export", "--last", "5m", "-o", str(out), "--json")
        assert r.returncode == 0, r.stderr
        reply = json.loads(r.stdout)
        w = reply["window"]
        assert not w["complete"] and w["asked_s"] == 300 and 2 < w["have_s"] < 60
        assert "asked for 300 s, this node retains" in w["note"]
        s = summarize(open_node_trace(out))
        assert s["sealed"] and s["records"]["/host/node"] >= 2
        with h5py.File(out) as f:
            assert json.loads(f.attrs["continuous_window_json"])["asked_s"] == 300
            assert f.attrs["window_incomplete"].startswith("asked for 300 s")
            procs = set(f["/host/procs"]["pid"])
        assert mine.pids | other.pids <= procs
        # the job's owner: their own job only, into a file they open themselves
        jf = user_dir / "job.h5"
        r = gpuprof(conf, "export", "--last", "1m", "--job", mine.job_id, "-o", str(jf), user=unprivileged)
        assert r.returncode == 0, r.stderr
        assert jf.stat().st_uid == unprivileged.pw_uid
        with h5py.File(jf) as f:
            assert f.attrs["job_id"] == mine.job_id
            assert set(f["/host/procs"]["pid"]) == mine.pids
            assert set(f["/processes/events"]["pid"]) <= mine.pids
        # refused: someone else's job, the whole node; then a second export too soon (rate limit)
        r = gpuprof(conf, "export", "--last", "1m", "--job", other.job_id, "-o", str(user_dir / "x.h5"),
                    user=unprivileged)
        assert r.returncode == 1 and "is not yours" in r.stderr and not (user_dir / "x.h5").exists()
        r = gpuprof(conf, "export", "--last", "1m", "-o", str(user_dir / "y.h5"), user=unprivileged)
        assert r.returncode == 1 and "only root may export the whole node" in r.stderr
        r = gpuprof(conf, "export", "--last", "1m", "--job", mine.job_id, "-o", str(jf), user=unprivileged)
        assert r.returncode == 1 and "at most one export per" in r.stderr
        st = status(conf)["continuous"]
        assert isinstance(st, dict)
        assert st["auth_refused"] == 2 and st["requests_refused"] == 1
        # the rule held at every flush: one export, the rest counted
        assert st["triggers_fired"] == 1 and st["triggers_refused"] >= 2
        assert len(list((tmp_path / "exports").glob("rule-*.h5"))) == 1
        # Prometheus' textfile: parsed back with prometheus_client's own parser
        text = (tmp_path / "prom" / "gpuprof.prom").read_text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        jobs = {s.labels["job"]: s.value for s in fams["gpuprof_job_processes"].samples}
        assert jobs[mine.job_id] == 2 and jobs[other.job_id] == 2
        users = {s.labels["job"]: s.labels["user"] for s in fams["gpuprof_job_processes"].samples}
        assert users[mine.job_id] == unprivileged.pw_name and users[other.job_id] == "root"
        assert 0 <= fams["gpuprof_node_cpu_busy_ratio"].samples[0].value <= 1
        # a --profile-gpu job on this node: the prolog joins it, the epilog gets its node file
        sock = tmp_path / "run" / "c.sock"
        assert running_collector(sock)
        join_job(sock, mine.job_id)
        time.sleep(3.5)
        nf = tmp_path / "job-node.h5"
        reply = end_job(sock, mine.job_id, nf, nodelist=node)
        assert reply["ok"] and reply["window"]["complete"]
        js = summarize(open_node_trace(nf))
        assert js["sealed"] and js["job_id"] == mine.job_id and 2.5 < js["span_s"] < 12
        with h5py.File(nf) as f:
            # only the job's processes (at 1 Hz a loaded machine may have sampled one of them once)
            assert f.attrs["job_nodelist"] == node and set(f["/host/procs"]["pid"]) <= mine.pids
            assert len(f["/host/procs"])
        # a descriptor that is not a regular file (a pipe nobody reads) is refused, not written to
        rd, wr = os.pipe()
        try:
            reply = client_request(sock, {"cmd": "export", "last_s": 5}, fd=wr)
        finally:
            os.close(rd)
            os.close(wr)
        assert not reply["ok"] and "not a regular file" in reply["error"]
        with pytest.raises(ContinuousError, match="no job_begin"):
            end_job(sock, other.job_id, tmp_path / "never.h5")
        assert not (tmp_path / "never.h5").exists()
        stop_collector(p)
        # a restarted collector still has what the spill holds
        t_restart = time.clock_gettime_ns(time.CLOCK_REALTIME)
        p = start_collector(conf, node)
        time.sleep(1.5)
        out2 = tmp_path / "after.h5"
        r = gpuprof(conf, "export", "--last", "2m", "-o", str(out2), "--json")
        assert r.returncode == 0, r.stderr
        with h5py.File(out2) as f:
            assert int(f.attrs["start_realtime_ns"]) < t_restart - 3 * S
        # both exports of the node merge with the ordinary merge
        mdir = tmp_path / "merge"
        mdir.mkdir()
        os.link(out, mdir / f"{node}.h5")
        from gpuprof.mpi_merge.merge import merge

        res = merge(str(mdir))
        assert res is not None and res.job_file.exists()
    finally:
        if p.poll() is None:
            stop_collector(p)
        remove_job(mine)
        remove_job(other)


def test_no_collector_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CollectorError, match="no continuous collector socket"):
        client_request(tmp_path / "absent.sock", {"cmd": "status"})
