"""Megatron's schedule and log-probs over micro-batches: token alignment, padded vs packed, chunked vs whole."""

import torch


def test_token_alignment_for_sequence_parallelism_and_fp8():
    from types import SimpleNamespace

    from megatron_pacs.mcore.forward import token_alignment

    def align(tp, sp, fp8, recipe="delayed"):
        config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp, fp8=fp8, fp8_recipe=recipe)
        return token_alignment(config)  # type: ignore[arg-type]

    assert align(1, False, None) == 1
    assert align(4, True, None) == 4
    assert align(1, False, "hybrid") == 16
    assert align(2, True, "hybrid") == 32  # each TP rank's share of the tokens must be a multiple of 16
    assert align(2, False, "e4m3") == 16
    for recipe in ("tensorwise", "blockwise"):
        assert align(1, False, "e4m3", recipe) == 16
    assert align(1, False, "e4m3", "mxfp8") == 32  # MXFP8 scales blocks of 32
    assert align(2, True, "e4m3", "mxfp8") == 64


def test_alignment_padding_changes_no_log_prob(tmp_path):
    """FP8 (or sequence parallelism) pads every micro-batch to a multiple of 16 tokens; the padding is never scored
    and, packed or padded, changes no sequence's log-probs (tiny model on the local spec)."""

    from transformers import AutoConfig

    from megatron_pacs.config import BatchConfig, ParallelConfig
    from megatron_pacs.data.batching import RolloutBatch
    from megatron_pacs.data.layout import StepLayout
    from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
    from megatron_pacs.mcore.forward import model_token_logprobs, run_schedule
    from megatron_pacs.mcore.model import build_gpt_model
    from megatron_pacs.mcore.parallel import init_parallel
    from megatron_pacs.mcore.weights import load_hf_weights

    groups = init_parallel(ParallelConfig())
    build_tiny_model(str(tmp_path / "m"), tiny_hf_config("qwen2", layers=2), seed=1, scale=3.0)
    hf = AutoConfig.from_pretrained(tmp_path / "m")
    models = build_gpt_model(hf, groups)
    load_hf_weights(models, str(tmp_path / "m"), groups, hf)
    gen = torch.Generator().manual_seed(0)
    lens = [(5, 7), (3, 11), (6, 2), (4, 9)]
    seqs = [torch.randint(3, hf.vocab_size, (p + r,), generator=gen).tolist() for p, r in lens]
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor([p for p, _ in lens]), torch.tensor([r for _, r in lens]), torch.zeros(4), 2
    )

    def sums(packing: bool, align: int) -> torch.Tensor:
        cfg = BatchConfig(
            global_batch_size=2,
            group_size=2,
            ppo_mini_batch_size=2,
            micro_batch_size=2,
            sequence_packing=packing,
            max_prompt_length=8,
            max_response_length=12,
        )
        layout = StepLayout(
            batch, cfg, dp_rank=0, dp_size=1, pp_size=1, interleaved=False, whole_groups=False, align=align
        )
        mbs = layout.micro_batches([0])
        assert all(mb.tokens.shape[1] % align == 0 for mb in mbs)
        out = torch.zeros(4, dtype=torch.float64)

        def loss_fn(logits, mb):
            scored = mb.scored(model_token_logprobs(logits, mb, groups.tp_group))
            out[scored.index.cpu()] = scored.sequence_sums().cpu()
            return scored.logp.sum(), torch.tensor(1), {}

        with torch.no_grad():
            run_schedule(models, mbs, loss_fn, forward_only=True)
        return out

    for packing in (True, False):
        torch.testing.assert_close(sums(packing, 16), sums(packing, 1), rtol=0, atol=1e-5)


def test_logprob_impl_reaches_every_pass_that_scores_tokens_simulated_fused_path(tmp_path, monkeypatch):
    """``--logprob-impl chunked`` keeps the fused kernels out of the update, the scoring pass (old and reference
    log-probs) and ``token_logprobs`` (the sync probe); ``auto`` takes them where they can run.
    Simulated fused path: Triton cannot compile here and its interpreter is too slow for a model, so ``available``
    is forced on and the kernel's entry point is recorded and answered by the chunked path."""
    from megatron_pacs.algo.tokens import make_micro_batches
    from megatron_pacs.config import ModelConfig, OptimConfig, ParallelConfig
    from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config
    from megatron_pacs.mcore import fused_logprobs, logprobs
    from megatron_pacs.mcore.actor import Actor
    from megatron_pacs.mcore.forward import token_logprobs
    from megatron_pacs.mcore.parallel import init_parallel

    fused_calls: list[int] = []

    class RecordedFused(torch.autograd.Function):
        @staticmethod
        def apply(flat, labels, group, vocab_start, temperature, with_entropy):  # type: ignore[override]
            fused_calls.append(flat.shape[0])
            return logprobs._VocabParallelLogProbs.apply(
                flat, labels, group, vocab_start, 512, temperature, with_entropy
            )

    monkeypatch.setattr(fused_logprobs, "available", lambda device: True)
    monkeypatch.setattr(logprobs, "_FusedVocabParallelLogProbs", RecordedFused)
    groups = init_parallel(ParallelConfig())
    build_tiny_model(str(tmp_path / "m"), tiny_hf_config("qwen2", layers=1), seed=1)
    tokens = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 4:] = True
    mbs = make_micro_batches(tokens, mask, 1)

    def passes(impl: str) -> list[int]:
        actor = Actor(ModelConfig(hf_model=str(tmp_path / "m"), logprob_impl=impl), groups, OptimConfig(lr=1e-4))
        counts = []
        for run in (
            lambda: actor.logprobs(mbs, torch.tensor([5, 5]), tokens=True),
            lambda: token_logprobs(actor.chunks, groups, tokens, micro_batch_size=2, impl=actor.logprob_impl),
            lambda: actor.optimizer_step(mbs, lambda scored: (-scored.logp.sum(), torch.tensor(1), {})),
        ):
            fused_calls.clear()
            run()
            counts.append(len(fused_calls))
        return counts

    assert passes("chunked") == [0, 0, 0]
    assert all(n > 0 for n in passes("auto"))
