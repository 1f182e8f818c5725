"""One torchrun rank of the MoE checks (tests/mcore/test_moe.py): a tiny Qwen3-MoE at ``--ep`` with ``--dispatcher``
on gloo, against Hugging Face on the same weights.

Each rank takes its own half of four sequences (data parallel); the logits of its half are compared with HF's, and
after a backward of the summed token log-probs (gradients summed over the data-parallel ranks, experts over the
ranks that hold the same experts) the router's and every expert's gradients are compared with HF's on all four.
Writes ``results_ep{EP}_{dispatcher}_{norm}.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.moe_weights import EXPERT_NAME
from megatron_pacs.mcore.parallel import init_parallel
from megatron_pacs.mcore.weights import load_hf_weights

SEQ, BATCH = 12, 4


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s-1]`` log-probs of each next token."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--dispatcher", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    groups = init_parallel(
        ParallelConfig(expert_model_parallel_size=args.ep, moe_token_dispatcher_type=args.dispatcher)
    )
    hf_config = AutoConfig.from_pretrained(args.model)
    models = build_gpt_model(hf_config, groups)
    load_hf_weights(models, args.model, groups, hf_config)
    model = models[0]
    ids = torch.randint(3, hf_config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = ids.chunk(world)[rank]
    pos = torch.arange(SEQ).expand(mine.shape[0], -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None].expand(mine.shape[0], 1, -1, -1)
    logits = model(mine, pos, causal)
    _token_logprobs(logits, mine).sum().backward()

    hf = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
    hf_logits = hf(ids).logits
    _token_logprobs(hf_logits, ids).sum().backward()

    logit_diff = (logits.detach() - hf_logits.detach().chunk(world)[rank]).abs().max()
    per_rank = max(1, hf_config.num_experts // args.ep)
    worst_router, worst_expert, experts_seen = 0.0, 0.0, 0
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        assert grad is not None, name
        grad = grad.clone()
        m = EXPERT_NAME.search(name)
        dist.all_reduce(grad, group=groups.expert_dp_group if m else groups.dp_group)
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
    diffs = torch.tensor([logit_diff.item(), worst_router, worst_expert])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    seen = torch.tensor([experts_seen])
    dist.all_reduce(seen)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "logit_diff": diffs[0].item(),
                    "router_grad_diff": diffs[1].item(),
                    "expert_grad_diff": diffs[2].item(),
                    "expert_weights_seen": int(seen.item()),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
