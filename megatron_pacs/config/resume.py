"""What a resumed run may change: the checkpoint's configuration against this launch's (docs/architecture.md).

A checkpoint stores the whole :class:`TrainConfig` (``TrainConfig.to_dict``). On resume, a change that would make
the saved state mean something else is refused; any other change to what is trained is reported, so the record
says where the run's recipe changed; settings that only place, pace or log the run are free.
"""

from __future__ import annotations

from typing import Any

from megatron_pacs.config.base import flag

__all__ = ["resume_changes"]

REFUSED = {
    "run.seed": "the loader's saved position indexes the data order of the saved seed: the run would skip some "
    "prompts and repeat others",
}
"""Changes that break the saved state, and why."""

REFUSED_WITH_PENDING = (
    "batch.global_batch_size",
    "batch.group_size",
    "batch.max_response_length",
    "rollout.off_policy_steps",
    "rollout.max_staleness",
)
"""Refused when the checkpoint holds rollouts generated ahead (one step off) or the asynchronous stream's groups:
they were laid out for these, and another schedule would drop them."""

FREE_SECTIONS = ("parallel", "checkpoint", "eval", "reward")
"""Sections that only place, save, validate or score the run (checkpoints reshard to any parallel layout)."""

FREE_FIELDS = frozenset(
    {
        "run.train_iters",
        "run.log_dir",
        "run.wandb_project",
        "run.wandb_exp_name",
        "run.dry_run",
        "run.world_size",
        "run.exit_signal_handler",
        "run.exit_signal_grace_seconds",
        "run.dump_rollouts",
        "run.log_samples",
        "data.val_data",
        "batch.micro_batch_size",
        "batch.max_tokens_per_microbatch",
        "batch.sequence_packing",
        "rollout.num_engines",
        "rollout.rollout_tensor_parallel_size",
        "rollout.ray_address",
        "rollout.ray_runtime_env",
        "rollout.ray_object_store_gb",
        "rollout.gpu_memory_utilization",
        "rollout.kv_cache_gb",
        "rollout.weight_sync",
        "rollout.weight_sync_address",
        "rollout.weight_sync_bucket_mb",
        "rollout.keep_weights_for_restart",
        "rollout.chunks_per_engine",
        "rollout.max_engine_restarts",
        "rollout.rollout_cluster_reconnect_seconds",
        "rollout.max_logprob_diff",
        "model.hf_model",  # the weights come from the checkpoint; a moved directory is fine (the layers are checked)
        "model.recompute_activations",
        "model.bias_swiglu_fusion",
        "model.rope_fusion",
        "model.masked_softmax_fusion",
        "model.transformer_impl",
        "model.logprob_impl",
    }
)
"""Fields that only place, pace or log the run."""


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, fields in config.items() if isinstance(fields, dict) for k, v in fields.items()}


def resume_changes(saved: dict[str, Any], current: dict[str, Any], *, pending_rollouts: bool) -> list[str]:
    """Compare a checkpoint's configuration with this launch's.

    Args:
        saved: The checkpoint's ``config`` (``TrainConfig.to_dict()`` when it was written).
        current: This launch's ``TrainConfig.to_dict()``.
        pending_rollouts: Whether the checkpoint holds rollouts generated ahead for the next step.

    Returns:
        One ``"--flag: saved -> now"`` line per reported change (for a warning), by section and field.

    Raises:
        ValueError: naming the flag, when a change would break the resumed state.
    """
    old, new = _flatten(saved), _flatten(current)
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    report = []
    for key in changed:
        name = key.split(".", 1)[1]
        why = REFUSED.get(key)
        if why is None and pending_rollouts and key in REFUSED_WITH_PENDING:
            why = "the checkpoint holds the next step's rollouts (or the stream's groups), made for the saved value"
        if why is not None:
            raise ValueError(
                f"{flag(name)}: {old[key]!r} in the checkpoint, {new[key]!r} now; {why}. Resume with the saved "
                "value, or start a new run (a new --save directory)"
            )
        if key.split(".", 1)[0] not in FREE_SECTIONS and key not in FREE_FIELDS:
            report.append(f"{flag(name)}: {old[key]!r} -> {new[key]!r}")
    return report
