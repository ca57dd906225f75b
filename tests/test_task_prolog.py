"""The TaskProlog in shell (etc/task-prolog) against its Python twin: for the job's task plan the
prolog writes (gpuprof.collector.fastpath_env.job_task_plan), the script prints exactly the lines
`render_task_plan` makes, for every kind of plan line and the task environments that change them
(a task's own LD_PRELOAD, a plugin or injection the job set itself, GPUPROF_NVTX)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gpuprof.collector import config as config_mod
from gpuprof.collector import fastpath_env as fe

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "etc" / "task-prolog"
JOB, NODE = "4242", "tpnode"

SYNTHETIC_PLANS = {
    "metrics only": [("modes", "metrics")],
    "everything": [("modes", "metrics,stacks,collectives"), ("preload", "/opt/gp/libgpuprof_pmpi.so:/opt/gp/libgpuprof_nccl.so"),
                   ("job", JOB), ("dir", f"/dev/shm/gpuprof-{JOB}@{NODE}"), ("plugin", "/opt/gp/libnccl-profiler-gpuprof.so"),
                   ("nvtx", "/opt/gp/libgpuprof_nvtx.so"), ("cupti", "/opt/gp/libgpuprof_cupti.so")],
    "nvtx when asked": [("modes", "collectives"), ("job", JOB), ("dir", "/dev/shm/x"), ("nvtx_asked", "/opt/gp/nvtx.so")],
    "nvtx when asked, and the plugin": [("modes", "collectives"), ("job", JOB), ("dir", "/dev/shm/x"),
                                        ("plugin", "/opt/gp/plugin.so"), ("nvtx_asked", "/opt/gp/nvtx.so")],
    "a value with = in it": [("modes", "collectives"), ("preload", "/opt/a=b/lib.so"), ("job", JOB), ("dir", "/d")],
}
TASK_ENVS = {
    "plain": {},
    "its own preload": {"LD_PRELOAD": "/usr/lib/libfoo.so::/usr/lib/libbar.so:"},
    "a preload with a space and a glob": {"LD_PRELOAD": "/usr/lib/lib foo.so:/usr/lib/*.so"},
    "the job's own plugin and injections": {"NCCL_PROFILER_PLUGIN": "/home/u/myplugin.so",
                                            "NVTX_INJECTION64_PATH": "/home/u/nvtx.so", "CUDA_INJECTION64_PATH": "x" * 300},
    "ours set already": {"NCCL_PROFILER_PLUGIN": "/opt/gp/libnccl-profiler-gpuprof.so"},
    "asks for NVTX": {"GPUPROF_NVTX": "1"},
    "says no to NVTX": {"GPUPROF_NVTX": "0"},
}


def run_script(plan_dir: Path, task_env: dict[str, str], node: str = NODE) -> list[str]:
    e = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": JOB, "SLURMD_NODENAME": node, "GPUPROF_TASK_PLAN_DIR": str(plan_dir),
         "SPANK__SLURM_SPANK_OPTION_gpuprof_profile_gpu": "default", "GPUPROF_PYTHON": "/nonexistent", **task_env}
    r = subprocess.run(["/bin/sh", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=30, check=True)
    return r.stdout.splitlines()


def write_plan(plan_dir: Path, plan: list[tuple[str, str]]) -> None:
    fe.task_plan_path(JOB, NODE, plan_dir).write_text("".join(f"{k}={v}\n" for k, v in plan))


def _plans_of_the_config(tmp_path: Path) -> dict[str, list[tuple[str, str]]]:
    """Plans as job_task_plan makes them for this install (what is built decides what is in them)."""
    ring_dir = tmp_path / "ring"
    defaults = config_mod.defaults()
    nvtx_on = {**defaults, "sources.nvtx": {**defaults["sources.nvtx"], "inject": "on"}}
    nvtx_job = {**defaults, "sources.nvtx": {**defaults["sources.nvtx"], "inject": "job"}}
    return {
        "default modes": fe.job_task_plan(("metrics", "stacks", "collectives"), defaults, JOB, ring_dir),
        "no ring directory": fe.job_task_plan(("metrics", "collectives"), defaults, JOB, None),
        "kernels": fe.job_task_plan(("kernels",), defaults, JOB, ring_dir),
        "nvtx on": fe.job_task_plan(("collectives",), nvtx_on, JOB, ring_dir),
        "nvtx job": fe.job_task_plan(("collectives",), nvtx_job, JOB, ring_dir),
    }


@pytest.mark.parametrize("env_name", sorted(TASK_ENVS))
def test_the_shell_prints_what_python_renders(tmp_path: Path, env_name: str) -> None:
    task_env = TASK_ENVS[env_name]
    plans = {**SYNTHETIC_PLANS, **_plans_of_the_config(tmp_path)}
    for plan_name, plan in plans.items():
        write_plan(tmp_path, plan)
        assert run_script(tmp_path, task_env) == fe.render_task_plan(plan, task_env), (plan_name, env_name)


def test_what_the_renderer_says_for_the_job_and_the_task() -> None:
    """The lines themselves (the twin test alone would pass if both were wrong alike)."""
    plan = SYNTHETIC_PLANS["everything"]
    lines = fe.render_task_plan(plan, TASK_ENVS["its own preload"])
    assert lines[:4] == ["export GPUPROF_MODES=metrics,stacks,collectives",
                         ("export LD_PRELOAD=/opt/gp/libgpuprof_pmpi.so:/opt/gp/libgpuprof_nccl.so:/usr/lib/libfoo.so:"
                         "/usr/lib/libbar.so"),
                         f"export GPUPROF_FASTPATH_JOB={JOB}", f"export GPUPROF_FASTPATH_DIR=/dev/shm/gpuprof-{JOB}@{NODE}"]
    theirs = fe.render_task_plan(plan, TASK_ENVS["the job's own plugin and injections"])
    assert [ln for ln in theirs if ln.startswith("print ")] == [
        ("print gpuprof: NCCL_PROFILER_PLUGIN is already set by the job (/home/u/myplugin.so): gpuprof's stays out "
        "and records nothing through it"),
        ("print gpuprof: NVTX_INJECTION64_PATH is already set by the job (/home/u/nvtx.so): gpuprof's stays out and "
        "records nothing through it"),
        (f"print gpuprof: CUDA_INJECTION64_PATH is already set by the job ({'x' * 200}): gpuprof's stays out and "
        "records nothing through it")]
    asked = SYNTHETIC_PLANS["nvtx when asked"]
    assert "export NVTX_INJECTION64_PATH=/opt/gp/nvtx.so" in fe.render_task_plan(asked, {"GPUPROF_NVTX": "1"})
    # nothing would write to the rings: no job or directory either
    assert fe.render_task_plan(asked, {"GPUPROF_NVTX": "0"}) == ["export GPUPROF_MODES=collectives"]
    with pytest.raises(ValueError, match="unknown key"):
        fe.render_task_plan([("modes", "metrics"), ("bogus", "1")], {})


def test_fastpath_exports_are_the_plan_without_the_modes(tmp_path: Path) -> None:
    cfg = config_mod.defaults()
    plan = fe.job_task_plan(("collectives",), cfg, JOB, tmp_path)
    assert fe.fastpath_exports(("collectives",), cfg, JOB, existing_ld_preload="", ring_dir=tmp_path, job_env={}) == \
        fe.render_task_plan(plan, {})[1:]


def test_no_plan_no_job_or_another_node_falls_back_to_python(tmp_path: Path) -> None:
    """Without this node's plan the script runs the Python TaskProlog (here a Python that is not
    there: no lines), never another node's plan."""
    write_plan(tmp_path, SYNTHETIC_PLANS["metrics only"])
    assert run_script(tmp_path, {}) == ["export GPUPROF_MODES=metrics"]
    assert run_script(tmp_path, {}, node="othernode") == []


def test_the_script_and_the_prolog_use_the_same_directory() -> None:
    m = re.search(r'GPUPROF_TASK_PLAN_DIR:-([^}]+)}', SCRIPT.read_text())
    assert m and Path(m.group(1)) == fe.TASK_PLAN_DIR
    assert fe.task_plan_path(JOB, NODE) == fe.TASK_PLAN_DIR / f"{JOB}@{NODE}"
    with pytest.raises(ValueError):
        fe.task_plan_path("../x", NODE)


@pytest.mark.skipif(os.geteuid() != 0, reason="the plan is written as root for the job's user")
def test_a_plan_is_the_users_alone_in_a_directory_only_root_writes(tmp_path: Path) -> None:
    from gpuprof.slurm_hooks.paths import PlacementError, remove_task_plan, write_task_plan

    d = tmp_path / "plans"
    path = d / f"{JOB}@{NODE}"
    write_task_plan(path, ["modes=metrics"], 65534)
    st = path.stat()
    assert path.read_text() == "modes=metrics\n" and st.st_uid == 65534 and st.st_mode & 0o777 == 0o400
    assert d.stat().st_mode & 0o777 == 0o755 and list(d.iterdir()) == [path]
    write_task_plan(path, ["modes=stacks"], 65534)  # a prolog run again for the job: replaced
    assert path.read_text() == "modes=stacks\n"
    assert remove_task_plan(path) and not remove_task_plan(path)
    d.chmod(0o777)
    with pytest.raises(PlacementError, match="only root writes"):
        write_task_plan(path, ["modes=metrics"], 65534)
