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

# The variables a user sets (`make help` lists every `NAME ?=## meaning` line). They reach the recipes only
# as exported environment variables, quoted ("$$RUN"): a value is one argument to Python, never shell text.
RUN ?= $(DRL_RUN)## run id, the bucket prefix (required by gsm8k and psqa; default: the environment's DRL_RUN), e.g. RUN=gsm8k-2026-12-01a
HOST ?=## the GPU box, user@host[:port]: launch the real trainer there over SSH
MODEL ?=## a local HF model directory to train instead of the recipe's model
SSH_KEY ?=## SSH private key for HOST (default: your agent and ~/.ssh keys)
REMOTE_DIR ?=## where the tree goes on HOST (default /root/dRL)
ENGINE ?=## the learner on a GPU box: native (our megatron-core learner) or slime (default: the recipe's)
WORKER ?=## embedded run: the local workers' backend, torch (default) or mlx (the MLX worker, mlx[cpu] here)
STATE ?=## with `make clean`: STATE=1 also deletes .stoa/ (every local run, its checkpoints and signing key)
export RUN HOST MODEL SSH_KEY REMOTE_DIR ENGINE WORKER

# Every user value as one argument; the launcher treats an empty one as not given.
LAUNCH = $(PY) -m entrypoints.launch --run "$$RUN" --host "$$HOST" --model "$$MODEL" --ssh-key "$$SSH_KEY" \
         --remote-dir "$$REMOTE_DIR" --engine "$$ENGINE" --worker "$$WORKER"
# Say the usage before anything is installed; then bring the venv up to date (quietly when it is).
define need_run
@test -n "$$RUN" || { echo "usage: make $(1)   (or export DRL_RUN=<run-id>)" >&2; exit 2; }
@$(MAKE) --no-print-directory -q setup 2>/dev/null || $(MAKE) --no-print-directory setup
endef

.PHONY: help setup gsm8k psqa test lint bench preflight clean

help:  ## list the targets, the variables they read and the environment
	@echo "targets:"
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z0-9-]+):.*## /\1\t/' | \
	  awk -F '\t' '{ printf "  %-12s %s\n", $$1, $$2 }'
	@echo "variables (make gsm8k RUN=my-run HOST=root@box ...):"
	@awk '/^[A-Z_]+ *\?=/ { n = $$1; sub(/ *\?=.*/, "", n); d = $$0; sub(/^[^=]*= */, "", d); \
	  h = (d ~ /##/) ? substr(d, index(d, "##") + 2) : " (default: " (d == "" ? "unset" : d) ")"; \
	  sub(/^ +/, "", h); printf "  %-12s %s\n", n, h }' $(MAKEFILE_LIST)
	@echo "environment (export it, or put it before make):"
	@echo "  DRL_DRY_RUN=1  print the resolved configuration and what would run; change nothing"
	@echo "  DRL_STORE, DRL_N_SAMPLES, DRL_PULSE_PLANE, DRL_KV_MODE  the run contract (docs/r2-setup.md)"
	@echo "  R2_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY, R2_BUCKET  the bucket (or in .r2env, mode 0600)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@# uv where it can, pip where not; without an NVIDIA GPU the CPU torch build is pinned (infra/bootstrap.py)
	$(PY) infra/bootstrap.py --cpu-torch '$(CPU_TORCH)'
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the project with its dev extras

gsm8k:  ## run the GSM8K job: embedded default on this machine, or HOST=user@box for a GPU box
	$(call need_run,gsm8k RUN=<run-id> [HOST=user@box] [MODEL=/path/to/hf-model])
	$(LAUNCH) --recipe gsm8k

psqa:  ## run the PaperSearchQA job: its embedded miniature on this machine, or HOST=user@box for the fleet reference
	$(call need_run,psqa RUN=<run-id> [HOST=user@box] [MODEL=/path/to/lfm2-moe])
	$(LAUNCH) --recipe psqa

test: setup  ## install what the tests need and run them (nox -s tests)
	$(VENV)/bin/nox -s tests

lint: setup  ## ruff over the tree (nox -s lint)
	$(VENV)/bin/nox -s lint

bench: setup  ## benchmarks, results in bench/results/ (nox -s bench)
	$(VENV)/bin/nox -s bench

preflight: setup  ## check a launch before it happens (nox -s preflight)
	$(VENV)/bin/nox -s preflight

clean:  ## remove the venv and nox's cache; keeps .stoa/ (local runs, signing keys) unless STATE=1
	@if [ -n "$(filter 1,$(STATE))" ]; then $(PYTHON) -c 'import sys; from infra.boxops import live_runs; r = live_runs("."); \
	  stops = "; ".join(f"invoke stop --run {x} --local" for x in r); \
	  r and print(f"make clean STATE=1: run(s) {chr(44).join(r)} running here hold .stoa/ (stop each first: Ctrl-C where it runs, or {stops}); nothing removed", file=sys.stderr); sys.exit(2 if r else 0)' || exit 2; fi
	@echo "removing $(VENV)/ and .nox/"
	rm -rf $(VENV) .nox
	@if [ -n "$(filter 1,$(STATE))" ]; then echo "STATE=1: removing .stoa/ (every local run, its checkpoints and signing key)"; \
	  rm -rf .stoa; elif [ -d .stoa ]; then echo "kept .stoa/ (local runs and signing keys); make clean STATE=1 removes it too"; fi
