"""Slurm filename patterns, result paths, and placement as the job's user without following symlinks."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import unprivileged_user

from gpuprof.slurm_hooks.paths import (
    PatternContext,
    PlacementError,
    expand_stdout_pattern,
    job_result_paths,
    node_dir_for_stdout,
    place_as_user,
)

CTX = PatternContext("123", "train", "alice", "node1")


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("slurm-%j.out", "slurm-123.out"),
        ("/w/%x-%j.log", "/w/train-123.log"),
        ("%u/%N/%5j.out", "alice/node1/00123.out"),
        ("slurm-%A_%a.out", "slurm-123_4294967294.out"),
        ("100%%-%j", "100%-123"),
        ("%J.out", "123.batch.out"),
    ],
)
def test_expand(pattern: str, expected: str) -> None:
    assert expand_stdout_pattern(pattern, CTX) == expected


def test_expand_array() -> None:
    ctx = PatternContext("130", "a", "bob", "node2", array_job_id="128", array_task_id="2")
    assert expand_stdout_pattern("slurm-%A_%a.out", ctx) == "slurm-128_2.out"


def test_result_paths() -> None:
    assert node_dir_for_stdout("/w/slurm-123.out") == Path("/w/slurm-123.gpuprof.d")
    assert job_result_paths("/w/slurm-123.out")["h5"] == Path("/w/slurm-123.gpuprof.h5")
    assert job_result_paths("/w/run.log")["html"] == Path("/w/run.gpuprof.html")
    assert node_dir_for_stdout("/w/noext") == Path("/w/noext.gpuprof.d")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Like pytest's tmp_path, but reachable by the unprivileged user (pytest's is 0700 root)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gpuprof-paths-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="placement drops privileges: needs root")


@needs_root
@pytest.mark.root
def test_place_as_user_owns_file(tmp_path: Path) -> None:
    u = unprivileged_user()
    dest = tmp_path / "w"
    dest.mkdir()
    os.chown(dest, u.pw_uid, u.pw_gid)
    src = tmp_path / "src.h5"
    src.write_bytes(b"data" * 1000)
    placed = place_as_user(src, dest, "node1.h5", uid=u.pw_uid, gid=u.pw_gid, subdir="slurm-1.gpuprof.d")
    st = placed.stat()
    assert (st.st_uid, st.st_gid) == (u.pw_uid, u.pw_gid)
    assert placed.read_bytes() == src.read_bytes()
    assert placed.parent.stat().st_uid == u.pw_uid


@needs_root
@pytest.mark.root
def test_symlinked_stdout_dir_to_root_place_writes_nothing(tmp_path: Path) -> None:
    u = unprivileged_user()
    root_dir = tmp_path / "rootonly"
    root_dir.mkdir(mode=0o755)
    link = tmp_path / "userdir"
    link.symlink_to(root_dir)
    src = tmp_path / "src.h5"
    src.write_bytes(b"x")
    with pytest.raises(PlacementError, match="uid"):
        place_as_user(src, link, "node1.h5", uid=u.pw_uid, gid=u.pw_gid, subdir="slurm-1.gpuprof.d")
    assert list(root_dir.iterdir()) == []


@needs_root
@pytest.mark.root
def test_symlink_at_target_name_is_replaced_not_followed(tmp_path: Path) -> None:
    u = unprivileged_user()
    dest = tmp_path / "w"
    (dest / "slurm-1.gpuprof.d").mkdir(parents=True)
    os.chown(dest, u.pw_uid, u.pw_gid)
    os.chown(dest / "slurm-1.gpuprof.d", u.pw_uid, u.pw_gid)
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    (dest / "slurm-1.gpuprof.d" / "node1.h5").symlink_to(victim)
    src = tmp_path / "src.h5"
    src.write_bytes(b"trace")
    placed = place_as_user(src, dest, "node1.h5", uid=u.pw_uid, gid=u.pw_gid, subdir="slurm-1.gpuprof.d")
    assert victim.read_text() == "root's file"
    assert not placed.is_symlink() and placed.read_bytes() == b"trace"


@needs_root
@pytest.mark.root
def test_symlinked_subdir_is_refused(tmp_path: Path) -> None:
    u = unprivileged_user()
    dest = tmp_path / "w"
    dest.mkdir()
    os.chown(dest, u.pw_uid, u.pw_gid)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, u.pw_uid, u.pw_gid)
    (dest / "slurm-1.gpuprof.d").symlink_to(elsewhere)
    src = tmp_path / "src.h5"
    src.write_bytes(b"x")
    with pytest.raises(PlacementError, match="symlink"):
        place_as_user(src, dest, "node1.h5", uid=u.pw_uid, gid=u.pw_gid, subdir="slurm-1.gpuprof.d")
    assert list(elsewhere.iterdir()) == []
