"""One torchrun rank of the router-replay checks (tests/mcore/test_router_replay.py): a tiny Qwen3-MoE at each layout
of ``--runs`` (TP with sequence parallelism, or PP) on gloo, one after the other in the same two processes,
replaying a given routing, against Hugging Face forced to the same routing.

Two models are built in this process, the second with activation recompute (it extends Megatron's process-wide list
of replay objects, as a reference model would): each runs a padded and a packed forward-backward through Megatron's
schedule, replaying a random routing (not the one the routers would choose), and its token log-probs and router and
expert gradients are compared with HF's under the same routing. After each pass the replay objects must be empty.
Then a pass without routing (the routers choose) must differ from the forced one, and the agreement of the model's
own routing with HF's natural routing on the same weights must be 1 (and with the random routing far below).
Rank 0 writes each layout's results to ``--out-dir``. The second layout's models are built while the first's replay
objects may still sit in Megatron's process-wide list: its checks hold all the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from moe_checks import parse_launch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_pacs.algo.tokens import MicroBatch, TokenStore
from megatron_pacs.config import ParallelConfig
from megatron_pacs.mcore.forward import (
    model_token_logprobs,
    own_routing_report,
    run_schedule,
    run_schedule_together,
)
from megatron_pacs.mcore.model import build_gpt_model
from megatron_pacs.mcore.moe_weights import EXPERT_NAME
from megatron_pacs.mcore.parallel import init_parallel
from megatron_pacs.mcore.router_replay import routers
from megatron_pacs.mcore.weights import load_hf_weights

LENGTHS = (7, 12, 9, 4)


def _random_routing(length: int, layers: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[length, layers, k]`` distinct experts per token and layer, -1 at the last token (as an engine gives)."""
    routed = torch.rand(length, layers, experts, generator=gen).argsort(-1)[..., :k]
    routed[-1] = -1
    return routed


def _force_hf_routing(hf, routing: list[torch.Tensor | None]) -> None:
    """Patch each HF router's top-k to the experts of ``routing[layer]`` ``[tokens, k]`` (None: its own), as
    Megatron's replay does: the kept scores are the softmax's at those experts, renormalised with norm_topk_prob."""
    for layer, block in enumerate(hf.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, layer=layer):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            given = routing[layer]
            if given is None:
                top, idx = torch.topk(probs, gate.top_k, dim=-1)
            else:
                idx = torch.where(given < 0, torch.arange(gate.top_k), given)
                top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = forward


def _hf_pass(hf, seqs: list[torch.Tensor], routed: list[torch.Tensor] | None):
    """Per sequence: ``[len - 1]`` token log-probs under the routing (None: HF's own) and the natural routing HF
    chose ``[len, layers, k]``; gradients of the sum of all log-probs accumulate in ``hf``."""
    logps, natural = [], []
    for i, ids in enumerate(seqs):
        layers = len(hf.model.layers)
        chosen: list[torch.Tensor] = []
        if routed is None:
            _force_hf_routing(hf, [None] * layers)
            record = lambda module, args, out, chosen=chosen: chosen.append(out[2])  # noqa: E731
            hooks = [b.mlp.gate.register_forward_hook(record) for b in hf.model.layers]
        else:
            _force_hf_routing(hf, [routed[i][:, layer] for layer in range(layers)])
            hooks = []
        logits = hf(ids[None]).logits[0]
        for h in hooks:
            h.remove()
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
        logp.sum().backward()
        logps.append(logp.detach())
        if chosen:
            natural.append(torch.stack(chosen, 1))
    return logps, natural


def _micro_batches(seqs, routed, *, packed: bool, align: int) -> list[MicroBatch]:
    """Two micro-batches of two sequences, padded or packed, every within-sequence prediction scored."""
    up = lambda n: -(-n // align) * align  # noqa: E731
    k, layers = (routed[0].shape[2], routed[0].shape[1]) if routed is not None else (0, 0)
    out = []
    if packed:
        width = up(max(sum(len(seqs[i]) for i in pair) for pair in ((0, 1), (2, 3))))
    else:
        width = up(max(len(s) for s in seqs))
    for pair in ((0, 1), (2, 3)):
        rows = 1 if packed else 2
        tokens = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.bool)
        routing = torch.full((rows, width, layers, k), -1, dtype=torch.long) if routed is not None else None
        offset = 0
        for j, i in enumerate(pair):
            row, n = (0, len(seqs[i])) if packed else (j, len(seqs[i]))
            start = offset if packed else 0
            tokens[row, start : start + n] = seqs[i]
            mask[row, start + 1 : start + n] = True
            if routing is not None and routed is not None:
                routing[row, start : start + n] = routed[i]
            offset += n
        seqlens = tuple(len(seqs[i]) for i in pair) if packed else None
        out.append(MicroBatch(tokens, mask, torch.tensor(pair), seqlens=seqlens, routed_experts=routing))
    return out


def _megatron_pass(models, groups, mbs, *, backward: bool) -> dict[int, torch.Tensor]:
    """Run the schedule; on the last stage, each sequence's ``[len - 1]`` log-probs (by sequence index)."""
    got: dict[int, torch.Tensor] = {}

    def loss_fn(logits, mb):
        scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group))
        for s, i in enumerate(scored.index.tolist()):
            got[i] = scored.logp[scored.seq == s].detach()
        return -scored.logp.sum(), torch.tensor(1, dtype=torch.int), {}

    for m in models:
        m.zero_grad(set_to_none=True)
    run_schedule(models, mbs, loss_fn, forward_only=not backward)
    return got


def _replay_left_empty(models) -> bool:
    for m in models:
        for r in routers(m):
            rr = r.router_replay
            assert rr is not None
            if rr.target_topk_idx is not None or rr.replay_backward_list or rr.router_replay_action is not None:
                return False
    return True


def _grad_diffs(models, groups, hf, layers_per_stage: int) -> tuple[float, float]:
    """Worst router and expert gradient differences from HF's (Megatron's are minus HF's: its loss is -sum)."""
    worst_router = worst_expert = 0.0
    for name, p in models[0].named_parameters():
        if ".mlp." not in name:
            continue
        assert p.grad is not None, name
        grad = -p.grad.clone()
        m = EXPERT_NAME.search(name)
        if m:
            dist.all_reduce(grad, group=groups.expert_dp_group)
        elif getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad, group=groups.tp_group)
        layer = int(name.split(".")[2]) + groups.pp_rank * layers_per_stage
        mlp = hf.model.layers[layer].mlp
        if name.endswith(".mlp.router.weight"):
            worst_router = max(worst_router, (grad - mlp.gate.weight.grad).abs().max().item())
        elif m:
            e = int(m.group(1))
            ref = mlp.experts.gate_up_proj.grad[e] if m.group(2) == "1" else mlp.experts.down_proj.grad[e]
            worst_expert = max(worst_expert, (grad - ref).abs().max().item())
    return worst_router, worst_expert


def check(model_dir: str, tp: int, pp: int, out: Path) -> None:
    """One layout's checks on ``model_dir``; rank 0 writes them to ``out``."""
    groups = init_parallel(
        ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, pipeline_model_parallel_size=pp)
    )
    hf_config = AutoConfig.from_pretrained(model_dir)
    layers, experts, k = hf_config.num_hidden_layers, hf_config.num_experts, hf_config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, hf_config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    routed = [_random_routing(n, layers, experts, k, gen) for n in LENGTHS]
    align = tp

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    hf.zero_grad(set_to_none=True)
    hf_forced, _ = _hf_pass(hf, seqs, routed)
    result: dict[str, float | bool] = {}
    built = []
    for recompute in (False, True):
        models = build_gpt_model(
            hf_config, groups, recompute=recompute, calculate_per_token_loss=True, moe_enable_routing_replay=True
        )
        load_hf_weights(models, model_dir, groups, hf_config)
        for m in models:
            m.train()
        built.append(models)
    # the first model still replays right after the second (and its replay objects) was built
    for recompute, models in zip((False, True), built, strict=True):
        for packed in (False, True):
            mbs = _micro_batches(seqs, routed, packed=packed, align=align)
            got = _megatron_pass(models, groups, mbs, backward=True)
            tag = f"{'recompute' if recompute else 'plain'}_{'packed' if packed else 'padded'}"
            logp = max(((got[i] - hf_forced[i]).abs().max().item() for i in got), default=0.0)
            router, expert = _grad_diffs(models, groups, hf, layers // pp)
            empty = all(_replay_left_empty(m) for m in built)
            diffs = torch.tensor([logp, router, expert, 0.0 if empty else 1.0])
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
            result.update(
                {
                    f"{tag}_logprob_diff": diffs[0].item(),
                    f"{tag}_router_grad_diff": diffs[1].item(),
                    f"{tag}_expert_grad_diff": diffs[2].item(),
                    f"{tag}_cleared": diffs[3].item() == 0.0,
                }
            )
    # the actor and the reference in one forward-only schedule (run_schedule_together): both replay
    together: list[dict[int, torch.Tensor]] = [{}, {}]

    def keep(store: dict[int, torch.Tensor]):
        def loss_fn(logits, mb):
            scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group))
            for s, i in enumerate(scored.index.tolist()):
                store[i] = scored.logp[scored.seq == s].detach()
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        return loss_fn

    with torch.no_grad():
        run_schedule_together(
            built, _micro_batches(seqs, routed, packed=True, align=align), [keep(t) for t in together]
        )
    both = torch.tensor([max(((t[i] - hf_forced[i]).abs().max().item() for t in together for i in t), default=0.0)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    result["together_logprob_diff"] = both.item()
    result["together_cleared"] = all(_replay_left_empty(m) for m in built)
    models = built[0]
    # without a routing the routers choose: the log-probs move away from the forced ones
    own = _megatron_pass(models, groups, _micro_batches(seqs, None, packed=False, align=align), backward=False)
    moved = torch.tensor([max(((own[i] - hf_forced[i]).abs().max().item() for i in own), default=0.0)])
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    result["unreplayed_vs_forced_diff"] = moved.item()
    # the agreement metric: the model's own routing against HF's natural one (same weights), and the random one
    hf.zero_grad(set_to_none=True)
    hf_natural, natural = _hf_pass(hf, seqs, None)
    lens = torch.tensor([len(s) - 1 for s in seqs])
    for name, given in (("natural", natural), ("random", routed)):
        natural_given = [g.clone() for g in given]
        for g in natural_given:
            g[-1] = -1
        mbs = _micro_batches(seqs, natural_given, packed=True, align=align)
        counts = own_routing_report(models, mbs, TokenStore.zeros(lens, "cpu"), groups.tp_group)
        agree = counts["moe/router_agreement"].double()
        dist.all_reduce(agree)
        result[f"agreement_{name}"] = (agree[0] / agree[1]).item()
    # the step's report: HF's natural log-probs stand for the engine's (same weights, its own routing)
    engine = TokenStore.zeros(lens, "cpu")
    engine.values[:] = torch.cat(hf_natural)
    natural_given = [g.clone() for g in natural]
    mbs = _micro_batches(seqs, natural_given, packed=False, align=align)
    report = own_routing_report(models, mbs, engine, groups.tp_group)
    sums = torch.stack([report["moe/router_agreement"], report["moe/logprob_abs_diff_mean_without_replay"]])
    dist.all_reduce(sums)
    result["report_agreement"] = (sums[0, 0] / sums[0, 1]).item()
    result["report_gap_without_replay"] = (sums[1, 0] / sums[1, 1]).item()
    result["cleared_after_agreement"] = all(_replay_left_empty(m) for m in built)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


def main() -> None:
    models, runs, out_dir = parse_launch("TP,PP,NORM_TOPK_PROB (0 or 1)")
    for tp, pp, norm in runs:
        check(str(models / f"moe_norm{norm}"), int(tp), int(pp), out_dir / f"results_tp{tp}_pp{pp}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
