"""`gpuprof merge`, `gpuprof report`, `gpuprof export`: thin wrappers over merge.merge, report and export.

Exit status of merge: 0 complete, 3 partial (something missing or excluded, named in the report),
2 error. Under MPI (launch with `python -m mpi4py`), an error on any rank aborts every rank with the
message instead of leaving the others waiting.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from gpuprof.collector.environment import launched_by_mpirun, single_threaded_blas
from gpuprof.collector.errors import GpuprofError


def _comm() -> Any:
    """MPI's world communicator when launched by mpirun/srun, else the serial stand-in."""
    import os

    launched = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID"))
    if not launched:
        from gpuprof.mpi_merge.merge import SerialComm

        return SerialComm()
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _merge_config(ctx: click.Context) -> dict[str, Any]:
    from gpuprof.collector import config

    return config.load(ctx.obj.get("config_path") if ctx.obj else None)["merge"]


@click.command()
@click.argument("job_or_dir")
@click.option("--output-stem", default=None, help="Write STEM.gpuprof.{h5,txt,json,html} (default: beside the node dir).")
@click.option("--expect-nodes", default=None, help="Comma list of the job's nodes: a node without a file is reported.")
@click.option("--reference", default=None, help="Reference node of the clock alignment.")
@click.option("--quiet", is_flag=True, help="Do not print the text report.")
@click.option("--progress/--no-progress", default=None,
              help="Progress lines per step on stderr (default: on when stderr is a terminal).")
@click.pass_context
def merge(ctx: click.Context, job_or_dir: str, output_stem: str | None, expect_nodes: str | None,
          reference: str | None, quiet: bool, progress: bool | None) -> None:
    """Merge a job's node files (JOB id or directory) into one job file and reports."""
    single_threaded_blas()  # one rank per core: before numpy loads its BLAS
    from gpuprof.mpi_merge import merge as m
    from gpuprof.mpi_merge.clock import ClockParams
    from gpuprof.mpi_merge.stragglers import StragglerParams

    comm = _comm()
    try:
        cfg = _merge_config(ctx)
        res = m.merge(
            job_or_dir, comm=comm, output_stem=output_stem,
            expect_nodes=[n for n in expect_nodes.split(",") if n] if expect_nodes else None,
            reference=reference if reference is not None else cfg["reference_node"],
            clock_params=ClockParams(window_s=float(cfg["clock_window_s"]),
                                     max_bound_width_us=float(cfg["clock_max_bound_width_us"])),
            straggler_params=StragglerParams(window_s=float(cfg["straggler_window_s"]),
                                             score_threshold=float(cfg["straggler_score_threshold"])),
            show_progress=sys.stderr.isatty() if progress is None else progress,
        )
    except (GpuprofError, OSError) as e:
        click.echo(f"gpuprof merge: error on rank {comm.Get_rank()}: {e}", err=True)
        if comm.Get_size() > 1:
            comm.Abort(m.EXIT_ERROR)
        sys.exit(m.EXIT_ERROR)
    if res is None:  # not rank 0
        return
    if not quiet:
        click.echo(res.reports["txt"].read_text(), nl=False)
    click.echo(f"gpuprof merge: {res.status}: {res.job_file} (+ .txt .json .html) in {res.seconds:.1f} s", err=True)
    if res.exit_code != 0 and launched_by_mpirun():
        # A partial result is a result, not a crash: `python -m mpi4py` turns any non-zero
        # SystemExit into MPI_Abort (with its alarming banner), so finalize MPI and leave directly.
        from mpi4py import MPI

        sys.stdout.flush()
        sys.stderr.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
        os._exit(res.exit_code)
    sys.exit(res.exit_code)


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]), default="text", show_default=True)
@click.option("--text", "fmt", flag_value="text", help="The text report (same as --format text).")
@click.option("--json", "fmt", flag_value="json", help="The JSON report (same as --format json).")
@click.option("--html", "fmt", flag_value="html",
              help="Redraw the HTML page from the job file (written beside it as STEM.gpuprof.html unless -o).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write the report to this file instead of stdout (html: instead of beside the job file).")
def report(job_file: str, fmt: str, output: str | None) -> None:
    """Print or regenerate a report from a merged job file: text, JSON or the HTML page."""
    from gpuprof.mpi_merge.export import load_report
    from gpuprof.mpi_merge.report import render_json, render_text, write_report

    try:
        if fmt == "html":
            from gpuprof.mpi_merge.html_report import html_path_of, render_html_file

            out = Path(output) if output else html_path_of(Path(job_file))
            write_report(out, render_html_file(job_file))
            click.echo(f"wrote {out}", err=True)
            return
        r = load_report(job_file)
        text = render_json(r) if fmt == "json" else render_text(r)
        if output:
            write_report(Path(output), text)
            click.echo(f"wrote {output}", err=True)
            return
    except (GpuprofError, OSError) as e:  # OSError: the output path (a directory, no permission)
        raise click.ClickException(str(e)) from None
    click.echo(text, nl=False)


@click.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["perfetto", "chrome-json", "perfetto-proto", "otf2", "collapsed",
                                                   "speedscope", "csv"]), required=True,
              help="perfetto/chrome-json: Chrome trace JSON; perfetto-proto: Perfetto's protobuf; otf2: an OTF2 "
                   "archive directory (open OUTPUT/traces.otf2 in Vampir or Scalasca)")
@click.option("--output", "-o", type=click.Path(), required=True, help="The file (otf2: the archive's directory).")
@click.option("--series", default="gpu0:util_gpu", show_default=True,
              help="csv: TABLE:COLUMN of one series across nodes, e.g. gpu/samples:util_gpu, host/node:cpu_busy")
def export(job_file: str, fmt: str, output: str, series: str) -> None:
    """Export a merged job file: Chrome trace JSON, Perfetto protobuf, OTF2, collapsed stacks, speedscope JSON or CSV."""
    from gpuprof.mpi_merge import export as ex

    try:
        n = ex.export(Path(job_file), fmt, Path(output), series=series)
    except GpuprofError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {output} ({n} records)", err=True)
