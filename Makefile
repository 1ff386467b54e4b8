# The README's two commands: `make demo` and `make test`. Each creates (or reuses) the
# virtual environment in .venv and installs what it needs first, with pip's progress shown.
#   make demo  -> the library and its command line only (pip install -e ".[cli]"), then
#                 `pointalign warmup` (register()'s kernels compiled once, with a progress
#                 bar; `pointalign warmup --all`: every method's)
#   make test  -> plus the test tools (".[dev]": pytest, hypothesis, ruff, Triton for the
#                 kernels' interpreter tests, matplotlib/plotly/selenium for the viewer)
#   make docs  -> the documentation: guides, tutorials, API reference (mkdocs build --strict
#                 into site/)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# PyTorch as pip resolves this pin on the machine: on Linux from PyPI that is the CUDA
# build (several GB). TORCH_INDEX takes it from another index instead, e.g. the CPU build:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# TORCH pins another version or build (e.g. TORCH="torch").
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
PIP    := $(BIN)/python -m pip --disable-pip-version-check
BASE   := $(VENV)/.base
DEMO   := $(VENV)/.demo
DEV    := $(VENV)/.dev
DOCS   := $(VENV)/.docs

.PHONY: demo test test-gpu bench docs lint clean

$(BASE): Makefile
	@echo "== creating $(VENV) and installing PyTorch ($(TORCH)$(if $(TORCH_INDEX), from $(TORCH_INDEX))); this can take minutes"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install --progress-bar on $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	touch $(BASE)

$(DEMO): $(BASE) pyproject.toml
	@echo "== installing pointalign with its command line (no test tools)"
	$(PIP) install --progress-bar on -e ".[cli]"
	touch $(DEMO)

$(DEV): $(DEMO) pyproject.toml
	@echo "== installing the test tools (pytest, ruff, hypothesis, Triton, viz, selenium)"
	$(PIP) install --progress-bar on -e ".[cli,viz,dev]"
	touch $(DEV)

$(DOCS): $(DEMO) pyproject.toml
	$(PIP) install --progress-bar on -e ".[cli,docs]"
	touch $(DOCS)

demo: $(DEMO)
	@echo "== compiling the kernels of register() (the demo's, a first register()'s) once for this machine (kept in numba's and Triton's disk caches; on a CPU in one process per core, about 25 s on 2 cores); other methods compile on first use (announced) or with pointalign warmup --all"
	$(BIN)/pointalign warmup
	$(BIN)/pointalign demo

test: $(DEV)
	$(BIN)/python -m pytest -q -m "not gpu"

# on a CUDA machine: the GPU tests (Triton kernels vs references on CUDA tensors)
test-gpu: $(DEV)
	$(BIN)/python -m pytest -q -m gpu

# every benchmark for this machine's device (--quick on CPU), then BENCHMARKS.md;
# e.g. make bench ARGS="--device cpu --full --only knn icp".
# For a quick look at the speed on your machine: $(BIN)/pointalign bench --quick
bench: $(DEV)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

docs: $(DOCS)
	$(BIN)/mkdocs build --strict

lint: $(DEV)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m mypy src/pointalign

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
