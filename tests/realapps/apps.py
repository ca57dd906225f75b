"""The catalogue: real MPI applications from Debian (nobody here wrote them) and one mpi4py program
shaped like data-parallel training, each sized to run in well under a minute on 2 cores with one rank
per virtual node (`mpirun --oversubscribe` inside the batch script, as the demo does).

Each application knows its Debian package, how to write its input into the job's working directory,
its command line, and the name of its rank processes (`/proc/PID/comm`), by which the outside
injectors find a rank's pid in a node's Slurm job cgroup.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
        if self.name == "gromacs" and shutil.which(GMX) is None:
            raise AppUnavailable(f"gromacs: {GMX} not found (apt-get install {self.package})")
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


# A box of SPC water (GROMACS's own spc216.gro, replicated by `gmx solvate`: 1378 molecules, 4134
# atoms in 3.5 nm), particle-mesh Ewald electrostatics: each step a halo exchange between the
# domains of the decomposition and the PME grid's all-to-all. Steps of 2 fs: GROMACS_STEPS, about
# 30 s of mdrun on the 4 virtual nodes of this VM's 2 cores, 10 s on one node's 2 ranks (a bench
# asks for more with gromacs_steps). Written for the suite; the seed fixed so every run is the same.
GROMACS_STEPS = 4000
GROMACS_TOP = """\
#include "oplsaa.ff/forcefield.itp"
#include "oplsaa.ff/spc.itp"

[ system ]
SPC water box

[ molecules ]
"""
GROMACS_MDP = f"""\
integrator     = md
dt             = 0.002
nsteps         = {GROMACS_STEPS}
cutoff-scheme  = Verlet
nstlist        = 10
coulombtype    = PME
rcoulomb       = 1.0
rvdw           = 1.0
tcoupl         = V-rescale
tc-grps        = System
tau-t          = 0.1
ref-t          = 300
gen-vel        = yes
gen-temp       = 300
gen-seed       = 1
nstxout        = 0
nstvout        = 0
nstenergy      = 1000
nstlog         = 1000
"""
GMX = "/usr/bin/gmx"  # the serial build, for the input; the ranks run gmx_mpi (Open MPI)


def gromacs_steps(app: App, steps: int) -> App:
    """The gromacs app running `steps` steps instead of GROMACS_STEPS."""
    i = app.argv.index("-nsteps")
    return replace(app, argv=(*app.argv[:i + 1], str(steps), *app.argv[i + 2:]))


def _gromacs_input(work: Path) -> None:
    """md.tpr in work: the water box solvated and preprocessed by the serial gmx (about 1 s)."""
    (work / "topol.top").write_text(GROMACS_TOP)
    (work / "md.mdp").write_text(GROMACS_MDP)
    for argv in ([GMX, "-quiet", "solvate", "-cs", "spc216.gro", "-box", "3.5", "3.5", "3.5", "-o", "water.gro",
                  "-p", "topol.top"],
                 [GMX, "-quiet", "grompp", "-f", "md.mdp", "-c", "water.gro", "-p", "topol.top", "-o", "md.tpr"]):
        p = subprocess.run(argv, check=False, cwd=work, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise AppUnavailable(f"gromacs: {' '.join(argv[:3])} in {work} failed (exit {p.returncode}): "
                                 f"{(p.stderr or p.stdout)[-800:]}")


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
    "gromacs": App(
        name="gromacs", package="gromacs", nodes=4, comm="gmx_mpi", prepare=_gromacs_input,
        doc="GROMACS molecular dynamics of a water box (domain decomposition halo exchange, PME all-to-all)",
        argv=("/usr/bin/gmx_mpi", "-quiet", "mdrun", "-s", "md.tpr", "-ntomp", "1", "-deffnm", "run",
              "-nsteps", str(GROMACS_STEPS)),
    ),
}


def get(name: str) -> App:
    try:
        return APPS[name]
    except KeyError:
        sys.exit(f"unknown application {name!r}; known: {', '.join(APPS)}")
