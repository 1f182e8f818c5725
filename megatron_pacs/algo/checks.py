"""Input checks shared by the estimators: each refuses bad input with a ``ValueError`` that names the argument and
the fix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["as_float_vector", "check_1d", "check_choice", "check_finite", "check_groups", "check_rewards"]


def check_choice(name: str, value: str, valid: Iterable[str]) -> None:
    """Raise a ``ValueError`` naming ``name`` and listing the valid options when ``value`` is not one of them."""
    valid = sorted(valid)
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not a valid option; choose one of {valid}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise a ``ValueError`` if ``tensor`` holds NaN or inf (one device sync)."""
    if not bool(torch.isfinite(tensor).all()):
        bad = (~torch.isfinite(tensor)).nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"{name} contains NaN or inf (first bad positions {bad}); drop or fix those responses before the loss"
        )


def check_groups(num_responses: int, group_size: int, *, need_pairs: bool) -> int:
    """Validate the group layout and return the number of groups.

    Args:
        num_responses: S, the number of responses (groups contiguous).
        group_size: N, responses per prompt.
        need_pairs: True when the option needs N >= 2 (leave-one-out or std over the group).
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (responses sampled per prompt)")
    if need_pairs and group_size < 2:
        raise ValueError(
            f"group_size={group_size} is too small for a group baseline (rloo/grpo need >= 2 responses per "
            "prompt); sample more responses per prompt or use advantage='naive'"
        )
    if num_responses % group_size != 0:
        raise ValueError(
            f"the batch has {num_responses} responses, not a multiple of group_size={group_size}; each prompt's "
            "responses must be contiguous and complete"
        )
    return num_responses // group_size


def check_rewards(rewards: torch.Tensor) -> None:
    """Rewards are BCE labels: finite and within [0, 1]."""
    check_finite("rewards", rewards)
    if rewards.numel() and (bool((rewards < 0).any()) or bool((rewards > 1).any())):
        lo, hi = rewards.min().item(), rewards.max().item()
        raise ValueError(
            f"rewards must lie in [0, 1] to serve as BCE labels, got values in [{lo}, {hi}]; "
            "rescale the reward (e.g. (r - r_min) / (r_max - r_min)) or binarise it"
        )


def check_1d(name: str, tensor: torch.Tensor, size: int | None = None) -> None:
    """Raise a ``ValueError`` unless ``tensor`` is 1-D (of length ``size`` when given)."""
    if tensor.dim() != 1 or (size is not None and tensor.shape[0] != size):
        want = f"[{size}]" if size is not None else "[S]"
        raise ValueError(f"{name} must have shape {want} (one value per response), got {tuple(tensor.shape)}")


def as_float_vector(name: str, values: Sequence[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Coerce ``values`` to a float tensor on ``like``'s device."""
    t = torch.as_tensor(values, device=like.device)
    if not torch.is_floating_point(t):
        t = t.float()
    check_1d(name, t, like.shape[0])
    return t
