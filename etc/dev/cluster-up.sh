#!/usr/bin/env bash
# Start slurm-gpuprof's local Slurm cluster: munged (if not already running), slurmctld and four
# virtual nodes node[1-4] (one `slurmd -N nodeN` each), all state under <repo>/.cluster.
# Idempotent: daemons already running (per their pid files) are left alone; nodes that come back
# down or drained are resumed. Never touches /etc/slurm.
#
# Environment:
#   GPUPROF_HOOKS_DIR   where prolog, epilog, task-prolog, epilog-slurmctld live (default <repo>/etc)
#   GPUPROF_CLUSTER_WAIT  seconds to wait for the nodes to be idle (default 90)
#   GPUPROF_PROCTRACK   force "cgroup" or "linuxproc" (default: cgroup when cgroup v1 is usable)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
C="$REPO/.cluster"
HOOKS_DIR="${GPUPROF_HOOKS_DIR:-$REPO/etc}"
WAIT_S="${GPUPROF_CLUSTER_WAIT:-90}"
CTLD_PORT=16817
SLURMD_PORT=17000
NODE_PORTS=17001-17004
NODES=(node1 node2 node3 node4)

log() { echo "cluster-up: $*"; }
die() { echo "cluster-up: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd runs jobs as their users)"
for b in slurmctld slurmd munged sinfo scontrol; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || die "$b not found: run 'make setup'"
done
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

# pid_alive PIDFILE NAME: the pid in PIDFILE runs a process called NAME.
pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

mkdir -p "$C"/{bin,run,log,state/ctld,state/gpuprof,run/ctld,log/ctld} "${NODES[@]/#/$C/spool/}"
chmod 755 "$C" "$C/bin" "$C/spool" "$C"/spool/*
# slurmctld runs as SlurmUser=slurm, as sites run it: its state, log and pid file are its own
# (the `slurm` user comes with Debian's slurm packages; slurmd stays root, as Slurm requires).
id slurm >/dev/null 2>&1 || die "user slurm missing (Debian's slurmctld package creates it): run 'make setup'"
chown -R slurm:slurm "$C/state/ctld" "$C/run/ctld" "$C/log/ctld"
chmod 755 "$C/run" "$C/log" "$C/state"

# --- the SPANK plugin ------------------------------------------------------------------------
make -s -C "$REPO/slurm_hooks/spank" >/dev/null
SPANK_SO="$REPO/slurm_hooks/spank/gpuprof_spank.so"
[ -f "$SPANK_SO" ] || die "SPANK plugin not built: $SPANK_SO"

# --- munge -----------------------------------------------------------------------------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating munge key"
        mungekey -c
    fi
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- munged
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged did not start (see /var/log/munge/munged.log)"
    # Remember that we started it, so cluster-down stops it (and only then).
    cat /run/munge/munged.pid > "$C/run/munged.started"
    log "started munged (pid $(cat "$C/run/munged.started"))"
fi

# --- process tracking --------------------------------------------------------------------------
PLUGIN_DIR="$(dirname "$(find /usr/lib /usr/lib64 /usr/local/lib -name proctrack_linuxproc.so 2>/dev/null | head -1)")"
PROCTRACK_MODE="${GPUPROF_PROCTRACK:-auto}"
if [ "$PROCTRACK_MODE" = auto ]; then
    if [ -f "$PLUGIN_DIR/cgroup_v1.so" ] && [ -f "$PLUGIN_DIR/proctrack_cgroup.so" ] \
        && grep -qE '^[^ ]+ /sys/fs/cgroup/freezer cgroup ' /proc/mounts; then
        PROCTRACK_MODE=cgroup
    else
        PROCTRACK_MODE=linuxproc
    fi
fi
if [ "$PROCTRACK_MODE" = cgroup ]; then
    PROCTRACK=proctrack/cgroup
    TASKPLUGIN=task/cgroup
    PROCTRACK_WHY="cgroup v1 controllers are mounted here and Slurm's cgroup/v1 plugin works with\
 several slurmd on one host (one hierarchy slurm_<node> per virtual node)."
    cp "$REPO/etc/cgroup.conf" "$C/cgroup.conf"
else
    PROCTRACK=proctrack/linuxproc
    TASKPLUGIN=task/none
    PROCTRACK_WHY="linuxproc, because cgroup v1 (freezer) is not mounted or Slurm's cgroup/v1 plugin\
 is missing; cgroup/v2 with several slurmd per host needs systemd scopes and is not set up here."
    rm -f "$C/cgroup.conf"
fi

# --- slurm.conf and friends ---------------------------------------------------------------------
HOST="$(uname -n)"; HOST="${HOST%%.*}"
CPUS="$(nproc)"; [ "$CPUS" -ge 2 ] || CPUS=2
sed -e "s|@CLUSTER@|$C|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
    -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" -e "s|@NODE_PORTS@|$NODE_PORTS|g" -e "s|@CPUS@|$CPUS|g" \
    -e "s|@PROCTRACK@|$PROCTRACK|g" -e "s|@TASKPLUGIN@|$TASKPLUGIN|g" \
    -e "s|@PROCTRACK_WHY@|$PROCTRACK_WHY|g" -e "s|@HOOKS_DIR@|$HOOKS_DIR|g" \
    "$REPO/etc/dev/slurm.conf.in" > "$C/slurm.conf.new"
if [ -f "$C/slurm.conf" ] && ! cmp -s "$C/slurm.conf.new" "$C/slurm.conf" \
    && pid_alive "$C/run/ctld/slurmctld.pid" slurmctld; then
    log "slurm.conf changed while the cluster runs: restarting it"
    rm -f "$C/slurm.conf.new"
    "$REPO/etc/dev/cluster-down.sh"
    mv "$C/slurm.conf" "$C/slurm.conf.old"  # so the next run sees no running cluster to compare with
    exec "$0" "$@"
fi
mv "$C/slurm.conf.new" "$C/slurm.conf"
mkdir -p "$C/profile_hdf5" && chmod 1777 "$C/profile_hdf5"
printf 'ProfileHDF5Dir=%s\nProfileHDF5Default=None\n' "$C/profile_hdf5" > "$C/acct_gather.conf"
chmod 644 "$C/acct_gather.conf"
sed -e "s|/usr/local/lib/slurm/gpuprof_spank.so|$SPANK_SO|" "$REPO/etc/plugstack.conf" > "$C/plugstack.conf"
chmod 644 "$C/slurm.conf" "$C/plugstack.conf"

# Hook wrappers: set the suite's environment and exec the real hook. A missing hook exits 0
# (with a note on stderr) so that an incomplete checkout never drains the nodes.
write_wrapper() {  # NAME
    cat > "$C/bin/$1" <<EOF
#!/bin/sh
# GENERATED by etc/dev/cluster-up.sh: runs $HOOKS_DIR/$1 with the local cluster's settings.
export GPUPROF_CONFIG="$C/gpuprof.toml"
export SLURM_CONF="$C/slurm.conf"
export PATH="$REPO/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
if [ ! -x "$HOOKS_DIR/$1" ]; then
    echo "gpuprof wrapper: $HOOKS_DIR/$1 missing, skipped" >&2
    exit 0
fi
exec "$HOOKS_DIR/$1" "\$@"
EOF
    chmod 755 "$C/bin/$1"
}
for h in prolog epilog task-prolog; do write_wrapper "$h"; done

# The cluster's gpuprof config: the shipped defaults, with state and hook log under .cluster/.
# Rewritten at every start, so a test that changed it cannot leave it changed.
{
    echo "# GENERATED by etc/dev/cluster-up.sh for the local cluster; defaults: etc/gpuprof.toml"
    echo "[paths]"
    echo "state_dir = \"$C/state/gpuprof\""
    echo "log_file = \"$C/log/gpuprof-hooks.log\""
    # Four virtual nodes share this host's cores, so four collectors compile their BPF objects at
    # once (each 2-5 s of CPU alone): the default 10 s budget would start the job before they are
    # attached, and the niced compiles then starve behind the job's ranks for tens of seconds. A
    # real node compiles one within the default (docs/probes.md, "Attached before the job runs").
    echo "[hooks]"
    echo "attach_timeout_s = 60.0"
} > "$C/gpuprof.toml"
chmod 644 "$C/gpuprof.toml"

cat > "$C/env" <<EOF
# source this file: the local slurm-gpuprof cluster's client environment.
export SLURM_CONF="$C/slurm.conf"
export GPUPROF_CONFIG="$C/gpuprof.toml"
case ":\$PATH:" in *":$REPO/.venv/bin:"*) ;; *) export PATH="$REPO/.venv/bin:\$PATH" ;; esac
EOF
export SLURM_CONF="$C/slurm.conf"

# Jobs of other users exec the TaskProlog wrapper and their batch script from under $C.
# A checkout under /root (as CI may make) is unreachable for them: grant search permission (o+x,
# not listing) on each parent directory, and say so.
if id gpuprof-test >/dev/null 2>&1 && ! runuser -u gpuprof-test -- test -x "$C/bin/task-prolog"; then
    d="$REPO"
    while [ "$d" != / ]; do
        if ! runuser -u gpuprof-test -- test -x "$d"; then
            chmod o+x "$d"
            log "made $d searchable (o+x) so that jobs of unprivileged users can reach the checkout"
        fi
        d="$(dirname "$d")"
    done
    runuser -u gpuprof-test -- test -x "$C/bin/task-prolog" \
        || log "WARNING: user gpuprof-test still cannot reach $C: jobs of unprivileged users will fail"
fi

# --- daemons ------------------------------------------------------------------------------------
if pid_alive "$C/run/ctld/slurmctld.pid" slurmctld; then
    log "slurmctld already running (pid $(cat "$C/run/ctld/slurmctld.pid"))"
else
    slurmctld -f "$C/slurm.conf" || die "slurmctld failed: $(tail -n 20 "$C/log/ctld/slurmctld.log" 2>/dev/null)"
    log "started slurmctld"
fi
for n in "${NODES[@]}"; do
    if pid_alive "$C/run/slurmd-$n.pid" slurmd; then
        log "slurmd $n already running"
    else
        slurmd -f "$C/slurm.conf" -N "$n" || die "slurmd $n failed: $(tail -n 20 "$C/log/slurmd-$n.log" 2>/dev/null)"
        log "started slurmd $n"
    fi
done

# --- wait for node[1-4] idle --------------------------------------------------------------------
deadline=$((SECONDS + WAIT_S))
while :; do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)"
    idle=$(printf '%s\n' "$states" | awk '$2 == "idle" || $2 == "mix" || $2 == "alloc"' | wc -l)
    [ "$idle" -eq ${#NODES[@]} ] && break
    # Nodes left down/drained by an earlier run (or a failed hook) are put back into service.
    bad="$(printf '%s\n' "$states" | awk '$2 ~ /^(down|drain|drng|drained|fail|failg)/ {print $1}' | paste -sd, -)"
    if [ -n "$bad" ]; then
        scontrol update NodeName="$bad" State=RESUME >/dev/null 2>&1 || true
    fi
    if [ $SECONDS -ge $deadline ]; then
        echo "cluster-up: ERROR: nodes not idle after ${WAIT_S}s:" >&2
        printf '%s\n' "$states" >&2
        sinfo -R >&2 2>/dev/null || true
        echo "--- $C/log/ctld/slurmctld.log (tail)" >&2; tail -n 20 "$C/log/ctld/slurmctld.log" >&2 2>/dev/null || true
        for n in "${NODES[@]}"; do
            echo "--- $C/log/slurmd-$n.log (tail)" >&2; tail -n 8 "$C/log/slurmd-$n.log" >&2 2>/dev/null || true
        done
        exit 1
    fi
    sleep 1
done
log "node[1-4] up ($PROCTRACK); use: source $C/env"
