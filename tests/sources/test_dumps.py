"""Replayable rollout dumps: written and read back exactly; every dump a replay cannot use exactly is refused before
anything is built, naming the file and the mismatch."""

import json
from pathlib import Path

import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.sources import DumpContext, ReplaySource, StepRollouts, dump_rollouts, load_dump
from megatron_pacs.sources.dumps import dump_path, read_dump_metadata

CONTEXT = DumpContext(tokenizer_size=512, tokenizer_sha256="ab" * 32, vocab_size=512, temperature=1.0)


def _rollouts(num_prompts: int = 2, group_size: int = 2, seed: int = 0, routed: bool = False) -> StepRollouts:
    g = torch.Generator().manual_seed(seed)
    seqs, plens, rlens = [], [], []
    for _ in range(num_prompts * group_size):
        p, r = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        seqs.append(torch.randint(3, 500, (p + r,), generator=g).tolist())
        plens.append(p)
        rlens.append(r)
    engine = -torch.rand(sum(rlens), generator=g)
    engine[1] = float("nan")  # an engine gave no log-prob for this token
    # the engine's routing of every token but the last (2 layers, top-2 of 8 experts), as vLLM returns it
    routing = [torch.randint(0, 8, (len(s) - 1, 2, 2), generator=g, dtype=torch.int16) for s in seqs]
    batch = RolloutBatch.from_sequences(
        seqs,
        torch.tensor(plens),
        torch.tensor(rlens),
        torch.tensor([1.0, 0.0] * num_prompts),
        group_size,
        engine,
        routed_experts=routing if routed else None,
    )
    return StepRollouts(
        batch,
        records=[{"id": f"p{i // group_size}", "output": "..."} for i in range(len(seqs))],
        metrics={"rollout/reward_mean": 0.5, "perf/time/generate": 1.0},
        prompt_ids=[f"p{i}" for i in range(num_prompts)],
        finish_reasons=["stop", "length"] * num_prompts,
    )


def _run(tmp_path: Path, *argv: str):
    return parse_config(["--log-dir", str(tmp_path), *argv])


def _dumped(tmp_path: Path, steps=(1, 2, 3), **kw) -> Path:
    run = _run(tmp_path / "src").run
    for step in steps:
        dump_rollouts(run, step, _rollouts(seed=step, **kw), CONTEXT)
    return tmp_path / "src"


def test_a_dump_reads_back_bit_for_bit(tmp_path):
    rollouts = _rollouts()
    written = dump_rollouts(_run(tmp_path).run, 7, rollouts, CONTEXT)
    assert [p.name for p in written] == ["step_000007.jsonl", "step_000007.safetensors"]
    back = load_dump(written[1])
    for name in ("token_ids", "offsets", "prompt_lens", "response_lens", "rewards", "engine_logprobs"):
        a, b = getattr(rollouts.batch, name), getattr(back.batch, name)
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()), name
    assert back.batch.engine_logprobs is not None and back.batch.engine_logprobs[1].isnan()
    assert back.batch.group_size == 2 and back.prompt_ids == ["p0", "p1"]
    assert back.finish_reasons == rollouts.finish_reasons
    assert back.metrics == {"rollout/reward_mean": 0.5}  # timings belong to the run that measured them
    assert read_dump_metadata(written[1])["context"]["tokenizer_sha256"] == CONTEXT.tokenizer_sha256


def test_no_dump_rollouts_writes_neither_file(tmp_path):
    assert dump_rollouts(_run(tmp_path, "--no-dump-rollouts").run, 1, _rollouts(), CONTEXT) == []
    assert not (tmp_path / "rollouts").exists()


def _replay(tmp_path: Path, src: Path, *argv: str, context: DumpContext = CONTEXT) -> ReplaySource:
    flags = ["--rollout-source", "replay", "--replay-from", str(src), "--global-batch-size", "2"]
    cfg = _run(tmp_path / "replay", *flags, "--group-size", "2", "--ppo-mini-batch-size", "2", *argv)
    return ReplaySource(cfg, context)


def test_a_matching_run_is_accepted_and_replays_the_dumps(tmp_path):
    src = _dumped(tmp_path)
    source = _replay(tmp_path, src)
    source.check([1, 2, 3])
    got = source.collect([], 2)
    assert torch.equal(got.batch.token_ids, load_dump(dump_path(src, 2)).batch.token_ids)
    assert len(got.records) == 4 and "perf/time/load_rollouts" in got.metrics


def test_a_folder_without_dumps_is_refused(tmp_path):
    (tmp_path / "empty" / "rollouts").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--replay-from .*empty: .*holds no rollout dumps"):
        _replay(tmp_path, tmp_path / "empty").check([1])


def test_missing_steps_are_refused_naming_the_step_and_what_exists(tmp_path):
    src = _dumped(tmp_path, steps=(1, 2))
    with pytest.raises(ValueError, match=r"step 3 has no dump .*step_000003\.safetensors.*steps 1-2 \(2 dumps\)"):
        _replay(tmp_path, src).check([1, 2, 3])


@pytest.mark.parametrize(
    ("context", "what"),
    [
        (DumpContext(512, "cd" * 32, 512, 1.0), "tokenizer"),
        (DumpContext(600, "ab" * 32, 512, 1.0), "tokenizer size"),
        (DumpContext(512, "ab" * 32, 1024, 1.0), "vocabulary size"),
        (DumpContext(512, "ab" * 32, 512, 0.7), "--temperature"),
    ],
)
def test_another_tokenizer_vocabulary_or_temperature_is_refused(tmp_path, context, what):
    src = _dumped(tmp_path, steps=(1,))
    with pytest.raises(ValueError, match=rf"step_000001\.safetensors: made with {what} "):
        _replay(tmp_path, src, context=context).check([1])


def test_another_group_or_batch_size_is_refused(tmp_path):
    src = _dumped(tmp_path, steps=(1,))
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: group size 2, this run has --group-size 4"):
        _replay(tmp_path, src, "--group-size", "4").check([1])
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: 2 prompts, this run has --global-batch-size 4"):
        _replay(tmp_path, src, "--global-batch-size", "4", "--ppo-mini-batch-size", "4").check([1])


def test_a_truncated_dump_is_refused_before_anything_is_built(tmp_path):
    src = _dumped(tmp_path, steps=(1,))
    path = dump_path(src, 1)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: not a readable rollout dump .*truncated"):
        _replay(tmp_path, src).check([1])
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: not a readable rollout dump"):
        _replay(tmp_path, src).check([1])


def test_a_corrupt_dump_is_refused_when_its_step_loads(tmp_path):
    src = _dumped(tmp_path, steps=(1,))
    path = dump_path(src, 1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit inside the tensors: the header and the size are intact
    path.write_bytes(bytes(data))
    _replay(tmp_path, src).check([1])  # the header check cannot see it
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: the tensors do not match the SHA-256"):
        _replay(tmp_path, src).collect([], 1)


def test_a_safetensors_file_that_is_not_a_rollout_dump_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = dump_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    save_file({"x": torch.zeros(2)}, str(path), metadata={"megatron_pacs": json.dumps({"format": "other/9"})})
    with pytest.raises(ValueError, match=r"a rollout dump of format 'other/9'"):
        read_dump_metadata(path)


def test_routed_experts_are_dumped_and_read_back_bit_for_bit_and_a_replay_with_r3_needs_them(tmp_path):
    """A run with --router-replay r3 dumps the engines' routing with its rollouts (format 2; without
    routing a dump stays format 1); a replay with r3 replays it, one without r3 drops it, and r3 refuses dumps
    without routing, naming the file and the flag."""
    from megatron_pacs.sources.dumps import DUMP_FORMAT, ROUTED_DUMP_FORMAT

    rollouts = _rollouts(routed=True)
    routed = rollouts.batch.routed_experts
    assert routed is not None and (routed[rollouts.batch.offsets[1:] - 1] == -1).all()  # no routing: last tokens
    written = dump_rollouts(_run(tmp_path).run, 1, rollouts, CONTEXT)
    assert read_dump_metadata(written[1])["format"] == ROUTED_DUMP_FORMAT
    back = load_dump(written[1]).batch.routed_experts
    assert back is not None and back.dtype == torch.int16 and torch.equal(back, routed)
    plain = dump_rollouts(_run(tmp_path / "plain").run, 1, _rollouts(), CONTEXT)[1]
    assert read_dump_metadata(plain)["format"] == DUMP_FORMAT and load_dump(plain).batch.routed_experts is None

    src = _dumped(tmp_path / "r3", steps=(1, 2), routed=True)
    source = _replay(tmp_path, src, "--router-replay", "r3")
    source.check([1, 2])
    assert torch.equal(source.collect([], 2).batch.routed_experts, load_dump(dump_path(src, 2)).batch.routed_experts)
    assert _replay(tmp_path, src).collect([], 2).batch.routed_experts is None  # r3 off: the routers choose
    with pytest.raises(ValueError, match=r"step_000001\.safetensors: no routed experts .* --router-replay r3"):
        _replay(tmp_path, _dumped(tmp_path / "plain_run", steps=(1,)), "--router-replay", "r3").check([1])
