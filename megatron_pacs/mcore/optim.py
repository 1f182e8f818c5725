"""Megatron DDP + optimizer, and one training step with a world-wide non-finite-gradient guard.

Loss normalisation ("local sum / global count"). The model must be built with ``calculate_per_token_loss=True``
(``build_gpt_model(hf_config, groups, calculate_per_token_loss=True)``); ``loss_fn`` returns Megatron's 3-tuple
``(loss_sum, count, report)`` per micro-batch. In megatron-core (checked in 0.16.1,
``pipeline_parallel/schedules.py`` and ``distributed/finalize_model_grads.py``):

1. ``forward_step_calc_loss`` leaves ``loss_sum`` unscaled (no division by ``count`` or by the number of
   micro-batches when ``calculate_per_token_loss``), so each micro-batch's backward adds ``d loss_sum / d theta``
   into the fp32 ``main_grad`` buffers, and the schedule sums the counts: ``total = sum_mb count_mb`` (on the last
   pipeline stage; 0 elsewhere).
2. ``DistributedDataParallel`` uses ``gradient_scaling_factor = 1`` under ``calculate_per_token_loss``: the DP
   all-reduce in ``finish_grad_sync`` *sums* the gradients over data-parallel ranks (no averaging).
3. ``finalize_model_grads(model, total)`` broadcasts ``total`` from the last pipeline stage over the PP group,
   all-reduces it (sum) over the DP(xCP) group, and scales every gradient by ``1 / N``.

So the optimizer sees ``grad = sum_{dp} sum_{mb} d loss_sum / d theta / N`` with ``N = sum_{dp} sum_{mb} count``:
the gradient of ``(sum of the global batch's per-token losses) / (global token count)``, independent of how the
batch is split into micro-batches and ranks. A ``loss_fn`` wanting another normaliser (e.g. per sequence) returns
that unit as ``count``.

Optimizer: Megatron's ``get_megatron_optimizer`` with ``optimizer="adam"`` and ``decoupled_weight_decay=True``
(TE's or Apex's FusedAdam in AdamW mode when installed; otherwise megatron-core falls back to ``torch.optim.AdamW``
in foreach mode, which :func:`build_trainable` switches to torch's fused CUDA kernel on GPU). Biases and 1-D
parameters (norms) get no weight decay (Megatron's standard ``wd_mult=0`` groups; applied here because no Megatron
scheduler runs). Learning rate: a linear warm-up over ``lr_warmup_steps`` optimizer steps (skipped steps do not
count), then constant (or a linear decay over ``lr_decay_steps``), set on the parameter groups before each step.

The step is Megatron's ``ChainedOptimizer.step`` spelled out (``prepare_grads``, ``get_grad_norm``, clip,
``step_with_ready_grads``) with one change: a non-finite global norm skips the update. The norm Megatron computes is
already global (the gradients are DP-reduced, the norm all-reduced over the model-parallel group, or over DP too
with the distributed optimizer), so every rank sees the same value and agrees to skip without another collective,
and reading it is the step's only host sync. The clip is one multi-tensor multiply (Megatron's clip asserts CUDA
tensors, so CPU runs would need another path otherwise). The distributed optimizer and the bf16 mixed-precision
wrapper are GPU only and refused on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

from megatron_pacs.algo.tokens import MicroBatch
from megatron_pacs.config import OptimConfig
from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.mcore.forward import LossFn, run_schedule
from megatron_pacs.mcore.parallel import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "LRSchedule",
    "StepResult",
    "Trainable",
    "build_trainable",
    "masked_sum_and_count",
    "offload_trainable",
    "onload_trainable",
    "optimizer_step",
    "reset_optimizer_state",
]


@dataclass
class LRSchedule:
    """Linear warm-up, then constant (or a linear decay); counts the optimizer steps taken (checkpoint it).

    After an optimizer reset with a re-warm-up (:func:`reset_optimizer_state`), the next ``rewarm_steps`` taken
    steps scale the schedule's rate by ``k / rewarm_steps``, k = 1, 2, ... (``since_reset`` counts them).
    """

    lr: float
    warmup_steps: int
    decay_steps: int = 0
    num_steps: int = 0
    rewarm_steps: int = 0
    since_reset: int | None = None

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step."""
        if self.num_steps < self.warmup_steps:
            lr = self.lr * (self.num_steps + 1) / self.warmup_steps
        elif self.decay_steps:
            lr = self.lr * max(0.0, 1.0 - (self.num_steps - self.warmup_steps) / self.decay_steps)
        else:
            lr = self.lr
        if self.since_reset is not None and self.rewarm_steps:
            lr *= min(1.0, (self.since_reset + 1) / self.rewarm_steps)
        return lr

    def step_taken(self) -> None:
        """Count a taken optimizer step (skipped ones do not advance the schedule)."""
        self.num_steps += 1
        if self.since_reset is not None:
            self.since_reset += 1
            if self.since_reset >= self.rewarm_steps:
                self.since_reset = None

    def state_dict(self) -> dict[str, int | None]:
        return {"num_steps": self.num_steps, "rewarm_steps": self.rewarm_steps, "since_reset": self.since_reset}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        self.num_steps = int(state["num_steps"] or 0)
        self.rewarm_steps = int(state.get("rewarm_steps") or 0)
        since = state.get("since_reset")
        self.since_reset = None if since is None else int(since)


@dataclass
class StepResult:
    """Outcome of :func:`optimizer_step`.

    Attributes:
        skipped: True when some rank had a non-finite gradient and no rank stepped.
        grad_norm: Global L2 norm of the gradient before clipping (NaN when skipped).
        reports: ``loss_fn``'s report dicts, one per micro-batch (last pipeline stage only; ``[]`` elsewhere).
        lr: The learning rate used (0 when skipped).
    """

    skipped: bool
    grad_norm: float
    reports: list[dict[str, torch.Tensor]] = field(default_factory=list)
    lr: float = 0.0


@dataclass
class Trainable:
    """Model chunks in Megatron DDP with their optimizer and learning-rate schedule (from :func:`build_trainable`).

    Attributes:
        models: DDP-wrapped chunks; their parameters are the built model's (updated in place).
        optimizer: Megatron's optimizer over them.
        config: The optimizer settings.
        schedule: The learning-rate schedule; checkpoint its ``state_dict``.
        reset_pending: The next optimizer step starts from a fresh Adam state (:func:`reset_optimizer_state`);
            checkpoint it.
    """

    models: list[DDP]
    optimizer: MegatronOptimizer
    config: OptimConfig
    schedule: LRSchedule
    reset_pending: bool = False


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def build_trainable(models: Sequence[MegatronModule], groups: ParallelGroups, cfg: OptimConfig) -> Trainable:
    """Wrap model chunks in Megatron DDP and build the AdamW optimizer; wire the schedule hooks.

    Sets on the chunks' ``TransformerConfig``: ``finalize_model_grads_func`` (DP gradient all-reduce, tied and
    sequence-parallel gradient sync, division by the global count; with ``groups.pg_collection``),
    ``no_sync_func`` and ``grad_scale_func``. A bf16 model (``TransformerConfig.bf16``) gets Megatron's
    mixed-precision optimizer with fp32 main parameters.

    Args:
        models: Chunks from :func:`megatron_pacs.mcore.model.build_gpt_model`, built with
            ``calculate_per_token_loss=True`` (see the module docstring).
        groups: The parallel groups the chunks were built with.
        cfg: Optimizer settings.

    Returns:
        The :class:`Trainable`; the chunks' parameters are shared with ``models`` (updated in place).

    Raises:
        ValueError: for a model built without ``calculate_per_token_loss``, or GPU-only options on CPU.
    """
    tcfg = models[0].config
    if not tcfg.calculate_per_token_loss:
        raise ValueError(
            "the model was built with calculate_per_token_loss=False; build it with "
            "build_gpt_model(hf_config, groups, calculate_per_token_loss=True) so the loss is sum / global count"
        )
    bf16 = bool(tcfg.bf16)
    if _on_cpu() and cfg.use_distributed_optimizer:
        raise ValueError("--use-distributed-optimizer needs CUDA (Megatron's distributed optimizer); drop it on CPU")
    if _on_cpu() and bf16:
        raise ValueError("--bf16 needs CUDA (Megatron's mixed-precision optimizer checks CUDA types); use fp32")
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.use_distributed_optimizer
    )
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        decoupled_weight_decay=True,
        clip_grad=cfg.clip_grad,  # applied in _step_unless_nonfinite (Megatron's own clip asserts CUDA tensors)
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    with cuda_to_cpu():
        ddp_models = [
            DDP(tcfg, ddp_cfg, m, disable_bucketing=i > 0, pg_collection=groups.pg_collection)
            for i, m in enumerate(models)
        ]
        optimizer = get_megatron_optimizer(
            opt_cfg,
            cast("list[MegatronModule]", ddp_models),
            use_gloo_process_groups=False,
            pg_collection=groups.pg_collection,
        )
    pg_collection = groups.pg_collection

    def finalize(model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None, **kwargs: Any) -> None:
        # The schedule passes the groups it resolved itself; use this model's groups instead.
        kwargs["pg_collection"] = pg_collection
        finalize_model_grads(model_chunks, num_tokens, **kwargs)

    no_sync = [m.no_sync for m in ddp_models]
    for chunk_config in {id(m.config): m.config for m in ddp_models}.values():
        chunk_config.finalize_model_grads_func = finalize
        # Typed as one callable; Megatron's interleaved schedule takes a list of them, one per chunk.
        chunk_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync  # pyright: ignore[reportAttributeAccessIssue]
        chunk_config.grad_scale_func = optimizer.scale_loss
    _use_fused_torch_adamw(optimizer)
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.lr_warmup_steps, decay_steps=cfg.lr_decay_steps)
    return Trainable(models=ddp_models, optimizer=optimizer, config=cfg, schedule=schedule)


def _params(ddp_models: list[DDP]) -> list[torch.nn.Parameter]:
    return [p for m in ddp_models for p in m.module.parameters() if p.requires_grad]


def _zero_grads(ddp_models: list[DDP], optimizer: MegatronOptimizer) -> None:
    for m in ddp_models:
        m.zero_grad_buffer()
    optimizer.zero_grad()


def _set_lr(optimizer: MegatronOptimizer, lr: float, peak_lr: float, weight_decay: float) -> None:
    for group in optimizer.param_groups:
        # Groups with their own peak (Megatron's decoupled_lr) follow the same schedule shape.
        group["lr"] = lr * group.get("max_lr", peak_lr) / peak_lr if peak_lr else 0.0  # --lr 0: a frozen policy
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _use_fused_torch_adamw(optimizer: MegatronOptimizer) -> int:
    """On CUDA, switch megatron-core's ``torch.optim.AdamW`` fallback (foreach mode) to torch's fused kernel.

    Megatron builds the torch optimizer without a way to ask for ``fused=True``; before the first step no state
    exists, so the flag can still be set on its parameter groups (the state is then created in the fused layout).

    Returns:
        The number of optimizers switched (0 with TE/Apex, whose FusedAdam is already fused, or on CPU).
    """
    if not torch.cuda.is_available():
        return 0
    switched = 0
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if type(inner) is torch.optim.AdamW and not inner.state:
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
            switched += 1
    return switched


def _clip(optimizer: MegatronOptimizer, clip_grad: float, grad_norm: float) -> None:
    """Scale every main gradient by ``clip_grad / (norm + 1e-6)`` when below 1 (Megatron's rule), in one
    multi-tensor op."""
    coeff = clip_grad / (grad_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    grads = [p.grad for opt in _inner_optimizers(optimizer) for p in opt.get_parameters() if p.grad is not None]
    if grads:
        # torch.optim's own multi-tensor kernel; the public clip_grads_with_norm_ would compute the coefficient in
        # float32 rather than Megatron's (and the former CPU path's) Python-double rule, changing the last bit.
        torch._foreach_mul_(grads, coeff)  # pyright: ignore[reportPrivateImportUsage]


def _step_unless_nonfinite(
    optimizer: MegatronOptimizer, clip_grad: float, before_update: Callable[[], None] | None = None
) -> tuple[bool, float]:
    """Megatron's ``ChainedOptimizer.step`` with a skip on a non-finite global norm (see the module docstring).

    ``before_update`` runs only when the step is taken, right before the parameters move (a pending optimizer
    reset: a skipped step must not use it up).

    Returns:
        ``(stepped, grad_norm)``; not stepped when the norm is not finite or an fp16 loss scaler found inf.
    """
    if optimizer.prepare_grads():  # fp16 only: the loss scaler found inf (Megatron agreed on it over the world)
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())  # the step's one host sync
    if not math.isfinite(grad_norm):
        return False, grad_norm
    if clip_grad > 0:
        _clip(optimizer, clip_grad, grad_norm)
    if before_update is not None:
        before_update()
    return bool(optimizer.step_with_ready_grads()), grad_norm


def optimizer_step(trainable: Trainable, micro_batches: list[MicroBatch], loss_fn: LossFn) -> StepResult:
    """One optimizer step over ``micro_batches`` (this rank's share of the global batch). Collective.

    Zeroes the gradient buffers, runs Megatron's forward-backward schedule (``loss_fn`` in the 3-tuple
    convention; normalisation in the module docstring), then steps unless the global gradient norm is NaN/inf,
    which every rank sees alike: then no rank steps (gradients are zeroed, the warm-up counter does not advance)
    and ``skipped=True``.

    Args:
        trainable: From :func:`build_trainable`.
        micro_batches: This rank's micro-batches (padded ``[b, L]`` or packed ``[1, T]``; one shape across the
            pipeline).
        loss_fn: ``(logits_shard [b, L, Vp], micro_batch) -> (loss_sum, count, report)``.

    Returns:
        The step's :class:`StepResult`.
    """
    ddp_models, optimizer, cfg, schedule = trainable.models, trainable.optimizer, trainable.config, trainable.schedule
    for m in ddp_models:
        m.train()
    _zero_grads(ddp_models, optimizer)
    reports = run_schedule(ddp_models, micro_batches, loss_fn, forward_only=False)
    lr = schedule.current_lr()
    _set_lr(optimizer, lr, cfg.lr, cfg.weight_decay)
    # a pending reset is applied only on a taken step: a skipped one leaves Adam's state (and the reset) as it was
    reset = partial(_apply_pending_reset, trainable) if trainable.reset_pending else None
    with cuda_to_cpu():
        ok, grad_norm = _step_unless_nonfinite(optimizer, cfg.clip_grad, reset)
    if not ok:
        _zero_grads(ddp_models, optimizer)
        return StepResult(skipped=True, grad_norm=float("nan"), reports=reports, lr=0.0)
    schedule.step_taken()
    return StepResult(skipped=False, grad_norm=grad_norm, reports=reports, lr=lr)


def reset_optimizer_state(trainable: Trainable, rewarm_steps: int = 0) -> None:
    """Forget Adam's moments and step counters at the next optimizer step (PACS v2's reset with the reference,
    following ProRL): that step is a first Adam step again, close to ``lr * sign(g)`` per element whatever the
    gradient's scale. The learning-rate schedule continues; with ``rewarm_steps`` > 0 the next ``rewarm_steps``
    taken steps ramp it back linearly from ``lr / rewarm_steps`` (``--ref-reset-lr-warmup-steps``).

    The reset is applied just before the next update that is taken (a step skipped on a non-finite gradient
    leaves it pending and Adam's state intact) rather than now: until then the state stays valid, so a
    checkpoint written in between (say at the reset step) saves it normally together with
    ``Trainable.reset_pending`` (megatron-core 0.16.1 drops a zero step count when saving, so an optimizer holding
    freshly zeroed counters would not reload).
    """
    trainable.reset_pending = True
    if rewarm_steps:
        trainable.schedule.rewarm_steps, trainable.schedule.since_reset = rewarm_steps, 0


def _apply_pending_reset(trainable: Trainable) -> None:
    """Drop the optimizer state; torch's (and TE's) Adam re-create it at this step, as on the first one."""
    for opt in _inner_optimizers(trainable.optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        inner.state.clear()
        for group in inner.param_groups:
            group.pop("step", None)  # Apex/TE FusedAdam keep the step count per group
    trainable.reset_pending = False


def masked_sum_and_count(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of values where mask, int count)`` for the 3-tuple convention (``values``, ``mask`` ``[b, T]``)."""
    mask = mask.to(values.device)
    return torch.where(mask, values, torch.zeros_like(values)).sum(), mask.sum().to(torch.int)


def offload_trainable(trainable: Trainable) -> None:
    """Optimizer state and gradient buffers to host memory (Megatron's RL offload; GPU only, else a no-op)."""
    if not torch.cuda.is_available():
        return
    trainable.optimizer.offload_to_cpu()
    for m in trainable.models:
        m.offload_grad_buffers()


def onload_trainable(trainable: Trainable) -> None:
    """Undo :func:`offload_trainable` before an update."""
    if not torch.cuda.is_available():
        return
    for m in trainable.models:
        m.restore_grad_buffers()
    trainable.optimizer.restore_from_cpu()
