# Set-up and entry points. Every target (re)uses the virtual environment in $(VENV)
# and installs with constraints.txt so torch stays at the pinned CPU build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo lint typecheck test test-all gpu-check wheelhouse clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dpscale train

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The default suite on TEST_WORKERS processes (pytest-xdist), each with one OpenMP thread: on the 2-core
# VMs it took 677 s against 1117 s in one process (AVX2 VM, session 17); TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
test: lint typecheck
	$(if $(filter 0,$(TEST_WORKERS)),$(BIN)/python -m pytest,OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS))

test-all: $(STAMP)
	$(BIN)/python -m pytest -m ""

# The device acceptance suite on a CUDA machine (offline): writes gpu-report.md, exits 1 on a FAIL row.
# Section 5 trains the whole Fashion-MNIST preset when GPU_DATA names the data (default: ../shared's, if present).
GPU_DATA ?= $(wildcard ../shared/data/fashion-mnist)
gpu-check: $(STAMP)
	$(BIN)/dpscale bench gpu-suite --device cuda --out gpu-report.md $(if $(GPU_DATA),--data-root $(GPU_DATA))

# Wheels of dpscale and every runtime dependency, for an offline install elsewhere (scripts/wheelhouse.py:
# --python-version, --platform and --torch for another machine); then: pip install --no-index --find-links wheelhouse dpscale
wheelhouse: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py --dest wheelhouse $(WHEELHOUSE_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis wheelhouse
