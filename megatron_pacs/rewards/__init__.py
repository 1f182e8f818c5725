"""Verifiable rewards: the math-verify reward and a process-pool scorer with hard per-item timeouts."""

from megatron_pacs.rewards.math_verify import math_verify_reward, score_with_status
from megatron_pacs.rewards.scorer import RewardScorer, ScoreResult

__all__ = ["RewardScorer", "ScoreResult", "math_verify_reward", "score_with_status"]
