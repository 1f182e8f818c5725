"""Supervised warm-up of a Hugging Face checkpoint through the Megatron training stack, exported back to HF.

Used by the embedded CPU demo to turn a random tiny model into one that answers in the reward's format before RL.
The path is the trainer's own: :func:`build_gpt_model` -> :func:`load_hf_weights` -> :func:`build_trainable` ->
:func:`optimizer_step` (Megatron's schedule, vocab-parallel log-probs) -> :func:`export_hf_weights` ->
:func:`save_hf_checkpoint`. Any TP / PP / DP layout works; a single gloo process is the usual case.

Loss: mean negative log-likelihood of the response tokens (the response and its closing ``<|im_end|>``), over the
global batch: per-token sums with the token count as Megatron's ``count`` (see :mod:`megatron_pacs.mcore.optim`).

Shapes: N rows, L padded length, B global batch, b micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_pacs.algo.tokens import MicroBatch, make_micro_batches
from megatron_pacs.config import OptimConfig
from megatron_pacs.data.prompts import apply_chat_template, build_messages
from megatron_pacs.mcore.forward import model_token_logprobs, sequence_logprobs
from megatron_pacs.mcore.model import MegatronModule, build_gpt_model
from megatron_pacs.mcore.model_checkpoint import save_hf_checkpoint
from megatron_pacs.mcore.optim import build_trainable, masked_sum_and_count, optimizer_step
from megatron_pacs.mcore.parallel import ParallelGroups
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights

__all__ = ["encode_sft_rows", "sft_warmup"]


def encode_sft_rows(tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template prompts followed by their target responses and EOS, right-padded.

    Args:
        tokenizer: A tokenizer with a chat template, ``eos_token_id`` and ``pad_token_id``.
        rows: Dicts with ``problem`` (the question) and ``response`` (the target text).

    Returns:
        ``tokens [N, L]`` and ``score_mask [N, L]`` (True at the response tokens and the EOS).
    """
    if not rows:
        raise ValueError("rows is empty; pass at least one {'problem', 'response'} row")
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs eos_token and pad_token set")
    seqs, masks = [], []
    for i, row in enumerate(rows):
        if "response" not in row or "problem" not in row:
            raise ValueError(f"rows[{i}] needs 'problem' and 'response' keys (e.g. demo_task.sft_response(row))")
        prompt = apply_chat_template(tokenizer, build_messages(row["problem"]))
        response = [*tokenizer(row["response"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        seqs.append(prompt + response)
        masks.append([False] * len(prompt) + [True] * len(response))
    length = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    score_mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        score_mask[i, : len(m)] = torch.tensor(m)
    return tokens, score_mask


def _nll_loss_fn(tp_group: dist.ProcessGroup):
    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        token_logp = model_token_logprobs(logits, mb, tp_group)  # [b, L - 1]
        loss_sum, count = masked_sum_and_count(-token_logp, mb.score_mask[:, 1:])
        return loss_sum, count, {"nll": torch.stack([loss_sum.detach(), count.detach().float()])}

    return loss_fn


def _global_mean_loss(reports: list[dict[str, torch.Tensor]], groups: ParallelGroups) -> float:
    """Token-mean loss of the global batch, the same on every rank."""
    total = torch.zeros(2, dtype=torch.float64)
    if groups.is_last_stage:
        for r in reports:
            total += r["nll"].double().cpu()
    if groups.dp_size > 1:
        dist.all_reduce(total, group=groups.dp_group)
    if groups.pp_size > 1:
        dist.broadcast(total, src=groups.last_stage_global_rank, group=groups.pp_group)
    return (total[0] / total[1].clamp(min=1)).item()


def _accuracy_estimator(tokenizer: Any, rows: list[dict[str, Any]], groups: ParallelGroups, micro_batch_size: int):
    """``models -> mean probability of the rows' (correct) responses``, the same on every rank."""
    tokens, score_mask = encode_sft_rows(tokenizer, rows)

    def evaluate(models: Sequence[MegatronModule]) -> float:
        seq_logp = sequence_logprobs(models, groups, tokens, score_mask, micro_batch_size=micro_batch_size)
        return seq_logp.double().exp().mean().item()

    return evaluate


def _batches(num_rows: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Row indices per step: shuffled epochs, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    need = steps * batch_size
    order = torch.cat([torch.randperm(num_rows, generator=gen) for _ in range(-(-need // num_rows))])
    return list(order[:need].view(steps, batch_size))


def sft_warmup(
    hf_dir_in: str | Path,
    hf_dir_out: str | Path,
    rows: list[dict[str, Any]],
    *,
    steps: int,
    lr: float,
    micro_batch_size: int,
    seed: int,
    groups: ParallelGroups,
    batch_size: int | None = None,
    weight_decay: float = 0.0,
    adam_beta2: float = 0.95,
    lr_warmup_steps: int = 0,
    lr_decay: bool = True,
    eval_rows: list[dict[str, Any]] | None = None,
    eval_every: int = 50,
    stop_at: float | None = None,
) -> dict[str, Any]:
    """Fine-tune ``hf_dir_in`` on ``rows`` (PACS-instruction prompt -> target response), save to ``hf_dir_out``.

    Collective over all ranks of ``groups``. The output directory holds the trained safetensors, the input's
    config and tokenizer files (replaced if it exists).

    Args:
        hf_dir_in: Hugging Face model directory with tokenizer.
        hf_dir_out: Output directory.
        rows: ``{"problem", "response"}`` dicts.
        steps: Optimizer steps.
        lr: Peak AdamW learning rate.
        micro_batch_size: Rows per micro-batch.
        seed: Data order seed.
        groups: From :func:`megatron_pacs.mcore.parallel.init_parallel`.
        batch_size: Global rows per step (default ``micro_batch_size * dp_size``); a multiple of
            ``micro_batch_size * dp_size``.
        weight_decay: AdamW decoupled weight decay.
        adam_beta2: Adam second-moment decay (0.95 shortens the plateaus of small models trained from scratch).
        lr_warmup_steps: Linear warm-up steps.
        lr_decay: Decay the learning rate linearly towards 0 over ``steps`` after the warm-up (else constant).
        eval_rows: Held-out ``{"problem", "response"}`` rows with *correct* responses; every ``eval_every`` steps
            the probability the model gives each of them (teacher forcing, one forward pass) is averaged:
            an estimate of the accuracy of temperature-1 sampling (slightly low: it ignores other correct
            wordings).
        eval_every: Steps between estimates.
        stop_at: Stop once the estimate reaches this value (needs ``eval_rows``); ``steps`` is then a maximum.

    Returns:
        ``{"loss": [per-step token-mean NLL], "first_loss", "final_loss", "steps" (taken), "skipped_steps",
        "time_s", "sampled_acc_est": [(step, estimate)]}``.
    """
    from transformers import AutoConfig, AutoTokenizer

    per_step = micro_batch_size * groups.dp_size
    batch_size = per_step if batch_size is None else batch_size
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if stop_at is not None and not eval_rows:
        raise ValueError("stop_at needs eval_rows (held-out rows with correct responses)")
    if eval_every < 1:
        raise ValueError(f"eval_every={eval_every} must be >= 1")
    if micro_batch_size < 1 or batch_size % per_step:
        raise ValueError(
            f"batch_size={batch_size} must be a positive multiple of micro_batch_size * dp_size = {per_step}"
        )
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir_in)
    hf_config = AutoConfig.from_pretrained(hf_dir_in)
    tokens, score_mask = encode_sft_rows(tokenizer, rows)
    models = build_gpt_model(hf_config, groups, calculate_per_token_loss=True)
    load_hf_weights(models, str(hf_dir_in), groups, hf_config)
    decay_steps = max(steps - lr_warmup_steps, 1) if lr_decay else 0
    cfg = OptimConfig(
        lr=lr,
        weight_decay=weight_decay,
        adam_beta2=adam_beta2,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=decay_steps,
    )
    trainable = build_trainable(models, groups, cfg)
    loss_fn = _nll_loss_fn(groups.tp_group)
    local = batch_size // groups.dp_size
    evaluate = _accuracy_estimator(tokenizer, eval_rows, groups, micro_batch_size) if eval_rows else None
    losses, skipped, estimates = [], 0, []
    for step, idx in enumerate(_batches(len(rows), batch_size, steps, seed), start=1):
        mine = idx[groups.dp_rank * local : (groups.dp_rank + 1) * local]
        length = int(score_mask[mine].any(0).nonzero().max()) + 1  # responses end their rows
        micro_batches = make_micro_batches(tokens[mine, :length], score_mask[mine, :length], micro_batch_size)
        result = optimizer_step(trainable, micro_batches, loss_fn)
        skipped += int(result.skipped)
        losses.append(_global_mean_loss(result.reports, groups))
        if evaluate is not None and (step % eval_every == 0 or step == steps):
            estimates.append((step, evaluate(models)))
            if stop_at is not None and estimates[-1][1] >= stop_at:
                break
    for m in models:
        m.eval()
    if dist.get_rank() == 0:
        Path(hf_dir_out).parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with torch.no_grad():  # the export's collectives must not enter the parameters' autograd history
        save_hf_checkpoint(
            export_hf_weights(models, groups, hf_config), hf_dir_out, side_files_from=hf_dir_in, progress=False
        )
    return {
        "loss": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "steps": len(losses),
        "skipped_steps": skipped,
        "time_s": time.perf_counter() - start,
        "sampled_acc_est": estimates,
    }
