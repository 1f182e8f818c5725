"""The embedded CPU demo and the tiny local models and tokenizers that tests and the demo build.

- :mod:`megatron_pacs.demo.run`: ``python -m megatron_pacs.demo`` (``make demo``), a complete small PACS run.
- :mod:`megatron_pacs.demo.task`: its verifiable task (small arithmetic with ``\\boxed{}`` answers).
- :mod:`megatron_pacs.demo.sft`: the supervised warm-up through the Megatron stack.
- :mod:`megatron_pacs.demo.tiny`: tokenizers and tiny Qwen2/Qwen3/Llama models built locally, no downloads.

Nothing in the product imports this package.
"""
