"""Prolog, epilog and task prolog: plain functions; gpuprof.slurm_hooks.commands wraps them for the CLI.

Rules every hook keeps (ARCHITECTURE.md, decision 5):
- it returns normally whatever happens: a failing Prolog or Epilog drains the node. Errors are
  logged with the job id and node, never raised to Slurm;
- the DCGM lock taken by the prolog is released by the epilog even when everything else failed;
- a job that did not ask for profiling is turned away by the thin etc/ wrapper before Python starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment as env
from gpuprof.collector.errors import GpuprofError, JobLookupError
from gpuprof.collector.schema import parse_modes
from gpuprof.slurm_hooks import log as log_mod
from gpuprof.slurm_hooks.dcgm_lock import DcgmLock, holder_name
from gpuprof.slurm_hooks.job import JobInfo, from_hook_environment, job_source
from gpuprof.slurm_hooks.paths import (
    PlacementError,
    make_job_dir,
    make_private_dir,
    node_dir_for_stdout,
    place_as_user,
    remove_job_dir,
)

# Job states in which a job still holds its nodes (scontrol's JobState, flags stripped).
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING",
               "REQUEUED", "SIGNALING", "STAGE_OUT"}


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
    state_dir = _job_node_dir(cfg, job_id, node)
    lock = DcgmLock(Path(cfg["paths"]["state_dir"]), cfg["dcgm"], log)
    _watchdog(lock, log)
    dcgm = lock.acquire(holder_name(job_id, node), {"job": job_id, "node": node})
    log.info("DCGM lock held by %d holder(s), action %s (%s)", len(dcgm.holders), dcgm.action, dcgm.dcgmi)

    ring_dir = _make_ring_dir(job_id, node, modes, job, log)
    trace = state_dir / f"{node}.h5"
    socket = state_dir / "control.sock"
    python = cfg["hooks"]["collector_python"] or sys.executable
    cmd = collector_command(config_path or env.get(env.GPUPROF_CONFIG), job, node, modes, trace, socket, python)
    state = NodeJobState(job_id, node, list(modes), job.uid, job.gid, None, str(trace), str(socket), time.time(),
                         False, dcgm.dcgmi, ring_dir=str(ring_dir or ""))
    try:
        started = time.monotonic()
        proc = _start_collector(cmd, int(cfg["hooks"]["collector_nice"]), state_dir / "collector.log")
    except OSError as e:
        log.error("collector cannot start (%s): %s; the job runs unprofiled", cmd[0], e.strerror)
    else:
        state.collector_pid = proc.pid
        attach_budget = float(cfg["hooks"]["attach_timeout_s"])
        why_not, late = _wait_recording(socket, proc, float(cfg["hooks"]["collector_ready_timeout_s"]),
                                        started + attach_budget)
        state.collector_started = not why_not
        state.attached = not why_not and not late
        state.late_sources = late
        if why_not:
            log.error("%s; see %s", why_not, state_dir / "collector.log")
        else:
            log.info("collector pid %d recording to %s (modes %s)", proc.pid, trace, ",".join(modes))
        if late:
            # The job starts anyway; the collector marks these in the node file (attach_json).
            log.warning("sources %s not attached within hooks.attach_timeout_s = %s s: the job starts and "
                        "they are marked late in the node file", ",".join(late), attach_budget)
    (state_dir / "state.json").write_text(json.dumps(asdict(state), indent=1))


def _make_ring_dir(job_id: str, node: str, modes: tuple[str, ...], job: JobInfo,
                   log: logging.Logger) -> Path | None:
    """The fast path's per-job directory, made by root for the job's uid (mode 0700) before any of
    the job's processes run (docs/probes.md, "Who may write a ring"); None without mode collectives."""
    if "collectives" not in modes:
        return None
    from gpuprof.collector.sources.fastpath import job_ring_dir

    try:
        path = job_ring_dir(job_id, node)
        make_job_dir(path, job.uid, job.gid)
    except (ValueError, PlacementError) as e:
        log.error("fast-path ring directory: %s; the fast path records nothing for this job", e)
        return None
    return path


def job_still_running(holder: str, info: dict[str, Any]) -> bool:
    """For the DCGM watchdog: False only when Slurm says definitely that the job is gone."""
    job_id = str(info.get("job", ""))
    try:
        job = job_source().lookup(job_id)
    except JobLookupError as e:
        return "Invalid job id" not in str(e)
    return job.state.split()[0] in LIVE_STATES


def _watchdog(lock: DcgmLock, log: logging.Logger) -> None:
    gone, result = lock.watchdog(job_still_running)
    if gone:
        log.warning("watchdog dropped stale DCGM holders %s; action %s (%s)", gone, result.action, result.dcgmi)


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
    lock = DcgmLock(Path(cfg["paths"]["state_dir"]), cfg["dcgm"], log)
    state_dir = Path(cfg["paths"]["state_dir"]) / "jobs" / f"{job_id}@{node}"
    try:
        _seal_and_place(cfg, job_id, node, state_dir, log)
    finally:
        result = lock.release(holder_name(job_id, node))
        log.info("DCGM lock released; %d holder(s) left, action %s (%s)", len(result.holders), result.action,
                 result.dcgmi)
        _watchdog(lock, log)
        if state_dir.is_dir() and not state_dir.is_symlink():
            shutil.rmtree(state_dir, ignore_errors=True)
        _remove_ring_dir(job_id, node, log)
    # after the DCGM lock is handed back: on the job's first node, the merge job (slurm_hooks/automerge.py)
    from gpuprof.slurm_hooks.automerge import from_node_epilog

    from_node_epilog(cfg, job_id, node, log)


def _remove_ring_dir(job_id: str, node: str, log: logging.Logger) -> None:
    """The fast path's per-job directory, with whatever the job left in it (the collector removes
    the rings it read; one that died cannot). Removed as root without following any symlink, and
    only /dev/shm/gpuprof-<job>@<node> itself (paths.remove_job_dir)."""
    from gpuprof.collector.sources.fastpath import job_ring_dir

    try:
        path = job_ring_dir(job_id, node)
        if remove_job_dir(path):
            log.info("removed fast-path ring directory %s", path)
    except (ValueError, PlacementError) as e:
        log.warning("fast-path ring directory: %s", e)


def _seal_and_place(cfg: dict[str, Any], job_id: str, node: str, state_dir: Path, log: logging.Logger) -> None:
    from gpuprof.collector.control import request
    from gpuprof.collector.writer import recover

    state_file = state_dir / "state.json"
    try:
        state = NodeJobState(**json.loads(state_file.read_text()))
    except FileNotFoundError:
        log.error("no prolog state at %s: nothing was recorded on this node", state_file)
        return
    except (json.JSONDecodeError, TypeError) as e:
        log.error("prolog state %s unreadable: %s", state_file, e)
        return
    trace = Path(state.trace)
    to_place = trace
    sealed = False
    if state.collector_started:
        try:
            reply = request(state.socket, "seal", timeout_s=float(cfg["hooks"]["seal_timeout_s"]))
            sealed = bool(reply.get("sealed"))
        except GpuprofError as e:
            log.error("collector did not seal %s: %s", trace, e)
    _stop_collector(state.collector_pid, log)
    if not trace.exists():
        log.error("no trace file %s: the collector recorded nothing on this node", trace)
        return
    if not sealed:
        to_place = state_dir / f"{node}.recovered.h5"
        try:
            recover(trace, to_place, "collector died or did not seal; data up to its last flush")
            log.warning("recovered unsealed trace %s up to its last flush", trace)
        except GpuprofError as e:
            log.error("cannot recover %s: %s", trace, e)
            return
    job = _job_for_placement(job_id, log)
    dest = node_dir_for_stdout(job.stdout, cfg["hooks"]["output_dir_template"], work_dir=job.work_dir,
                               job_id=job_id, user=job.user)
    try:
        placed = place_as_user(to_place, dest.parent, f"{node}.h5", uid=job.uid, gid=job.gid, subdir=dest.name)
    except GpuprofError as e:
        log.error("%s", e)
        return
    log.info("node trace placed at %s", placed)


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


def task_prolog_lines(raw_modes: str | None, cfg: dict[str, Any]) -> list[str]:
    """The `export` lines the job's modes need (none when profiling was not asked for)."""
    if raw_modes is None:
        return []
    modes = parse_modes(raw_modes)
    lines = [f"export {env.GPUPROF_MODES}={','.join(modes)}"]
    if "collectives" in modes:
        try:
            from gpuprof.collector.sources.fastpath import fastpath_exports
        except ImportError:
            return lines
        lines += fastpath_exports(modes, cfg)
    return lines


def task_prolog(config_path: str | None = None) -> int:
    job_id, node = _hook_context()
    log = log_mod.setup("task-prolog", job_id, node)
    raw = env.profile_modes_job()
    try:
        cfg = config_mod.load(config_path)
        for line in task_prolog_lines(raw, cfg):
            print(line)
    except (GpuprofError, ValueError) as e:
        log.error("task prolog: %s; no exports", e)
    return 0
