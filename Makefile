# The README's two commands: `make demo` and `make test`. Each creates (or reuses) the
# virtual environment in .venv and installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch; override (e.g. TORCH="torch") where another build is wanted.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pointalign demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

# on a CUDA machine: the GPU tests (Triton kernels vs references on CUDA tensors)
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

# every benchmark for this machine's device (--quick on CPU), then BENCHMARKS.md;
# e.g. make bench ARGS="--device cpu --full --only knn icp"
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
