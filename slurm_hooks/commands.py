"""Click wrappers of the Slurm-side commands: thin, each over a plain function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gpuprof.collector import config as config_mod
from gpuprof.collector.errors import GpuprofError
from gpuprof.slurm_hooks import hooks
from gpuprof.slurm_hooks import task_prolog as task_prolog_mod


def _cfg_path(ctx: click.Context) -> str | None:
    return (ctx.obj or {}).get("config_path")


@click.command()
@click.pass_context
def prolog(ctx: click.Context) -> None:
    """Slurm Prolog: pause DCGM, start this node's collector (always exits 0)."""
    sys.exit(hooks.prolog(_cfg_path(ctx)))


@click.command()
@click.pass_context
def epilog(ctx: click.Context) -> None:
    """Slurm Epilog: seal and place the node file, resume DCGM (always exits 0)."""
    sys.exit(hooks.epilog(_cfg_path(ctx)))


@click.command("task-prolog")
@click.pass_context
def task_prolog(ctx: click.Context) -> None:
    """Slurm TaskProlog: print the export lines the job's modes need."""
    sys.exit(task_prolog_mod.task_prolog(_cfg_path(ctx)))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check this node: Slurm, plugin, munge, BPF, NVML, DCGM, MPI, HDF5, config."""
    from gpuprof.slurm_hooks.doctor import run_checks

    checks, _ = run_checks(_cfg_path(ctx))
    failed = [c for c in checks if c.required and not c.ok]
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=1))
    else:
        for c in checks:
            mark = "ok     " if c.ok else ("MISSING" if c.required else "absent ")
            line = f"{mark} {c.name:<16} {c.detail}"
            if not c.ok and c.fix:
                line += f"\n        fix: {c.fix}"
            click.echo(line)
    sys.exit(1 if failed else 0)


@click.group("config")
def config_cmd() -> None:
    """Show or check the configuration."""


@config_cmd.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print the effective configuration (after the lookup order) as JSON."""
    try:
        cfg = config_mod.load(_cfg_path(ctx.parent) if ctx.parent else None)
    except GpuprofError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(cfg, indent=1))


@config_cmd.command("defaults")
def config_defaults() -> None:
    """Print the default config file (what etc/gpuprof.toml ships)."""
    click.echo(config_mod.render_defaults())


@click.group("dcgm")
def dcgm() -> None:
    """The per-host DCGM profiling lock."""


def _lock(ctx: click.Context):  # type: ignore[no-untyped-def]
    from gpuprof.slurm_hooks import log as log_mod
    from gpuprof.slurm_hooks.dcgm_lock import DcgmLock

    try:
        cfg = config_mod.load(_cfg_path(ctx.find_root()))
    except GpuprofError as e:
        raise click.ClickException(str(e)) from None
    return DcgmLock(Path(cfg["paths"]["state_dir"]), cfg["dcgm"], log_mod.setup("dcgm"))


@dcgm.command("status")
@click.pass_context
def dcgm_status(ctx: click.Context) -> None:
    """Holders of the lock on this host."""
    click.echo(json.dumps(_lock(ctx).holders(), indent=1))


@dcgm.command("site-pause")
@click.pass_context
def dcgm_site_pause(ctx: click.Context) -> None:
    """The site pauses DCGM profiling itself; the suite will not resume it until site-resume."""
    from gpuprof.slurm_hooks.dcgm_lock import SITE_HOLDER

    r = _lock(ctx).acquire(SITE_HOLDER, {"by": "site"})
    click.echo(f"action {r.action} ({r.dcgmi}); holders {r.holders}")


@dcgm.command("site-resume")
@click.pass_context
def dcgm_site_resume(ctx: click.Context) -> None:
    """Drop the site's hold; DCGM resumes when no profiled job holds it either."""
    from gpuprof.slurm_hooks.dcgm_lock import SITE_HOLDER

    r = _lock(ctx).release(SITE_HOLDER)
    click.echo(f"action {r.action} ({r.dcgmi}); holders {r.holders}")


@dcgm.command("watchdog")
@click.pass_context
def dcgm_watchdog(ctx: click.Context) -> None:
    """Drop holders whose job is gone and resume DCGM if none remain (run from a timer)."""
    gone, r = _lock(ctx).watchdog(hooks.job_still_running)
    click.echo(f"dropped {gone}; action {r.action} ({r.dcgmi}); holders {r.holders}")
