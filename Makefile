# The user's entry points. Every target bootstraps the repo's own venv first (`make setup`);
# the logic lives in Python (trainer/, infra/) and nox sessions, these are aliases.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stoa-setup-stamp
# Inside the slime/Megatron image the venv must see the image's CUDA torch, slime and Megatron-LM.
VENV_FLAGS := $(if $(wildcard /root/slime),--system-site-packages)
# torch for machines without an NVIDIA GPU (a CPU build where the package index offers one).
CPU_TORCH ?= torch==2.13.0

RUN ?=
HOST ?=
MODEL ?=
SSH_KEY ?=
REMOTE_DIR ?=

# Optional flags forwarded to the launcher only when the user set them.
LAUNCH_FLAGS = $(if $(HOST),--host $(HOST)) $(if $(MODEL),--model $(MODEL)) \
               $(if $(SSH_KEY),--ssh-key $(SSH_KEY)) $(if $(REMOTE_DIR),--remote-dir $(REMOTE_DIR))

.PHONY: help setup gsm8k psqa test lint bench preflight clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	@# Without an NVIDIA GPU, pin the CPU torch build first so the resolver never pulls the multi-GB CUDA one.
	@if ! $(PY) -c 'import torch' 2>/dev/null && ! command -v nvidia-smi >/dev/null; then \
	  echo "no NVIDIA GPU: installing $(CPU_TORCH)"; $(PY) -m pip install '$(CPU_TORCH)'; fi
	$(PY) -m pip install -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the project with its dev extras

gsm8k: setup  ## run the GSM8K job: embedded default on this machine, or HOST=user@box for a GPU box
	@test -n "$(RUN)" || { echo "usage: make gsm8k RUN=<run-id> [HOST=user@box] [MODEL=/path/to/hf-model]" >&2; exit 2; }
	$(PY) -m entrypoints.launch --recipe gsm8k --run $(RUN) $(LAUNCH_FLAGS)

psqa: setup  ## run the PaperSearchQA fleet reference on HOST=user@box
	@test -n "$(RUN)" || { echo "usage: make psqa RUN=<run-id> HOST=user@box" >&2; exit 2; }
	$(PY) -m entrypoints.launch --recipe psqa --run $(RUN) $(LAUNCH_FLAGS)

test: setup  ## install what the tests need and run them (nox -s tests)
	$(VENV)/bin/nox -s tests

lint: setup  ## ruff over the tree (nox -s lint)
	$(VENV)/bin/nox -s lint

bench: setup  ## benchmarks, results in bench/results/ (nox -s bench)
	$(VENV)/bin/nox -s bench

preflight: setup  ## check a launch before it happens (nox -s preflight)
	$(VENV)/bin/nox -s preflight

clean:  ## remove the venv and local run state (.stoa/)
	rm -rf $(VENV) .nox .stoa
