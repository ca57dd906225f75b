"""What a hostile local user can and cannot do to a profiled job and to the root collector.

- fast-path rings: another user's file or a symlink at a ring's name, a ring written by a process
  outside the job, a ring directory others can write into: refused and counted, never read; an
  interposer that finds its ring's name taken uses another one or leaves a `.failed` note that the
  collector counts;
- /tmp/perf-PID.map and the ELF files of job processes, read as root: a symlink to a root-only
  file, a FIFO, a huge sparse file, a file of another user are never read and never block;
- the fast path's per-job directory: made as root for the job's user (0700) whatever was planted
  at its name, removed without following a symlink;
- the control socket refuses a directory others can write into; `doctor` names an install
  others can write;
- a deliberately slow attach (collector.test_slow_attach_s): the prolog's wait and the late marks.

Cross-user cases use the unprivileged user gpuprof-test (tests run as root).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "progs"))

from harness import (
    REPO,
    GatedProcess,
    bpf_skip_reason,
    collect,
    make_ctx,
    mpi_skip_reason,
    own_cgroup_dir,
    python,
    ring_bytes,
)

from gpuprof.collector import config as config_mod
from gpuprof.collector import fastpath_env as fe
from gpuprof.collector import schema
from gpuprof.collector.bpf_support import _parse_elf, dynamic_functions
from gpuprof.collector.cli import format_summary
from gpuprof.collector.control import ControlServer
from gpuprof.collector.daemon import Collector, CollectorOptions
from gpuprof.collector.errors import CollectorError
from gpuprof.collector.reader import open_node_trace, summarize
from gpuprof.collector.safeio import UnsafeFile, read_user_file
from gpuprof.collector.sources import fastpath as fp
from gpuprof.collector.sources.base import Batch, Source, SourceContext
from gpuprof.collector.sources.clock import ClockSource
from gpuprof.collector.symbolize import read_perf_map
from gpuprof.slurm_hooks import doctor, hooks
from gpuprof.slurm_hooks.paths import PlacementError, make_job_dir, remove_job_dir

TEST_USER = "gpuprof-test"
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another user, chown)")
FASTPATH = {"sources.collectives": {"mpi_path": "fastpath", "nccl_path": "fastpath"}}


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        pytest.skip(f"user {TEST_USER} missing: run `make setup`")


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    proc = subprocess.run(["make", "-C", str(REPO / "bpf" / "fastpath")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return {k: v for k, v in fe.built_libraries().items() if v}


@pytest.fixture
def ring_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    return d


def as_user(user: pwd.struct_passwd, fn: Any, *args: Any) -> None:
    """Run fn(*args) in a child that dropped root to user (as a hostile user would)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"{fn.__name__} as {user.pw_name} failed"


def source_over(ring_dir: Path, pids: set[int], job: str = "99", uid: int | None = 0,
                errors: list[str] | None = None, grace_s: float = 0.0,
                gone: set[int] | None = None, cgroups: tuple[str, ...] = ()) -> fp.FastpathSource:
    """gone: pids the tracker saw in the job and that have ended since (its recent_pids);
    cgroups: the job's cgroup directories."""
    ctx = make_ctx(lambda: frozenset(pids), ("collectives",), errors=errors, config=FASTPATH, job_id=job)
    ctx.cgroup_dirs = lambda: cgroups
    ctx.recent_pids = lambda: frozenset(pids | (gone or set()))
    ctx.uid = uid
    src = fp.FastpathSource(ring_dir=str(ring_dir))
    src.pid_grace_s = grace_s
    src.start(ctx)
    return src


# --- rings ---------------------------------------------------------------------------------------
@root
def test_ring_of_another_user_is_refused_and_counted(built: dict[str, Path], ring_dir: Path,
                                                     user: pwd.struct_passwd,
                                                     sleeper: subprocess.Popen[bytes]) -> None:
    """A ring file owned by another uid (written by a job process's pid, valid header) is not read."""
    name = f"gpuprof-99-{sleeper.pid}"
    (ring_dir / name).write_bytes(ring_bytes(sleeper.pid))
    os.chown(ring_dir / name, user.pw_uid, user.pw_gid)
    errors: list[str] = []
    src = source_over(ring_dir, {sleeper.pid}, errors=errors)
    try:
        src.sample(0)
        assert not src.rings
        s = src.summary()
        assert s["refused"] == 1 and f"owned by uid {user.pw_uid}" in s["refused_detail"][0]
        assert any(name in e and "refused" in e for e in errors), errors
    finally:
        src.stop()


def test_symlink_at_a_ring_name_is_refused_and_counted(built: dict[str, Path], ring_dir: Path,
                                                       sleeper: subprocess.Popen[bytes]) -> None:
    target = ring_dir.parent / "victim"
    target.write_bytes(ring_bytes(sleeper.pid))
    os.symlink(target, ring_dir / f"gpuprof-99-{sleeper.pid}")
    errors: list[str] = []
    src = source_over(ring_dir, {sleeper.pid}, errors=errors)
    try:
        src.sample(0)
        assert not src.rings and src.summary()["refused"] == 1
        assert "symlink" in src.summary()["refused_detail"][0]
    finally:
        src.stop()
    assert target.exists(), "the link's target is never touched"


def test_ring_written_by_a_foreign_pid_is_refused(built: dict[str, Path], ring_dir: Path,
                                                  sleeper: subprocess.Popen[bytes]) -> None:
    """Right owner, valid ring, but its writer is not a process of the job (nor a child of one)."""
    job_proc = subprocess.Popen(["sleep", "60"])
    try:
        (ring_dir / f"gpuprof-99-{sleeper.pid}").write_bytes(ring_bytes(sleeper.pid))
        # a header that names a job pid in a file named after another pid: refused as well
        (ring_dir / f"gpuprof-99-{sleeper.pid}.1").write_bytes(ring_bytes(job_proc.pid))
        (ring_dir / f"gpuprof-99-{job_proc.pid}").write_bytes(ring_bytes(job_proc.pid))  # the good one
        src = source_over(ring_dir, {job_proc.pid}, uid=os.geteuid())
        try:
            src.sample(0)
            assert list(src.rings) == [f"gpuprof-99-{job_proc.pid}"]
            detail = " | ".join(src.summary()["refused_detail"])
            assert src.summary()["refused"] == 2, detail
            assert f"writer pid {sleeper.pid} is not a process of the job" in detail
            assert f"header names pid {job_proc.pid}" in detail
        finally:
            src.stop()
    finally:
        job_proc.kill()
        job_proc.wait()


def test_foreign_pid_gets_a_grace_period_then_is_refused(built: dict[str, Path], ring_dir: Path,
                                                         sleeper: subprocess.Popen[bytes]) -> None:
    """The tracker picks up new processes once a second: a ring of a pid not (yet) in the job is
    kept pending, and refused once the grace period is over."""
    (ring_dir / f"gpuprof-99-{sleeper.pid}").write_bytes(ring_bytes(sleeper.pid))
    src = source_over(ring_dir, set(), grace_s=0.5)
    try:
        src.sample(0)
        assert src.pending and not src.refused
        time.sleep(0.6)
        src.sample(0)
        assert not src.pending and len(src.refused) == 1
    finally:
        src.stop()


def test_ring_of_a_writer_gone_before_the_drain_saw_it_is_read(built: dict[str, Path], ring_dir: Path) -> None:
    """A process that came and went between two drains was seen by the tracker only: its ring is
    read after it ended (checked against the tracker's recent pids, not its current ones)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    name = f"gpuprof-99-{gone.pid}"
    (ring_dir / name).write_bytes(ring_bytes(gone.pid))
    src = source_over(ring_dir, set(), gone={gone.pid})
    try:
        src.sample(0)
        assert list(src.rings) == [name] and not src.refused, src.summary()["refused_detail"]
    finally:
        src.stop()


def test_ring_of_a_writer_in_the_job_cgroup_is_read_before_the_tracker_saw_it(
        built: dict[str, Path], ring_dir: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """A process shorter than the tracker's scan interval is in no pid set; it is in the job's
    cgroup while it lives, and the ring watch drains as soon as its ring appears."""
    name = f"gpuprof-99-{sleeper.pid}"
    (ring_dir / name).write_bytes(ring_bytes(sleeper.pid))
    mine = own_cgroup_dir()
    if mine is None:
        pytest.skip("this process is in no cgroup but the roots")
    src = source_over(ring_dir, set(), cgroups=(mine,))  # the sleeper is in ours: our child
    try:
        src.sample(0)
        assert list(src.rings) == [name] and not src.refused, src.summary()["refused_detail"]
    finally:
        src.stop()


@root
def test_ring_directory_others_can_write_is_refused(built: dict[str, Path], tmp_path: Path,
                                                    user: pwd.struct_passwd) -> None:
    open_dir = tmp_path / "world"
    open_dir.mkdir()
    open_dir.chmod(0o1777)  # like /dev/shm itself
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, user.pw_uid, user.pw_gid)
    for d, why in ((open_dir, "writable by others"), (foreign, f"owned by uid {user.pw_uid}")):
        errors: list[str] = []
        src = source_over(d, set(), errors=errors)
        try:
            src.sample(0)
            assert why in src.summary()["dir_problem"], src.summary()
            assert len(errors) == 1, errors  # reported once, not at every scan
        finally:
            src.stop()
    missing = tmp_path / "missing"
    src = source_over(missing, set())
    assert "missing" in src.summary()["dir_problem"]
    src.stop()


def singleton_mpi(env: dict[str, str]) -> GatedProcess:
    """One MPI process (Open MPI singleton: its pid is the python's) making two collectives."""
    code = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); MPI.COMM_WORLD.allreduce(1)"
    return GatedProcess([python(), "-c", code], env={**os.environ, **env})


@root
@pytest.mark.mpi
def test_interposer_never_writes_into_a_planted_ring(built: dict[str, Path], ring_dir: Path,
                                                     user: pwd.struct_passwd) -> None:
    """The victim's ring name is taken (another user's file, then a symlink): the interposer makes
    <name>.1 instead (O_EXCL|O_NOFOLLOW), its calls are recorded, and the planted file is refused."""
    if mpi_skip_reason():
        pytest.skip(mpi_skip_reason() or "")
    for plant in ("foreign", "symlink"):
        job = f"s{uuid.uuid4().hex[:6]}"
        env = {"LD_PRELOAD": str(built["mpi"]), "GPUPROF_FASTPATH_JOB": job, "GPUPROF_FASTPATH_DIR": str(ring_dir),
               "SLURMD_NODENAME": "node1"}
        gated = singleton_mpi(env)
        planted = ring_dir / f"gpuprof-{job}-{gated.pid}"
        victim = ring_dir.parent / f"victim-{plant}"
        victim.write_bytes(b"root's file\n")
        if plant == "foreign":
            planted.write_bytes(ring_bytes(gated.pid))
            os.chown(planted, user.pw_uid, user.pw_gid)
        else:
            os.symlink(victim, planted)
        errors: list[str] = []
        src = source_over(ring_dir, {gated.pid}, job=job, errors=errors)
        batches: list[Batch] = []
        try:
            gated.go()
            rc, _out, err = gated.wait(60)
            assert rc == 0, err
            batches += src.final(0)
        finally:
            src.stop()
        assert victim.read_bytes() == b"root's file\n", "nothing written through the link"
        calls = collect(batches, schema.COLLECTIVE_CALLS)
        ops = {schema.COLLECTIVE_OPS[int(o)] for o in calls["op"]}
        assert "MPI_Barrier" in ops, (plant, ops, errors)
        s = src.summary()
        assert s["rings"] == 1 and s["refused"] == 1, (plant, s)
        assert s["refused_detail"][0].startswith(planted.name + ":"), s
        planted.unlink()


@root
@pytest.mark.mpi
def test_interposer_that_cannot_create_its_ring_is_counted(built: dict[str, Path], ring_dir: Path) -> None:
    """Every name the interposer may use is taken: it leaves a `.failed` note, which the collector
    counts and reports (the process's calls are missing, and the file says so)."""
    if mpi_skip_reason():
        pytest.skip(mpi_skip_reason() or "")
    job = f"f{uuid.uuid4().hex[:6]}"
    env = {"LD_PRELOAD": str(built["mpi"]), "GPUPROF_FASTPATH_JOB": job, "GPUPROF_FASTPATH_DIR": str(ring_dir)}
    gated = singleton_mpi(env)
    for i in range(8):
        os.symlink("/nonexistent", ring_dir / (f"gpuprof-{job}-{gated.pid}" + (f".{i}" if i else "")))
    errors: list[str] = []
    src = source_over(ring_dir, {gated.pid}, job=job, errors=errors)
    try:
        gated.go()
        rc, _out, err = gated.wait(60)
        assert rc == 0, err  # the job itself is untouched
        src.final(0)
    finally:
        src.stop()
    s = src.summary()
    assert s["create_failed"] == 1 and "create: errno 17" in s["create_failed_detail"][0], s
    assert any(f"process {gated.pid} could not create its ring" in e for e in errors), errors
    assert s["refused"] == 8


@root
@pytest.mark.mpi
def test_interposer_refuses_a_directory_it_does_not_own(built: dict[str, Path], tmp_path: Path,
                                                        user: pwd.struct_passwd) -> None:
    if mpi_skip_reason():
        pytest.skip(mpi_skip_reason() or "")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, user.pw_uid, user.pw_gid)
    env = {"LD_PRELOAD": str(built["mpi"]), "GPUPROF_FASTPATH_JOB": "x1", "GPUPROF_FASTPATH_DIR": str(d)}
    gated = singleton_mpi(env)
    gated.go()
    rc, _out, err = gated.wait(60)
    assert rc == 0, err
    assert not list(d.iterdir()), "a root process writes no ring into a directory of another user"


# --- files read as root: perf maps, ELF files ------------------------------------------------------
@pytest.fixture
def user_process(user: pwd.struct_passwd) -> Iterator[int]:
    """A live process of the unprivileged user (whose perf map the collector would read)."""
    p = subprocess.Popen(["runuser", "-u", user.pw_name, "--", "sleep", "60"])
    deadline = time.monotonic() + 10
    pid = p.pid
    while time.monotonic() < deadline:  # runuser forks: find the sleep itself
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True, check=False).stdout.split()
        if kids and os.stat(f"/proc/{kids[0]}").st_uid == user.pw_uid:
            pid = int(kids[0])
            break
        time.sleep(0.05)
    assert os.stat(f"/proc/{pid}").st_uid == user.pw_uid
    yield pid
    p.send_signal(signal.SIGTERM)
    subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
    p.wait()


def timed(fn: Any, *args: Any, limit_s: float = 5.0) -> Any:
    """fn(*args) on a thread; fails (instead of hanging the suite) when it blocks."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"{fn.__name__} blocked for more than {limit_s} s"
    return out[0]


@root
def test_hostile_perf_maps_are_never_read(user: pwd.struct_passwd, user_process: int, tmp_path: Path) -> None:
    pid = user_process
    perf_map = Path(f"/tmp/perf-{pid}.map")
    secret = tmp_path / "secret"
    secret.write_text("1000 10 root_only_secret\n")
    secret.chmod(0o600)

    def plant(kind: str) -> None:
        perf_map.unlink(missing_ok=True)
        if kind == "symlink":
            as_user(user, os.symlink, str(secret), str(perf_map))
        elif kind == "fifo":
            as_user(user, os.mkfifo, str(perf_map), 0o600)
        elif kind == "sparse":
            def sparse() -> None:
                with open(perf_map, "wb") as f:
                    f.write(b"1000 10 sparse\n")
                    f.truncate(64 << 30)  # 64 GiB, no blocks
            as_user(user, sparse)
        elif kind == "foreign":
            perf_map.write_text("1000 10 not_the_users\n")  # root's file, for a process of the user
        elif kind == "good":
            as_user(user, perf_map.write_text, "1000 10 jit_function\n")

    try:
        for kind in ("symlink", "fifo", "sparse", "foreign"):
            plant(kind)
            _, entries = timed(read_perf_map, pid, user.pw_uid)
            assert entries == [], (kind, entries)
            # the uid as read by the collector itself when none is given
            assert timed(read_perf_map, pid)[1] == [], kind
        plant("good")
        assert read_perf_map(pid, user.pw_uid)[1] == [(0x1000, 0x10, "jit_function")]
        assert read_perf_map(pid, user.pw_uid + 1)[1] == [], "the map must be the process's own"
    finally:
        perf_map.unlink(missing_ok=True)


def test_safe_reads_of_elf_files_never_block(tmp_path: Path) -> None:
    fifo = tmp_path / "lib.so"
    os.mkfifo(fifo)
    refused = timed(_try, _parse_elf, str(fifo))
    assert isinstance(refused, ValueError) and "not a regular file" in str(refused)
    assert timed(dynamic_functions, str(fifo)) == frozenset()
    link = tmp_path / "link.so"
    os.symlink("/etc/passwd", link)
    with pytest.raises(UnsafeFile, match="symlink"):
        read_user_file(str(link), owners=None, max_bytes=1 << 20)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(UnsafeFile, match="more than"):
        read_user_file(str(big), owners=None, max_bytes=16 << 20)


def test_elf_symbols_never_read_through_a_symlinked_directory(tmp_path: Path) -> None:
    """A job's library path whose directory a user swapped for a symlink (to a root-only tree): the
    symbol reader of the Python walk and of the kernels source refuses it, through the process's
    root too (resolved inside that root), and still reads a real path both ways."""
    real = tmp_path / "real"
    real.mkdir()
    lib = real / "libc.so.6"
    shutil.copy("/lib/x86_64-linux-gnu/libc.so.6", lib)
    (tmp_path / "swapped").symlink_to(real)
    me = f"/proc/{os.getpid()}/root"
    for path in (str(tmp_path / "swapped" / "libc.so.6"), me + str(tmp_path / "swapped" / "libc.so.6")):
        refused = _try(_parse_elf, path)
        assert isinstance(refused, ValueError) and "symlink" in str(refused), (path, refused)
    for path in (str(lib), me + str(lib)):
        assert "printf" in _parse_elf(path).by_name, path


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ValueError as e:
        return e


# --- the per-job ring directory ---------------------------------------------------------------------
@pytest.fixture
def shm() -> Iterator[Path]:
    """A stand-in for /dev/shm: sticky and world-writable (in /tmp, so the test user reaches it)."""
    base = Path(tempfile.mkdtemp(prefix="gpuprof-sec-", dir="/tmp"))
    base.chmod(0o755)
    d = base / "shm"
    d.mkdir()
    d.chmod(0o1777)
    yield d
    shutil.rmtree(base, ignore_errors=True)


@root
def test_job_dir_made_for_the_user_whatever_was_planted(shm: Path, user: pwd.struct_passwd) -> None:
    path = fe.job_ring_dir("77", "node1", base=str(shm))
    assert path.name == "gpuprof-77@node1"
    victim = shm.parent / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")

    def foreign_dir() -> None:  # another user's directory with a link inside
        os.mkdir(path, 0o777)
        (path / "evil").symlink_to(victim / "keep")
        os.chown(path, 65534, 65534)

    plants = {
        "symlink": lambda: as_user(user, os.symlink, str(victim), str(path)),
        "file": lambda: as_user(user, Path(path).write_text, "planted"),
        "foreign dir": foreign_dir,
        "own dir, wrong mode": lambda: as_user(user, os.mkdir, str(path), 0o777),
    }
    for what, plant in plants.items():
        plant()
        make_job_dir(path, user.pw_uid, user.pw_gid)
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == user.pw_uid and stat.S_IMODE(st.st_mode) == 0o700, what
        assert not list(path.iterdir()), what
        assert (victim / "keep").read_text() == "x", f"{what}: the planted link's target is untouched"
        assert remove_job_dir(path) and not os.path.lexists(path)
    # made again while ours already: kept (a prolog run twice)
    make_job_dir(path, user.pw_uid, user.pw_gid)
    (path / "ring").write_text("r")
    make_job_dir(path, user.pw_uid, user.pw_gid)
    assert (path / "ring").exists()
    with pytest.raises(PlacementError):
        make_job_dir(shm / "not-ours", user.pw_uid, user.pw_gid)


@root
def test_job_dir_removed_without_following_links(shm: Path, user: pwd.struct_passwd) -> None:
    victim = shm.parent / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    path = fe.job_ring_dir("78", "node1", base=str(shm))
    make_job_dir(path, user.pw_uid, user.pw_gid)

    def fill() -> None:
        os.symlink(str(victim), str(path / "link-to-dir"))
        os.symlink(str(victim / "keep"), str(path / "link-to-file"))
        os.mkdir(path / "sub")
        os.symlink(str(victim), str(path / "sub" / "deeper"))
    as_user(user, fill)
    assert remove_job_dir(path) and not os.path.lexists(path)
    assert (victim / "keep").read_text() == "x"
    # the user swapped the whole directory for a link to a root directory: only the link goes
    as_user(user, lambda: (os.symlink(str(victim), str(path))))
    assert remove_job_dir(path) and (victim / "keep").exists() and not os.path.lexists(path)
    assert not remove_job_dir(path)  # nothing there


def test_task_prolog_exports_the_job_dir(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    lines = fe.fastpath_exports(("collectives",), config_mod.defaults() | FASTPATH, existing_ld_preload="")
    assert "export GPUPROF_FASTPATH_DIR=/dev/shm/gpuprof-123@node3" in lines
    with pytest.raises(ValueError):
        fe.job_ring_dir("1/../../etc", "node1")


# --- control socket, state directory, install --------------------------------------------------------
class _Idle:
    state = "recording"
    finished_event = threading.Event()
    output = Path("/nonexistent")

    def status(self) -> dict[str, Any]:
        return {}

    def request_flush(self) -> bool:
        return True

    def request_stop(self, reason: str) -> None:
        return None


def test_control_socket_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(CollectorError, match="writable by others"):
        ControlServer(_Idle(), d / "c.sock")
    d.chmod(0o1777)  # sticky, like /tmp: nobody can replace root's socket there
    srv = ControlServer(_Idle(), d / "c.sock")
    try:
        st = os.lstat(d / "c.sock")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    finally:
        srv.close()


def test_doctor_names_an_install_others_can_write(tmp_path: Path) -> None:
    tree = tmp_path / "install"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("")
    tmp_path.chmod(0o755)
    if os.geteuid() == 0:
        assert doctor.writable_by_others([tree]) == []
    (tree / "pkg" / "mod.py").chmod(0o666)
    bad = doctor.writable_by_others([tree])
    assert any("mod.py" in b and "rw-rw-rw-" in b for b in bad), bad


@root
def test_doctor_names_an_install_owned_by_a_user(tmp_path: Path, user: pwd.struct_passwd) -> None:
    tree = tmp_path / "install"
    tree.mkdir()
    tmp_path.chmod(0o755)
    os.chown(tree, user.pw_uid, user.pw_gid)
    assert doctor.writable_by_others([tree]) == [f"{tree} (owner uid {user.pw_uid})"]


def test_install_check_is_required_and_passes_here() -> None:
    roots = doctor.install_roots(None)
    assert any(str(r).endswith("collector") for r in roots) and Path(sys.executable) in roots
    if os.geteuid() == 0 and os.stat(REPO).st_uid == 0:
        assert doctor.writable_by_others(roots) == []


# --- probes attached before the job runs: a deliberately slow attach ----------------------------------
class FakeProbe(Source):
    """A probe source (attaches=True) with nothing to record."""

    name = "fakeprobe"
    attaches = True
    interval_s = 0.2

    def start(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    def sample(self, now_ns: int) -> list[Batch]:
        return []


def test_slow_attach_is_marked_late(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """The job's process exists before the (slowed) probe attaches: the collector says so in
    status and in the node file (attach_json, late_sources, an error row)."""
    cfg = config_mod.defaults()
    cfg["collector"]["test_slow_attach_s"] = 1.0
    out = tmp_path / "n.h5"
    c = Collector(CollectorOptions(output=out, modes=("metrics",), config=cfg, pid=sleeper.pid, use_scontrol=False),
                  sources=[ClockSource(1.0), FakeProbe()])
    c.start()
    try:
        t0 = time.monotonic()
        assert c.status()["attach"]["fakeprobe"]["state"] == "pending" and not c.status()["attached"]
        while not c.status()["attached"] and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert time.monotonic() - t0 >= 0.9
        st = c.status()
        a = st["attach"]["fakeprobe"]
        assert st["late_sources"] == ["fakeprobe"] and a["late"] and sleeper.pid in a["pids_before"]
        assert a["first_process_ns"] < a["attached_ns"] and a["late_by_s"] > 0.9
        assert not st["attach"]["clock"]["late"], "only probe sources can be late"
    finally:
        c.request_stop("test")
        c.shutdown()
    with h5py.File(out, "r") as f:
        attach = json.loads(f.attrs["attach_json"])
        assert attach["fakeprobe"]["late"] and json.loads(f.attrs["late_sources"]) == ["fakeprobe"]
        msgs = [r["message"].decode() for r in f["diagnostics/errors"][()] if r["source"] == b"fakeprobe"]
    assert any("attached late" in m for m in msgs), msgs
    summary = summarize(open_node_trace(out))
    assert summary["late_sources"] == ["fakeprobe"] and summary["attach"]["fakeprobe"]["late"]
    assert "late:      fakeprobe attached after" in format_summary(summary)


def test_inspect_shows_refused_rings() -> None:
    s = {"file": "f", "schema": "s", "job_id": "1", "node": "n", "hostname": "h", "modes": "collectives",
         "sealed": True, "partial_reasons": [], "span_s": 1.0, "rates_hz": {}, "records": {}, "drops": {},
         "errors": [], "missing_metrics": [], "late_sources": [],
         "fastpath": {"rings": 3, "refused": 1, "create_failed": 1, "dir_problem": "",
                      "refused_detail": ["gpuprof-1-5: a symlink"], "create_failed_detail": ["gpuprof-1-6.failed: x"]}}
    text = format_summary(s)
    assert "fastpath:  3 rings read, 1 refused, 1 processes without a ring" in text
    assert "gpuprof-1-5: a symlink" in text and "gpuprof-1-6.failed" in text


def test_attach_before_the_job_is_not_late(tmp_path: Path) -> None:
    """No job process yet when the probe attaches (what the prolog's wait gives): not late."""
    cfg = config_mod.defaults()
    c = Collector(CollectorOptions(output=tmp_path / "n.h5", modes=("metrics",), config=cfg, job_id="424242",
                                   node="nowhere", uid=12345, use_scontrol=False),
                  sources=[ClockSource(1.0), FakeProbe()])
    c.start()
    try:
        deadline = time.monotonic() + 10
        while not c.status()["attached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        st = c.status()
        assert st["attached"] and st["late_sources"] == [] and not st["attach"]["fakeprobe"]["late"]
    finally:
        c.request_stop("test")
        c.shutdown()


def _collector_proc(tmp_path: Path, slow_s: float, pid: int) -> tuple[subprocess.Popen[bytes], Path]:
    conf = tmp_path / "c.toml"
    conf.write_text(f"[collector]\ntest_slow_attach_s = {slow_s}\n")
    sock = tmp_path / "c.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPROF_"))}
    p = subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf), "collect",
                          "--pid", str(pid), "--modes", "metrics", "--output", str(tmp_path / "n.h5"),
                          "--control-socket", str(sock)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    return p, sock


@pytest.mark.parametrize("slow_s, budget_s, waits", [(1.5, 8.0, True), (4.0, 1.0, False)])
def test_prolog_waits_for_attachment_within_its_budget(tmp_path: Path, sleeper: subprocess.Popen[bytes],
                                                       slow_s: float, budget_s: float, waits: bool) -> None:
    """hooks._wait_recording, as the prolog calls it: waits until every source is attached, at
    most until the budget; then the job starts and the sources still pending are named."""
    proc, sock = _collector_proc(tmp_path, slow_s, sleeper.pid)
    try:
        t0 = time.monotonic()
        why_not, late = hooks._wait_recording(sock, proc, 15.0, t0 + budget_s)
        took = time.monotonic() - t0
        assert why_not == ""
        if waits:
            assert late == [] and slow_s - 0.2 <= took < budget_s
        else:
            assert set(late) >= {"host"} and budget_s - 0.1 <= took < slow_s, (late, took)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.bpf
def test_slow_bpf_attach_marks_real_probes_late(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)
    conf = tmp_path / "c.toml"
    conf.write_text("[collector]\ntest_slow_attach_s = 1.0\n")
    out = tmp_path / "s.h5"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUPROF_"))}
    log = tmp_path / "collector.log"
    with log.open("wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "gpuprof.slurm_hooks.cli", "--config", str(conf), "collect",
                              "--pid", str(sleeper.pid), "--modes", "stacks", "--output", str(out), "--duration",
                              "120"], env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # stopped once both sources say they attached (the compile's time depends on the machine's load)
        deadline = time.monotonic() + 100
        while not all(f"{s}: attached late" in log.read_text() for s in ("stacks", "offcpu")):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with h5py.File(out, "r") as f:
        late = json.loads(f.attrs["late_sources"])
        attach = json.loads(f.attrs["attach_json"])
    assert {"stacks", "offcpu"} <= set(late), attach
    assert attach["stacks"]["may_have_missed"].startswith("CPU samples")


def test_a_process_in_another_mount_namespace_has_its_files_looked_up_through_its_root(tmp_path: Path) -> None:
    """The stack store names a mapped library by its path only when the path means the same file
    to the process as to the collector (same root, same mount namespace: same_file_view); a process
    in a mount namespace of its own, where the same path can be another file, gets its files
    through /proc/PID/root."""
    from gpuprof.collector.bpf_support import attach_path, same_file_view

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    here = subprocess.Popen(["sleep", "30"])
    # its own mount namespace, with a file bind-mounted over /usr/bin/env: the path names another file there
    other = tmp_path / "other"
    other.write_text("not env\n")
    ns = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount --bind {other} /usr/bin/env && exec sleep 30"])
    try:
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{ns.pid}/exe") != shutil.which("sleep") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert same_file_view(here.pid) and not same_file_view(ns.pid)
        assert attach_path(here.pid, "/usr/bin/env", same_file_view(here.pid)) == "/usr/bin/env"
        assert attach_path(ns.pid, "/usr/bin/env", same_file_view(ns.pid)) == f"/proc/{ns.pid}/root/usr/bin/env"
    finally:
        for p in (here, ns):
            p.kill()
            p.wait()
