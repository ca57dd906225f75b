"""Builds the C parts that travel in the wheel as package data: the fast-path interposers
(bpf/fastpath/build/) and the collector's native sampling library (collector/native/build/).
Everything else about the package is in pyproject.toml. The SPANK plugin needs Slurm's headers and
is built on the site (`make -C slurm_hooks/spank install`, docs/slurm.md), not here."""

import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
NATIVE_DIRS = ("bpf/fastpath", "collector/native")


class BuildNativeThenPy(build_py):
    """`make` in each native folder before the package data is collected, so build/ is in the wheel."""

    def run(self) -> None:
        for d in NATIVE_DIRS:
            try:
                subprocess.run(["make", "-s", "-C", str(HERE / d)], check=True)
            except (OSError, subprocess.CalledProcessError) as e:
                raise SystemExit(f"slurm-gpuprof: building {d} failed ({e}); a C compiler and make are needed")
        super().run()


class NativeDistribution(Distribution):
    """The wheel carries native libraries: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildNativeThenPy}, distclass=NativeDistribution)
