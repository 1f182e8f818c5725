"""The Megatron-Core layer: the only package that imports ``megatron.core``.

Parallel state (:mod:`.parallel`), the GPTModel builder (:mod:`.model`), exact HF <-> Megatron weights
(:mod:`.weights`), vocab-parallel log-probs (:mod:`.logprobs`), Megatron's schedule (:mod:`.forward`), the optimizer
step (:mod:`.optim`), checkpoints (:mod:`.checkpoint`, :mod:`.train_checkpoint`) and the actor (:mod:`.actor`).
Importing any of them first installs the CPU support layer (a no-op with CUDA), whose warning filters must be in
place before megatron.core is imported.
"""

from megatron_pacs.mcore import cpu_support as _cpu_support  # noqa: F401
