"""One torchrun rank of the MoE checks (tests/mcore/test_moe.py): a tiny Qwen3-MoE at each of ``--runs`` (TP, EP,
token dispatcher, ``norm_topk_prob``) on gloo, against Hugging Face on the same weights. The layouts run one after
the other in the same two processes (Megatron's groups made anew for each): one launch instead of one per layout.

Each data-parallel rank takes its share of four sequences; their token log-probs (vocab-parallel at TP > 1) are
compared with HF's, and after a backward of their sum (gradients summed over the data-parallel ranks, experts over
the ranks that hold the same experts) the router's and every expert's gradients are compared with HF's on all four.
Then the weights are exported and compared with the checkpoint, bit for bit. Rank 0 writes each layout's results
to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.logprobs import vocab_parallel_logprobs
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.moe_weights import EXPERT_NAME
from megatron_pacs.mcore.parallel import init_parallel
from megatron_pacs.mcore.weights import export_hf_weights, load_hf_weights

SEQ, BATCH = 12, 4


def _hf_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]`` log-probs of each next token."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _train_step_grad_norm(model_dir: str, groups, ids: torch.Tensor) -> float:
    """One optimizer step of the project's training path (Megatron DDP and optimizer, per-token loss normalised
    over the global batch) on this data-parallel rank's sequences; its gradient norm, before clipping."""
    from megatron_pacs.algo.tokens import make_micro_batches
    from megatron_pacs.config import OptimConfig
    from megatron_pacs.mcore.forward import model_token_logprobs
    from megatron_pacs.mcore.optim import build_trainable, masked_sum_and_count, optimizer_step

    hf_config = AutoConfig.from_pretrained(model_dir)
    models = build_gpt_model(hf_config, groups, calculate_per_token_loss=True)
    load_hf_weights(models, model_dir, groups, hf_config)
    trainable = build_trainable(models, groups, OptimConfig(lr=1e-3))
    mine = ids.chunk(groups.dp_size)[groups.dp_rank]
    mbs = make_micro_batches(mine, torch.ones_like(mine, dtype=torch.bool), 1)

    def loss_fn(logits, mb):
        loss_sum, count = masked_sum_and_count(-model_token_logprobs(logits, mb, groups.tp_group), mb.score_mask[:, 1:])
        return loss_sum, count, {}

    return optimizer_step(trainable, mbs, loss_fn).grad_norm


def _rl_steps(model_dir: str, groups) -> list[float]:
    """Two RL steps of the project's update (:func:`~megatron_pacs.update.update_policy`: the reference's pass
    with the old log-probs riding along, then two optimizer steps) on one seeded batch with Bernoulli rewards: the
    first packed, the second padded and cut by a token budget that gives the two ranks different micro-batch counts
    (under EP > 1 the short rank runs fillers). Each step's loss and gradient norm, then the weights' checksum."""
    import random

    from megatron_pacs.algo.objectives import build_objective
    from megatron_pacs.config import BatchConfig, LossConfig, ModelConfig, OptimConfig
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.reference import ReferencePolicy
    from megatron_pacs.update import update_policy
    from megatron_pacs.utils.timing import PhaseTimer

    rng = random.Random(0)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    seqs, plens, rlens = [], [], []
    for _ in range(4):  # prompts
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        for _ in range(2):  # group size
            response = [rng.randrange(3, vocab) for _ in range(rng.choice([2, 3, 12, 20]))]
            seqs.append(prompt + response)
            plens.append(len(prompt))
            rlens.append(len(response))
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in seqs])
    batch = RolloutBatch.from_sequences(seqs, torch.tensor(plens), torch.tensor(rlens), rewards, 2)
    model = ModelConfig(hf_model=model_dir)
    actor = Actor(model, groups, OptimConfig(lr=1e-3))
    reference = ReferencePolicy(model, groups, load=None, offload=False)
    objective_cfg = LossConfig(loss="pacs", pacs_score_reference="ref")
    out = []
    for packing in (True, False):
        cfg = BatchConfig(
            global_batch_size=4,
            group_size=2,
            ppo_mini_batch_size=4,
            micro_batch_size=2,
            max_prompt_length=8,
            max_response_length=20,
            max_tokens_per_microbatch=None if packing else 28,
            sequence_packing=packing,
        )
        metrics = update_policy(
            actor,
            batch,
            build_objective(objective_cfg, cfg),
            cfg,
            groups,
            PhaseTimer(),
            temperature=1.0,
            reference=reference,
        )
        out += [metrics["train/loss"], metrics["train/grad_norm"]]
    dense, experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for name, p in actor.models[0].named_parameters():  # the weights' checksum: experts summed over EP
        if EXPERT_NAME.search(name):
            experts += p.detach().double().abs().sum()
        else:
            dense += p.detach().double().abs().sum()
    dist.all_reduce(experts, group=groups.ep_group)
    return [*out, (dense + experts).item()]


def check(model_dir: str, tp: int, ep: int, dispatcher: str, out: Path) -> None:
    """One layout's checks on ``model_dir``; rank 0 writes them to ``out``."""
    layout = ParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
    )
    groups = init_parallel(layout)
    hf_config = AutoConfig.from_pretrained(model_dir)
    models = build_gpt_model(hf_config, groups)
    load_hf_weights(models, model_dir, groups, hf_config)
    model = models[0]
    ids = torch.randint(3, hf_config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mine = ids.chunk(groups.dp_size)[groups.dp_rank]
    pos = torch.arange(SEQ).expand(mine.shape[0], -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None].expand(mine.shape[0], 1, -1, -1)
    logits = model(mine, pos, causal)  # [b, s, V / TP]
    logp = vocab_parallel_logprobs(logits[:, :-1], mine[:, 1:], groups.tp_group)
    logp.sum().backward()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    hf_logits = hf(ids).logits
    hf_logp = _hf_token_logprobs(hf_logits, ids)
    hf_logp.sum().backward()

    logit_diff = (logp.detach() - hf_logp.detach().chunk(groups.dp_size)[groups.dp_rank]).abs().max()
    per_rank = max(1, hf_config.num_experts // ep)
    worst_router, worst_expert, experts_seen = 0.0, 0.0, 0
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        assert grad is not None, name
        grad = grad.clone()
        m = EXPERT_NAME.search(name)
        if m:
            # with sequence parallelism each TP rank routes its own tokens: the expert-data-parallel group (which
            # spans the TP ranks too) holds every partial sum
            dist.all_reduce(grad, group=groups.expert_dp_group)
        else:
            dist.all_reduce(grad, group=groups.dp_group)
            if getattr(p, "sequence_parallel", False):  # the router and the norms: this rank's tokens only
                dist.all_reduce(grad, group=groups.tp_group)
        if ".mlp." not in name:
            continue
        layer = int(name.split(".")[2])
        experts = hf.model.layers[layer].mlp.experts
        if name.endswith(".mlp.router.weight"):
            ref = hf.model.layers[layer].mlp.gate.weight.grad
            worst_router = max(worst_router, (grad - ref).abs().max().item())
        elif m:
            expert = int(m.group(1)) + per_rank * groups.ep_rank
            assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None
            ref = experts.gate_up_proj.grad[expert] if m.group(2) == "1" else experts.down_proj.grad[expert]
            worst_expert = max(worst_expert, (grad - ref).abs().max().item())
            experts_seen += 1
    from safetensors.torch import load_file

    stored = load_file(Path(model_dir) / "model.safetensors")
    exported = dict(export_hf_weights(models, groups, hf_config))
    export_same = exported.keys() == stored.keys() and all(torch.equal(exported[k], stored[k]) for k in stored)
    grad_norm = _train_step_grad_norm(model_dir, groups, ids)
    rl_steps = _rl_steps(model_dir, groups) if tp == 1 else None
    diffs = torch.tensor([logit_diff.item(), worst_router, worst_expert, 0.0 if export_same else 1.0])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    seen = torch.tensor([experts_seen])
    dist.all_reduce(seen)
    if dist.get_rank() == 0:
        out.write_text(
            json.dumps(
                {
                    "logprob_diff": diffs[0].item(),
                    "router_grad_diff": diffs[1].item(),
                    "expert_grad_diff": diffs[2].item(),
                    "expert_weights_seen": int(seen.item()),
                    "export_bitwise": diffs[3].item() == 0.0,
                    "train_grad_norm": grad_norm,
                    "rl_steps": rl_steps,
                }
            )
        )


def parse_launch(fields: str) -> tuple[Path, list[list[str]], Path]:
    """A launch's ``--models`` (the folder of moe_norm0/ and moe_norm1/), ``--runs`` (``fields``, comma-separated,
    each) and ``--out-dir``; router_replay_checks.py takes the same."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="the folder of moe_norm0/ and moe_norm1/")
    ap.add_argument("--runs", nargs="+", required=True, help=f"{fields} each")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    return Path(args.models), [run.split(",") for run in args.runs], Path(args.out_dir)


def main() -> None:
    models, runs, out_dir = parse_launch("TP,EP,DISPATCHER,NORM_TOPK_PROB (0 or 1)")
    for tp, ep, dispatcher, norm in runs:
        out = out_dir / f"results_tp{tp}_ep{ep}_{dispatcher}_{norm}.json"
        check(str(models / f"moe_norm{norm}"), int(tp), int(ep), dispatcher, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
