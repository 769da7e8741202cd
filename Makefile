# zerofn: set up, demo, test, lint. Every target installs what it needs into .venv first.
#
#   make demo                 # python -m zerofn demo (ARGS="--world-size 3 --stage 1")
#   make test                 # python -m pytest -n 2 (PYTEST_ARGS="-k demo -x", PYTEST_WORKERS=0: one process)
#   make test-numerics        # the float-sensitive checks with every rank on torch's portable CPU kernels
#   make lint                 # ruff check + ruff format --check
#   make notebooks            # execute notebooks/NN_*.py into NN_*.ipynb (ARGS="03")
#   make docs                 # build the documentation site into site/ (mkdocs build --strict)
#   make docs-serve           # serve it at http://127.0.0.1:8000 while you edit
#   make benchmarks           # every system on every model, into benchmarks/results/latest.* (the site's page)
#
# torch is installed first, pinned, so that `pip install -e .[test,docs,lowbit,data,lightning,hf]` finds its `torch>=2.4`
# already satisfied: an unpinned torch would pull a CUDA build of several GB on a machine
# that only has a CPU. GPU users pick their build, e.g. make test TORCH_SPEC='torch==2.13.0'
# TORCH_PIP_ARGS='--index-url <a PyTorch wheel index for your CUDA>'.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist processes `make test` spreads the tests over. Two even on two cores: much of
# the suite waits (process starts, rendezvous, timeouts slept out, subprocesses), and the
# other process computes meanwhile. Each has its own pools of ranks. 0: one process.
PYTEST_WORKERS ?= 2
# The kernel family of `make test-numerics`: torch's portable kernels (no AVX2/AVX-512).
# `make test` sees it too: its pool of 3 ranks runs on them (tests/conftest.py).
NUMERICS_CPU_CAPABILITY ?= default

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.zerofn-installed
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: install demo test test-numerics lint notebooks docs docs-serve benchmarks clean FORCE

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Rewritten only when TORCH_SPEC or TORCH_PIP_ARGS change, so a new torch choice reinstalls.
$(TORCH_STAMP): FORCE | $(PY)
	@echo '$(TORCH_SPEC) $(TORCH_PIP_ARGS)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_PIP_ARGS)' > $@

# The lowbit extra (torchao) is installed too, so the tests of zerofn.lowbit run; torchao
# has no dependencies of its own, so it leaves the pinned torch alone. So is the data extra
# (torchdata, for zerofn.data's tests): its `torch>=2` is met by the pinned torch. So is the
# lightning extra (zerofn.lightning's tests): lightning 2.6.6's `torch>=2.1,<4` is met too.
# So is the hf extra (zerofn.hf's tests): transformers 5.23.0 requires no torch, and accelerate
# 1.16.0's `torch>=2.6.0` is met by the pinned torch.
# numpy beside torch: torch warns at import when numpy is missing ("Failed to initialize
# NumPy"), which clutters the demo and is an error under pytest's filterwarnings=error.
# pip installs without compiling bytecode, then compileall compiles site-packages on every
# core (pip's own compile runs on one: half of the install's time on a 2-core machine). Like
# pip's, it skips the files it cannot compile (a few packages ship Python 2 or template
# sources), hence the `|| true`; what Python imports is compiled either way.
$(STAMP): pyproject.toml $(TORCH_STAMP) | $(PY)
	$(PIP) install --no-compile $(TORCH_PIP_ARGS) '$(TORCH_SPEC)' numpy
	$(PIP) install --no-compile -e '.[test,docs,lowbit,data,lightning,hf]'
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
	touch $@

demo: $(STAMP)
	$(PY) -m zerofn demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The float-sensitive tests (marker `numerics`) are bitwise by construction or held to a
# bound from error analysis, so they must pass on any kernels. `make test` runs its pool of
# 3 ranks on torch's portable kernels and the rest on the machine's own; this runs the
# marked set with every rank and this process on the portable ones: the cases at 3 and 4
# ranks (where the float64 wire and the fp32 bounds live; a sum of one or two addends has
# one order) and the tests not parametrized by world size (ZEROFN_NUMERICS_RERUN,
# tests/conftest.py). ZEROFN_TEST_SEED=k moves every seed: the sweep over seeds runs this.
test-numerics: $(STAMP)
	ZEROFN_NUMERICS_RERUN=1 ATEN_CPU_CAPABILITY=$(NUMERICS_CPU_CAPABILITY) $(PY) -m pytest -m numerics -p no:cacheprovider

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

notebooks: $(STAMP)
	$(PY) notebooks/build.py $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict

# The run the site's benchmarks page is generated from (about an hour on 2 cores; run it on an
# otherwise idle machine). DeepSpeed (the bench extra) builds from its sdist; its unpinned torch
# requirement is met by the torch already installed. ARGS='--note "..."' records the machine's state.
benchmarks: $(STAMP)
	$(PIP) install -e '.[bench]'
	$(PY) -m benchmarks.run --out benchmarks/results/latest $(ARGS)

clean:
	rm -rf $(VENV)

# The GPU check: tests/gpu, then the N=1 CUDA benchmark, everything under one
# folder. Runs with the machine's own python3 (no .venv, nothing installed), from the
# repository root: make gpu-check ARGS=/path/to/out   (ARGS="--dry-run /tmp/out" on a CPU).
.PHONY: gpu-check
gpu-check:
	$(PYTHON) scripts/gpu-check $(ARGS)
