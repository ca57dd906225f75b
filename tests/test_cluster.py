"""The local Slurm cluster and the built SPANK plugin."""

from __future__ import annotations

import subprocess
import time

import pytest

pytestmark = pytest.mark.slurm

EXPORTED = {
    "plugin_name",
    "plugin_type",
    "plugin_version",
    "spank_plugin_version",
    "slurm_spank_init",
    "slurm_spank_init_post_opt",
    "slurm_spank_user_init",
}


def test_four_nodes_idle(cluster):
    deadline = time.monotonic() + 60  # jobs of earlier tests may still be completing
    while True:
        states = cluster.node_states()
        if sorted(states) == ["node1", "node2", "node3", "node4"] and set(states.values()) == {"idle"}:
            break
        assert time.monotonic() < deadline, states
        time.sleep(1)


def test_cluster_up_is_idempotent(cluster):
    pids = {p.name: p.read_text() for p in (cluster.dir / "run").glob("**/slurm*.pid")}
    assert len(pids) == 5, pids
    proc = subprocess.run(
        [str(cluster.repo / "etc/dev/cluster-up.sh")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "already running" in proc.stdout
    assert {p.name: p.read_text() for p in (cluster.dir / "run").glob("**/slurm*.pid")} == pids


def test_config_has_suite_settings(cluster):
    out = cluster.run(["scontrol", "show", "config"], check=True).stdout
    conf = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            conf[key.strip()] = value.strip()
    bindir = str(cluster.dir / "bin")
    assert conf["Prolog"] == f"{bindir}/prolog"
    assert conf["Epilog"] == f"{bindir}/epilog"
    assert conf["TaskProlog"] == f"{bindir}/task-prolog"
    # as sites run it: slurmctld unprivileged, so no EpilogSlurmctld (the first node's Epilog submits
    # the merge as the job's user)
    assert conf["SlurmUser"].startswith("slurm")
    assert conf.get("EpilogSlurmctld", "(null)") in ("(null)", "")
    assert conf["PlugStackConfig"] == str(cluster.dir / "plugstack.conf")
    assert "Alloc" in conf["PrologFlags"]
    assert conf["MinJobAge"].startswith("300")
    assert conf["SelectType"] == "select/cons_tres"
    assert conf["ProctrackType"] in ("proctrack/cgroup", "proctrack/linuxproc")


def test_plugin_exports_only_its_symbols(cluster):
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(cluster.spank_so)], capture_output=True, text=True, check=True
    ).stdout
    symbols = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert symbols == EXPORTED


def _conf_with_plugstack(cluster, tmp_path, plugstack_line: str):
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text(plugstack_line + "\n")
    lines = []
    for line in cluster.conf.read_text().splitlines():
        if line.startswith("PlugStackConfig="):
            line = f"PlugStackConfig={plugstack}"
        lines.append(line)
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def test_unknown_plugstack_argument_fails_init(cluster, tmp_path):
    conf = _conf_with_plugstack(cluster, tmp_path, f"required {cluster.spank_so} bogus_arg=1")
    proc = cluster.run(["sbatch", "--test-only", "--wrap", "true"], env={"SLURM_CONF": str(conf)})
    assert proc.returncode != 0
    assert 'unknown plugstack.conf argument "bogus_arg=1"' in proc.stderr


def test_plugstack_without_arguments_loads(cluster, tmp_path):
    conf = _conf_with_plugstack(cluster, tmp_path, f"required {cluster.spank_so}")
    proc = cluster.run(
        ["sbatch", "--test-only", "--profile-gpu=metrics", "--wrap", "true"], env={"SLURM_CONF": str(conf)}
    )
    assert proc.returncode == 0, proc.stderr
