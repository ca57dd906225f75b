"""The `gpuprof` CLI: it lists only commands that load, and the DCGM lock commands work end to end."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprof.slurm_hooks.cli import COMMANDS, cli

FAKE_DCGMI = Path(__file__).parent / "doubles" / "fake_dcgmi"


def test_help_lists_exactly_the_commands_and_each_loads() -> None:
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0
    listed = [ln.split()[0] for ln in r.output.split("Commands:")[1].splitlines() if ln.strip()]
    assert listed == sorted(COMMANDS)
    for name in COMMANDS:
        sub = CliRunner().invoke(cli, [name, "--help"])
        assert sub.exit_code == 0, f"gpuprof {name} --help: {sub.output}"


@pytest.mark.skipif(not FAKE_DCGMI.exists(), reason="test double missing")
def test_site_pause_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_DCGMI_LOG", str(calls))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path}/state"\n[dcgm]\ndcgmi = "{FAKE_DCGMI}"\n')
    run = CliRunner().invoke
    assert "action pause (ok)" in run(cli, ["--config", str(cfg), "dcgm", "site-pause"]).output
    assert '"site"' in run(cli, ["--config", str(cfg), "dcgm", "status"]).output
    assert "action resume (ok)" in run(cli, ["--config", str(cfg), "dcgm", "site-resume"]).output
    assert calls.read_text().splitlines() == ["profile --pause", "profile --resume"]


def test_bad_config_is_named_by_dcgm_commands(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[dcgm]\ntimeout_s = 'soon'\n")
    r = CliRunner().invoke(cli, ["--config", str(cfg), "dcgm", "status"])
    assert r.exit_code != 0 and "dcgm.timeout_s" in r.output
