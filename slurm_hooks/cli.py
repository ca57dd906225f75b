"""`gpuprof`: one click CLI, a thin wrapper per subcommand over plain functions.

Each package contributes its own commands (gpuprof.slurm_hooks.commands, gpuprof.collector.cli, gpuprof.mpi_merge.cli);
they are imported lazily so that a hook pays only for what it runs.
"""

from __future__ import annotations

import importlib

import click

from gpuprof.collector import __version__

# command name -> (module, attribute). Only commands that work are listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "prolog": ("gpuprof.slurm_hooks.commands", "prolog"),
    "epilog": ("gpuprof.slurm_hooks.commands", "epilog"),
    "task-prolog": ("gpuprof.slurm_hooks.commands", "task_prolog"),
    "doctor": ("gpuprof.slurm_hooks.commands", "doctor"),
    "config": ("gpuprof.slurm_hooks.commands", "config_cmd"),
    "dcgm": ("gpuprof.slurm_hooks.commands", "dcgm"),
    "collect": ("gpuprof.collector.cli", "collect"),
    "prepare": ("gpuprof.collector.cli", "prepare"),
    "inspect": ("gpuprof.collector.cli", "inspect"),
    "status": ("gpuprof.collector.cli", "status"),
    "merge": ("gpuprof.mpi_merge.cli", "merge"),
    "report": ("gpuprof.mpi_merge.cli", "report"),
    # --last: the continuous collector's window, else mpi_merge.cli's export, unchanged (mpi_merge/continuous_cli.py)
    "export": ("gpuprof.mpi_merge.continuous_cli", "export"),
    "watch": ("gpuprof.mpi_merge.continuous_cli", "watch"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module = importlib.import_module(target[0])
        cmd = getattr(module, target[1])
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuprof")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Config file (default: $GPUPROF_CONFIG, then /etc/gpuprof/gpuprof.toml, then built-in defaults).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """slurm-gpuprof: profile GPU jobs across Slurm nodes, align clocks, name the straggler."""
    ctx.obj = {"config_path": config_path}


def main() -> None:
    cli(prog_name="gpuprof")


if __name__ == "__main__":
    main()
