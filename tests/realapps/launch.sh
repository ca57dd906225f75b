#!/bin/bash
# Rank launcher of tests/realapps (mpirun ... launch.sh APP ARGS): prints which node and pid each rank
# has (the runner's ground truth reads it from the job's output), adds the suite's LD_PRELOAD fault
# library AFTER whatever the profiler's TaskProlog preloaded (so the profiler's PMPI interposer calls
# into it and records the delay inside the call), then execs the application (same pid).
set -euo pipefail
echo "realapps: rank ${OMPI_COMM_WORLD_RANK:-?} node ${SLURMD_NODENAME:-?} pid $$" >&2
if [ -n "${REALAPPS_PRELOAD:-}" ]; then
    export LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$REALAPPS_PRELOAD"
fi
exec "$@"
