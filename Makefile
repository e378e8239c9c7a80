# Two entry points: `make demo` (set up, prepare the bundled data, train a tiny Llama on 2 CPU
# processes) and `make test` (set up, run the whole test suite). Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.nxdt-installed
DATA   := data/kjv/kjv_text_document
NPROC  ?= 2

.PHONY: setup data demo test test-fast slurm-local clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU wheel first: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

$(DATA).idx: | $(STAMP)
	$(BIN)/nxdt preprocess --input src/nxdt/assets/kjv_chapters.jsonl.gz \
		--tokenizer src/nxdt/assets/tokenizer --output-prefix $(DATA) --workers $(NPROC)

data: $(DATA).idx

demo: setup data
	$(BIN)/python -m nxdt.tools.unigram_entropy --data-prefix $(DATA)
	$(BIN)/nxdt train --standalone --nproc-per-node $(NPROC) --config-name tiny_llama_cpu \
		exp_manager.create_checkpoint_callback=true $(ARGS)

# two pytest workers on the 2-core machines this runs on: one takes the longest module while the
# other works through the rest (tests/conftest.py starts the long modules first)
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# A one-node Slurm cluster on this machine (root; Debian's slurm-wlm + munge), for tests/test_slurm.py
slurm-local:
	bash .ci/start-local-slurm.sh

clean:
	rm -rf data nxdt_experiments .pytest_cache

# The XLA path (docs/xla.md): torch-xla 2.9.0 needs torch 2.9.0, so it gets its own venv.
# Trains a tiny Llama with every precision preset on XLA:CPU, reloads an xser checkpoint, and runs
# the SPMD layouts (dp, FSDP, ZeRO-1, tp + sp) on four XLA:CPU devices of one process.
# From PyPI, torch 2.9.0 comes with its CUDA wheels (GBs); where download.pytorch.org is reachable,
# XLA_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu' takes the CPU wheel instead.
XLA_VENV  := .venv-xla
XLA_STAMP := $(XLA_VENV)/.nxdt-installed
XLA_PIP_ARGS ?=

$(XLA_STAMP): pyproject.toml setup.py
	test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q torch==2.9.0 torch-xla==2.9.0 $(XLA_PIP_ARGS)
	$(XLA_VENV)/bin/python -m pip install -q -e '.[test]' $(XLA_PIP_ARGS)
	touch $(XLA_STAMP)

.PHONY: test-xla
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/xla $(ARGS)

# Issue 40: nxdt against the tools a user would pick instead (benchmarks/peers.py). torchtitan 0.3.0's
# requirements (datasets < 4.8, torchdata, wandb, spmd_types==0.2.3, ...) are not nxdt's, so it gets its
# own venv: torch 2.13.0 as in .venv, torchtitan with --no-deps and what its model and loop import
# (triton: its model package imports it at the top). TRL, peft and transformers run in .venv.
TITAN_VENV  := .venv-peers-titan
TITAN_STAMP := $(TITAN_VENV)/.nxdt-installed
TITAN_DEPS  := tyro spmd_types==0.2.3 einops triton numpy
PEERS_ARGS  ?=

$(TITAN_STAMP):
	test -x $(TITAN_VENV)/bin/python || $(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TITAN_VENV)/bin/python -m pip install -q --no-deps torchtitan==0.3.0
	$(TITAN_VENV)/bin/python -m pip install -q $(TITAN_DEPS)
	touch $(TITAN_STAMP)

.PHONY: bench-peers
bench-peers: setup $(TITAN_STAMP)
	$(BIN)/python benchmarks/peers.py $(PEERS_ARGS)
