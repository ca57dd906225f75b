"""`gpuprof collect` and `gpuprof inspect`: thin click wrappers over gpuprof.collector.daemon and reader."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment, schema
from gpuprof.collector.errors import GpuprofError


def _config(ctx: click.Context) -> dict[str, dict[str, Any]]:
    path = (ctx.find_root().obj or {}).get("config_path") if ctx.find_root().obj else None
    return config_mod.load(path)


def _setup_logging(log_file: str) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        try:
            handlers.append(logging.FileHandler(log_file))
        except OSError as e:
            print(f"gpuprof collect: cannot open log file {log_file}: {e.strerror}", file=sys.stderr)
    fmt = logging.Formatter("%(asctime)s gpuprof-collect[%(process)d] %(levelname)s %(message)s")
    logger = logging.getLogger("gpuprof")
    for h in handlers:
        h.setFormatter(fmt)
        logger.addHandler(h)
    logger.setLevel(logging.INFO)


def _modes(value: str | None) -> tuple[str, ...]:
    try:
        return schema.parse_modes(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--modes") from None


@click.command("collect")
@click.option("--job", "job_id", metavar="JOBID", help="Slurm job to observe (its cgroup, else scontrol listpids).")
@click.option("--pid", type=int, metavar="PID", help="Observe this process and its descendants (by hand, or fallback).")
@click.option("--node", metavar="NODE", help="Slurm node name (default: $SLURMD_NODENAME, else the host name).")
@click.option("--uid", type=int, metavar="UID", help="Job owner's uid (narrows the cgroup lookup).")
@click.option("--modes", metavar="MODES", default=None, help="Comma list of metrics,stacks,collectives,kernels "
              "(default: metrics,stacks,collectives).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="Node trace file to write (.h5).")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None,
              help="Unix socket for status/flush/seal (mode 0600).")
@click.option("--duration", type=float, default=None, metavar="S", help="Stop and seal after S seconds.")
@click.option("--nice", type=int, default=None, help="Nice value (default: config hooks.collector_nice).")
@click.option("--gpus", type=click.Choice(["job", "all"]), default=None,
              help="Which GPUs: the job's (default, from config sources.nvml.gpus) or all.")
@click.pass_context
def collect(
    ctx: click.Context,
    job_id: str | None,
    pid: int | None,
    node: str | None,
    uid: int | None,
    modes: str | None,
    output: str,
    control_socket: str | None,
    duration: float | None,
    nice: int | None,
    gpus: str | None,
) -> None:
    """Record one node's trace for a job (or a process tree) until SIGINT/SIGTERM, --duration or seal."""
    from gpuprof.collector.daemon import Collector, CollectorOptions

    if job_id is None and pid is None:
        raise click.UsageError("give --job JOBID or --pid PID")
    if duration is not None and duration <= 0:
        raise click.BadParameter("must be positive", param_hint="--duration")
    try:
        cfg = _config(ctx)
    except GpuprofError as e:
        click.echo(f"gpuprof collect: {e}", err=True)
        ctx.exit(2)
    if gpus is not None:
        cfg["sources.nvml"]["gpus"] = gpus
    _setup_logging(str(cfg["paths"]["log_file"]))
    opts = CollectorOptions(
        output=Path(os.path.abspath(output)),
        modes=_modes(modes),
        config=cfg,
        job_id=job_id,
        node=node or environment.get(environment.SLURMD_NODENAME) or os.uname().nodename,
        uid=uid,
        pid=pid,
        duration_s=duration,
        control_socket=Path(control_socket) if control_socket else None,
        nice=nice if nice is not None else int(cfg["hooks"]["collector_nice"]),
    )
    try:
        collector = Collector(opts)
        rc = collector.run()
    except GpuprofError as e:
        click.echo(f"gpuprof collect: {e}", err=True)
        ctx.exit(2)
    if collector.writer_abandoned:
        # HDF5 would retry the failed writes when it closes the file at interpreter exit and, on a
        # full disk, crash (SIGSEGV in libhdf5): leave without its exit handlers. What was flushed
        # is on disk already.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(rc)
    ctx.exit(rc)


def format_summary(s: dict[str, Any]) -> str:
    """The text `gpuprof inspect` prints."""
    lines = [
        f"file:      {s['file']}",
        f"schema:    {s['schema']}",
        f"job:       {s['job_id']}   node: {s['node']}   host: {s['hostname']}",
        f"modes:     {s['modes']}",
        "state:     " + ("sealed" if s["sealed"] else "PARTIAL: " + "; ".join(s["partial_reasons"])),
        f"span:      {s['span_s']:.3f} s" if s["span_s"] is not None else "span:      unknown (not sealed)",
    ]
    if s.get("synthetic"):
        lines.append("NOTE:      synthetic data (generated, not measured)")
    if s.get("emulated"):
        lines.append("NOTE:      GPU metrics come from an emulated NVML (test double), not a GPU")
    lines.append("rates:     " + ", ".join(f"{k} {v:g} Hz" for k, v in sorted(s["rates_hz"].items())))
    lines.append("records:")
    for path, n in sorted(s["records"].items()):
        lines.append(f"  {path:<28} {n:>10}")
    drops = {k: v for k, v in s["drops"].items() if v}
    lines.append("drops:     " + (", ".join(f"{k} {v}" for k, v in sorted(drops.items())) if drops else "none"))
    if s.get("late_sources"):
        lines.append("late:      " + ", ".join(s["late_sources"])
                     + " attached after the job's first process (attach_json says what they may have missed)")
    fast = s.get("fastpath")
    if fast:
        lines.append(f"fastpath:  {fast.get('rings', 0)} rings read, {fast.get('refused', 0)} refused, "
                     f"{fast.get('create_failed', 0)} processes without a ring"
                     + (f"; {fast['dir_problem']}" if fast.get("dir_problem") else ""))
        for why in [*fast.get("refused_detail", []), *fast.get("create_failed_detail", [])][:20]:
            lines.append(f"  {why}")
    lines.append(f"errors:    {len(s['errors'])}")
    for e in s["errors"][:20]:
        lines.append(f"  [{e['source']}] {e['message']}")
    if len(s["errors"]) > 20:
        lines.append(f"  ... {len(s['errors']) - 20} more (use --json)")
    lines.append(f"missing:   {len(s['missing_metrics'])}")
    for m in s["missing_metrics"][:30]:
        dev = "node" if m["device"] < 0 else f"gpu {m['device']}"
        lines.append(f"  [{m['source']}] {dev} {m['metric']}: {m['reason']}")
    if len(s["missing_metrics"]) > 30:
        lines.append(f"  ... {len(s['missing_metrics']) - 30} more (use --json)")
    return "\n".join(lines)


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def inspect(ctx: click.Context, file: str, as_json: bool) -> None:
    """Summarize a node trace: sources, rates, span, record counts, drops, errors, missing metrics."""
    from gpuprof.collector.reader import open_node_trace, summarize

    try:
        s = summarize(open_node_trace(file))
    except GpuprofError as e:
        click.echo(f"gpuprof inspect: {e}", err=True)
        ctx.exit(2)
    click.echo(json.dumps(s, sort_keys=True) if as_json else format_summary(s))
