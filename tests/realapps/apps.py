"""The catalogue: real MPI applications from Debian (nobody here wrote them) and one mpi4py program
shaped like data-parallel training, each sized to run in well under a minute on 2 cores with one rank
per virtual node (`mpirun --oversubscribe` inside the batch script, as the demo does).

Each application knows its Debian package, how to write its input into the job's working directory,
its command line, and the name of its rank processes (`/proc/PID/comm`), by which the outside
injectors find a rank's pid in a node's Slurm job cgroup.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
TRAIN_APP = HERE / "train_app.py"
HPCC_EXAMPLE = Path("/usr/share/doc/hpcc/examples/_hpccinf.txt")


class AppUnavailable(RuntimeError):
    """The application (its Debian package or input) is not installed here."""


@dataclass(frozen=True)
class App:
    name: str
    package: str  # Debian package ('' for the program of this suite)
    doc: str
    nodes: int  # sbatch -N (one rank per node)
    argv: tuple[str, ...]  # the application's command line, after `mpirun ... [launcher]`
    comm: str  # /proc/PID/comm of a rank process
    prepare: Callable[[Path], None] = field(default=lambda work: None)
    # fault classes this application supports (the data-loading knob exists only in train)
    faults: tuple[str, ...] = ("balanced", "sigstop", "cpu_quota", "corunner", "slow_collectives")
    # extra arguments for the fault "load_sleep" (train only)
    load_sleep_argv: tuple[str, ...] = ()
    # CFS quota of the fault cpu_quota, in CPUs: below what one rank uses, so that it binds
    quota_cpus: float = 0.08

    def check(self) -> None:
        """Raise AppUnavailable naming what is missing."""
        exe = self.argv[0]
        if shutil.which(exe) is None and not Path(exe).exists():
            raise AppUnavailable(f"{self.name}: {exe} not found (apt-get install {self.package})")
        if self.name == "hpcc" and not HPCC_EXAMPLE.exists():
            raise AppUnavailable(f"hpcc: {HPCC_EXAMPLE} missing (reinstall the hpcc package)")


HPCC_N = 1200  # HPL's N in _hpcc_input's file


def _hpcc_input(work: Path) -> None:
    """A tiny hpccinf.txt from the package's example: HPL at N=HPCC_N on a 2x2 grid (every other
    part of HPCC sizes itself from it), about 20 s on 4 virtual nodes of 2 cores."""
    text = HPCC_EXAMPLE.read_text()
    if "1000         Ns" not in text:
        raise AppUnavailable(f"hpcc: {HPCC_EXAMPLE} has no '1000         Ns' line to resize")
    (work / "hpccinf.txt").write_text(text.replace("1000         Ns", f"{HPCC_N:<13}Ns"))


def hpcc_size(work: Path, n: int) -> None:
    """HPL's N in work/hpccinf.txt (_hpcc_input's is HPCC_N): every other part of HPCC sizes itself
    from the memory HPL's matrix takes, so the whole run grows with it (HPL as N^3)."""
    path = work / "hpccinf.txt"
    text = path.read_text()
    line = f"{HPCC_N:<13}Ns"
    if line not in text:
        raise AppUnavailable(f"hpcc: {path} has no {line!r} line to resize")
    path.write_text(text.replace(line, f"{n:<13}Ns"))


def hpcc_grid(work: Path, p: int, q: int) -> None:
    """HPL's process grid in work/hpccinf.txt (_hpcc_input's is 2x2, for 4 ranks): P x Q must be
    the job's rank count, else HPL is skipped."""
    path = work / "hpccinf.txt"
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        field = line.split(maxsplit=1)
        if len(field) == 2 and field[1].strip() in ("Ps", "Qs"):
            lines[i] = f"{p if field[1].strip() == 'Ps' else q:<13}{field[1]}"
    path.write_text("".join(lines))


MEEP_CTL = """\
; A 2-D dielectric waveguide driven by a continuous source (FDTD; meep splits the cell into one
; chunk per rank and exchanges the chunk boundaries every time step). Written for the suite.
(set! geometry-lattice (make lattice (size 32 8 no-size)))
(set! geometry (list (make block (center 0 0) (size infinity 1 infinity)
                           (material (make dielectric (epsilon 12))))))
(set! sources (list (make source (src (make continuous-src (frequency 0.15)))
                          (component Ez) (center -15 0))))
(set! pml-layers (list (make pml (thickness 1.0))))
(set! resolution 10)
(define (energy) (print "energy: " (meep-time) " " (field-energy-in-box (volume (center 0 0) (size 30 6))) "\\n"))
(run-until 1000 (at-every 2 energy))
"""


def _meep_input(work: Path) -> None:
    (work / "waveguide.ctl").write_text(MEEP_CTL)


APPS: dict[str, App] = {
    "train": App(
        name="train", package="", nodes=4, comm="python",
        doc="mpi4py data-parallel training loop (tests/realapps/train_app.py): load, matmul, Allreduce",
        argv=(str(PYTHON), str(TRAIN_APP), "--steps", "1500", "--load-s", "0.004"),
        faults=("balanced", "sigstop", "cpu_quota", "corunner", "load_sleep", "slow_collectives"),
        load_sleep_argv=("--load-extra-s", "0.012"), quota_cpus=0.08,
    ),
    "hpcc": App(
        name="hpcc", package="hpcc", nodes=4, comm="hpcc", prepare=_hpcc_input,
        doc="HPC Challenge (HPL, PTRANS, RandomAccess, FFT, STREAM, DGEMM, latency/bandwidth)",
        argv=("/usr/bin/hpcc",),
    ),
    "meep": App(
        name="meep", package="meep-openmpi", nodes=4, comm="meep", prepare=_meep_input,
        doc="Meep FDTD electromagnetics (halo exchange every step, an Allreduce for the field energy)",
        argv=("/usr/bin/meep", "waveguide.ctl"),
    ),
    "netpipe": App(
        name="netpipe", package="netpipe-openmpi", nodes=2, comm="NPopenmpi",
        faults=("balanced", "sigstop", "cpu_quota", "corunner"),  # next to no collectives to slow
        doc="NetPIPE ping-pong between 2 ranks (point to point only), 1 B to 1 MiB",
        argv=("/usr/bin/NPopenmpi", "-u", "1048576", "-n", "1000", "-p", "0", "-o", "np.out"), quota_cpus=0.1,
    ),
}


def get(name: str) -> App:
    try:
        return APPS[name]
    except KeyError:
        sys.exit(f"unknown application {name!r}; known: {', '.join(APPS)}")
