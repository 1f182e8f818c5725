"""The training pass's entropies: ``actor/entropy`` every optimizer step, and their gradient for a bonus.

Tiny model on the local spec (TP=1, so the logits hold the whole vocabulary): the entropy the training pass reports
is the token mean, over the scored (response) tokens, of ``-sum_v p log p`` computed naively from full logits; the
gradient an entropy bonus sends through the kernels equals autograd's through ``log_softmax``. The fused kernels'
entropy and its gradient are checked against float64 under Triton's interpreter in test_fused_logprobs.py.
"""

import torch


def test_training_pass_reports_the_naive_entropy_and_differentiates_it(tmp_path):
    from megatron_pacs.algo.tokens import make_micro_batches
    from megatron_pacs.config import ModelConfig, OptimConfig, ParallelConfig
    from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.forward import model_token_logprobs, run_schedule
    from megatron_pacs.mcore.parallel import init_parallel

    groups = init_parallel(ParallelConfig())
    build_tiny_model(str(tmp_path / "m"), tiny_hf_config("qwen2", layers=1), seed=1, scale=3.0)
    actor = Actor(ModelConfig(hf_model=str(tmp_path / "m"), logprob_impl="chunked"), groups, OptimConfig(lr=1e-4))
    tokens = torch.randint(3, 100, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 4:] = True
    mask[2, 8:] = False  # a shorter response
    mbs = make_micro_batches(tokens, mask, 2)
    temperature = 0.7

    naive: list[torch.Tensor] = []
    bonus_grad_ok: list[bool] = []

    def reference(logits, mb):
        with torch.enable_grad():
            x = logits.detach().double().requires_grad_(True)
            logp_all = torch.log_softmax(x / temperature, -1)
            ent_all = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]  # position t predicts token t + 1
            flat_pos = mb.scored(torch.zeros_like(ent_all), ent_all.detach()).entropy
            assert flat_pos is not None
            naive.append(flat_pos)
            # the kernels' gradient of sum(entropy) over the scored tokens, against autograd's
            y = logits.detach().float().requires_grad_(True)
            _, ent = model_token_logprobs(y, mb, groups.tp_group, temperature, impl="chunked", entropy=True)
            scored = mb.scored(torch.zeros_like(ent), ent)
            assert scored.entropy is not None
            (g,) = torch.autograd.grad(scored.entropy.sum(), y)
            (want,) = torch.autograd.grad(mb.scored(torch.zeros_like(ent_all), ent_all).entropy.sum(), x)  # type: ignore[union-attr]
            bonus_grad_ok.append(torch.allclose(g.double(), want, rtol=1e-4, atol=1e-6))
        return logits.sum() * 0, torch.tensor(1), {}

    with torch.no_grad():
        run_schedule(actor.chunks, mbs, reference, forward_only=True)
    want = torch.cat(naive)
    seen: list[torch.Tensor] = []

    def loss(scored):
        assert scored.entropy is not None and scored.entropy.requires_grad
        seen.append(scored.entropy.detach())
        return -0.01 * scored.entropy.sum() - scored.logp.sum(), torch.tensor(scored.num_sequences), {}

    result = actor.optimizer_step(mbs, loss, temperature=temperature, entropy_grad=True)
    got = torch.stack([r["actor/entropy"] for r in result.reports]).sum(0)
    assert got[1].item() == int(mask[:, 1:].sum()) == want.numel()  # every scored token, once
    assert abs(got[0].item() / got[1].item() - want.mean().item()) < 1e-5
    torch.testing.assert_close(torch.cat(seen).double(), want, rtol=1e-5, atol=1e-5)
    assert bonus_grad_ok and all(bonus_grad_ok)
    assert result.grad_norm > 0 and not result.skipped

    def no_grad_loss(scored):
        assert scored.entropy is not None and not scored.entropy.requires_grad  # only reported
        return -scored.logp.sum(), torch.tensor(scored.num_sequences), {}

    assert "actor/entropy" in actor.optimizer_step(mbs, no_grad_loss, temperature=temperature).reports[0]
