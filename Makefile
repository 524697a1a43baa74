# GeoFP8 — set-up, tests and the main job. Every target creates/uses .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# torchtitan 0.3.0 for geofp8.integrations.torchtitan and its tests, without its own pins
# (datasets<4.8 would downgrade datasets and huggingface_hub): --no-deps, plus the modules
# its model, parallelize and config code import (triton: its llama3 package imports Triton
# kernels even on CPU; tensorboard, protobuf, absl-py, torchdata: its Trainer module).
TORCHTITAN_PACKAGES ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
	docstring_parser==0.18.0 typeguard==4.6.1 triton==3.9.0 torchdata==0.11.0 \
	tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1

.PHONY: install test lint demo bench gpu-check clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A loose torch requirement pulls a multi-GB CUDA build; pin the local CPU build first.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[all]"
	$(PY) -m pip install -q --no-deps $(TORCHTITAN_PACKAGES)
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check src tests benchmarks

demo: install
	$(PY) -m geofp8.tools.cli demo

bench: install
	$(PY) -m geofp8.tools.cli bench

# On a machine with one NVIDIA GPU (a CUDA build of torch installed first): correctness on
# the device, a 1-rank NCCL run of every method, codec/transform throughput vs a D2D copy.
# Without network: PYTHONPATH=src python3 -m geofp8.tools.gpu_check (README "Check it on a GPU").
gpu-check: install
	$(PY) -m geofp8.tools.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis src/*.egg-info
