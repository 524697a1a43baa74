# GeoFP8 — set-up, tests and the main job. Every target creates/uses .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: install test lint demo bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A loose torch requirement pulls a multi-GB CUDA build; pin the local CPU build first.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[all]"
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
gpu-check: install
	$(PY) -m geofp8.tools.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis src/*.egg-info
