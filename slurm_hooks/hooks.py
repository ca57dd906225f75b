"""Prolog, epilog and task prolog: plain functions; gpuprof.slurm_hooks.commands wraps them for the CLI.

Rules every hook keeps (ARCHITECTURE.md, decision 5):
- it returns normally whatever happens: a failing Prolog or Epilog drains the node. Errors are
  logged with the job id and node, never raised to Slurm;
- the DCGM lock taken by the prolog is released by the epilog even when everything else failed;
- a job that did not ask for profiling is turned away by the thin etc/ wrapper before Python starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment as env
from gpuprof.collector.errors import CollectorError, GpuprofError, JobLookupError
from gpuprof.collector.jobwatch import LIVE_STATES
from gpuprof.collector.modes import parse_modes
from gpuprof.slurm_hooks import log as log_mod
from gpuprof.slurm_hooks.dcgm_lock import DcgmLock, DcgmStateError, holder_name
from gpuprof.slurm_hooks.job import JobInfo, from_hook_environment, job_source
from gpuprof.slurm_hooks.paths import (
    PlacementError,
    make_job_dir,
    make_private_dir,
    node_dir_for_stdout,
    place_as_user,
    remove_job_dir,
    remove_task_plan,
    write_task_plan,
)


@dataclass
class NodeJobState:
    """What the prolog did for one job on one node; read back by the epilog."""

    job_id: str
    node: str
    modes: list[str]
    uid: int
    gid: int
    collector_pid: int | None
    trace: str
    socket: str
    started_at: float
    collector_started: bool
    dcgm: str
    ring_dir: str = ""  # the fast path's per-job directory ('' when none was made)
    attached: bool = False  # every source was in place before the prolog returned
    late_sources: list[str] | None = None  # sources still not attached when the prolog gave up
    problem: str = ""  # why this node records nothing or less (told to the user by the epilog)
    # the node's continuous collector records the job (no collector of its own): its socket, or ''
    continuous_socket: str = ""


def _job_node_dir(cfg: dict[str, Any], job_id: str, node: str) -> Path:
    base = make_private_dir(Path(cfg["paths"]["state_dir"]))
    return make_private_dir(make_private_dir(base / "jobs") / f"{job_id}@{node}")


def _hook_context() -> tuple[str, str]:
    return env.get(env.SLURM_JOB_ID) or "?", env.get(env.SLURMD_NODENAME) or os.uname().nodename


def _load_config(config_path: str | None, log: logging.Logger) -> dict[str, Any] | None:
    try:
        return config_mod.load(config_path)
    except GpuprofError as e:
        log.error("config: %s; profiling skipped for this job", e)
        return None


def collector_command(cfg_path: str | None, job: JobInfo, node: str, modes: tuple[str, ...], trace: Path,
                      socket: Path, python: str) -> list[str]:
    cmd = [python, "-m", "gpuprof.slurm_hooks.cli"]
    if cfg_path:
        cmd += ["--config", cfg_path]
    cmd += ["collect", "--job", job.job_id, "--node", node, "--uid", str(job.uid), "--modes", ",".join(modes),
            "--output", str(trace), "--control-socket", str(socket)]
    return cmd


def _start_collector(cmd: list[str], nice: int, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as logf:
        # A new session: the collector outlives the prolog and is in no job's process group.
        return subprocess.Popen(
            ["nice", "-n", str(nice), *cmd], stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
            start_new_session=True, close_fds=True,
        )


def _wait_recording(socket: Path, proc: subprocess.Popen[bytes], timeout_s: float,
                    attach_deadline: float | None = None) -> tuple[str, list[str]]:
    """Poll the control socket until the collector says it records ('' on success, else why not),
    then, until attach_deadline (monotonic), until every source is attached ("attached" in
    `status`). Returns (why not recording, sources still not attached when the wait ended)."""
    from gpuprof.collector.control import request

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    recording = False
    st: dict[str, Any] = {}
    while True:
        now = time.monotonic()
        if not recording and now >= deadline:
            return f"collector not recording after {timeout_s} s ({last})", []
        if recording and (attach_deadline is None or now >= attach_deadline):
            break
        if proc.poll() is not None:
            return f"collector exited with status {proc.returncode} before recording", []
        if socket.exists():
            try:
                st = request(str(socket), "status", timeout_s=0.5)
            except GpuprofError as e:
                last = str(e)
            else:
                if st.get("state") == "recording":
                    recording = True
                    if attach_deadline is None or st.get("attached", True):
                        return "", []
                elif recording:
                    return "", []  # sealed or failed since: nothing more to wait for
                else:
                    last = f"state {st.get('state')}: {st.get('errors')}"
        time.sleep(0.05 if recording else 0.02)
    pending = sorted(n for n, a in st.get("attach", {}).items() if a.get("state") == "pending")
    return "", pending


def prolog(config_path: str | None = None) -> int:
    job_id, node = _hook_context()
    log = log_mod.setup("prolog", job_id, node)
    try:
        _prolog(config_path, job_id, node, log)
    except Exception:  # the one place a bug must not drain the node: log it with its traceback
        log.exception("prolog failed unexpectedly")
    return 0


def _prolog(config_path: str | None, job_id: str, node: str, log: logging.Logger) -> None:
    raw_modes = env.profile_modes_hook()
    if raw_modes is None:
        return
    cfg = _load_config(config_path, log)
    if cfg is None:
        return
    log = log_mod.setup("prolog", job_id, node, cfg["paths"]["log_file"])
    try:
        modes = parse_modes(raw_modes)
    except ValueError as e:
        log.error("--profile-gpu=%r: %s; profiling skipped", raw_modes, e)
        return
    job = from_hook_environment()
    try:
        state_dir = _job_node_dir(cfg, job_id, node)
        lock = DcgmLock(Path(cfg["paths"]["state_dir"]), cfg["dcgm"], log)
    except (OSError, PlacementError) as e:
        log.error("state directory %s: %s%s; profiling skipped", cfg["paths"]["state_dir"],
                  getattr(e, "strerror", None) or e, _fs_full_note(Path(cfg["paths"]["state_dir"])))
        return
    _watchdog(lock, log, cfg, node, job_id)
    try:
        dcgm = lock.acquire(holder_name(job_id, node), {"job": job_id, "node": node})
    except DcgmStateError as e:
        log.error("%s%s; DCGM not paused, profiling skipped", e, _fs_full_note(lock.dir))
        return
    log.info("DCGM lock held by %d holder(s), action %s (%s)", len(dcgm.holders), dcgm.action, dcgm.dcgmi)

    trace = state_dir / f"{node}.h5"
    socket = state_dir / "control.sock"
    continuous = _join_continuous(cfg, job_id, node, log)
    ring_dir = None if continuous else _make_ring_dir(job_id, node, modes, job, log)
    _write_task_plan(cfg, job_id, node, modes, job, ring_dir, log)
    if continuous:
        # the always-on collector records the job: no second collector, no rings (it drains none)
        why_state = _write_state(state_dir, NodeJobState(
            job_id, node, list(modes), job.uid, job.gid, None, str(trace), continuous, time.time(), True, dcgm.dcgmi,
            attached=True, continuous_socket=continuous))
        if why_state:
            log.error("%s; the epilog will not know the continuous collector has the job", why_state)
        return
    python = cfg["hooks"]["collector_python"] or sys.executable
    cmd = collector_command(config_path or env.get(env.GPUPROF_CONFIG), job, node, modes, trace, socket, python)
    state = NodeJobState(job_id, node, list(modes), job.uid, job.gid, None, str(trace), str(socket), time.time(),
                         False, dcgm.dcgmi, ring_dir=str(ring_dir or ""))
    # Written before the collector starts: a state directory that cannot hold this small file
    # (disk full) cannot hold a node file either, and a collector the epilog cannot find must
    # never be started.
    why_state = _write_state(state_dir, state)
    if why_state:
        log.error("%s; the job runs unprofiled on this node", why_state)
        return
    try:
        started = time.monotonic()
        proc = _start_collector(cmd, int(cfg["hooks"]["collector_nice"]), state_dir / "collector.log")
    except OSError as e:
        state.problem = f"collector cannot start ({cmd[0]}): {e.strerror}"
        log.error("%s; the job runs unprofiled", state.problem)
    else:
        state.collector_pid = proc.pid
        attach_budget = float(cfg["hooks"]["attach_timeout_s"])
        why_not, late = _wait_recording(socket, proc, float(cfg["hooks"]["collector_ready_timeout_s"]),
                                        started + attach_budget)
        state.collector_started = not why_not
        state.attached = not why_not and not late
        state.late_sources = late
        if why_not:
            state.problem = why_not
            log.error("%s; see %s", why_not, state_dir / "collector.log")
            # A collector that does not record costs the job and answers no one: stop it now, its
            # file (if any) is the epilog's to recover.
            _terminate(proc.pid, log)
        else:
            log.info("collector pid %d recording to %s (modes %s)", proc.pid, trace, ",".join(modes))
        if late:
            # The job starts anyway; the collector marks these in the node file (attach_json).
            log.warning("sources %s not attached within hooks.attach_timeout_s = %s s: the job starts and "
                        "they are marked late in the node file", ",".join(late), attach_budget)
    why_state = _write_state(state_dir, state)
    if why_state:
        # the first state.json stays; the epilog finds the collector by its socket and its command line
        log.error("%s", why_state)


def _join_continuous(cfg: dict[str, Any], job_id: str, node: str, log: logging.Logger) -> str:
    """The socket of this node's continuous collector (docs/continuous.md) when one runs and takes the
    job ('' otherwise: the prolog starts a collector of the job's own)."""
    from gpuprof.collector.continuous import join_job, running_collector
    from gpuprof.collector.watch import socket_for

    sock = socket_for(str(cfg["continuous"]["socket"]), node)
    if not Path(sock).is_socket() or not running_collector(sock):
        return ""
    try:
        join_job(sock, job_id)
    except CollectorError as e:
        log.warning("continuous collector at %s: %s; starting a collector for the job", sock, e)
        return ""
    log.info("continuous collector at %s records the job (its modes and rates)", sock)
    return sock


def _write_state(state_dir: Path, state: NodeJobState) -> str:
    """state.json, replaced atomically ('' when written, else why not): a full disk leaves the
    previous version whole instead of an empty file."""
    path = state_dir / "state.json"
    tmp = state_dir / "state.json.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            data = json.dumps(asdict(state), indent=1).encode()
            if os.write(fd, data) != len(data):
                raise OSError(28, "short write")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return f"cannot write prolog state {path}: {e.strerror}{_fs_full_note(state_dir)}"
    return ""


def _fs_full_note(path: Path) -> str:
    """' (the file system of PATH is full: N bytes free)' when under 256 kB are left, else ''."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" (the file system of {path} is full: {free} bytes free)" if free < 256 * 1024 else ""


def _make_ring_dir(job_id: str, node: str, modes: tuple[str, ...], job: JobInfo,
                   log: logging.Logger) -> Path | None:
    """The fast path's per-job directory, made by root for the job's uid (mode 0700) before any of
    the job's processes run (docs/probes.md, "Who may write a ring"); None without mode collectives
    or kernels (CUPTI's kernel times cross the same rings)."""
    if "collectives" not in modes and "kernels" not in modes:
        return None
    from gpuprof.collector.fastpath_env import job_ring_dir

    try:
        path = job_ring_dir(job_id, node)
        make_job_dir(path, job.uid, job.gid)
    except (ValueError, PlacementError) as e:
        log.error("fast-path ring directory: %s; the fast path records nothing for this job", e)
        return None
    return path


def _write_task_plan(cfg: dict[str, Any], job_id: str, node: str, modes: tuple[str, ...], job: JobInfo,
                     ring_dir: Path | None, log: logging.Logger) -> None:
    """What the job's TaskProlog exports, decided once for the job (fastpath_env.job_task_plan) and
    read by etc/task-prolog in shell at every task. When it cannot be written, the TaskProlog
    makes the same lines in Python (a Python start a task instead of 1 ms)."""
    from gpuprof.collector.fastpath_env import job_task_plan, task_plan_path

    try:
        plan = job_task_plan(modes, cfg, job_id, ring_dir)
        write_task_plan(task_plan_path(job_id, node), [f"{k}={v}" for k, v in plan], job.uid)
    except (ValueError, PlacementError) as e:
        log.warning("task plan: %s; the TaskProlog makes the exports itself", e)


def _remove_task_plan(job_id: str, node: str, log: logging.Logger) -> None:
    from gpuprof.collector.fastpath_env import task_plan_path

    try:
        remove_task_plan(task_plan_path(job_id, node))
    except (ValueError, PlacementError) as e:
        log.warning("task plan: %s", e)


def job_still_running(holder: str, info: dict[str, Any]) -> bool:
    """For the DCGM watchdog: False only when Slurm says definitely that the job is gone."""
    job_id = str(info.get("job", ""))
    try:
        job = job_source().lookup(job_id)
    except JobLookupError as e:
        return "Invalid job id" not in str(e)
    return job.state.split()[0] in LIVE_STATES


def _watchdog(lock: DcgmLock, log: logging.Logger, cfg: dict[str, Any] | None = None, node: str = "",
              current_job: str = "") -> None:
    try:
        gone, result = lock.watchdog(job_still_running)
    except GpuprofError as e:
        log.error("DCGM watchdog: %s", e)
    else:
        if gone:
            log.warning("watchdog dropped stale DCGM holders %s; action %s (%s)", gone, result.action, result.dcgmi)
    if cfg is not None and node:
        reap_orphans(cfg, node, current_job, log)


def reap_orphans(cfg: dict[str, Any], node: str, current_job: str, log: logging.Logger) -> list[str]:
    """State left by jobs of this node whose epilog never ran (node crash, slurmd down at job end):
    for each whose job Slurm says is gone, stop its collector, keep its node file where root can
    find it (state_dir/undelivered/, the job's output directory is not known any more) and remove
    the rest. Returns the jobs reaped."""
    jobs_dir = Path(cfg["paths"]["state_dir"]) / "jobs"
    reaped = []
    try:
        entries = sorted(jobs_dir.iterdir())
    except OSError:
        return []
    for d in entries:
        job_id, _, dnode = d.name.partition("@")
        if dnode != node or job_id == current_job or d.is_symlink() or not d.is_dir():
            continue
        if job_still_running("", {"job": job_id}):
            continue
        stopped = stop_job_collectors(job_id, node, log)
        kept = ""
        trace = d / f"{node}.h5"
        if trace.is_file() and not trace.is_symlink():
            undelivered = Path(cfg["paths"]["state_dir"]) / "undelivered"
            try:
                make_private_dir(undelivered)
                os.replace(trace, undelivered / f"{job_id}@{node}.h5")
                kept = str(undelivered / f"{job_id}@{node}.h5")
            except (OSError, PlacementError) as e:
                log.error("orphaned node file %s cannot be kept: %s", trace, getattr(e, "strerror", None) or e)
            else:
                _trim_undelivered(undelivered, int(cfg["hooks"]["undelivered_max_mb"]) << 20, Path(kept), log)
        shutil.rmtree(d, ignore_errors=True)
        _remove_ring_dir(job_id, node, log)
        _remove_task_plan(job_id, node, log)
        log.warning("job %s ended without an epilog on %s: %d collector(s) stopped, state removed%s", job_id, node,
                    stopped, f", node file kept at {kept}" if kept else ", no node file")
        reaped.append(job_id)
    return reaped


def collector_pids(job_id: str, node: str) -> list[int]:
    """Root's collectors of (job, node), found by their command line in /proc (what the prolog
    started: `... gpuprof.slurm_hooks.cli ... collect --job JOB --node NODE ...`)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != 0:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"collect" not in argv or b"gpuprof.slurm_hooks.cli" not in argv:
            continue
        try:
            if argv[argv.index(b"--job") + 1] == job_id.encode() and argv[argv.index(b"--node") + 1] == node.encode():
                out.append(int(name))
        except (ValueError, IndexError):
            continue
    return sorted(p for p in out if _process_alive(p))


def stop_job_collectors(job_id: str, node: str, log: logging.Logger) -> int:
    """SIGTERM (the collector seals what it can), then SIGKILL, every collector of (job, node)."""
    pids = collector_pids(job_id, node)
    for pid in pids:
        log.warning("collector pid %d of job %s on %s still running: stopping it", pid, job_id, node)
        _terminate(pid, log)
    return len(pids)


def _terminate(pid: int, log: logging.Logger, grace_s: float = 3.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _process_alive(pid):
            return
        time.sleep(0.02)
    log.warning("collector pid %d ignored SIGTERM for %s s: killing it", pid, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def epilog(config_path: str | None = None) -> int:
    job_id, node = _hook_context()
    log = log_mod.setup("epilog", job_id, node)
    try:
        _epilog(config_path, job_id, node, log)
    except Exception:  # as in prolog(): never let a bug drain the node
        log.exception("epilog failed unexpectedly")
    return 0


def _epilog(config_path: str | None, job_id: str, node: str, log: logging.Logger) -> None:
    if env.get(env.SPANK_OPTION_HOOK) is None:
        return
    cfg = _load_config(config_path, log)
    if cfg is None:
        # Without the config we do not know the state dir: DCGM stays to the watchdog of the next
        # hook that can read a config. Say so loudly.
        log.error("epilog cannot read the config: DCGM resume left to the watchdog")
        return
    log = log_mod.setup("epilog", job_id, node, cfg["paths"]["log_file"])
    state_dir = Path(cfg["paths"]["state_dir"]) / "jobs" / f"{job_id}@{node}"
    try:
        _seal_and_place(cfg, job_id, node, state_dir, log)
    finally:
        # whatever happened above, no collector of this job outlives its epilog
        stop_job_collectors(job_id, node, log)
        try:
            lock = DcgmLock(Path(cfg["paths"]["state_dir"]), cfg["dcgm"], log)
            result = lock.release(holder_name(job_id, node))
        except (OSError, GpuprofError) as e:
            log.error("DCGM lock: %s; resume left to the watchdog", getattr(e, "strerror", None) or e)
        else:
            log.info("DCGM lock released; %d holder(s) left, action %s (%s)", len(result.holders), result.action,
                     result.dcgmi)
            _watchdog(lock, log, cfg, node, job_id)
        if state_dir.is_dir() and not state_dir.is_symlink():
            shutil.rmtree(state_dir, ignore_errors=True)
        _remove_ring_dir(job_id, node, log)
        _remove_task_plan(job_id, node, log)
    # after the DCGM lock is handed back: on the job's first node, the merge job (slurm_hooks/automerge.py)
    from gpuprof.slurm_hooks.automerge import from_node_epilog

    from_node_epilog(cfg, job_id, node, log)


def _remove_ring_dir(job_id: str, node: str, log: logging.Logger) -> None:
    """The fast path's per-job directory, with whatever the job left in it (the collector removes
    the rings it read; one that died cannot). Removed as root without following any symlink, and
    only /dev/shm/gpuprof-<job>@<node> itself (paths.remove_job_dir)."""
    from gpuprof.collector.fastpath_env import job_ring_dir

    try:
        path = job_ring_dir(job_id, node)
        if remove_job_dir(path):
            log.info("removed fast-path ring directory %s", path)
    except (ValueError, PlacementError) as e:
        log.warning("fast-path ring directory: %s", e)


PROBLEM_NOTE = "{node}.problem.txt"  # next to the node files: why this node's file is missing or partial
RECOVER_PREFIX = "gpuprof-recover-"  # a private temporary directory, when the state directory is full


def _load_state(state_dir: Path, job_id: str, node: str, problems: list[str],
                log: logging.Logger) -> NodeJobState | None:
    """The prolog's state.json; when it is missing or unreadable (a full state directory), what
    the fixed paths and a running collector still tell (None: nothing was started here)."""
    state_file = state_dir / "state.json"
    try:
        return NodeJobState(**json.loads(state_file.read_text()))
    except FileNotFoundError:
        why = f"no prolog state at {state_file}"
    except (json.JSONDecodeError, TypeError, OSError) as e:
        why = f"prolog state {state_file} unreadable: {e}"
    why += _fs_full_note(state_dir.parent if not state_dir.is_dir() else state_dir)
    trace, socket = state_dir / f"{node}.h5", state_dir / "control.sock"
    pids = collector_pids(job_id, node)
    if not pids and not trace.exists():
        log.error("%s: nothing was recorded on this node", why)
        problems.append(f"{why}: nothing was recorded on this node")
        return None
    log.error("%s; using the collector's fixed paths (%s, %s), collector pids %s", why, trace, socket, pids)
    problems.append(why)
    return NodeJobState(job_id, node, [], -1, -1, pids[0] if pids else None, str(trace), str(socket), 0.0,
                        bool(pids), "unknown")


def _seal_and_place(cfg: dict[str, Any], job_id: str, node: str, state_dir: Path, log: logging.Logger) -> None:
    problems: list[str] = []
    placed: Path | None = None
    try:
        placed = _seal_and_recover(cfg, job_id, node, state_dir, problems, log)
    finally:
        if problems:
            _place_note(cfg, job_id, node, problems, placed, log)


def _seal_and_recover(cfg: dict[str, Any], job_id: str, node: str, state_dir: Path, problems: list[str],
                      log: logging.Logger) -> Path | None:
    from gpuprof.collector.control import request
    from gpuprof.collector.writer import is_sealed

    state = _load_state(state_dir, job_id, node, problems, log)
    if state is None:
        return None
    if state.problem:
        problems.append(f"prolog: {state.problem}")
    trace = Path(state.trace)
    if state.continuous_socket:
        return _from_continuous(cfg, state, trace, problems, log)
    sealed = False
    why = ""
    if state.collector_started and Path(state.socket).exists():
        try:
            reply = request(state.socket, "seal", timeout_s=float(cfg["hooks"]["seal_timeout_s"]))
            sealed = bool(reply.get("sealed"))
            if not sealed:
                why = f"collector failed: {reply.get('error', '?')}"
        except GpuprofError as e:
            log.error("collector did not seal %s: %s", trace, e)
            problems.append(f"collector did not answer the seal request: {e}")
    elif state.collector_started:
        problems.append(f"collector gone before the epilog (no control socket {state.socket})")
    if sealed:
        _stop_collector(state.collector_pid, log)
    else:
        # a collector that did not answer in time may still be sealing (a slow disk, a loaded node):
        # SIGTERM asks for the same seal; it gets the seal's budget once more before SIGKILL
        for pid in collector_pids(job_id, node):
            _terminate(pid, log, grace_s=float(cfg["hooks"]["seal_timeout_s"]))
    if not trace.exists():
        log.error("no trace file %s: the collector recorded nothing on this node", trace)
        problems.append(f"no node file: the collector recorded nothing on this node{_fs_full_note(state_dir)}")
        return None
    to_place: Path | None = trace
    if not sealed and is_sealed(trace):
        # sealed after all: by SIGTERM just now, or by itself before the epilog came (it stops when
        # Slurm says the job is over), which left no socket to answer
        log.warning("collector sealed %s without answering the epilog", trace)
        problems.append("the collector sealed its node file without answering the epilog's seal request; "
                        "the file is complete")
        sealed = True
    if not sealed:
        _quote_collector_log(state_dir / "collector.log", log)
        to_place = _recover(trace, state_dir, node, why, problems, log)
    if to_place is None:
        return None
    try:
        return _place_node_file(cfg, job_id, node, to_place, problems, log)
    finally:
        if to_place.parent.name.startswith(RECOVER_PREFIX):
            shutil.rmtree(to_place.parent, ignore_errors=True)


def _quote_collector_log(path: Path, log: logging.Logger, lines: int = 30) -> None:
    """The end of a collector's own log (its stderr: a Python traceback, faulthandler's stacks of a
    crash) into the hooks' log before the state directory goes: why it did not seal."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError as e:
        log.warning("collector log %s: %s", path, e.strerror)
        return
    if tail:
        log.error("the collector's log ends with:\n%s", "\n".join(f"    {line}" for line in tail))


def _from_continuous(cfg: dict[str, Any], state: NodeJobState, trace: Path, problems: list[str],
                     log: logging.Logger) -> Path | None:
    """The job's node file from the continuous collector (its processes from the prolog on), placed
    like a job collector's."""
    from gpuprof.collector.continuous import end_job

    try:
        # bounded like a job collector's seal (a 10-minute retention exports in about 2 s: docs/continuous.md)
        end_job(state.continuous_socket, state.job_id, trace, nodelist=env.get(env.SLURM_JOB_NODELIST) or "",
                timeout_s=float(cfg["hooks"]["seal_timeout_s"]))
    except (CollectorError, OSError) as e:
        log.error("continuous collector at %s: %s", state.continuous_socket, e)
        problems.append(f"the node's continuous collector did not write the job's node file: {e}")
        return None
    log.info("continuous collector wrote %s", trace)
    return _place_node_file(cfg, state.job_id, state.node, trace, problems, log)


def _recover(trace: Path, state_dir: Path, node: str, why: str, problems: list[str],
             log: logging.Logger) -> Path | None:
    """An unsealed node file made whole (data up to its last flush) in the state directory, or,
    when that is full, in a private temporary directory; None when neither works."""
    from gpuprof.collector.writer import recover

    reason = f"{why}; data up to its last flush" if why else "collector died or did not seal; data up to its last flush"
    reason += _fs_full_note(state_dir)
    last: Exception | None = None
    for where in ("state", "tmp"):
        d = state_dir
        try:
            if where == "tmp":
                d = Path(tempfile.mkdtemp(prefix=RECOVER_PREFIX))  # root's own, mode 0700
            dst = d / f"{node}.recovered.h5"
            recover(trace, dst, reason)
        except (GpuprofError, OSError, RuntimeError) as e:
            last = e
            log.warning("cannot recover %s into %s: %s", trace, d, e)
            if where == "tmp":
                shutil.rmtree(d, ignore_errors=True)
            continue
        log.warning("recovered unsealed trace %s up to its last flush (%s)", trace, reason)
        problems.append(f"node file partial: {reason}")
        return dst
    log.error("cannot recover %s: %s", trace, last)
    problems.append(f"node file {trace.name} could not be recovered: {last}")
    return None


def _output_dirs(cfg: dict[str, Any], job_id: str, log: logging.Logger) -> tuple[JobInfo, list[Path]]:
    """Where the node files go: the template's directory next to the job's stdout, then (when the
    stdout directory is gone) the same name in the job's working directory."""
    job = _job_for_placement(job_id, log)
    dest = node_dir_for_stdout(job.stdout, cfg["hooks"]["output_dir_template"], work_dir=job.work_dir,
                               job_id=job_id, user=job.user)
    dirs = [dest]
    if job.work_dir:
        alt = Path(job.work_dir) / dest.name
        if alt != dest:
            dirs.append(alt)
    return job, dirs


def _place_node_file(cfg: dict[str, Any], job_id: str, node: str, src: Path, problems: list[str],
                     log: logging.Logger) -> Path | None:
    job, dirs = _output_dirs(cfg, job_id, log)
    errors = []
    for dest in dirs:
        try:
            placed = place_as_user(src, dest.parent, f"{node}.h5", uid=job.uid, gid=job.gid, subdir=dest.name)
        except GpuprofError as e:
            errors.append(str(e))
            log.error("%s", e)
            continue
        if dest != dirs[0]:
            problems.append(f"placed in {dest} (the job's working directory): {errors[0]}")
        log.info("node trace placed at %s", placed)
        return placed
    # the user's directories cannot take it (full, removed): keep it for root, say where
    kept = _keep_undelivered(cfg, job_id, node, src, log)
    problems.append(f"node file not delivered ({'; '.join(errors)})" + (f"; kept by root at {kept}" if kept else ""))
    return None


def _keep_undelivered(cfg: dict[str, Any], job_id: str, node: str, src: Path, log: logging.Logger) -> str:
    undelivered = Path(cfg["paths"]["state_dir"]) / "undelivered"
    dst = undelivered / f"{job_id}@{node}.h5"
    try:
        make_private_dir(undelivered)
        shutil.copyfile(src, dst, follow_symlinks=False)
    except (OSError, PlacementError) as e:
        log.error("node file %s lost: cannot keep it at %s either: %s", src, dst, getattr(e, "strerror", None) or e)
        with contextlib.suppress(OSError):
            dst.unlink()
        return ""
    log.warning("node file kept at %s (not delivered to the job's user)", dst)
    _trim_undelivered(undelivered, int(cfg["hooks"]["undelivered_max_mb"]) << 20, dst, log)
    return str(dst)


def _trim_undelivered(undelivered: Path, max_bytes: int, newest: Path, log: logging.Logger) -> None:
    """The node files root keeps for users they could not reach, held to hooks.undelivered_max_mb:
    the oldest removed first, the one just kept never (a node whose deliveries keep failing would
    otherwise fill the state directory the collectors write to)."""
    kept: list[tuple[int, int, Path]] = []
    try:
        with os.scandir(undelivered) as entries:
            for e in entries:
                if e.name.endswith(".h5") and e.is_file(follow_symlinks=False) and e.path != str(newest):
                    st = e.stat(follow_symlinks=False)
                    kept.append((st.st_mtime_ns, st.st_size, Path(e.path)))
        total = sum(size for _, size, _ in kept) + newest.stat().st_size
    except OSError as e:
        log.warning("undelivered node files in %s not trimmed: %s", undelivered, e.strerror or e)
        return
    for _, size, path in sorted(kept):
        if total <= max_bytes:
            break
        try:
            path.unlink()
        except OSError as e:
            log.warning("undelivered node file %s not removed: %s", path, e.strerror)
            continue
        total -= size
        log.warning("undelivered node file %s removed (%d MB): %s holds more than hooks.undelivered_max_mb",
                    path, size >> 20, undelivered)


def _place_note(cfg: dict[str, Any], job_id: str, node: str, problems: list[str], placed: Path | None,
                log: logging.Logger) -> None:
    """<node>.problem.txt next to the node files, written as the job's user: what went wrong on
    this node, so that a missing or partial node file is explained where the user looks."""
    text = f"gpuprof: job {job_id}, node {node}\n" + "".join(f"- {p}\n" for p in problems)
    for p in problems:
        log.warning("told the user: %s", p)
    try:
        job, dirs = _output_dirs(cfg, job_id, log)
    except GpuprofError as e:
        log.error("problem note not written: %s", e)
        return
    if placed is not None:
        dirs = [placed.parent] + [d for d in dirs if d != placed.parent]
    with tempfile.TemporaryDirectory(prefix="gpuprof-note-") as tmp:
        src = Path(tmp) / "note.txt"
        try:
            src.write_text(text)
        except OSError as e:
            log.error("problem note not written: %s", e.strerror)
            return
        for dest in dirs:
            try:
                place_as_user(src, dest.parent, PROBLEM_NOTE.format(node=node), uid=job.uid, gid=job.gid,
                              subdir=dest.name)
                return
            except GpuprofError as e:
                log.error("problem note: %s", e)


def _job_for_placement(job_id: str, log: logging.Logger) -> JobInfo:
    """Slurm's view (expanded StdOut) when it answers, else the hook environment's."""
    try:
        return job_source().lookup(job_id)
    except JobLookupError as e:
        log.warning("job lookup through Slurm failed (%s); using the hook environment", e)
        return from_hook_environment()


def _process_alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped by init) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _stop_collector(pid: int | None, log: logging.Logger) -> None:
    if pid is None:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not _process_alive(pid):
            return
        time.sleep(0.02)
    log.warning("collector pid %d still running after seal: killing it", pid)
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


