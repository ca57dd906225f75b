"""`gpuprof collect` and `gpuprof inspect`: thin click wrappers over gpuprof.collector.daemon and reader."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment
from gpuprof.collector import modes as modes_mod
from gpuprof.collector.errors import GpuprofError


def _config(ctx: click.Context) -> dict[str, dict[str, Any]]:
    path = (ctx.find_root().obj or {}).get("config_path") if ctx.find_root().obj else None
    return config_mod.load(path)


M_ARENA_MAX = -8  # glibc's mallopt parameter
MALLOC_ARENAS = 2


def few_malloc_arenas() -> bool:
    """At most MALLOC_ARENAS malloc arenas in this process (as MALLOC_ARENA_MAX=2 would), before
    any thread starts; False where the C library has no mallopt. glibc gives a thread that
    allocates an arena of its own, up to 8 per core, and keeps each arena's freed memory: with
    the collector's fifteen threads that was 13 MB of resident set (tests/bench/bench_collector.py,
    default modes: 110 -> 97 MB). The threads' allocations are small and brief; the lock they
    now share is not contended."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_ARENA_MAX, MALLOC_ARENAS))


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
        return modes_mod.parse_modes(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--modes") from None


@click.command("collect")
@click.option("--job", "job_id", metavar="JOBID", help="Slurm job to observe (its cgroup, else scontrol listpids).")
@click.option("--pid", type=int, metavar="PID", help="Observe this process and its descendants (by hand, or fallback).")
@click.option("--node", metavar="NODE", help="Slurm node name (default: $SLURMD_NODENAME, else the host name).")
@click.option("--uid", type=int, metavar="UID", help="Job owner's uid (narrows the cgroup lookup).")
@click.option("--modes", metavar="MODES", default=None, help="Comma list of metrics,stacks,collectives,kernels "
              "(default: metrics,stacks,collectives).")
@click.option("--output", "-o", required=False, type=click.Path(dir_okay=False),
              help="Node trace file to write (.h5); required unless --continuous.")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None,
              help="Unix socket for status/flush/seal (mode 0600).")
@click.option("--duration", type=float, default=None, metavar="S", help="Stop and seal after S seconds.")
@click.option("--nice", type=int, default=None, help="Nice value (default: config hooks.collector_nice).")
@click.option("--gpus", type=click.Choice(["job", "all"]), default=None,
              help="Which GPUs: the job's (default, from config sources.nvml.gpus) or all.")
@click.option("--continuous", is_flag=True, help="Always-on node collector: every job of the node, the last "
              "[continuous] retention_min minutes kept for `gpuprof export --last` (docs/continuous.md).")
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
    continuous: bool,
) -> None:
    """Record one node's trace for a job (or a process tree) until SIGINT/SIGTERM, --duration or seal."""
    environment.single_threaded_blas()  # before the daemon's imports load numpy
    from gpuprof.collector.daemon import Collector, CollectorOptions

    few_malloc_arenas()
    # a crash (SIGSEGV in a native part, an abort) leaves every thread's Python stack on stderr, the
    # collector's log, which the epilog quotes when the collector did not seal
    faulthandler.enable()
    if continuous:
        _collect_continuous(ctx, node, modes, control_socket, duration, nice)
        return
    if output is None:
        raise click.UsageError("Missing option '--output' / '-o'.")
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
    _leave(rc)


EXPORT_WAIT_AT_EXIT_S = 10.0  # a continuous collector's triggered export in flight when it stops


def _leave(rc: int) -> None:
    """The end of a collector process, once run() returned (sealed, or what was flushed is on
    disk): without the interpreter's exit handlers and finalization. After a failed write HDF5 would
    retry the writes when it closes the file at exit and, on a full disk, crash (SIGSEGV in
    libhdf5). And a daemon thread still inside h5py when the stop came (a continuous collector's
    triggered export) is frozen by the finalization holding h5py's global lock, which the
    finalization's own release of h5py objects then waits for forever (seen under load: main thread
    in Py_FinalizeEx -> h5py ObjectID dealloc -> lock acquire, in gdb). The BPF programs and probes
    the process holds by descriptor are detached by the kernel as the descriptors close."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _collect_continuous(ctx: click.Context, node: str | None, modes: str | None, control_socket: str | None,
                        duration: float | None, nice: int | None) -> None:
    """`gpuprof collect --continuous`: the always-on collector of collector/continuous.py."""
    from gpuprof.collector.continuous import ContinuousCollector, continuous_config
    from gpuprof.collector.daemon import CollectorOptions

    if duration is not None and duration <= 0:
        raise click.BadParameter("must be positive", param_hint="--duration")
    try:
        cfg = continuous_config(_config(ctx))
    except GpuprofError as e:
        click.echo(f"gpuprof collect: {e}", err=True)
        ctx.exit(2)
    _setup_logging(str(cfg["paths"]["log_file"]))
    c = cfg["continuous"]
    here = node or environment.get(environment.SLURMD_NODENAME) or os.uname().nodename
    for key in ("spill_dir", "export_dir"):  # {node}: several slurmd on one host, one collector each
        c[key] = str(c[key]).replace("{node}", here)
    opts = CollectorOptions(
        output=Path(str(c["spill_dir"]) or "/dev/null"),
        modes=_modes(modes or str(c["modes"])),
        config=cfg,
        node=here,
        duration_s=duration,
        nice=nice if nice is not None else int(cfg["hooks"]["collector_nice"]),
    )
    try:
        from gpuprof.collector.watch import socket_for

        assert opts.node is not None
        sock = Path(control_socket or socket_for(str(c["socket"]), opts.node))
        collector = ContinuousCollector(opts, socket_path=sock)
        from gpuprof.collector.prometheus import attach_prometheus

        attach_prometheus(collector, cfg["prometheus"])
        rc = collector.run()
    except GpuprofError as e:
        click.echo(f"gpuprof collect: {e}", err=True)
        ctx.exit(2)
    if not collector.wait_for_exports(EXPORT_WAIT_AT_EXIT_S):
        logging.getLogger("gpuprof.collector").warning(
            "a triggered export was still being written after %.0f s: left unsealed", EXPORT_WAIT_AT_EXIT_S)
    _leave(rc)


@click.command("export-window")
@click.option("--last", "last", required=True, metavar="DURATION", help="How far back: 300s, 5m, 1h.")
@click.option("--job", "job_id", default=None, metavar="JOBID", help="Only this job's processes (yours, or any as root).")
@click.option("--node", "nodes", default=None, metavar="NODES",
              help="Comma list of nodes: each exports through `srun --overlap` on it (default: this node).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=True),
              help="Node file (.h5); with several nodes, a directory of <node>.h5 for `gpuprof merge`.")
@click.option("--socket", "socket_path", default=None, help="Continuous collector socket (default: config).")
@click.option("--json", "as_json", is_flag=True, help="Print the collector's reply as JSON.")
@click.pass_context
def export_window(ctx: click.Context, last: str, job_id: str | None, nodes: str | None, output: str,
                  socket_path: str | None, as_json: bool) -> None:
    """Write a v1 node file of the last DURATION from this node's continuous collector."""
    from gpuprof.collector.continuous import export_to_file, parse_duration

    try:
        last_s = parse_duration(last)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--last") from None
    if job_id is not None and not job_id.isdigit():
        raise click.BadParameter("a job id is digits", param_hint="--job")
    try:
        cfg = _config(ctx)
    except GpuprofError as e:
        click.echo(f"gpuprof export: {e}", err=True)
        ctx.exit(2)
    from gpuprof.collector.watch import socket_for

    here = environment.get(environment.SLURMD_NODENAME) or os.uname().nodename
    sock = socket_path or socket_for(str(cfg["continuous"]["socket"]), here)
    targets = [n for n in (nodes or "").split(",") if n] or [here]
    if targets != [here]:
        _export_nodes(ctx, targets, last, job_id, Path(output), sock)
        return
    out = Path(output)
    if out.is_dir():
        out = out / f"{here}.h5"
    try:
        reply = export_to_file(sock, out, last_s=last_s, job=job_id)
    except GpuprofError as e:
        click.echo(f"gpuprof export: {e}", err=True)
        ctx.exit(2)
    if as_json:
        click.echo(json.dumps(reply, sort_keys=True))
    elif reply.get("ok"):
        w = reply["window"]
        click.echo(f"{out}: {w['have_s']:.0f} s of {w['asked_s']:.0f} s asked, {reply['bytes']} bytes"
                   + (f"; {w['note']}" if w.get("note") else ""))
    else:
        click.echo(f"gpuprof export: {reply.get('error')}", err=True)
    ctx.exit(0 if reply.get("ok") else 1)


def _export_nodes(ctx: click.Context, nodes: list[str], last: str, job_id: str | None, out_dir: Path,
                  sock: str) -> None:
    """One `srun --overlap` step per node runs the export there, into OUT_DIR/<node>.h5 (a shared
    filesystem, like the job's output directory); the files merge with `gpuprof merge OUT_DIR`."""
    import shutil
    import subprocess

    srun = shutil.which("srun")
    if srun is None:
        click.echo("gpuprof export: --node needs srun (an allocation or a job to step into)", err=True)
        ctx.exit(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for n in nodes:
        cmd = [srun, "--overlap", "-N1", "-n1", "-w", n] + (["--jobid", job_id] if job_id else []) + [
            "gpuprof", "export", "--last", last, "--socket", sock, "-o", str(out_dir / f"{n}.h5")
        ] + (["--job", job_id] if job_id else [])
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        click.echo(f"{n}: " + (r.stdout.strip() or r.stderr.strip()))
        failed += r.returncode != 0
    ctx.exit(1 if failed else 0)


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


@click.command("prepare")
@click.option("--modes", default=None, metavar="MODES",
              help="The job modes to prepare for, as --profile-gpu takes them (default: metrics,stacks,collectives).")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as one JSON object.")
@click.pass_context
def prepare(ctx: click.Context, modes: str | None, as_json: bool) -> None:
    """Do ahead what a node's first profiled job would do at its start: compile the BPF object and keep
    its image, and compile the CFI tables of the node's runtime libraries (run as root at boot, and
    after an upgrade of gpuprof or BCC: etc/gpuprof-prepare.service). Exit 1, saying why, when BPF
    cannot run here or collector.bpf_object_cache is off."""
    from gpuprof.collector.prepare import prepare_node
    from gpuprof.collector.sources.base import SourceUnavailable

    cfg = _config(ctx)
    try:
        done = prepare_node(cfg, _modes(modes))
    except SourceUnavailable as e:
        click.echo(f"gpuprof prepare: no BPF object kept: {e}", err=True)
        ctx.exit(1)
    if as_json:
        click.echo(json.dumps(done, sort_keys=True))
    else:
        line = f"gpuprof prepare: modes {done['modes']}: {done['state']}"
        if "cpu_s" in done:
            line += f" ({done['cpu_s']} s CPU, {done['wall_s']} s){': ' + done['image'] if done['kept'] else ''}"
        if "cfi_prewarm_files" in done:
            line += (f"; CFI prewarm {done['cfi_prewarm']}: {done['cfi_prewarm_files']} runtime libraries, "
                     f"{done['cfi_tables_compiled']} tables compiled now ({done['cfi_prewarm_wall_s']} s)")
        elif "cfi_prewarm" in done:
            line += f"; CFI prewarm {done['cfi_prewarm']}"
        click.echo(line)
        for problem in done.get("problems", []):
            click.echo(f"gpuprof prepare: {problem}", err=True)
    ctx.exit(0 if done["kept"] or not done["switches"] else 1)


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


@click.command("status")
@click.argument("job_id", metavar="JOBID")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: node -> the collector's status.")
@click.pass_context
def status(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Ask the running collectors of JOBID on this host what they have recorded so far (rows per
    table, drops, sources, errors). Root only: the control sockets are root's (docs/collector.md).
    Exit 1 when no collector of the job answers here."""
    from gpuprof.collector.control import request

    if not job_id.replace("_", "").isdigit():
        raise click.BadParameter("a job id is digits (array jobs: <array>_<task>)", param_hint="JOBID")
    if os.geteuid() != 0:
        click.echo("gpuprof status: root only (the collectors' control sockets are root's); on the node: "
                   f"sudo gpuprof status {job_id}", err=True)
        ctx.exit(2)
    cfg = _config(ctx)
    jobs = Path(str(cfg["paths"]["state_dir"])) / "jobs"
    found: dict[str, dict[str, Any]] = {}
    for d in sorted(jobs.glob(f"{job_id}@*")) if jobs.is_dir() else []:
        node = d.name.split("@", 1)[1]
        sock = d / "control.sock"
        if d.is_symlink() or not sock.is_socket():
            found[node] = {"state": "no collector socket (continuous collector, or not started)"}
            continue
        try:
            found[node] = request(sock, "status", timeout_s=5.0)
        except GpuprofError as e:
            found[node] = {"state": "not answering", "error": str(e)}
    if as_json:
        click.echo(json.dumps(found, sort_keys=True))
    elif not found:
        click.echo(f"gpuprof status: no collector of job {job_id} on this host ({jobs})", err=True)
    for node, st in sorted(found.items()) if not as_json else ():
        rows = st.get("records") or {}
        drops = sum((st.get("drops") or {}).values())
        click.echo(f"{node}: {st.get('state')}, {st.get('pids', 0)} job processes, "
                   + ", ".join(f"{k} {v}" for k, v in sorted(rows.items()) if v) + f"; drops {drops}"
                   + (f"; errors: {'; '.join(_error_text(e) for e in st['errors'][:3])}" if st.get("errors") else "")
                   + (f"; {st['error']}" if st.get("error") else ""))
    ctx.exit(0 if any(s.get("state") == "recording" for s in found.values()) else 1)


def _error_text(e: Any) -> str:
    """A collector's error row as one phrase: 'source: message'."""
    return f"{e.get('source', '?')}: {e.get('message', '')}" if isinstance(e, dict) else str(e)
