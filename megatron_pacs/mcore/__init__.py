"""The Megatron-Core layer: the only package that imports ``megatron.core``.

Parallel state (:mod:`.parallel`), the GPTModel builder (:mod:`.model`), exact HF <-> Megatron weights
(:mod:`.weights`), vocab-parallel log-probs (:mod:`.logprobs`), Megatron's schedule (:mod:`.forward`), the optimizer
step (:mod:`.optim`), checkpoints (:mod:`.model_checkpoint`: weights; :mod:`.training_checkpoint`: a run's
resumable state) and the actor (:mod:`.actor`).
Importing any of them first installs the CPU support layer (a no-op with CUDA), whose warning filters must be in
place before megatron.core is imported.
"""

from megatron_pacs.mcore import cpu_support as _cpu_support  # noqa: F401
