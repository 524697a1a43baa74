# GeoFP8 — set-up, tests and the main job, in a virtual environment of their own (.venv).
# To use GeoFP8 in an environment you already have: pip install .   (README, "Install").
#
# Which torch: when .venv has none, `make` installs the CPU build torch==$(TORCH_VERSION)+cpu
# from the indexes and wheels pip is configured with when they offer it, else torch==
# $(TORCH_VERSION) with PyTorch's CPU index added ($(TORCH_INDEX)), which is asked only then
# (pip retries an index it cannot reach for every package it resolves). Another build:
# `TORCH_INDEX=` (only the indexes pip is configured with: PyPI's torch is a CUDA build on
# Linux), `TORCH_INDEX=<a PyTorch CUDA index>`, `TORCH_VERSION=2.12.0`, or install torch
# into .venv yourself first: any torch already in .venv is kept as it is.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX   ?= $(TORCH_CPU_INDEX)
# torchtitan 0.3.0 for geofp8.integrations.torchtitan and its tests, without its own pins
# (datasets<4.8 would downgrade datasets and huggingface_hub): --no-deps, plus the modules
# its model, parallelize and config code import (triton: its llama3 package imports Triton
# kernels even on CPU; tensorboard, protobuf, absl-py, torchdata: its Trainer module).
TORCHTITAN_PACKAGES ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
	docstring_parser==0.18.0 typeguard==4.6.1 triton==3.9.0 torchdata==0.11.0 \
	tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1

.PHONY: install test lint demo bench gpu-check gpu-round clean

# the environment and its torch (kept when present)
$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || \
		$(if $(filter $(TORCH_CPU_INDEX),$(TORCH_INDEX)),$(PY) -m pip install -q \
			torch==$(TORCH_VERSION)+cpu 2>/dev/null ||) \
		$(PY) -m pip install -q torch==$(TORCH_VERSION) \
			$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -c "import torch; print('make: using torch', torch.__version__)"
	touch $@

# what `make demo` needs: the core and its demo extra (transformers, tokenizers, matplotlib)
$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

# everything the tests need, so that none is skipped: every extra, and torchtitan
$(VENV)/.installed: $(VENV)/.torch pyproject.toml Makefile
	$(PY) -m pip install -q -e ".[all]"
	$(PY) -m pip install -q --no-deps $(TORCHTITAN_PACKAGES)
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m ruff check src tests benchmarks docs examples
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check src tests benchmarks docs examples

demo: $(VENV)/.demo
	$(PY) -m geofp8.tools.cli demo

bench: $(VENV)/.demo
	$(PY) -m geofp8.tools.cli bench

# On a machine with one NVIDIA GPU (`make gpu-check TORCH_INDEX=`, or a CUDA build of torch
# installed into .venv first): correctness on the device, a 1-rank NCCL run of every method,
# codec/transform throughput vs a D2D copy. Without network:
# PYTHONPATH=src python3 -m geofp8.tools.gpu_check (README "Check it on a GPU").
gpu-check: $(VENV)/.demo
	$(PY) -m geofp8.tools.gpu_check

# The GPU round (docs/performance.md, "On a GPU"): gpu-check, one bucket's stages timed with
# CUDA events, the overlap trace, into $(OUT) with one summary table; about 5 minutes, at
# most 8. No network and nothing installed: .venv's python if there is one, else $(PYTHON).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
OUT ?= runs/gpu-round
gpu-round:
	PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_round.sh $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis src/*.egg-info build
