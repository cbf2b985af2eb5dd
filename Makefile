# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The virtual environment is built from requirements.lock (every package pinned,
# installed without resolution so nothing can drift; torch is the 2.13.0 CPU wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
XDIST ?= 2

.PHONY: install demo test lint bench bench-full clean

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

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(XDIST) -p no:cacheprovider

lint: install
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks
	$(PY) -m mypy

bench: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --quick

bench-full: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --full

clean:
	rm -rf $(VENV) results
