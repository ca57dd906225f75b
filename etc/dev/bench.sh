#!/usr/bin/env bash
# `make bench`: every figure of the suite, one JSON object per line on stdout (progress on stderr).
# BENCH_QUICK=1 runs each benchmark briefly (a smoke run; figures are then not the reported ones).
# bench_real.py runs the real-application fault-injection suite on the local cluster (as root); its
# recordings stay in /var/tmp/gpuprof-realapps and are re-merged, not re-run, on the next call:
# BENCH_REALAPPS_RESCORE=1 never runs a job, GPUPROF_REALAPPS_RUNS=N runs per (app, fault).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
# shellcheck disable=SC1091
source .cluster/env
quick=()
[ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
for b in tests/bench/bench_*.py; do
    echo "bench: $b" >&2
    extra=()
    [ "$(basename "$b")" = bench_real.py ] && [ "${BENCH_REALAPPS_RESCORE:-0}" = 1 ] && extra=(--rescore)
    .venv/bin/python "$b" "${quick[@]}" "${extra[@]}"
done
