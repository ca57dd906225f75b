"""Builds and configures the NVML test double (fake_nvml.c) for the tests and the benchmark.

Emulated values are never measurements: files written with the double carry GPU names
"Emulated GPU (gpuprof test double)" and the attribute emulated_gpus once sealed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_nvml.c"
BUILD_DIR = HERE / "build"
LIBRARY = BUILD_DIR / "libnvidia-ml.so.1"


class DoubleUnavailable(Exception):
    """No C compiler: the NVML tests cannot run on this machine."""


def build() -> Path:
    """Compile the double if it is missing or older than its source; returns the library path."""
    if LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LIBRARY
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise DoubleUnavailable("no C compiler (gcc/cc) to build tests/nvml_double/fake_nvml.c")
    BUILD_DIR.mkdir(exist_ok=True)
    tmp = LIBRARY.with_suffix(".tmp")
    subprocess.run(
        [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-fvisibility=hidden", "-shared",
         "-Wl,-soname,libnvidia-ml.so.1", "-o", str(tmp), str(SOURCE), "-lpthread"],
        check=True,
    )
    tmp.replace(LIBRARY)  # atomic: a parallel test run never loads a half-written library
    return LIBRARY


def write_config(path: Path, **keys: object) -> Path:
    """A GPUPROF_FAKE_NVML_CONFIG file; keys like gpu1__lost_after become gpu1.lost_after."""
    lines = []
    for k, v in keys.items():
        if isinstance(v, (list, tuple)):
            v = ",".join(str(x) for x in v)
        lines.append(f"{k.replace('__', '.')} = {v}")
    path.write_text("\n".join(lines) + "\n")
    return path
