"""The dry run's compute estimate (megatron_pacs/compute_plan.py): its formula re-derived by hand for the 7B PACS
recipe, PPO's critic and the reference priced in, the GPU count of separate and colocated fleets, and the section
``--dry-run`` prints. Pure arithmetic on the shipped configs, well under a second."""

import pytest
from test_planner import EXAMPLES, _config, _plan

from megatron_pacs.compute_plan import PEAK_TFLOPS, ROLLOUT_MFU, TRAIN_MFU, estimate_compute, format_compute
from megatron_pacs.planner import ModelShape


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    return ModelShape.from_pretrained(EXAMPLES / "qwen2.5-7b")


def test_the_7b_pacs_estimate_is_the_documented_formula(qwen7b):
    plan, cfg = _plan(qwen7b), _config()
    e = estimate_compute(plan, cfg, response_tokens=2048)
    n, lh, s = qwen7b.num_params(), qwen7b.num_hidden_layers * qwen7b.hidden_size, 512 + 2048
    full, fwd = 6 * n * s + 12 * lh * s * s, 2 * n * s + 4 * lh * s * s
    # recompute adds a forward; old log-probs (4 optimizer steps) and PACS's phase 1 one forward each; no reference
    train = 8192 * ((full + fwd) + 2 * fwd) / 1e12
    rollout = 8192 * (2 * n * s + 4 * lh * (512 * 2048 + 2048**2 / 2)) / 1e12
    assert e.train_tflop == pytest.approx(train) and e.rollout_tflop == pytest.approx(rollout)
    step = train / (64 * PEAK_TFLOPS * TRAIN_MFU) + rollout / (64 * PEAK_TFLOPS * ROLLOUT_MFU)  # 32 engines x TP 2
    assert e.step_s == pytest.approx(step) and e.gpus == 128
    assert e.gpu_hours == pytest.approx(128 * step * cfg.run.train_iters / 3600)


def test_ppo_pays_for_its_critic_and_a_reference_for_its_forward(qwen7b):
    def estimate(**overrides):
        plan, cfg = _plan(qwen7b, **overrides), _config(**overrides)
        return estimate_compute(plan, cfg, response_tokens=1024)

    pacs, grpo, ppo = estimate(), estimate(loss="grpo"), estimate(loss="ppo")
    assert grpo.train_tflop < pacs.train_tflop < ppo.train_tflop  # PACS's phase 1; the critic's values and update
    assert ppo.rollout_tflop == grpo.rollout_tflop == pacs.rollout_tflop
    assert estimate(loss="grpo", kl_coef=0.001).train_tflop > grpo.train_tflop  # the reference's forward


def test_the_dry_run_prints_the_range_of_response_lengths(qwen7b):
    text = format_compute(_plan(qwen7b), _config())
    assert "== compute (an estimate: 989 TFLOP/s peak per GPU" in text and "GPU-h (" in text
    assert "2048 tokens" in text and "4096 tokens" in text
