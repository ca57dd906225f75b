"""The DCGM profiling lock, reference-counted per host.

DCGM's profiling pause is one host-wide switch with no timeout, and profilers (ours, Nsight Compute,
DCGM's own profiling metrics) cannot share the GPU's performance counters. So the suite keeps a set
of holders on this host, (job, node) pairs plus an optional "site" holder, in a JSON file under an
flock, and calls `dcgmi profile --pause` when the set goes from empty to non-empty and
`dcgmi profile --resume` when it becomes empty again. Several virtual Slurm nodes on one host share
the one set, as they share the GPUs' switch.

- Interleaved prologs/epilogs of jobs sharing a node: the flock serializes them; acquire and release
  are idempotent per holder, so a repeated epilog cannot resume early.
- A site that pauses DCGM itself registers with `gpuprof dcgm site-pause`; while that holder is in
  the set the suite never resumes.
- The watchdog (`gpuprof dcgm watchdog`, also run by every prolog and epilog) drops holders whose
  job no longer runs on that node (slurmd restarted, epilog never ran) and resumes when none remain.
- DCGM absent (dcgmi not found): the count is kept, the calls are skipped and that is logged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector.errors import GpuprofError
from gpuprof.slurm_hooks.paths import make_private_dir

SITE_HOLDER = "site"


class DcgmStateError(GpuprofError):
    """The holder file cannot be written (the message names it); DCGM was left as it was."""


@dataclass
class DcgmResult:
    action: str  # "pause", "resume" or "none"
    holders: list[str]
    dcgmi: str  # what happened to the dcgmi call: "ok", "absent", "failed: ...", "skipped"


class DcgmLock:
    def __init__(self, state_dir: Path, dcgm_config: dict[str, Any], log: logging.Logger) -> None:
        self.dir = make_private_dir(state_dir / "dcgm")
        self.state_file = self.dir / "holders.json"
        self.lock_file = self.dir / "lock"
        self.calls_log = self.dir / "calls.log"
        self.cfg = dcgm_config
        self.log = log
        self._saved = ""  # the holder file's content as last read or written

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = self._read()
            self._saved = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != self._saved:
                self._save(state)
        finally:
            os.close(fd)  # closing releases the flock

    def _save(self, state: dict[str, Any]) -> None:
        """Replace the holder file atomically; DcgmStateError (naming the file) when it cannot be
        written (a full disk): the previous file stays whole."""
        text = json.dumps(state, sort_keys=True)
        data = json.dumps(state, sort_keys=True, indent=1).encode()
        tmp = self.state_file.with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.state_file)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._rewrite_in_place(data):
                raise DcgmStateError(f"cannot write the DCGM holder file {self.state_file}: {e.strerror}") from None
        self._saved = text

    def _rewrite_in_place(self, data: bytes) -> bool:
        """On a full disk a second file does not fit but the holder file's own pages do (a release
        only shrinks it): rewrite it in place, under the flock. Not atomic; a torn file reads as
        damaged, which resumes DCGM (_read), the safe side."""
        try:
            fd = os.open(self.state_file, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return os.write(fd, data) == len(data)
        except OSError:
            return False
        finally:
            os.close(fd)

    def _read(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {"holders": {}, "paused_by_us": False}
        except (json.JSONDecodeError, OSError) as e:
            # A damaged count must not keep DCGM paused forever: start from the processes we can see.
            self.log.error("DCGM holder file %s unreadable (%s); starting from an empty set", self.state_file, e)
            return {"holders": {}, "paused_by_us": True}
        if not isinstance(state.get("holders"), dict):
            self.log.error("DCGM holder file %s has no 'holders' table; starting from an empty set", self.state_file)
            return {"holders": {}, "paused_by_us": True}
        return state

    def _dcgmi(self, verb: str) -> str:
        if not self.cfg["enabled"]:
            return "skipped (dcgm.enabled = false)"
        exe = self.cfg["dcgmi"]
        args = [exe, "profile", f"--{verb}"]
        with open(self.calls_log, "a") as f:
            f.write(f"{time.time():.6f} {verb}\n")
        try:
            p = subprocess.run(args, capture_output=True, text=True, check=False, timeout=float(self.cfg["timeout_s"]))
        except FileNotFoundError:
            self.log.info("DCGM not installed (%s not found): profiling lock not %sd", exe, verb)
            return "absent"
        except subprocess.TimeoutExpired:
            self.log.error("%s timed out after %s s", " ".join(args), self.cfg["timeout_s"])
            return f"failed: timeout after {self.cfg['timeout_s']} s"
        except OSError as e:
            self.log.error("%s cannot run: %s", " ".join(args), e.strerror)
            return f"failed: {e.strerror}"
        if p.returncode != 0:
            msg = (p.stderr or p.stdout).strip()[:200]
            self.log.error("%s exited %d: %s", " ".join(args), p.returncode, msg)
            return f"failed: exit {p.returncode}: {msg}"
        return "ok"

    def _transition(self, state: dict[str, Any]) -> DcgmResult:
        """Bring DCGM to what the holder set wants: paused while it is non-empty."""
        held = bool(state["holders"])
        holders = sorted(state["holders"])
        paused = state.get("paused_by_us", False)
        if held and not paused:
            outcome = self._dcgmi("pause")
            # Remember the pause as ours even if dcgmi failed: a later resume is harmless.
            state["paused_by_us"] = True
            return DcgmResult("pause", holders, outcome)
        if not held and paused:
            outcome = self._dcgmi("resume")
            # A failed resume is retried by the next hook or watchdog run.
            state["paused_by_us"] = outcome.startswith("failed")
            return DcgmResult("resume", holders, outcome)
        return DcgmResult("none", holders, "skipped")

    def acquire(self, holder: str, info: dict[str, Any]) -> DcgmResult:
        """Add the holder; pause DCGM when it is the first. The holder (and the pause, as an intent)
        is recorded before dcgmi is called: a pause that could not be recorded is never made, so
        no pause outlives its record (raises DcgmStateError then, nothing changed)."""
        with self._locked() as state:
            state["holders"][holder] = dict(info, since=time.time())
            pause = not state.get("paused_by_us", False)
            if pause:
                state["paused_by_us"] = True  # a later resume of a pause that failed is harmless
            self._save(state)
            if pause:
                return DcgmResult("pause", sorted(state["holders"]), self._dcgmi("pause"))
            return DcgmResult("none", sorted(state["holders"]), "skipped")

    def release(self, holder: str) -> DcgmResult:
        with self._locked() as state:
            state["holders"].pop(holder, None)
            return self._transition(state)

    def watchdog(self, still_running: Callable[[str, dict[str, Any]], bool]) -> tuple[list[str], DcgmResult]:
        """Drop holders whose job is gone; resume when none is left. `still_running(holder, info)`
        must answer True when in doubt (Slurm unreachable): only a definite 'gone' drops a holder."""
        with self._locked() as state:
            gone = [h for h, info in state["holders"].items() if h != SITE_HOLDER and not still_running(h, info)]
            for h in gone:
                self.log.warning("DCGM holder %s is gone (job ended without epilog?): dropping it", h)
                del state["holders"][h]
            return gone, self._transition(state)

    def holders(self) -> dict[str, Any]:
        with self._locked() as state:
            return dict(state["holders"])


def holder_name(job_id: str, node: str) -> str:
    return f"job:{job_id}@{node}"
