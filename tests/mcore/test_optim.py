"""Megatron DDP + AdamW training step on gloo groups (one rank in-process; two ranks under torchrun, this file
run as a script), against a plain PyTorch reference.

The reference is the Hugging Face model with ``torch.optim.AdamW`` on the loss ``sum of response-token NLL /
number of response tokens`` over the whole batch. A large ``adam_eps`` makes the update depend on the gradient's
scale (with eps ~ 0 the first Adam step is ``lr * sign(g)``, blind to any constant factor), so a wrong
normalisation (per micro-batch, per DP rank) shows up in the weights, not only in the reported norm.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from faults import poison_gradient
from zygote import run as zygote_run

pytestmark = pytest.mark.distributed

LR, EPS, WD = 1e-2, 1e-3, 0.1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
    from megatron_pacs.utils.launch import free_port

    torch.set_num_threads(1)
    owns_group, old_port = not dist.is_initialized(), os.environ.get("MASTER_PORT")
    os.environ["MASTER_PORT"] = str(free_port())
    groups = init_parallel(ParallelConfig())
    model_dir = tmp_path_factory.mktemp("optim") / "qwen2"
    cfg = tiny_hf_config("qwen2", tied=True)
    build_tiny_model(str(model_dir), cfg, seed=1, scale=3.0)
    tokens, mask = _batch(cfg.vocab_size)
    yield {"groups": groups, "dir": str(model_dir), "cfg": cfg, "tokens": tokens, "mask": mask}
    if owns_group:
        destroy_parallel()
    if old_port is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = old_port


def _batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [6, 20]`` and a response mask of lengths 2, 4, ..., 12 (per-micro-batch means would weight the
    tokens differently from the global mean)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab_size, (6, 20), generator=gen)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for i in range(6):
        mask[i, 8 : 10 + 2 * i] = True
    return tokens, mask


def _nll_loss_fn(tp_group):
    from megatron_pacs.mcore.forward import model_token_logprobs
    from megatron_pacs.mcore.optim import masked_sum_and_count

    def loss_fn(logits, mb):
        loss_sum, count = masked_sum_and_count(-model_token_logprobs(logits, mb, tp_group), mb.score_mask[:, 1:])
        return loss_sum, count, {"nll": torch.stack([loss_sum.detach(), count.float()])}

    return loss_fn


def _trainable(env, **optim):
    from megatron_pacs.config import OptimConfig
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.optim import build_trainable
    from megatron_pacs.mcore.weights import load_hf_weights

    models = build_gpt_model(env["cfg"], env["groups"], calculate_per_token_loss=True)
    load_hf_weights(models, env["dir"], env["groups"], env["cfg"])
    return models, build_trainable(models, env["groups"], OptimConfig(lr=LR, adam_eps=EPS, weight_decay=WD, **optim))


def _step(env, trainable, micro_batch_size):
    from megatron_pacs.algo.tokens import make_micro_batches
    from megatron_pacs.mcore.optim import optimizer_step

    mbs = make_micro_batches(env["tokens"], env["mask"], micro_batch_size)
    return optimizer_step(trainable, mbs, _nll_loss_fn(env["groups"].tp_group))


def _export(env, models):
    from megatron_pacs.mcore.weights import export_hf_weights

    with torch.no_grad():  # the export's collectives must not enter the parameters' autograd history
        # On the host: the references (HF, torch AdamW) run on the CPU whatever device the model is on.
        return {k: v.detach().cpu().clone() for k, v in export_hf_weights(models, env["groups"], env["cfg"])}


def _reference(env, steps, lrs, clip):
    """HF model + torch AdamW (no decay on biases and 1-D params, as Megatron); returns (state, grad norms)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(env["dir"], dtype=torch.float32, attn_implementation="eager")
    named = list(hf.named_parameters())
    decay = [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS
    )
    tokens, mask = env["tokens"], env["mask"][:, 1:]
    norms = []
    for step in range(steps):
        opt.zero_grad()
        logp = torch.log_softmax(hf(input_ids=tokens).logits.float(), -1)[:, :-1]
        logp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        (-(logp * mask).sum() / mask.sum()).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in hf.parameters()]).item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        for g in opt.param_groups:
            g["lr"] = lrs[step]
        opt.step()
    state = hf.state_dict()
    if env["cfg"].tie_word_embeddings:
        state.pop("lm_head.weight")
    return state, norms


@pytest.mark.parametrize("clip_grad", [0.0, 1.0], ids=["no_clip", "clip"])
def test_train_steps_match_torch_adamw_with_per_token_normalisation(env, clip_grad):
    models, trainable = _trainable(env, clip_grad=clip_grad, lr_warmup_steps=2)
    results = [_step(env, trainable, micro_batch_size=2) for _ in range(2)]  # 3 micro-batches of unequal counts
    assert [r.skipped for r in results] == [False, False]
    assert [r.lr for r in results] == pytest.approx([LR / 2, LR])
    ref_state, ref_norms = _reference(env, steps=2, lrs=[LR / 2, LR], clip=clip_grad)
    assert [r.grad_norm for r in results] == pytest.approx(ref_norms, rel=1e-6)
    if clip_grad:
        assert ref_norms[0] > clip_grad  # the clip is active
    ours = _export(env, models)
    assert set(ours) == set(ref_state)
    assert max((ours[k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-6
    # The loss reports sum to the global token count.
    total = torch.stack([r["nll"] for r in results[0].reports]).sum(0)
    assert total[1].item() == env["mask"][:, 1:].sum().item()


def test_one_or_three_micro_batches_give_the_same_update(env):
    outs = []
    for micro_batch_size in (6, 2):
        models, trainable = _trainable(env)
        _step(env, trainable, micro_batch_size=micro_batch_size)
        outs.append(_export(env, models))
    assert max((outs[0][k] - outs[1][k]).abs().max().item() for k in outs[0]) < 1e-6


def test_non_finite_gradient_skips_the_step_everywhere(env):
    models, trainable = _trainable(env, lr_warmup_steps=3)
    before = _export(env, models)
    hook = poison_gradient(models)
    result = _step(env, trainable, micro_batch_size=3)
    hook.remove()
    assert result.skipped and result.lr == 0.0
    after = _export(env, models)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainable.schedule.num_steps == 0  # the warm-up does not advance on a skipped step
    assert all(float(p.main_grad.abs().sum()) == 0.0 for m in trainable.models for p in m.module.parameters())
    # The next step is a normal first step: the same norm and warm-up lr as a fresh model's.
    again = _step(env, trainable, micro_batch_size=3)
    _, fresh_trainable = _trainable(env, lr_warmup_steps=3)
    fresh = _step(env, fresh_trainable, micro_batch_size=3)
    assert not again.skipped and again.lr == pytest.approx(LR / 3)
    assert again.grad_norm == pytest.approx(fresh.grad_norm, rel=1e-6)


def _torch_adamw_like(inner: torch.optim.Optimizer) -> torch.optim.AdamW:
    """An independent ``torch.optim.AdamW`` (foreach, not fused) over ``inner``'s parameter groups: their
    hyper-parameters, and the keys megatron-core's scheduler reads (lr and weight-decay multipliers), kept."""
    groups = [{**g, "foreach": True, "fused": False} for g in inner.param_groups]
    for g in groups:
        g.pop("decoupled_weight_decay", None)  # AdamW's own default (True) applies
    return torch.optim.AdamW(groups, lr=groups[0]["lr"])


def test_adam_update_matches_an_independent_torch_adamw(env):
    """Whatever Adam megatron-core picked (Transformer Engine's or Apex's FusedAdam on a GPU with them, its
    ``torch.optim.AdamW`` fallback, switched to ``fused=True`` on CUDA, or foreach on CPU), two steps equal a
    ``torch.optim.AdamW`` in foreach mode, built here over the same parameter groups, to fp32 rounding
    (the reference is never the optimizer under test, e.g. TE's FusedAdam compared with itself)."""
    from megatron.core import optimizer as megatron_optimizer

    from megatron_pacs.mcore.optim import _inner_optimizers

    models, trainable = _trainable(env)
    inner = [getattr(o, "optimizer", None) for o in _inner_optimizers(trainable.optimizer)]
    if megatron_optimizer.USING_PYTORCH_OPTIMIZER:
        fused = torch.cuda.is_available()  # the fallback runs torch's fused kernel on CUDA (mcore/optim.py)
        assert all(bool(g.get("fused")) is fused for o in inner if o is not None for g in o.param_groups)
    for _ in range(2):
        _step(env, trainable, micro_batch_size=2)
    ref_models, ref_trainable = _trainable(env)
    for o in _inner_optimizers(ref_trainable.optimizer):
        o.optimizer = _torch_adamw_like(o.optimizer)
    for _ in range(2):
        _step(env, ref_trainable, micro_batch_size=2)
    ours, ref = _export(env, models), _export(env, ref_models)
    moved = max((ours[k] - _export(env, _trainable(env)[0])[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # the steps moved the weights, so equality below is not vacuous
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-6


def test_refusals_and_config_validation(env):
    from megatron_pacs.config import OptimConfig
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.optim import LRSchedule, build_trainable

    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        build_trainable(build_gpt_model(env["cfg"], env["groups"]), env["groups"], OptimConfig(lr=1e-3))
    models = build_gpt_model(env["cfg"], env["groups"], calculate_per_token_loss=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--use-distributed-optimizer needs CUDA"):
            build_trainable(models, env["groups"], OptimConfig(lr=1e-3, use_distributed_optimizer=True))
        bf16 = build_gpt_model(env["cfg"], env["groups"], calculate_per_token_loss=True, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="--bf16 needs CUDA"):
            build_trainable(bf16, env["groups"], OptimConfig(lr=1e-3))
    for bad, match in [
        ({"lr": -1.0}, "--lr: -1.0 must be >= 0"),
        ({"lr": 1.0, "clip_grad": -1.0}, "--clip-grad: -1.0"),
        ({"lr": 1.0, "adam_beta2": 1.0}, "--adam-beta2: 1.0 must be in"),
        ({"lr": 1.0, "lr_warmup_steps": -1}, "--lr-warmup-steps: -1"),
    ]:
        with pytest.raises(ValueError, match=match):
            OptimConfig(**bad)
    warm = LRSchedule(lr=1.0, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(warm.current_lr())
        warm.num_steps += 1
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    decay = LRSchedule(lr=1.0, warmup_steps=0, decay_steps=4, num_steps=2)
    assert decay.current_lr() == 0.5


@pytest.mark.slow
def test_sft_warmup_lowers_the_loss_and_exports_a_loadable_model(env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_pacs.demo import task as demo_task
    from megatron_pacs.demo.sft import sft_warmup
    from megatron_pacs.demo.tiny import build_tokenizer

    tok = build_tokenizer(512, corpus=demo_task.tokenizer_corpus(num_lines=500), split_digits=True)
    base = tmp_path / "base"
    build_tiny_model(
        str(base), tiny_hf_config("qwen2", hidden=32, layers=2), seed=0, tokenizer=tok, perturb_norms=False
    )
    rows = demo_task.sft_rows(demo_task.make_problems(64, seed=0, split="train"), correct_prob=1.0, seed=0)
    metrics = sft_warmup(
        base,
        tmp_path / "out",
        rows,
        steps=80,
        lr=3e-3,
        micro_batch_size=8,
        seed=0,
        groups=env["groups"],
        batch_size=16,
        lr_warmup_steps=5,
    )
    assert metrics["skipped_steps"] == 0 and len(metrics["loss"]) == metrics["steps"] == 80
    assert metrics["final_loss"] < 0.5 * metrics["first_loss"]
    # Early stop on the estimated sampled accuracy: a threshold of 0 stops at the first estimate.
    clean = demo_task.sft_rows(demo_task.make_problems(8, seed=0, split="val"), correct_prob=1.0, seed=0)
    early = sft_warmup(
        base,
        tmp_path / "early",
        rows,
        steps=80,
        lr=3e-3,
        micro_batch_size=8,
        seed=0,
        groups=env["groups"],
        eval_rows=clean,
        eval_every=10,
        stop_at=0.0,
    )
    assert early["steps"] == 10 and len(early["sampled_acc_est"]) == 1
    assert 0.0 <= early["sampled_acc_est"][0][1] < 0.01
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    before = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(out.model.embed_tokens.weight, before.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "<|im_end|>"


@pytest.mark.slow
def test_two_data_parallel_ranks_match_the_reference_and_skip_together(env, tmp_path):
    """DP=2 (gradients summed over ranks, divided by the global count) equals the one-process reference; a NaN on
    one rank makes both ranks skip."""
    from megatron_pacs.utils.launch import free_port

    out = tmp_path / "dp2.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        __file__,
        env["dir"],
        str(out),
    ]
    proc = zygote_run(cmd, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    res = torch.load(out)
    ref_state, ref_norms = _reference(env, steps=1, lrs=[LR], clip=0.0)
    assert res["grad_norm"] == pytest.approx(ref_norms[0], rel=1e-5)
    assert max((res["state"][k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-5
    assert res["nan_skipped"] == [True, True] and res["nan_unchanged"] == [True, True]


def _dp_main(model_dir: str, out: str) -> None:
    """Under torchrun: one step with the batch split over the data-parallel ranks, then a NaN on rank 1 only."""
    from transformers import AutoConfig

    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    groups = init_parallel(ParallelConfig())
    cfg = AutoConfig.from_pretrained(model_dir)
    tokens, mask = _batch(cfg.vocab_size)
    n, r = tokens.shape[0] // groups.dp_size, groups.dp_rank
    env = {
        "groups": groups,
        "dir": model_dir,
        "cfg": cfg,
        "tokens": tokens[r * n : (r + 1) * n],
        "mask": mask[r * n : (r + 1) * n],
    }
    models, trainable = _trainable(env)
    result = _step(env, trainable, micro_batch_size=1)
    state = _export(env, models)
    models, trainable = _trainable(env)
    before = _export(env, models)
    if r == 1:
        poison_gradient(models)
    skipped = _step(env, trainable, micro_batch_size=1).skipped
    after = _export(env, models)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (skipped, all(torch.equal(before[k], after[k]) for k in before)))
    if dist.get_rank() == 0:
        torch.save(
            {
                "grad_norm": result.grad_norm,
                "state": state,
                "nan_skipped": [f[0] for f in flags],
                "nan_unchanged": [f[1] for f in flags],
            },
            out,
        )
    destroy_parallel()


if __name__ == "__main__":
    _dp_main(sys.argv[1], sys.argv[2])


def test_optimizer_reset_makes_the_next_step_a_first_adam_step(env, tmp_path):
    """PACS v2's reset: pending until the next update, which then starts from a fresh Adam state: equal to a
    first step of a new optimizer from the same weights and gradient."""
    from megatron_pacs.mcore.optim import _inner_optimizers, reset_optimizer_state

    models, trainable = _trainable(env)
    for _ in range(2):
        _step(env, trainable, micro_batch_size=3)
    inner = [o.optimizer for o in _inner_optimizers(trainable.optimizer)]
    assert all(float(s["step"]) == 2.0 for o in inner for s in o.state.values())
    reset_optimizer_state(trainable)
    assert trainable.reset_pending and all(float(s["step"]) == 2.0 for o in inner for s in o.state.values())
    before = _export(env, models)
    result = _step(env, trainable, micro_batch_size=3)
    assert not result.skipped and not trainable.reset_pending
    assert all(float(s["step"]) == 1.0 for o in inner for s in o.state.values())
    assert trainable.schedule.num_steps == 3  # the learning-rate schedule continues
    # The same as a brand-new optimizer's first step from the same weights (hence the same gradient).
    from megatron_pacs.mcore.model_checkpoint import save_hf_checkpoint

    save_hf_checkpoint(iter(before.items()), tmp_path / "before", side_files_from=env["dir"], progress=False)
    fresh_models, fresh = _trainable({**env, "dir": str(tmp_path / "before")})
    _step(env, fresh, micro_batch_size=3)
    after, expected = _export(env, models), _export(env, fresh_models)
    assert max((after[k] - expected[k]).abs().max().item() for k in after) < 1e-6


def test_a_skipped_step_keeps_a_pending_reset_and_a_checkpoint_then_resumes(env, tmp_path):
    """A step skipped on a non-finite gradient must not use up a pending reset: Adam's state stays as it was (a
    checkpoint saved then holds it and loads again), and the next taken step is the first Adam step."""
    from megatron_pacs.mcore.model_checkpoint import DIST_CHECKPOINT_LOAD_DEPRECATIONS
    from megatron_pacs.mcore.optim import _inner_optimizers, reset_optimizer_state
    from megatron_pacs.mcore.training_checkpoint import load_training_checkpoint, save_training_checkpoint

    models, trainable = _trainable(env)
    for _ in range(2):
        _step(env, trainable, micro_batch_size=3)
    reset_optimizer_state(trainable)
    hook = poison_gradient(models)
    assert _step(env, trainable, micro_batch_size=3).skipped
    hook.remove()
    inner = [o.optimizer for o in _inner_optimizers(trainable.optimizer)]
    assert trainable.reset_pending
    assert inner[0].state and all(float(s["step"]) == 2.0 for o in inner for s in o.state.values())
    path = save_training_checkpoint(tmp_path / "ckpt", 3, trainable.models, trainable.optimizer, {"step": 3})
    _, resumed = _trainable(env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_training_checkpoint(path, resumed.models, resumed.optimizer)
    # megatron-core's loader trips torch's deprecations on every load; filtered by their exact text (not ours to fix)
    assert not [w for w in caught if str(w.message) in DIST_CHECKPOINT_LOAD_DEPRECATIONS], caught
    resumed_inner = [o.optimizer for o in _inner_optimizers(resumed.optimizer)]
    assert all(float(s["step"]) == 2.0 for o in resumed_inner for s in o.state.values())
    result = _step(env, trainable, micro_batch_size=3)  # taken: now the reset applies
    assert not result.skipped and not trainable.reset_pending
    assert all(float(s["step"]) == 1.0 for o in inner for s in o.state.values())


def test_lr_re_warm_up_after_an_optimizer_reset_ramps_over_taken_steps_and_checkpoints():
    """--ref-reset-lr-warmup-steps N: after a reset the next N taken steps run at lr k / N (the first Adam step after
    a reset is sign-like, so at the full rate it moves every weight by about lr); a skipped step does not advance
    the ramp, and the ramp's position survives a checkpoint."""
    from types import SimpleNamespace

    from megatron_pacs.mcore.optim import LRSchedule, reset_optimizer_state

    schedule = LRSchedule(lr=1.0, warmup_steps=0)
    trainable = SimpleNamespace(schedule=schedule, reset_pending=False)  # what reset_optimizer_state touches
    schedule.step_taken()
    reset_optimizer_state(trainable, rewarm_steps=4)  # type: ignore[arg-type]
    assert trainable.reset_pending
    lrs = []
    for k in range(6):
        lrs.append(schedule.current_lr())
        if k == 1:  # a skipped step: the schedule does not advance
            continue
        schedule.step_taken()
    assert lrs == [0.25, 0.5, 0.5, 0.75, 1.0, 1.0]
    again = LRSchedule(lr=1.0, warmup_steps=0)
    reset_optimizer_state(SimpleNamespace(schedule=schedule, reset_pending=False), rewarm_steps=4)  # type: ignore[arg-type]
    schedule.step_taken()
    again.load_state_dict(schedule.state_dict())
    assert again.current_lr() == schedule.current_lr() == 0.5
    assert LRSchedule(lr=1.0, warmup_steps=0).state_dict()["since_reset"] is None
    old = LRSchedule(lr=1.0, warmup_steps=0)
    old.load_state_dict({"num_steps": 3})  # a checkpoint from before the re-warm-up existed
    assert old.num_steps == 3 and old.current_lr() == 1.0
