"""The demo's ``--model-type``: the tiny Qwen3-MoE it builds, and a run folder warmed up with another model refused."""

import json

import pytest

from megatron_pacs.demo import run as demo_run
from megatron_pacs.demo.task import DEMO_MODELS
from megatron_pacs.demo.tiny import tiny_hf_config


def test_the_moe_demo_model_is_a_tiny_qwen3_moe_vllm_cpu_can_run():
    c = tiny_hf_config(**DEMO_MODELS["qwen3_moe"])
    assert c.model_type == "qwen3_moe" and (c.num_experts, c.num_experts_per_tok) == (8, 2)
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim) == (128, 2, 32)  # vllm-cpu refuses head_dim 16


def test_a_warm_folder_of_another_model_type_is_refused_by_name(tmp_path, capsys):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (warm / "model.safetensors").write_bytes(b"")
    assert demo_run.warm_up(tmp_path, seed=0, model_type="qwen2") == warm  # reused, nothing built
    with pytest.raises(SystemExit):
        demo_run.main(["--out", str(tmp_path), "--model-type", "qwen3_moe", "--steps", "10"])
    err = capsys.readouterr().err
    assert "--model-type qwen3_moe: " in err and "holds a qwen2 model; pass another --out" in err
