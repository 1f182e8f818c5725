"""PPO's critic on a tiny in-process Megatron model (one gloo rank): the value head starts at exactly 0 and learns;
a tied checkpoint loads into an untied trunk exactly; V(s_t) is read at the position before token t (verl #1758:
a one-token offset between the values and the loss); and the value loss is normalised once over the mini-batch,
so the micro-batch count changes neither the gradient nor the update (verl PR #6957)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from megatron_pacs.config import ParallelConfig
    from megatron_pacs.mcore.parallel import destroy_parallel, init_parallel
    from megatron_pacs.utils.launch import free_port

    torch.set_num_threads(1)
    owns_group, old_port = not dist.is_initialized(), os.environ.get("MASTER_PORT")
    os.environ["MASTER_PORT"] = str(free_port())
    groups = init_parallel(ParallelConfig())
    model_dir = tmp_path_factory.mktemp("critic") / "qwen2"
    cfg = tiny_hf_config("qwen2", tied=True)
    build_tiny_model(str(model_dir), cfg, seed=1, scale=3.0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (6, 20), generator=gen)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for i in range(6):  # prompts of 8 tokens, responses of 2, 4, ..., 12
        mask[i, 8 : 10 + 2 * i] = True
    yield {"groups": groups, "dir": str(model_dir), "cfg": cfg, "tokens": tokens, "mask": mask}
    if owns_group:
        destroy_parallel()
    if old_port is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = old_port


def _critic(env, **critic):
    from megatron_pacs.config import ModelConfig, OptimConfig
    from megatron_pacs.config.critic import CriticConfig
    from megatron_pacs.mcore.critic import Critic

    optim = OptimConfig(lr=1e-6, adam_eps=1e-3)
    return Critic(ModelConfig(hf_model=env["dir"]), CriticConfig(critic_lr=1e-3, **critic), env["groups"], optim)


def _mbs(env, size, tokens=None):
    from megatron_pacs.algo.tokens import make_micro_batches

    return make_micro_batches(env["tokens"] if tokens is None else tokens, env["mask"], size)


def _lens(env):
    return env["mask"].sum(1)


def _targets(env, seed=0):
    from megatron_pacs.algo.tokens import TokenStore

    lens = _lens(env)
    old = TokenStore.zeros(lens, "cpu")
    returns = TokenStore.zeros(lens, "cpu")
    g = torch.Generator().manual_seed(seed)
    returns.values.copy_(torch.rand(returns.values.shape, generator=g))
    return old, returns


def _final_norm(chunk) -> torch.Tensor:
    norm = chunk.decoder.final_layernorm
    assert norm is not None
    return norm.weight


def test_first_values_are_zero_the_head_learns_and_the_trunk_follows(env):
    from megatron_pacs.algo.ppo import value_loss

    critic = _critic(env)
    chunk = critic.models[0]
    assert not chunk.share_embeddings_and_output_weights  # untied though the checkpoint ties them
    first = critic.values(_mbs(env, 6), _lens(env))
    assert first.values.numel() == int(env["mask"].sum()) and not first.values.any()
    old, returns = _targets(env)
    loss = value_loss(old, returns, clip=10.0, max_response_length=12)
    trunk = _final_norm(chunk).detach().clone()
    losses = []
    for _ in range(5):
        result = critic.optimizer_step(_mbs(env, 2), loss)
        assert not result.skipped and result.grad_norm > 0
        losses.append(float(sum(r["critic/vf_loss"][0] for r in result.reports)))
    assert losses[-1] < losses[0], losses
    assert not torch.equal(_final_norm(chunk), trunk)  # the trunk moves once the head has
    after = critic.values(_mbs(env, 6), _lens(env))
    assert after.values.abs().min() > 0


def test_a_tied_checkpoint_loads_into_the_untied_critic_exactly(env):
    from safetensors.torch import load_file

    from megatron_pacs.mcore.critic import ValueHead

    hf = load_file(os.path.join(env["dir"], "model.safetensors"))
    assert "lm_head.weight" not in hf  # the tiny checkpoint ties its embeddings
    chunk = _critic(env).models[0]
    assert torch.equal(chunk.embedding.word_embeddings.weight, hf["model.embed_tokens.weight"])
    assert torch.equal(_final_norm(chunk), hf["model.norm.weight"])
    assert isinstance(chunk.output_layer, ValueHead)
    assert tuple(dict(chunk.named_parameters())["output_layer.weight"].shape) == (1, env["cfg"].hidden_size)


def test_the_value_of_token_t_is_read_before_token_t(env):
    """V(s_0) (the first response token's) depends on the prompt only; changing response token k changes the
    values of tokens k + 1.. and no earlier one; changing the last prompt token changes V(s_0)."""
    from megatron_pacs.algo.ppo import value_loss

    critic = _critic(env)
    old, returns = _targets(env)
    loss = value_loss(old, returns, clip=10.0, max_response_length=12)
    for _ in range(2):  # a head and trunk that are no longer 0
        critic.optimizer_step(_mbs(env, 6), loss)
    base = critic.values(_mbs(env, 6), _lens(env))
    row, start, k = 5, 8, 3  # response 5 spans positions 8..19 (12 tokens)
    for position, first_changed in ((start + k, k + 1), (start, 1), (start - 1, 0)):
        tokens = env["tokens"].clone()
        tokens[row, position] = (tokens[row, position] + 1) % env["cfg"].vocab_size
        changed = critic.values(_mbs(env, 6, tokens), _lens(env)).response(row)
        same = changed == base.response(row)
        assert same[:first_changed].all() and not same[first_changed:].any(), (position, same)


def test_micro_batch_count_changes_neither_the_critics_gradient_nor_its_update(env):
    from megatron_pacs.algo.ppo import value_loss

    old, returns = _targets(env, seed=3)
    loss = value_loss(old, returns, clip=0.05, max_response_length=12)
    runs = []
    for size in (6, 2, 1):  # 1, 3 and 6 micro-batches of unequal token counts
        critic = _critic(env)
        norms = [critic.optimizer_step(_mbs(env, size), loss).grad_norm for _ in range(2)]
        runs.append((norms, {n: p.detach().clone() for n, p in critic.models[0].named_parameters()}))
    (ref_norms, ref_params), *others = runs
    for norms, params in others:
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_exported_critic_loads_back_with_its_values(env, tmp_path):
    """export_critic_hf_weights writes a one-label token-classification model; a critic built from it
    (--critic-hf-model) takes its trunk and its score head back: the same values, bit for bit."""
    from megatron_pacs.algo.ppo import value_loss
    from megatron_pacs.mcore.critic import export_critic_hf_weights, token_classification_config, untied
    from megatron_pacs.mcore.model_checkpoint import save_hf_checkpoint

    critic = _critic(env)
    old, returns = _targets(env)
    for _ in range(2):
        critic.optimizer_step(_mbs(env, 6), value_loss(old, returns, clip=10.0, max_response_length=12))
    trained = critic.values(_mbs(env, 6), _lens(env))
    out = tmp_path / "critic_hf"
    weights = export_critic_hf_weights(critic.models, env["groups"], untied(critic.hf_config))
    save_hf_checkpoint(weights, out, side_files_from=env["dir"], hf_config=token_classification_config(env["cfg"]))
    again = _critic(env, critic_hf_model=str(out))
    assert torch.equal(again.values(_mbs(env, 6), _lens(env)).values, trained.values)
    assert trained.values.abs().min() > 0
