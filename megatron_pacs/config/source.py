"""Where each step's rollouts come from: the fleet, an earlier run's dumps, or seeded synthetic sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_pacs.config.base import bad, flag, is_set, option
from megatron_pacs.config.sources import SOURCES

__all__ = ["FILTER_GROUPS", "SourceConfig", "check_source_flags"]

FILTER_GROUPS = ("none", "zero-variance")
"""The ``--filter-groups`` values."""


@dataclass(kw_only=True)
class SourceConfig:
    """The rollout source."""

    rollout_source: str = option("fleet", choices=SOURCES)
    """fleet: the engines generate and the reward pool scores. replay: an earlier run's dumped rollouts
    (--replay-from), bit for bit. synthetic: seeded random sequences with Bernoulli rewards (the training phase
    alone). docs/training.md"""
    replay_from: str | None = None
    """With --rollout-source replay: the --log-dir of the run whose rollouts/step_*.safetensors to replay."""
    synthetic_reward_rate: float = 0.5
    """With --rollout-source synthetic: the probability that a response's reward is 1 (else 0)."""
    filter_groups: str = option("none", choices=FILTER_GROUPS)
    """none, or zero-variance (DAPO's dynamic sampling): a group whose rewards are all equal is dropped after scoring
    and the batch is refilled with the next prompts of the stream until it holds --global-batch-size groups; the
    dropped groups' prompts count as used (docs/algorithm.md §2.8)."""
    max_filter_rounds: int = 8
    """With --filter-groups zero-variance: refill rounds a step may run after its first generation (0: no limit, the
    step logs that it is still refilling after 8, 16, 32, ... rounds); a step that still lacks groups after them
    fails, naming this flag (verl's max_num_gen_batches)."""

    def __post_init__(self) -> None:
        if self.rollout_source not in SOURCES:
            raise bad("rollout_source", f"{self.rollout_source!r} is not one of {list(SOURCES)}")
        if (self.rollout_source == "replay") != (self.replay_from is not None):
            raise bad(
                "replay_from",
                "names the run to replay and goes with --rollout-source replay (and only with it); give both or "
                "neither",
            )
        if not 0.0 <= self.synthetic_reward_rate <= 1.0:
            raise bad("synthetic_reward_rate", f"{self.synthetic_reward_rate} must lie in [0, 1]")
        if is_set(self, "synthetic_reward_rate") and self.rollout_source != "synthetic":
            raise bad("synthetic_reward_rate", "only applies with --rollout-source synthetic; drop it")
        if self.filter_groups not in FILTER_GROUPS:
            raise bad("filter_groups", f"{self.filter_groups!r} is not one of {list(FILTER_GROUPS)}")
        if self.filter_groups != "none" and self.rollout_source == "replay":
            raise bad(
                "filter_groups",
                "--rollout-source replay trains on the dumped batches as they are (a filtered run's dumps hold its "
                "filtered batches): there is nothing to refill from; drop it",
            )
        if self.filter_groups == "zero-variance" and self.rollout_source == "synthetic":
            rate = self.synthetic_reward_rate
            if rate in (0.0, 1.0):
                raise bad(
                    "filter_groups",
                    f"every reward is {rate:g} with --synthetic-reward-rate {rate:g}, so every group has equal "
                    "rewards and zero-variance filtering drops them all; use a rate strictly between 0 and 1, or drop "
                    "the filter",
                )
        if self.max_filter_rounds < 0:
            raise bad("max_filter_rounds", f"{self.max_filter_rounds} must be >= 0 (0: no limit)")
        if is_set(self, "max_filter_rounds") and self.filter_groups == "none":
            raise bad(
                "max_filter_rounds", "only means something with --filter-groups zero-variance; add it or drop this"
            )


# What only a fleet (engines, sampling, the weight-sync transports, colocation, overlap) or the reward pool and
# validation would use: refused with the other sources, never silently ignored.
_FLEET_ONLY = {
    "rollout": (
        "rollout_backend",
        "num_engines",
        "rollout_tensor_parallel_size",
        "top_p",
        "top_k",
        "rollout_dtype",
        "ray_address",
        "ray_runtime_env",
        "ray_object_store_gb",
        "colocate",
        "gpu_memory_utilization",
        "kv_cache_gb",
        "weight_sync",
        "weight_sync_address",
        "weight_sync_bucket_mb",
        "keep_weights_for_restart",
        "chunks_per_engine",
        "max_engine_restarts",
        "engine_call_timeout_seconds",
        "rollout_cluster_reconnect_seconds",
        "off_policy_steps",
        "max_staleness",
        "staleness_policy",
        "partial_rollouts",
        "rollout_round_tokens",
        "offload_optimizer_during_rollout",
        "rollout_engine_kwargs",
    ),
    "reward": ("reward_fn", "reward_workers", "reward_timeout", "reward_max_chars"),
    "eval": ("eval_interval", "val_n", "val_temperature"),
    "data": ("val_data",),
}


def check_source_flags(source: SourceConfig, sections: dict[str, Any]) -> None:
    """Refuse, naming the flag, every setting that only a fleet would use when the rollouts come from elsewhere.

    Args:
        source: The rollout source.
        sections: The run's other sections by name (``rollout``, ``loss``, ``reward``, ``eval``, ``data``,
            ``model``, ``run``).

    Raises:
        ValueError: naming the flag and the source.
    """
    kind, spec = source.rollout_source, SOURCES[source.rollout_source]
    if spec.engines:
        return
    if sections["model"].router_replay == "r3" and not spec.engine_logprobs:
        raise bad(
            "router_replay",
            "r3 replays the experts the engines routed each token to, and --rollout-source synthetic rollouts carry "
            "none; use --router-replay off (or replay the dumps of a run that had r3 on: --rollout-source replay)",
        )
    for section, names in _FLEET_ONLY.items():
        values = sections[section]
        for name in names:
            if hasattr(values, name) and is_set(values, name):
                raise bad(
                    name,
                    f"only a fleet uses it, and --rollout-source {kind} runs none (no engines, sampling, weight "
                    "sync or validation); drop it",
                )
    run = sections.get("run")
    if not spec.texts and run is not None and run.log_samples:
        raise bad(
            "log_samples",
            f"shows each step's first responses as text, and --rollout-source {kind} rollouts have none (token ids "
            "only); drop it",
        )
    if not spec.engine_logprobs:
        for section, name, why in (
            (
                "rollout",
                "max_logprob_diff",
                f"compares with the engines' log-probs, which {kind} rollouts have none of",
            ),
            (
                "loss",
                "off_policy_correction",
                f"weights by the engines' log-probs, which {kind} rollouts have none of",
            ),
        ):
            if is_set(sections[section], name):
                raise ValueError(f"{flag(name)}: {why}; drop it with --rollout-source {kind}")
