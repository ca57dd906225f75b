"""The per-host DCGM lock: paused exactly while at least one profiled job runs, checked through the
calls a stand-in dcgmi (tests/doubles/fake_dcgmi) records."""

import itertools
import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from gpuprof.collector.config import defaults
from gpuprof.slurm_hooks.dcgm_lock import SITE_HOLDER, DcgmLock, holder_name

FAKE = str(Path(__file__).parent / "doubles" / "fake_dcgmi")
LOG = logging.getLogger("test-dcgm")


def make_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dcgmi: str = FAKE) -> tuple[DcgmLock, Path]:
    calls = tmp_path / "dcgmi.calls"
    monkeypatch.setenv("FAKE_DCGMI_LOG", str(calls))
    cfg = dict(defaults()["dcgm"], dcgmi=dcgmi)
    return DcgmLock(tmp_path / "state", cfg, LOG), calls


def calls_of(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def test_two_jobs_interleaved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    a, b = holder_name("1", "node1"), holder_name("2", "node1")
    assert lock.acquire(a, {"job": "1"}).action == "pause"
    assert lock.acquire(b, {"job": "2"}).action == "none"
    assert lock.release(a).action == "none"  # job 2 still runs: stay paused
    assert lock.release(a).action == "none"  # a repeated epilog must not resume early
    assert lock.release(b).action == "resume"
    assert calls_of(calls) == ["profile --pause", "profile --resume"]


def _prolog_epilog(args: tuple[str, str, str]) -> None:
    state, job, log = args
    import os
    import time

    os.environ["FAKE_DCGMI_LOG"] = log
    cfg = dict(defaults()["dcgm"], dcgmi=FAKE)
    lock = DcgmLock(Path(state), cfg, logging.getLogger("p"))
    lock.acquire(holder_name(job, "node1"), {"job": job})
    time.sleep(0.01)
    lock.release(holder_name(job, "node1"))


def test_concurrent_prologs_and_epilogs_balance(tmp_path: Path) -> None:
    calls = tmp_path / "dcgmi.calls"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(_prolog_epilog, [(str(tmp_path / "state"), str(j), str(calls)) for j in range(24)])
    seq = calls_of(calls)
    # Pauses and resumes alternate, start with a pause and end with a resume: never two pauses in a row.
    assert seq and seq[0] == "profile --pause" and seq[-1] == "profile --resume"
    assert all(x != y for x, y in itertools.pairwise(seq))


def test_site_pause_is_never_resumed_by_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    assert lock.acquire(SITE_HOLDER, {"by": "site"}).action == "pause"
    lock.acquire(holder_name("7", "n"), {"job": "7"})
    assert lock.release(holder_name("7", "n")).action == "none"
    assert calls_of(calls) == ["profile --pause"]
    assert lock.release(SITE_HOLDER).action == "resume"


def test_watchdog_resumes_when_holder_job_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    lock.acquire(holder_name("5", "node2"), {"job": "5"})
    lock.acquire(holder_name("6", "node2"), {"job": "6"})

    def running(holder: str, info: dict[str, Any]) -> bool:
        return info["job"] == "6"

    gone, r = lock.watchdog(running)
    assert gone == [holder_name("5", "node2")] and r.action == "none"
    gone, r = lock.watchdog(lambda h, i: False)
    assert gone == [holder_name("6", "node2")] and r.action == "resume"
    assert calls_of(calls) == ["profile --pause", "profile --resume"]


def test_dcgm_absent_keeps_count_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, _ = make_lock(tmp_path, monkeypatch, dcgmi=str(tmp_path / "no-dcgmi"))
    r = lock.acquire(holder_name("1", "n"), {"job": "1"})
    assert (r.action, r.dcgmi) == ("pause", "absent")
    assert lock.release(holder_name("1", "n")).dcgmi == "absent"


def test_dcgmi_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_DCGMI_FAIL", "1")
    r = lock.acquire(holder_name("1", "n"), {"job": "1"})
    assert r.dcgmi.startswith("failed: exit 255")
    monkeypatch.delenv("FAKE_DCGMI_FAIL")
    # the resume is still attempted on release: a failed pause must not leave DCGM paused
    assert lock.release(holder_name("1", "n")).action == "resume"
    assert calls_of(calls) == ["profile --pause", "profile --resume"]


def test_damaged_holder_file_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    lock.acquire(holder_name("1", "n"), {"job": "1"})
    lock.state_file.write_text("{not json")
    # A damaged count must never keep DCGM paused: the next watchdog run resumes.
    _, r = lock.watchdog(lambda h, i: True)
    assert r.action == "resume"
    assert calls_of(calls) == ["profile --pause", "profile --resume"]


def test_failed_resume_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, calls = make_lock(tmp_path, monkeypatch)
    lock.acquire(holder_name("1", "n"), {"job": "1"})
    monkeypatch.setenv("FAKE_DCGMI_FAIL", "1")
    assert lock.release(holder_name("1", "n")).dcgmi.startswith("failed")
    monkeypatch.delenv("FAKE_DCGMI_FAIL")
    assert lock.watchdog(lambda h, i: True)[1].action == "resume"
    assert lock.watchdog(lambda h, i: True)[1].action == "none"
    assert calls_of(calls) == ["profile --pause", "profile --resume", "profile --resume"]


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="needs root (mounts a tmpfs)")
def test_full_disk_never_leaves_a_pause_unrecorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full state directory: a pause that cannot be recorded is not made (DcgmStateError, no
    dcgmi call), and the last release still resumes and records it (the holder file rewritten in
    place: a second file does not fit)."""
    import subprocess

    from gpuprof.slurm_hooks.dcgm_lock import DcgmStateError

    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "gpuprof-test", str(state)], check=True)
    try:
        lock, calls = make_lock(tmp_path, monkeypatch)
        a, b = holder_name("1", "node1"), holder_name("2", "node1")

        def fill() -> None:
            subprocess.run(["dd", "if=/dev/zero", f"of={state}/filler", "bs=4k"], capture_output=True, check=False)

        fill()
        with pytest.raises(DcgmStateError, match="holders.json"):
            lock.acquire(a, {"job": "1"})
        assert calls_of(calls) == []  # not paused: no pause without its record
        (state / "filler").unlink()
        assert lock.acquire(a, {"job": "1"}).action == "pause"
        fill()
        assert lock.acquire(b, {"job": "2"}).action == "none"  # fits in the holder file's own page
        assert lock.release(a).action == "none"
        assert lock.release(b).action == "resume"
        assert lock.holders() == {}
        assert calls_of(calls) == ["profile --pause", "profile --resume"]
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
