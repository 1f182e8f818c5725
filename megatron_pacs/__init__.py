"""megatron_pacs: PACS (arXiv 2509.02522) and GRPO RLVR post-training on Megatron-Core, vLLM and Ray.

Packages: ``algo`` (pure-PyTorch losses, pass@k), ``rewards`` (math-verify scorer), ``data`` (prompt datasets).
Heavy backends are imported lazily by their own modules only.
"""

__version__ = "0.1.0"
