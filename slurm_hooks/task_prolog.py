"""Slurm TaskProlog: the `export` lines a profiled job's tasks need, when the job has no task plan
(etc/task-prolog makes them in shell from the plan the prolog writes, and runs `python -m
gpuprof.slurm_hooks.task_prolog` as the job's user only when there is none).

Its own module, apart from hooks.py and the click commands, because it runs inside the job's time:
once per task of each step, mpirun's own launch included. With hooks.py's imports (numpy and h5py
through the schema, click) a task paid about 190 ms of CPU here, about 40 without them
(docs/collector.md, "What a job pays at each step"). The standard library and the suite's light
modules only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment as env
from gpuprof.collector.errors import GpuprofError
from gpuprof.collector.fastpath_env import job_ring_dir, job_task_plan, render_task_plan
from gpuprof.collector.modes import parse_modes
from gpuprof.slurm_hooks import log as log_mod


def task_prolog_lines(raw_modes: str | None, cfg: dict[str, Any]) -> list[str]:
    """The `export` lines the job's modes need (none when profiling was not asked for): the job's
    task plan, made here as the prolog makes it, rendered for this task's environment."""
    if raw_modes is None:
        return []
    modes = parse_modes(raw_modes)
    job_id = env.get(env.SLURM_JOB_ID) or ""
    try:
        ring_dir = job_ring_dir(job_id, env.get(env.SLURMD_NODENAME) or os.uname().nodename) if job_id else None
    except ValueError:
        ring_dir = None
    if ring_dir is not None and not ring_dir.is_dir():
        # the prolog made no ring directory for the job: the node's continuous collector records
        # it (it drains no rings), or making it failed (said in the prolog's log); nothing would
        # read what the interposers and plugins wrote
        ring_dir = None
    return render_task_plan(job_task_plan(modes, cfg, job_id, ring_dir), os.environ)


def task_prolog(config_path: str | None = None) -> int:
    job_id, node = env.get(env.SLURM_JOB_ID) or "?", env.get(env.SLURMD_NODENAME) or os.uname().nodename
    log = log_mod.setup("task-prolog", job_id, node)
    raw = env.profile_modes_job()
    try:
        cfg = config_mod.load(config_path)
        for line in task_prolog_lines(raw, cfg):
            print(line)
    except (GpuprofError, ValueError) as e:
        log.error("task prolog: %s; no exports", e)
    return 0


if __name__ == "__main__":
    sys.exit(task_prolog())  # the config by its lookup order ($GPUPROF_CONFIG, the site's, defaults)
