"""Faults injected from outside the product: a non-finite gradient on one rank, through a gradient hook.

Production signatures carry no test parameters; a test poisons a parameter's gradient with a tensor hook, which
runs before Megatron's DDP hook accumulates ``param.grad`` into ``main_grad``, exactly where a real overflow would
show up.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def poison_gradient(models: Iterable[torch.nn.Module]) -> torch.utils.hooks.RemovableHandle:
    """Make the first trainable parameter's gradient NaN in every backward until the handle is removed."""
    param = next(p for m in models for p in m.parameters() if p.requires_grad)
    return param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
