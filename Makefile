# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The test tiers (docs/test-tiers.md), each with a budget of real launches (a search's
# processes started as users start them: tests/launches.py counts them and fails the tier
# past its budget, NEPS_BCAST_LAUNCH_BUDGET): `make test` (unit and in-process tests, and
# one launch per launcher and per guarantee class), `make test-e2e` (every other
# end-to-end scenario), `make test-faults` (every fault at every step), `make test-slurm`
# (a real SLURM cluster), `make test-hosts` (torchrun across hosts made of network
# namespaces, and hosts cut off). .ci/run runs them all, and `make lint`.
# The virtual environment is built from requirements.lock (every package pinned,
# installed without resolution so nothing can drift; torch is the 2.13.0 CPU wheel).
# `make test-newest` runs the same suite in a second environment, .venv-newest: the same pins with
# torch 2.14.1 + torchvision 0.29.1 (requirements-newest.lock replaces requirements.lock's torch line).
# The interpreter the environments are built on: Debian's own CPython 3.11 where there is
# one (libpython linked into the binary), else python3 on PATH. Each launch spends ~85% of
# its CPU importing torch, NePS and Lightning, and on this kind of machine python3 is a
# pyenv build with a shared libpython and neither PGO nor LTO: `make test` took 503 CPU-s
# on Debian's against 537 on pyenv's, run side by side (docs/development.md).
# PYTHON=python3 picks PATH's.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3.11) python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
XDIST ?= 2
VENV_NEWEST := .venv-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
STAMP_NEWEST := $(VENV_NEWEST)/.installed-$(shell cat requirements.lock requirements-newest.lock pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install packages hosts-packages slurm-packages demo test test-e2e test-faults test-faults-full test-hosts lint bench bench-full clean install-newest test-newest test-slurm test-gpu docs

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	rm -rf results/demo
	OMP_NUM_THREADS=1 $(PY) examples/lightning_ddp.py --devices 2 --trials 10 --root results/demo

# The README's command: <= 10 min on a quiet 2-core machine. Its launches: the examples
# as README says (6), the guarantees (tests/test_e2e_guarantees.py, 10), the handshake,
# root-guard and fault-point tests (5), and 2 for tests/test_e2e_clean_device.py; 1 spare.
TEST_LAUNCHES ?= 24
test: install
	NEPS_BCAST_LAUNCH_BUDGET=$(TEST_LAUNCHES) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(XDIST) -p no:cacheprovider

# Every other end-to-end scenario (tests/e2e), each launched as users launch it.
E2E_LAUNCHES ?= 84
test-e2e: install
	NEPS_BCAST_LAUNCH_BUDGET=$(E2E_LAUNCHES) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(XDIST) -p no:cacheprovider tests/e2e

# Every fault at every step (tests/sweep/table.py, docs/fault-sweep.md): one launch per
# cell and its rerun, a chain of cells per worker. Three workers on two cores: a chain
# mostly waits (for a fault to be seen, a launch to end), at two the load stayed 1.2-1.6.
# `make test-faults` (every commit) runs every step and fault of the table under torchrun
# (2 and 3 ranks) and the Lightning cells that reach code only Lightning runs (table.CI_CELLS):
# one launch per cell whose fault stops its launch (108, 16 of them a frozen rank), the
# last run of each chain that shares a root (6), and the pool's 7 = 121.
# `make test-faults-full` runs every cell (21 Lightning cells more, each its torchrun
# twin's step and fault: table.FULL_ONLY) = 140; .ci/run runs it instead when a file of
# tests/sweep/lightning_only_paths.txt changed since .ci/full-sweep-at (.ci/sweep-target).
SWEEP_XDIST ?= 3
FAULT_LAUNCHES ?= 122
FAULT_LAUNCHES_FULL ?= 142
test-faults: install
	NEPS_BCAST_LAUNCH_BUDGET=$(FAULT_LAUNCHES) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(SWEEP_XDIST) --dist load -p no:cacheprovider tests/sweep

test-faults-full: install
	NB_SWEEP_FULL=1 NEPS_BCAST_LAUNCH_BUDGET=$(FAULT_LAUNCHES_FULL) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(SWEEP_XDIST) --dist load -p no:cacheprovider tests/sweep

# A real one-node SLURM cluster (slurmctld, slurmd, munge; installed with apt-get when missing,
# as root), the tests in tests/slurm against it, then the cluster stopped whatever the result.
SLURM_DIR ?= /tmp/neps_bcast_slurm
# The system packages of the SLURM and hosts tiers, one apt-get after the other.
packages: hosts-packages slurm-packages

slurm-packages:
	NEPS_BCAST_SLURM_DIR=$(SLURM_DIR) bash tests/slurm/cluster.sh install

test-slurm: install slurm-packages
	export NEPS_BCAST_SLURM_DIR=$(SLURM_DIR) SLURM_CONF=$(SLURM_DIR)/slurm.conf; \
	if bash tests/slurm/cluster.sh start; then \
		OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider tests/slurm; status=$$?; \
	else status=1; fi; \
	bash tests/slurm/cluster.sh stop; exit $$status

# torchrun across hosts (tests/hosts): each host a network namespace with its own hostname
# and address, on a bridge in a namespace of its own (198.18.0.0/15, never routed out), and
# hosts cut off mid-training, between trials, the leader's, the rendezvous store's; two
# workers on one root whose hosts' clocks disagree, one dead, one frozen or cut off from
# the shared folder and back. Needs
# root (CI is), iproute2 and libfaketime's faketime (each installed with apt-get when
# missing). Launches, one torchrun per host: 2 (healthy) + 2 (a partition that heals) +
# 3 two-host cuts x (2 + 2 again) + the 3-host cut (3 + 3 again) = 22, and
# tests/hosts/test_hosts_fencing.py's 4 cells x 2 (clock ahead, clock behind, a frozen
# host, a host cut off from the shared folder) = 30, and tests/hosts/test_hosts_containers.py's
# 2 cells (a frozen follower, a frozen leader, in two containers of one host: one torchrun
# node each, and again) x 4 = 38, and tests/hosts/test_hosts_in_doubt.py's 2 cells (a host
# killed, the same command at once on another, its clock 10 min behind or not) x 2 = 42.
HOSTS_LAUNCHES ?= 42
hosts-packages:
	command -v ip >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	command -v faketime >/dev/null || (apt-get update -qq && apt-get install -y -qq faketime)

test-hosts: install hosts-packages
	NEPS_BCAST_LAUNCH_BUDGET=$(HOSTS_LAUNCHES) OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider tests/hosts

# The GPU tier (tests/gpu; not in CI: CI has no GPU). By default with the project's venv;
# GPU_PYTHON=python3 runs it with that interpreter as it is (its own torch, Lightning and
# NePS, e.g. NePS from PYTHONPATH), without building the venv. Fails at once without CUDA.
# Figures go to NEPS_BCAST_GPU_REPORT (one JSON file per test).
GPU_PYTHON ?= $(PY)
NEPS_BCAST_GPU_REPORT ?= $(CURDIR)/results/gpu
test-gpu: $(if $(filter $(PY),$(GPU_PYTHON)),install)
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} NEPS_BCAST_GPU_REPORT=$(NEPS_BCAST_GPU_REPORT) \
		OMP_NUM_THREADS=1 $(GPU_PYTHON) -m pytest -n 0 -p no:cacheprovider tests/gpu

lint: install
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# The newest stack: requirements.lock without its torch line, plus requirements-newest.lock.
install-newest: $(STAMP_NEWEST)

$(STAMP_NEWEST): requirements.lock requirements-newest.lock pyproject.toml
	test -x $(PY_NEWEST) || $(PYTHON) -m venv $(VENV_NEWEST)
	grep -v '^torch==' requirements.lock > $(VENV_NEWEST)/requirements-base.txt
	$(PY_NEWEST) -m pip install --quiet --disable-pip-version-check --no-deps -r $(VENV_NEWEST)/requirements-base.txt -r requirements-newest.lock
	$(PY_NEWEST) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY_NEWEST) -m pip check --disable-pip-version-check
	rm -f $(VENV_NEWEST)/.installed-*
	touch $(STAMP_NEWEST)

test-newest: install-newest
	OMP_NUM_THREADS=1 $(PY_NEWEST) -m pytest -n $(XDIST) -p no:cacheprovider

bench: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --quick

bench-full: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --full

# docs/configuration.md, generated from neps_bcast.config, and the fault tables (docs/fault-sweep.md,
# failures.md's "How a trial ends") from tests/sweep/table.py; tests/test_docs.py checks both are current.
docs: install
	$(PY) docs/generate_configuration.py --write
	$(PY) docs/generate_fault_table.py --write

clean:
	rm -rf $(VENV) $(VENV_NEWEST) results
