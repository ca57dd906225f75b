#!/usr/bin/env bash
# `make bench`: every figure of the suite, one JSON object per line on stdout (progress on stderr).
# BENCH_QUICK=1 runs each benchmark briefly (a smoke run; figures are then not the reported ones).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
# shellcheck disable=SC1091
source .cluster/env
quick=()
[ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
for b in tests/bench/bench_*.py; do
    echo "bench: $b" >&2
    .venv/bin/python "$b" "${quick[@]}"
done
