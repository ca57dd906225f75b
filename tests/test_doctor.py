"""`gpuprof doctor` on the local cluster's node: each check ok or missing with the fix."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import Cluster

GPUPROF = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "gpuprof")


def doctor(cluster: Cluster, *args: str, env: dict[str, str] | None = None) -> tuple[int, list[dict]]:
    p = subprocess.run([GPUPROF, *args, "doctor", "--json"], env={**cluster.env, **(env or {})},
                       capture_output=True, text=True, timeout=60, check=False)
    return p.returncode, json.loads(p.stdout)


@pytest.mark.slurm
def test_doctor_on_a_configured_node(cluster: Cluster) -> None:
    rc, checks = doctor(cluster)
    by = {c["name"]: c for c in checks}
    for name in ("config", "slurm", "plugstack", "spank-plugin", "sbatch-option", "munge", "mpi", "hdf5",
                 "install-permissions"):
        assert by[name]["ok"], by[name]
    assert not by["nvml"]["ok"] and "driver" in by["nvml"]["fix"]  # no GPU here: said, not fatal
    assert rc == 0


@pytest.mark.slurm
def test_doctor_names_a_bad_config_key(cluster: Cluster, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[collector]\nmemory_limit_mb = \"lots\"\n")
    rc, checks = doctor(cluster, "--config", str(bad))
    cfg = next(c for c in checks if c["name"] == "config")
    assert rc == 1 and not cfg["ok"] and "collector.memory_limit_mb" in cfg["detail"]


@pytest.mark.slurm
def test_doctor_without_plugstack(cluster: Cluster, tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(ln for ln in cluster.conf.read_text().splitlines()
                              if not ln.startswith("PlugStackConfig")) + "\n")
    rc, checks = doctor(cluster, env={"SLURM_CONF": str(conf)})
    by = {c["name"]: c for c in checks}
    assert rc == 1 and not by["plugstack"]["ok"] and "PlugStackConfig" in by["plugstack"]["fix"]
