#!/usr/bin/env bash
# Prepare a Debian 12 or 13 machine (as root) to build, run and test slurm-gpuprof:
#   Debian packages (Slurm, munge, Open MPI, BCC, kernel headers, HDF5, tools), kernel headers
#   linked for the running kernel, tracefs/debugfs mounted, cgroup v1 freezer checked, the SPANK
#   plugin built, .venv created (with Debian's site packages, for `bcc`) and the project installed
#   into it, the unprivileged test user gpuprof-test, and a minimal Debian 13 root with CPython 3.13
#   (/var/lib/gpuprof-test/trixie, etc/dev/trixie-root.sh) for the Python-frames tests of 3.13.
# Idempotent: every step checks first and does nothing when already done.
#
# Environment: GPUPROF_SKIP_APT=1 skips the package step (for machines prepared by hand).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TEST_USER=gpuprof-test
export DEBIAN_FRONTEND=noninteractive
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

log() { echo "setup: $*"; }
warn() { echo "setup: WARNING: $*" >&2; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (installs packages, mounts tracefs, creates a user)"
[ -r /etc/debian_version ] || die "not a Debian system"
DEBIAN_VERSION="$(cut -d. -f1 /etc/debian_version)"
case "$DEBIAN_VERSION" in
    12|13) ;;
    *) warn "Debian $(cat /etc/debian_version) is untested (12 and 13 are supported)" ;;
esac

# --- 1. Debian packages -------------------------------------------------------------------------
REQUIRED_PKGS=(
    slurm-wlm slurmctld slurmd slurm-client munge libslurm-dev slurm-wlm-hdf5-plugin
    openmpi-bin libopenmpi-dev
    bpfcc-tools python3-bpfcc linux-headers-amd64
    # libbpf: the collector holds the BPF object the compile child made (collector/bpf_object.py)
    libbpf1
    python3-venv python3-dev libhdf5-dev build-essential
    stress-ng procps util-linux ca-certificates
    # headless browser: the HTML report's tests and bench load the page in it (tests/test_browser.py)
    chromium
    # elfutils' libdw: the CFI unwinder of stacks without frame pointers (collector/native/unwind_dwarf.c)
    libdw-dev
    # gfortran (g++ comes with build-essential): the test programs of the CFI unwinder in Fortran and C++
    gfortran
    # a quota for the fault suite (tests/faultcheck.mount_quota): btrfs quota groups, the one quota
    # this kernel has (no CONFIG_QFMT_V2 for ext4, no XFS or tmpfs quotas)
    btrfs-progs
    # the Debian 13 root with python3.13 of tests/test_python_stacks_313.py (step 8)
    mmdebstrap
)
# Real MPI applications for demos and the fault-injection suite (tests/realapps), only when cheap:
# hpcc is ~1.3 MB installed, netpipe-openmpi 0.2 MB, meep-openmpi ~74 MB with its dependencies
# (guile-3.0-libs alone is 53 MB; no smaller Debian halo-exchange code runs offline), and gromacs
# (66 MB to download, ~320 MB installed, most of it gromacs-data's documentation): molecular dynamics,
# the commonest HPC job, and the suite's one code that exchanges halos with MPI_Sendrecv and PME
# grids with MPI_Alltoall. Left out: lammps (~270 MB with data), quantum-espresso (~280 MB, and needs
# pseudopotentials), cp2k (~1 GB).
OPTIONAL_PKGS=(hpcc netpipe-openmpi meep-openmpi gromacs
    # MPICH (~30 MB) beside Open MPI, whose alternatives stay the default (priority 50 against 40):
    # the merge job run with MPICH's mpiexec and an mpi4py built for it (.venv-mpich, step 6b)
    mpich libmpich-dev)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }

if [ "${GPUPROF_SKIP_APT:-0}" != 1 ]; then
    missing=()
    for p in "${REQUIRED_PKGS[@]}" "${OPTIONAL_PKGS[@]}"; do installed "$p" || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing: ${missing[*]}"
        apt-get update -qq
        want=()
        for p in "${missing[@]}"; do
            if printf '%s\n' "${OPTIONAL_PKGS[@]}" | grep -qx "$p" && ! apt-cache show "$p" >/dev/null 2>&1; then
                warn "optional package $p not available, skipped"
                continue
            fi
            want+=("$p")
        done
        # policy-rc.d keeps postinst scripts from starting the system's slurmctld/slurmd/munge
        # services: the test cluster runs its own daemons.
        policy_created=0
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
            policy_created=1
        fi
        apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null || {
            [ $policy_created = 1 ] && rm -f /usr/sbin/policy-rc.d
            die "apt-get install failed"
        }
        [ $policy_created = 1 ] && rm -f /usr/sbin/policy-rc.d
    else
        log "Debian packages present"
    fi
fi
for b in slurmctld slurmd sbatch munged mpicc; do
    command -v "$b" >/dev/null || die "$b missing after package installation"
done

# --- 2. kernel headers for the running kernel (BCC) ---------------------------------------------
KREL="$(uname -r)"
KDIR="/lib/modules/$KREL"
HDR="$(find /usr/src -maxdepth 1 -name 'linux-headers-*-amd64' -type d 2>/dev/null | sort -V | tail -1)"
if [ -n "$HDR" ]; then
    COMMON="${HDR%-amd64}-common"
    mkdir -p "$KDIR"
    # Only replace symlinks (ours or Debian's), never a real headers tree.
    if [ ! -e "$KDIR/build" ] || [ -L "$KDIR/build" ]; then
        [ "$(readlink "$KDIR/build" 2>/dev/null)" = "$HDR" ] || { ln -sfn "$HDR" "$KDIR/build"; log "linked $KDIR/build -> $HDR"; }
    fi
    if [ -d "$COMMON" ] && { [ ! -e "$KDIR/source" ] || [ -L "$KDIR/source" ]; }; then
        [ "$(readlink "$KDIR/source" 2>/dev/null)" = "$COMMON" ] || { ln -sfn "$COMMON" "$KDIR/source"; log "linked $KDIR/source -> $COMMON"; }
    fi
else
    warn "no /usr/src/linux-headers-*-amd64: BCC programs will not compile"
fi

# --- 3. tracefs, debugfs ------------------------------------------------------------------------
mount_if_needed() {  # FSTYPE DIR
    if mountpoint -q "$2" 2>/dev/null; then return 0; fi
    mkdir -p "$2" 2>/dev/null || true
    if mount -t "$1" nodev "$2" 2>/dev/null; then log "mounted $1 at $2"; else warn "cannot mount $1 at $2"; fi
}
mount_if_needed debugfs /sys/kernel/debug
mount_if_needed tracefs /sys/kernel/tracing

# --- 4. cgroups: Slurm's proctrack/cgroup (cgroup/v1) needs the freezer controller --------------
# These machines come with the v1 controllers mounted under a tmpfs /sys/fs/cgroup; the cluster
# uses proctrack/cgroup then. On a pure cgroup v2 host nothing is changed and etc/dev/cluster-up.sh
# falls back to proctrack/linuxproc.
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ]; then
    log "cgroup v2 only: the local cluster will use proctrack/linuxproc"
elif ! grep -qE '^[^ ]+ /sys/fs/cgroup/freezer cgroup ' /proc/mounts; then
    mkdir -p /sys/fs/cgroup/freezer 2>/dev/null || true
    if mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer 2>/dev/null; then
        log "mounted cgroup v1 freezer"
    else
        warn "cgroup v1 freezer not mountable: the local cluster will use proctrack/linuxproc"
    fi
fi

# --- 5. SPANK plugin, the fast-path interposers (LD_PRELOAD libraries), the collector's C paths ---
make -s -C "$REPO/slurm_hooks/spank"
make -s -C "$REPO/bpf/fastpath"
make -s -C "$REPO/collector/native"
make -s -C "$REPO/collector/native" unwind  # the CFI unwinder (libdw-dev, above)

# --- 6. Python virtual environment --------------------------------------------------------------
VENV="$REPO/.venv"
if [ -x "$VENV/bin/python" ] && ! grep -q '^include-system-site-packages = true' "$VENV/pyvenv.cfg" 2>/dev/null; then
    warn "$VENV lacks system site packages (needed for Debian's bcc): recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
    log "created $VENV"
fi
STAMP="$VENV/.gpuprof-installed"
if [ ! -e "$STAMP" ] || [ "$REPO/pyproject.toml" -nt "$STAMP" ] || [ "$REPO/setup.py" -nt "$STAMP" ] \
    || ! "$VENV/bin/python" -c 'import gpuprof.slurm_hooks' 2>/dev/null; then
    log "installing the project into $VENV (pip install -e '.[test]')"
    # mpi4py is compiled against the MPI whose mpicc is found first: Debian's Open MPI.
    (cd "$REPO" && MPICC="$(command -v mpicc)" "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test]')
    touch "$STAMP"
else
    log "$VENV up to date"
fi
"$VENV/bin/python" -c 'import bcc' 2>/dev/null || warn "'import bcc' fails in $VENV"

# --- 6b. a second environment whose mpi4py is built for MPICH (tests/test_automerge.py) ----------
# A site whose MPI is MPICH installs mpi4py built against it; this is that environment, for the
# tests that run the merge job with MPICH's mpiexec (hydra), by itself and submitted through Slurm.
# Only the merge's own dependencies, and the project (editable, no dependencies: this tree).
if command -v mpicc.mpich >/dev/null && command -v mpiexec.mpich >/dev/null; then
    MVENV="$REPO/.venv-mpich"
    if ! "$MVENV/bin/python" -c 'import mpi4py.MPI as m, h5py, scipy, click; assert "MPICH" in m.Get_library_version()' 2>/dev/null; then
        rm -rf "$MVENV"
        /usr/bin/python3 -m venv "$MVENV"
        MPICC=mpicc.mpich "$MVENV/bin/pip" install -q --disable-pip-version-check --no-binary mpi4py --no-cache-dir mpi4py \
            && "$MVENV/bin/pip" install -q --disable-pip-version-check "click>=8.1" "numpy>=1.24" "h5py>=3.9" "scipy>=1.10" \
            && log "created $MVENV (mpi4py for MPICH)" || { warn "no MPICH environment: its merge tests are skipped"; rm -rf "$MVENV"; }
    fi
    if [ -x "$MVENV/bin/python" ] && ! "$MVENV/bin/python" -c 'import gpuprof.mpi_merge.merge' 2>/dev/null; then
        "$MVENV/bin/pip" install -q --disable-pip-version-check --no-deps -e "$REPO" \
            && log "installed the project into $MVENV" || warn "the project does not install into $MVENV"
    fi
fi

# --- 7. unprivileged test user ------------------------------------------------------------------
if ! id "$TEST_USER" >/dev/null 2>&1; then
    useradd --create-home --shell /bin/bash --comment "slurm-gpuprof tests" "$TEST_USER"
    log "created user $TEST_USER (uid $(id -u "$TEST_USER"))"
fi

# --- 8. a Debian 13 root with CPython 3.13 (tests/test_python_stacks_313.py) ----------------------
# Python frames of 3.13 are tested on Debian 13's own interpreter, run in this root with chroot (on
# Debian 12 and 13 alike). About 1 minute and 50 MB of downloads the first time (52-58 s here), nothing after.
"$REPO/etc/dev/trixie-root.sh" || warn "no Debian 13 root: tests/test_python_stacks_313.py will fail"

log "done"
