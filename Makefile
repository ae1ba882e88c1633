# The two commands a user needs: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The stamp changes whenever pyproject.toml does, so a second install is a no-op.
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
TORCH_VERSION ?= 2.13.0
PROTOS := protos/tandem/v1/generation.proto protos/tandem/internal/v1/prefill.proto

.PHONY: install run test test-quick lint protos fetch-model

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@# Pin torch first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)
	@# Compile the C++ CPU kernels now rather than on the first request; without a compiler the torch path serves.
	@$(BIN)/python -m kernels.cpu_extension || echo "C++ CPU kernels not built; the torch path will serve"

fetch-model: install
	$(BIN)/tandem fetch-model

run: install
	$(BIN)/tandem fetch-model
	$(BIN)/tandem up

# Tests run on one worker per core, at most four; a test file stays on one worker, so its module
# fixtures (a loaded model, a running server) are built once.
PYTEST_WORKERS := -n auto --maxprocesses 4 --dist loadfile

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) --durations=15

test-quick: install
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

protos: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
