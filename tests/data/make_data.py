"""Regenerates the small node files in tests/data/<edge-case>/ with the suite's own collector.

Run from the checkout: .venv/bin/python tests/data/make_data.py
Each case has node.h5 and expect.json ({"ok": true, "partial": bool} or {"error": "<substring>"});
tests/test_trace_format.py opens every one. GPU values in them come from the NVML test double.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "nvml_double"))
import double

from gpuprof.collector.control import request
from gpuprof.collector.errors import CollectorError
from gpuprof.collector.writer import recover


def case(name: str, expect: dict[str, object]) -> Path:
    d = HERE / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    (d / "expect.json").write_text(json.dumps(expect, sort_keys=True) + "\n")
    return d / "node.h5"


def collect(out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuprof.slurm_hooks.cli", "collect", "--modes", "metrics", "--pid", str(os.getpid()),
         "--gpus", "all", "--output", str(out), *extra], env=env)


def main() -> None:
    lib = double.build()
    tmp = HERE / ".tmp"
    tmp.mkdir(exist_ok=True)
    conf = double.write_config(tmp / "fake.conf", gpus=2, gpu1__unsupported="power,gpm")
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPUPROF_NVML_LIBRARY=str(lib), GPUPROF_FAKE_NVML_CONFIG=str(conf))

    sealed = case("sealed-metrics", {"ok": True, "partial": False})
    assert collect(sealed, env, "--duration", "0.6").wait(60) == 0

    killed = case("killed-unsealed", {"ok": True, "partial": True})
    sock = tmp / "c.sock"
    p = collect(killed, env, "--control-socket", str(sock))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if request(sock, "status", 2)["state"] == "recording":
                break
        except CollectorError:
            pass
        time.sleep(0.05)
    time.sleep(0.5)
    request(sock, "flush", 10)
    p.send_signal(signal.SIGKILL)
    p.wait()

    recovered = case("recovered", {"ok": True, "partial": True})
    recover(killed, recovered, "collector killed (tests/data)")

    truncated = case("truncated", {"error": "cannot be opened"})
    data = sealed.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])

    case("not-hdf5", {"error": "not an HDF5 file"}).write_text("PID JOBID\n42 7\n")

    other = case("other-schema", {"error": "schema is 'someone.else'"})
    shutil.copy(sealed, other)
    with h5py.File(other, "r+") as f:
        f.attrs["schema"] = "someone.else"

    newer = case("newer-version", {"error": "newer than this reader supports"})
    shutil.copy(sealed, newer)
    with h5py.File(newer, "r+") as f:
        f.attrs["schema_version"] = 2

    no_attrs = case("plain-hdf5", {"error": "root attribute 'schema' missing"})
    with h5py.File(no_attrs, "w") as f:
        f["x"] = [1, 2, 3]

    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
