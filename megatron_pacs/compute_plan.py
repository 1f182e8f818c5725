"""The dry run's compute estimate: FLOPs per step, a step time and the run's GPU-hours, from stated assumptions.

What the planner knows is the shape, the layout and the batch; what it cannot know is how long the responses will
be and how fast the kernels run on a given cluster. So the estimate is a range over the mean response length (half
the configured maximum and the maximum itself) at assumed efficiencies, each a module constant:

    training   6 N s + 12 L h s^2 FLOPs per sequence of s tokens for a forward and backward (the formula of
               docs/gpu.md's MFU figures), 2 N s + 4 L h s^2 for a forward alone; full recompute adds a forward;
    passes     the actor's update (x --ppo-epochs); a forward for the old log-probs when a step has more than one
               optimizer step; one for the reference policy; PACS's two-phase gradient adds one; PPO's critic
               adds its values pass and its update on the critic's own shape;
    rollouts   2 N per prompt and response token, plus 4 L h per token and token of context (the decode's
               attention over the prompt and the response so far);
    time       training FLOPs / (training GPUs x peak x TRAIN_MFU) + rollout FLOPs / (rollout GPUs x peak x
               ROLLOUT_MFU), one after the other (an on-policy step);
    GPU-hours  every GPU the run holds (the training ranks and, unless colocated, the rollout fleet's) x the step
               time x --train-iters.

N is every parameter (the embedding's too: a small overestimate), L the layers, h the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config import TrainConfig
from megatron_pacs.planner import ModelShape, RunPlan

__all__ = ["PEAK_TFLOPS", "ROLLOUT_MFU", "TRAIN_MFU", "ComputeEstimate", "estimate_compute", "format_compute"]

PEAK_TFLOPS = 989.0
"""Dense bf16 peak of one H100 / H200 SXM (TFLOP/s)."""
TRAIN_MFU = 0.35
"""Training efficiency: the 1.5B train step measured 37.7% MFU on one H200 (docs/gpu.md); larger layouts lose some
to communication."""
ROLLOUT_MFU = 0.10
"""Generation efficiency: an assumption, not a measurement (vLLM's decode at large batches is bound by memory
bandwidth, not FLOPs); replace it with a measured one for a real budget."""


@dataclass(frozen=True, kw_only=True)
class ComputeEstimate:
    """One step's FLOPs and time, and the run's GPU-hours, at one mean response length."""

    response_tokens: int
    """The mean response length assumed."""
    train_tflop: float
    """Training FLOPs of a step (TFLOP)."""
    rollout_tflop: float
    """Generation FLOPs of a step (TFLOP)."""
    step_s: float
    """Estimated step time (s)."""
    gpus: int
    """GPUs the run holds."""
    gpu_hours: float
    """``gpus x step_s x --train-iters`` / 3600."""


def _train_flops(shape: ModelShape, tokens: int) -> tuple[float, float]:
    """(forward and backward, forward alone) FLOPs of one sequence of ``tokens`` tokens."""
    n, lh = shape.num_params(), shape.num_hidden_layers * shape.hidden_size
    return 6 * n * tokens + 12 * lh * tokens**2, 2 * n * tokens + 4 * lh * tokens**2


def estimate_compute(plan: RunPlan, cfg: TrainConfig, *, response_tokens: int) -> ComputeEstimate:
    """The estimate of the module docstring for ``plan`` with responses of ``response_tokens`` tokens on average.

    Args:
        plan: The dry run's plan (shape, layout, batch).
        cfg: The run's configuration.
        response_tokens: The mean response length to assume.

    Returns:
        The step's FLOPs and time and the run's GPU-hours.
    """
    b = cfg.batch
    responses = plan.responses_per_step
    seq = b.max_prompt_length + response_tokens
    full, forward = _train_flops(plan.shape, seq)
    if plan.recompute_activations:
        full += forward
    forwards = int(plan.optimizer_steps_per_step > 1) + int(cfg.needs_reference) + int(cfg.loss.loss == "pacs")
    per_sequence = full * b.ppo_epochs + forward * forwards
    if plan.critic_shape is not None:
        critic_full, critic_forward = _train_flops(plan.critic_shape, seq)
        if plan.recompute_activations:
            critic_full += critic_forward
        per_sequence += critic_forward + critic_full * b.ppo_epochs
    n, lh = plan.shape.num_params(), plan.shape.num_hidden_layers * plan.shape.hidden_size
    context = b.max_prompt_length * response_tokens + response_tokens**2 / 2  # summed over the decoded tokens
    per_response = 2 * n * seq + 4 * lh * context
    train_tflop, rollout_tflop = responses * per_sequence / 1e12, responses * per_response / 1e12
    rollout_gpus = plan.world_size if cfg.rollout.colocate else plan.num_engines * plan.rollout_tp
    step_s = train_tflop / (plan.world_size * PEAK_TFLOPS * TRAIN_MFU)
    step_s += rollout_tflop / (rollout_gpus * PEAK_TFLOPS * ROLLOUT_MFU)
    gpus = plan.world_size + (0 if cfg.rollout.colocate else rollout_gpus)
    return ComputeEstimate(
        response_tokens=response_tokens,
        train_tflop=train_tflop,
        rollout_tflop=rollout_tflop,
        step_s=step_s,
        gpus=gpus,
        gpu_hours=gpus * step_s * cfg.run.train_iters / 3600,
    )


def format_compute(plan: RunPlan, cfg: TrainConfig) -> str:
    """The dry run's compute section: the estimate at half the maximum response length and at the maximum."""
    longest = cfg.batch.max_response_length
    rows = [estimate_compute(plan, cfg, response_tokens=t) for t in sorted({max(1, longest // 2), longest})]
    lines = [
        "",
        f"== compute (an estimate: {PEAK_TFLOPS:g} TFLOP/s peak per GPU, training at {TRAIN_MFU:.0%} MFU, "
        f"rollouts at {ROLLOUT_MFU:.0%}; megatron_pacs/compute_plan.py) ==",
        f"  {'mean response':<16}{'train PFLOP':>12}{'rollout PFLOP':>15}{'step s':>9}{'GPUs':>6}"
        f"{f'GPU-h ({cfg.run.train_iters} steps)':>22}",
    ]
    for e in rows:
        lines.append(
            f"  {f'{e.response_tokens} tokens':<16}{e.train_tflop / 1e3:>12.1f}{e.rollout_tflop / 1e3:>15.1f}"
            f"{e.step_s:>9.0f}{e.gpus:>6}{e.gpu_hours:>22.0f}"
        )
    return "\n".join(lines)
