# slurm-gpuprof. The README's two commands are `make demo` and `make test`; each does its own set-up.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup build cluster cluster-down test demo bench lint clean

# Everything the suite needs on a fresh Debian 12/13 machine, as root (idempotent).
setup:
	etc/dev/setup.sh

# C parts: the SPANK plugin, the fast-path interposers, the collector's native sampling paths
# (setup builds them too).
build:
	$(MAKE) -C slurm_hooks/spank
	$(MAKE) -C bpf/fastpath
	$(MAKE) -C collector/native

# A local Slurm cluster: slurmctld + node[1-4], all state under .cluster/.
cluster: setup
	etc/dev/cluster-up.sh

cluster-down:
	etc/dev/cluster-down.sh

# The test suite, including the local cluster end to end through real sbatch.
test: cluster
	set -o pipefail; $(PY) -m pytest -ra $(PYTEST_ARGS)

# The main job end to end: cluster up, a real 4-node MPI job under sbatch --profile-gpu, its results.
demo: cluster
	etc/dev/demo.sh

# Figures: one JSON object per line.
bench: cluster
	etc/dev/bench.sh

# mypy sees the packages under their installed names (gpuprof.*) through a tree of links.
lint:
	$(VENV)/bin/ruff check slurm_hooks collector mpi_merge tests setup.py
	mkdir -p build/typecheck/gpuprof
	for p in slurm_hooks collector mpi_merge; do ln -sfn ../../../$$p build/typecheck/gpuprof/$$p; done
	MYPYPATH=build/typecheck $(VENV)/bin/mypy --namespace-packages --explicit-package-bases \
		-p gpuprof.slurm_hooks -p gpuprof.collector -p gpuprof.mpi_merge

clean: cluster-down
	rm -rf .cluster build *.egg-info
