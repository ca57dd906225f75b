"""The continuous mode's commands that reach into the merge: `gpuprof watch JOB` (its statistics are
the merge's, mpi_merge/live_watch.py) and `gpuprof export`, which with --last is the continuous
collector's window (collector/cli.py export_window) and otherwise the merged job file's export
(mpi_merge/cli.py), unchanged. Here rather than in collector/cli.py: the collector package imports
nothing of the merge (tests/test_layout.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from gpuprof.collector.cli import export_window
from gpuprof.mpi_merge.cli import export as merged_export
from gpuprof.mpi_merge.live_watch import format_view, watch_once


@click.command("watch")
@click.argument("job_id", metavar="JOBID")
@click.option("--interval", type=float, default=5.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="One refresh, then exit (0: no finding, 3: a finding).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per refresh.")
@click.option("--log", "log_findings", is_flag=True, help="Also write each new finding to syslog (tag gpuprof-watch).")
@click.option("--comment", is_flag=True, help="Also put the finding in the job's Slurm comment (scontrol update).")
@click.option("--socket", "socket_path", default=None, help="Continuous collector socket ({node} = the node).")
@click.option("--node-summary", is_flag=True, hidden=True, help="Print this node's summary (the srun step's side).")
@click.pass_context
def watch(ctx: click.Context, job_id: str, interval: float, once: bool, as_json: bool, log_findings: bool,
          comment: bool, socket_path: str | None, node_summary: bool) -> None:
    """Watch a running job: per communicator the ranks arriving last and their lateness, refreshed,
    and a finding when the merge's straggler test is confident (docs/continuous.md, "Live watch")."""
    import os
    import subprocess

    from gpuprof.collector import config as config_mod
    from gpuprof.collector import environment
    from gpuprof.collector.errors import GpuprofError
    from gpuprof.collector.watch import socket_for

    if not job_id.isdigit():
        raise click.BadParameter("a job id is digits", param_hint="JOBID")
    try:
        root = ctx.find_root().obj or {}
        cfg = config_mod.load(root.get("config_path"))
    except GpuprofError as e:
        click.echo(f"gpuprof watch: {e}", err=True)
        ctx.exit(2)
    template = socket_path or str(cfg["continuous"]["socket"])
    if node_summary:
        from gpuprof.collector.continuous import client_request

        here = environment.get(environment.SLURMD_NODENAME) or os.uname().nodename
        try:
            reply = client_request(socket_for(template, here), {"cmd": "summary", "job": job_id}, timeout_s=15)
        except GpuprofError as e:
            reply = {"ok": False, "node": here, "error": str(e)}
        click.echo(json.dumps(reply))
        ctx.exit(0 if reply.get("ok") else 1)
    seen: set[str] = set()
    while True:
        view = watch_once(job_id, template)
        click.echo(json.dumps(view, sort_keys=True) if as_json else format_view(view))
        if view["state"] != "live":
            ctx.exit(1)  # the job ended (or never ran): said, not waited on
        for f in view["findings"]:
            key = f"{f['comm']}:{f['unit']}"
            if key in seen:
                continue
            seen.add(key)
            if log_findings:
                subprocess.run(["logger", "-t", "gpuprof-watch", f"job {job_id}: {f['line']}"], check=False)
            if comment:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", f"Comment=gpuprof: {f['line'][:200]}"],
                               check=False, capture_output=True)
        if once:
            ctx.exit(3 if view["findings"] else 0)
        time.sleep(interval)


class ExportCommand(click.Command):
    """`gpuprof export`: with --last, a window of the continuous collector (export_window above);
    otherwise the merged job file's export (gpuprof.mpi_merge.cli export), unchanged."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        if any(a == "--last" or a.startswith("--last=") for a in args):
            return export_window.make_context(info_name, args, parent=parent, **extra)
        if "--help" in args or "-h" in args:  # both forms' help: the merged export's exits after its own
            with click.Context(export_window, info_name=f"{info_name} --last", parent=parent) as c:
                click.echo(export_window.get_help(c) + "\n")
        return merged_export.make_context(info_name, args, parent=parent, **extra)

    def get_help(self, ctx: click.Context) -> str:
        with click.Context(export_window, info_name="export --last", parent=ctx.parent) as c1, \
                click.Context(merged_export, info_name="export", parent=ctx.parent) as c2:
            return export_window.get_help(c1) + "\n\n" + merged_export.get_help(c2)


export = ExportCommand("export", help="Export the continuous collector's last minutes (--last) or a merged job "
                       "file (JOB_FILE --format ...).")
