# Set-up and entry points. Every target (re)uses the virtual environment in $(VENV)
# and installs with constraints.txt so torch stays at the pinned CPU build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dpscale train

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)
	$(BIN)/python -m pytest -m ""

# The device acceptance suite on a CUDA machine (offline): writes gpu-report.md, exits 1 on a FAIL row.
gpu-check: $(STAMP)
	$(BIN)/dpscale bench gpu-suite --device cuda --out gpu-report.md

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
