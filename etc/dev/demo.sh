#!/usr/bin/env bash
# `make demo`: a real 4-node MPI job on the local cluster under `sbatch --profile-gpu`, submitted by
# an ordinary user, waited for, and what the profiler produced shown: the node traces next to the
# job's output, the merged job file and its report.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck disable=SC1091
source "$REPO/.cluster/env"
USER_NAME="${GPUPROF_DEMO_USER:-gpuprof-test}"
id "$USER_NAME" >/dev/null 2>&1 || { echo "demo: user $USER_NAME missing: run 'make setup'" >&2; exit 1; }

OUT="$(mktemp -d /tmp/gpuprof-demo.XXXXXX)"
chmod 755 "$OUT"
chown "$USER_NAME:" "$OUT"
echo "demo: submitting a 4-node MPI job as $USER_NAME with --profile-gpu (output in $OUT)"
JOB=$(cd "$OUT" && runuser -u "$USER_NAME" -- env SLURM_CONF="$SLURM_CONF" \
    GPUPROF_DEMO_PYTHON="$REPO/.venv/bin/python" GPUPROF_DEMO_APP="$REPO/etc/dev/demo/allreduce_app.py" \
    sbatch --parsable --profile-gpu --chdir="$OUT" "$REPO/etc/dev/demo/job.sh")
echo "demo: job $JOB submitted; waiting for it to end"
for _ in $(seq 600); do
    state=$(scontrol show job "$JOB" -o 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
    case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) break ;; esac
    sleep 0.5
done
echo "demo: job $JOB ended: $state"
echo "----- slurm-$JOB.out"
cat "$OUT/slurm-$JOB.out"
NODE_DIR="$OUT/slurm-$JOB.gpuprof.d"
echo "demo: waiting for the epilogs to place the node traces in $NODE_DIR"
for _ in $(seq 120); do
    n=$(ls "$NODE_DIR"/node*.h5 2>/dev/null | wc -l)
    [ "$n" -ge 4 ] && break
    sleep 0.5
done
echo "----- node traces (owner, size)"
ls -l "$NODE_DIR"
for f in "$NODE_DIR"/node*.h5; do
    echo "----- gpuprof inspect $f"
    "$REPO/.venv/bin/gpuprof" inspect "$f"
done
REPORT="$OUT/slurm-$JOB.gpuprof.txt"
if "$REPO/.venv/bin/gpuprof" --help | grep -q '^  merge'; then
    echo "demo: waiting for the automatic merge step (EpilogSlurmctld submits it as $USER_NAME)"
    for _ in $(seq 240); do [ -s "$REPORT" ] && break; sleep 0.5; done
    if [ -s "$REPORT" ]; then
        echo "----- merged results"
        ls -l "$OUT"/slurm-"$JOB".gpuprof.*
        echo "----- $REPORT"
        cat "$REPORT"
    else
        echo "demo: no merged report after 120 s; merge log:" >&2
        cat "$NODE_DIR"/merge-*.log 2>/dev/null >&2 || true
        exit 1
    fi
fi
echo "demo: done. Results in $OUT"
