"""PPO's critic flags (config/critic.py): the released run's defaults, their spelling, and what is refused before
anything is built, naming the flag: a critic flag without --loss ppo, gamma or lambda outside [0, 1], a reward KL
beside the KL loss, and a --critic-hf-model that cannot score the actor's tokens."""

import json

import pytest

from megatron_pacs.config import parse_config
from megatron_pacs.config.critic import CriticConfig

CRITIC_FLAGS = {
    "--critic-hf-model": "/somewhere",
    "--critic-lr": "2e-5",
    "--critic-weight-decay": "0.1",
    "--critic-clip-grad": "0.5",
    "--gae-gamma": "0.99",
    "--gae-lambda": "0.95",
    "--value-clip": "0.2",
    "--critic-warmup": "2",
    "--reward-kl-coef": "0.01",
}


def test_defaults_are_the_released_ppo_baseline_and_every_flag_parses():
    c = parse_config(["--loss", "ppo"]).critic
    assert c == CriticConfig()
    assert (c.critic_hf_model, c.critic_lr, c.critic_weight_decay, c.critic_clip_grad) == (None, 1e-5, 0.01, 1.0)
    assert (c.gae_gamma, c.gae_lambda, c.value_clip, c.critic_warmup, c.reward_kl_coef) == (1.0, 1.0, 0.5, 0, 0.0)
    argv = ["--loss", "ppo", *(x for kv in CRITIC_FLAGS.items() for x in kv)]
    c = parse_config(argv).critic
    assert (c.critic_hf_model, c.critic_lr, c.gae_gamma, c.gae_lambda, c.critic_warmup) == (
        "/somewhere",
        2e-5,
        0.99,
        0.95,
        2,
    )
    assert parse_config(argv).needs_reference  # the reward KL needs the reference's log-probs
    assert not parse_config(["--loss", "ppo"]).needs_reference


@pytest.mark.parametrize("loss", ["pacs", "grpo"])
@pytest.mark.parametrize("flag", sorted(CRITIC_FLAGS))
def test_a_critic_flag_without_loss_ppo_is_refused_naming_it(flag, loss):
    cfg = parse_config(["--loss", loss, flag, CRITIC_FLAGS[flag]])
    with pytest.raises(ValueError, match=rf"^{flag}: configures PPO's critic; it has no meaning for --loss {loss}"):
        cfg.validate(1, need_files=False)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gae_gamma", 1.01, r"^--gae-gamma: 1.01 must lie in \[0, 1\]"),
        ("gae_gamma", -0.1, r"^--gae-gamma: -0.1 must lie in \[0, 1\]"),
        ("gae_lambda", 2.0, r"^--gae-lambda: 2.0 must lie in \[0, 1\]"),
        ("value_clip", 0.0, r"^--value-clip: 0.0 must be > 0"),
        ("critic_lr", -1.0, r"^--critic-lr: "),
        ("critic_warmup", -1, r"^--critic-warmup: "),
    ],
)
def test_values_out_of_range_are_refused_naming_the_flag(field, value, message):
    with pytest.raises(ValueError, match=message):
        CriticConfig(**{field: value})


def test_reward_kl_with_the_kl_loss_is_refused():
    cfg = parse_config(["--loss", "ppo", "--reward-kl-coef", "0.01", "--kl-coef", "0.001"])
    with pytest.raises(ValueError, match=r"^--reward-kl-coef: a KL in the reward and --kl-coef's KL in the loss"):
        cfg.validate(1, need_files=False)


def _model(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, **config}))
    return str(path)


def test_a_critic_checkpoint_that_cannot_score_the_actors_tokens_is_refused(tmp_path):
    actor = _model(tmp_path / "actor", model_type="qwen2", vocab_size=512)
    (tmp_path / "train.jsonl").write_text("")
    base = ["--loss", "ppo", "--hf-model", actor, "--train-data", str(tmp_path / "train.jsonl")]
    cases = [
        (_model(tmp_path / "vocab", model_type="qwen2", vocab_size=1024), "vocab_size 1024 differs from --hf-model's"),
        (_model(tmp_path / "family", model_type="llama", vocab_size=512), "model_type 'llama' differs"),
        (str(tmp_path / "nothing"), "has no config.json"),
    ]
    for critic, message in cases:
        with pytest.raises(ValueError, match=rf"^--critic-hf-model: .*{message}"):
            parse_config([*base, "--critic-hf-model", critic]).validate(1)
    same = _model(tmp_path / "same", model_type="qwen2", vocab_size=512)
    parse_config([*base, "--critic-hf-model", same]).validate(1)
