#!/usr/bin/env bash
# Stop the local cluster started by etc/dev/cluster-up.sh: exactly the daemons named in the pid
# files under <repo>/.cluster/run (slurmd node1-4, slurmctld), and munged only when cluster-up
# started it. Other Slurm daemons on this host are left alone. State and logs stay in .cluster/.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
R="$REPO/.cluster/run"

log() { echo "cluster-down: $*"; }

# stop PIDFILE NAME: TERM the process if it is still NAME, wait up to 30 s, then KILL.
stop() {
    local pid
    [ -s "$1" ] || return 0
    pid="$(cat "$1" 2>/dev/null || true)"
    if [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 300); do
            [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || break
            sleep 0.1
        done
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
            kill -KILL "$pid" 2>/dev/null || true
            log "killed $2 (pid $pid) after 30 s"
        else
            log "stopped $2 (pid $pid)"
        fi
    fi
    rm -f "$1"
}

[ -d "$R" ] || { log "nothing to stop"; exit 0; }

# slurmctld runs as SlurmUser=slurm and keeps its pid file in a directory of its own (run/ctld);
# a cluster started before that kept it in run/.
CTLD_PID="$R/ctld/slurmctld.pid"
[ -s "$CTLD_PID" ] || CTLD_PID="$R/slurmctld.pid"
# Cancel the cluster's jobs first, so that no slurmstepd outlives its slurmd.
if [ -s "$CTLD_PID" ] && [ "$(cat "/proc/$(cat "$CTLD_PID")/comm" 2>/dev/null)" = slurmctld ]; then
    export SLURM_CONF="$REPO/.cluster/slurm.conf"
    jobs="$(squeue -h -o %i 2>/dev/null | paste -sd' ' - || true)"
    if [ -n "$jobs" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 60); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
fi
for n in node1 node2 node3 node4; do stop "$R/slurmd-$n.pid" slurmd; done
stop "$CTLD_PID" slurmctld
stop "$R/munged.started" munged
