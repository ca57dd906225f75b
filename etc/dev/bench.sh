#!/usr/bin/env bash
# `make bench`: every figure of the suite, one JSON object per line on stdout (progress on stderr).
# BENCH_QUICK=1 runs each benchmark briefly (a smoke run; figures are then not the reported ones).
# bench_real.py runs the real-application fault-injection suite on the local cluster (as root); its
# recordings stay in /var/tmp/gpuprof-realapps and are re-merged, not re-run, on the next call:
# BENCH_REALAPPS_RESCORE=1 never runs a job, GPUPROF_REALAPPS_RUNS=N runs per (app, fault).
# Issue 11's lines: bench_collector.py (collector_cpu, default modes and metrics only, on 16 busy
# processes), bench_faults.py (faults: the fault suite's checks added up), bench_slowdown.py
# (job_slowdown: real MPI applications with and without --profile-gpu), and bench_merge.py's
# sh5util peer on a 300 s, 4-node, 16-tasks-per-node --profile=task job (tests/bench/sh5util_peer.py).
# The cluster benches run one after another (never two at once: they share the 2 cores).
# BENCH_ONLY="collector faults" runs only those (bench_<name>.py).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
# shellcheck disable=SC1091
source .cluster/env
quick=()
[ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
for b in tests/bench/bench_*.py; do
    name="$(basename "$b" .py)"
    if [ -n "${BENCH_ONLY:-}" ] && [[ " $BENCH_ONLY " != *" ${name#bench_} "* ]]; then
        continue
    fi
    echo "bench: $b" >&2
    extra=()
    [ "$(basename "$b")" = bench_real.py ] && [ "${BENCH_REALAPPS_RESCORE:-0}" = 1 ] && extra=(--rescore)
    .venv/bin/python "$b" "${quick[@]}" "${extra[@]}"
done
