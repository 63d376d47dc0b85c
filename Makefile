# Two commands do all setup on a fresh machine (see README.md):
#   make demo   the whole job offline on the demo model
#   make test   lint and the full test suite (what CI runs)
# A fresh machine needs Python 3.11 and pip; everything else comes from uv.lock.
PYTHON ?= python3
UV_VERSION := 0.13.9
UV := .tools/uv-$(UV_VERSION)/bin/uv
# The CPU torch wheel uv.lock names (pyproject.toml [tool.uv.sources]) and its pip pin.
TORCH_WHEEL := $(shell sed -n 's/^torch = { path = "\(.*\)" }$$/\1/p' pyproject.toml)
TORCH_PIN := torch==$(word 2,$(subst -, ,$(notdir $(TORCH_WHEEL))))
TORCH_INDEX := https://download.pytorch.org/whl/cpu
export UV_PYTHON := 3.11

.PHONY: setup calib-env serve-env gpu-envs demo test test-fast lint bench lock gpu-lock-check \
	gpu-kit

# On a machine whose nvidia-smi lists a GPU, or with KVCALIB_GPU=1, setup syncs the GPU
# environments of gpu/ (PyPI's CUDA torch, vLLM's CUDA release); KVCALIB_GPU=0 forces CPU.
KVCALIB_GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(KVCALIB_GPU),1)
setup: gpu-envs
else
setup: calib-env serve-env
endif

# uv itself, pinned, from PyPI, inside this clone.
$(UV):
	$(PYTHON) -m pip install --quiet --target .tools/uv-$(UV_VERSION) uv==$(UV_VERSION)

# From PyTorch's CPU index, or wherever pip is configured to find it (pip tolerates an
# unreachable index); uv checks it against the sha256 in uv.lock when it installs it.
$(TORCH_WHEEL):
	$(PYTHON) -m pip download --quiet --no-deps --only-binary :all: --implementation cp \
	    --python-version 3.11 --abi cp311 --platform manylinux_2_28_x86_64 --retries 1 \
	    --extra-index-url $(TORCH_INDEX) --dest $(dir $(TORCH_WHEEL)) $(TORCH_PIN)

# Each clone has its own environments, hard-linked from uv's cache. A .venv or
# .venv-serve link to a shared env (the old layout) is replaced, never synced into.
# Bytecode is compiled once here: with PYTHONDONTWRITEBYTECODE set (as on these
# machines) every process would otherwise recompile what it imports, 10-15 s each.
export UV_COMPILE_BYTECODE := 1
calib-env: $(UV) $(TORCH_WHEEL)
	@if [ -L .venv ]; then rm .venv; fi
	$(UV) sync --locked

serve-env: $(UV) $(TORCH_WHEEL)
	@if [ -L .venv-serve ]; then rm .venv-serve; fi
	UV_PROJECT_ENVIRONMENT=.venv-serve $(UV) sync --locked --only-group serve

# The same two environments for GPUs, from gpu/uv.lock (docs/environments.md).
gpu-envs: $(UV)
	@if [ -L .venv ]; then rm .venv; fi
	UV_PROJECT_ENVIRONMENT=$(CURDIR)/.venv $(UV) sync --locked --project gpu
	UV_PROJECT_ENVIRONMENT=$(CURDIR)/.venv-serve $(UV) sync --locked --project gpu --only-group serve

# After changing a pin in pyproject.toml or gpu/pyproject.toml: `make lock`, then commit
# uv.lock and gpu/uv.lock.
lock: $(UV) $(TORCH_WHEEL)
	$(UV) lock
	$(UV) lock --project gpu

# CI: the GPU lock matches its pyproject, and both GPU environments resolve from it for
# this platform (a dry-run sync into a scratch folder; no GPU needed, nothing installed).
gpu-lock-check: $(UV) $(TORCH_WHEEL)
	$(UV) lock --check --project gpu
	UV_PROJECT_ENVIRONMENT=$$(mktemp -d)/calib $(UV) sync --dry-run --quiet --locked --project gpu
	UV_PROJECT_ENVIRONMENT=$$(mktemp -d)/serve $(UV) sync --dry-run --quiet --locked \
	    --project gpu --only-group serve

# The Python 3.12 wheels a lent GPU machine lacks, into .gpu-kit/ (docs/gpu.md).
gpu-kit: calib-env
	.venv/bin/python scripts/gpu_kit.py

demo: setup
	.venv/bin/kvcalib demo

lint: calib-env
	.venv/bin/ruff check kvcalib tests scripts
	.venv/bin/lint-imports

test: setup gpu-lock-check
	.venv/bin/ruff check kvcalib tests scripts
	.venv/bin/lint-imports
	.venv/bin/kvcalib demo-model
	.venv/bin/python -m pytest -v --durations=15 -n 2 --dist loadfile

# Tests that need neither torch nor vLLM; importing either fails them (tests/fast/no_torch).
# Two pytest workers: a machine of this project has two cores.
test-fast: calib-env
	PYTHONPATH=tests/fast/no_torch .venv/bin/python -m pytest -q -n 2 tests/fast

bench: setup
	.venv/bin/python scripts/bench_calibrate.py
	.venv/bin/python scripts/bench_verify.py
	.venv/bin/python scripts/bench_eval.py
