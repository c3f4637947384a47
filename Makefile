# Set-up, demo and tests. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; installed first so that no CUDA build is pulled in.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# Reuse a torch the system Python already has (a GPU machine's build); else install the CPU wheel.
$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the system's torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q "$(TORCH_CPU)"; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@
	@# moestream's CPU kernels for this CPU (cached per CPU; without a compiler the PyTorch path runs)
	-@$(BIN)/python -c 'import sys; from moestream.quant.native import main; sys.exit(main())'

demo: setup
	$(BIN)/moestream demo

test: setup
	$(BIN)/python -m pytest -q -n auto --dist loadfile  # one file per worker process: its module fixtures set up once

lint: setup
	$(BIN)/ruff check moestream tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
