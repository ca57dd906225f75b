"""`gpuprof doctor`: is this node ready to profile? Each check says ok or missing, and the fix."""

from __future__ import annotations

import ctypes.util
import importlib
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuprof.collector import config as config_mod
from gpuprof.collector import environment as env
from gpuprof.collector.errors import ConfigError


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str
    required: bool = True


def _cmd(args: list[str], timeout: float = 5.0) -> tuple[bool, str]:
    try:
        p = subprocess.run(args, capture_output=True, text=True, check=False, timeout=timeout)
    except FileNotFoundError:
        return False, f"{args[0]} not found"
    except subprocess.TimeoutExpired:
        return False, f"{' '.join(args)} timed out"
    out = (p.stdout or p.stderr).strip().splitlines()
    return p.returncode == 0, out[0] if out else f"exit {p.returncode}"


def _slurm_conf_value(key: str) -> str | None:
    """The key as this host's slurm.conf sets it (client commands read the local file, so the
    controller's view from `scontrol show config` is not the one that matters here)."""
    path = Path(env.get(env.SLURM_CONF) or "/etc/slurm/slurm.conf")
    try:
        text = path.read_text()
    except OSError:
        return None
    value = None
    for line in text.splitlines():
        k, sep, v = line.split("#", 1)[0].partition("=")
        if sep and k.strip().lower() == key.lower():
            value = v.strip()
    return value


def writable_by_others(roots: list[Path], limit: int = 5) -> list[str]:
    """Paths of the install that someone other than root could change: in the trees under roots
    (every file and directory) and every directory above them, what is not owned by root or is
    writable by group or others (a sticky directory above a root, like /tmp, is fine: nobody can
    replace what root put there). Symlinks are judged by what they point to. At most `limit`."""
    bad: list[str] = []
    seen: set[str] = set()

    def judge(path: str, ancestor: bool) -> None:
        if path in seen or len(bad) >= limit:
            return
        seen.add(path)
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            return  # its target is judged on its own (realpath of the roots; links inside: skipped)
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if ancestor and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            writable = 0
        if st.st_uid != 0:
            bad.append(f"{path} (owner uid {st.st_uid})")
        elif writable:
            bad.append(f"{path} (mode {stat.filemode(st.st_mode)})")

    for root in roots:
        real = os.path.realpath(root)
        for parent in Path(real).parents:
            judge(str(parent), True)
        if os.path.isdir(real):
            for dirpath, dirnames, filenames in os.walk(real):
                judge(dirpath, False)
                for name in filenames:
                    judge(os.path.join(dirpath, name), False)
                dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        else:
            judge(real, False)
    return bad


def install_roots(cfg: dict[str, Any] | None) -> list[Path]:
    """What the hooks run as root: the gpuprof packages, the BPF sources and interposers, the
    Python that runs them (its executable and its environment: a writable site-packages is code
    run as root) and hooks.collector_python when set."""
    roots: list[Path] = []
    for name in ("gpuprof.collector", "gpuprof.slurm_hooks", "gpuprof.mpi_merge"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__file__:
            roots.append(Path(mod.__file__).parent)
    from gpuprof.collector.bpf_support import BPF_DIR

    roots.append(Path(BPF_DIR))
    roots.append(Path(sys.executable))
    roots.append(Path(sys.prefix))
    if cfg and cfg["hooks"]["collector_python"]:
        roots.append(Path(cfg["hooks"]["collector_python"]))
    return roots


def run_checks(config_path: str | None) -> tuple[list[Check], dict[str, Any] | None]:
    checks: list[Check] = []
    cfg: dict[str, Any] | None = None
    try:
        cfg = config_mod.load(config_path)
        src = config_mod.config_path(config_path)
        checks.append(Check("config", True, f"{src or 'built-in defaults'} valid", ""))
    except ConfigError as e:
        checks.append(Check("config", False, str(e), "fix the named key or file (docs/config.md)"))

    ok, detail = _cmd(["scontrol", "--version"])
    checks.append(Check("slurm", ok, detail, "apt-get install slurm-wlm (and set SLURM_CONF if not /etc/slurm)"))
    plugstack = _slurm_conf_value("PlugStackConfig") if ok else None
    if plugstack:
        text = Path(plugstack).read_text() if Path(plugstack).exists() else ""
        so = [
            ln.split()[1]
            for ln in text.splitlines()
            if ln.split()[:1] in (["required"], ["optional"]) and len(ln.split()) > 1 and "gpuprof_spank" in ln
        ]
        found = bool(so) and Path(so[0]).exists()
        checks.append(Check("plugstack", bool(so), f"{plugstack}: {'lists gpuprof_spank' if so else 'no gpuprof line'}",
                            "add the line of etc/plugstack.conf to it (docs/slurm.md)"))
        checks.append(Check("spank-plugin", found, so[0] if so else "not configured",
                            "make -C slurm_hooks/spank and point plugstack.conf at the .so"))
    else:
        checks.append(Check("plugstack", False, "PlugStackConfig not set in slurm.conf",
                            "set PlugStackConfig= in slurm.conf (sbatch reads it only then)"))
    ok_sb, help_text = False, ""
    try:
        p = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, check=False, timeout=5)
        help_text = p.stdout
        ok_sb = "--profile-gpu" in help_text
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    checks.append(Check("sbatch-option", ok_sb, "sbatch --help lists --profile-gpu" if ok_sb else "option missing",
                        "check plugstack.conf and the plugin path"))

    ok, detail = _cmd(["munge", "-n"])
    checks.append(Check("munge", ok, "credential created" if ok else detail, "start munged (systemctl start munge)"))

    from gpuprof.collector.bpf_support import bpf_doctor

    bpf_checks = bpf_doctor()
    for name, ok, fix in bpf_checks:
        checks.append(Check(name, ok, "ok" if ok else "unavailable", fix, required=False))
    if cfg and all(ok for _, ok, _ in bpf_checks):
        from gpuprof.collector.bpf_support import kept_image
        from gpuprof.collector.modes import DEFAULT_MODES

        image = kept_image(cfg, DEFAULT_MODES)
        if image is not None:
            checks.append(Check("bpf-object-prepared", bool(image), image or (
                "no BPF object kept for the default modes: the node's next profiled job compiles it at its start"),
                "gpuprof prepare (at boot: etc/gpuprof-prepare.service)", required=False))

    nvml = ctypes.util.find_library("nvidia-ml") or env.get(env.GPUPROF_NVML_LIBRARY)
    checks.append(Check("nvml", bool(nvml), nvml or "libnvidia-ml not found",
                        "install the NVIDIA driver (GPU metrics are skipped without it)", required=False))
    dcgmi = cfg["dcgm"]["dcgmi"] if cfg else "/usr/bin/dcgmi"
    has_dcgmi = os.access(dcgmi, os.X_OK)
    checks.append(Check("dcgmi", has_dcgmi, dcgmi if has_dcgmi else f"{dcgmi} not found (DCGM lock is a no-op)",
                        "install DCGM or set dcgm.dcgmi; without it nothing conflicts with the profiler",
                        required=False))
    mpirun = shutil.which("mpirun")
    checks.append(Check("mpi", bool(mpirun), mpirun or "mpirun not found",
                        "apt-get install openmpi-bin (the merge runs under MPI)"))
    try:
        import h5py

        checks.append(Check("hdf5", True, f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}", ""))
    except ImportError as e:
        checks.append(Check("hdf5", False, str(e), "pip install h5py"))
    roots = install_roots(cfg)
    bad = writable_by_others(roots)
    checks.append(Check("install-permissions", not bad,
                        "the install and its Python are writable by root only" if not bad
                        else "writable by others than root: " + "; ".join(bad),
                        "chown -R root:root and chmod -R go-w the paths named (the hooks run this code as root)"))
    if cfg:
        sd = Path(cfg["paths"]["state_dir"])
        writable = os.access(sd if sd.exists() else sd.parent, os.W_OK)
        checks.append(Check("state-dir", writable, str(sd), "run the hooks as root or change paths.state_dir"))
    return checks, cfg
