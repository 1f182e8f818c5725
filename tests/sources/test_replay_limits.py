"""A replay keeps the run's length limits: dumps whose prompts or responses are longer than
``--max-prompt-length`` / ``--max-response-length`` are refused before anything is built, naming the file and the
flag (they trained before, past the limits the run was given)."""

from pathlib import Path

import pytest
import torch

from megatron_pacs.config import parse_config
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.sources import DumpContext, ReplaySource, StepRollouts, dump_rollouts
from megatron_pacs.sources.dumps import dump_path

CONTEXT = DumpContext(tokenizer_size=512, tokenizer_sha256="ab" * 32, vocab_size=512, temperature=1.0)


def _dumped(root: Path, prompt_len: int, response_len: int) -> Path:
    """Step 1 of a run of 2 prompts x 2 responses, every prompt and response of the given lengths."""
    seqs = [list(range(3, 3 + prompt_len + response_len)) for _ in range(4)]
    batch = RolloutBatch.from_sequences(
        seqs, torch.tensor([prompt_len] * 4), torch.tensor([response_len] * 4), torch.tensor([1.0, 0.0] * 2), 2
    )
    rollouts = StepRollouts(batch, records=[], metrics={}, prompt_ids=["p0", "p1"], finish_reasons=["stop"] * 4)
    dump_rollouts(parse_config(["--log-dir", str(root)]).run, 1, rollouts, CONTEXT)
    return root


def _replay(root: Path, src: Path, *limits: str) -> ReplaySource:
    flags = ["--rollout-source", "replay", "--replay-from", str(src), "--global-batch-size", "2"]
    flags += ["--group-size", "2", "--ppo-mini-batch-size", "2", "--log-dir", str(root / "replay"), *limits]
    return ReplaySource(parse_config(flags), CONTEXT)


def test_dumps_longer_than_the_runs_limits_are_refused_naming_the_file_and_the_flag(tmp_path):
    src = _dumped(tmp_path / "src", prompt_len=5, response_len=22)
    path = dump_path(src, 1)
    with pytest.raises(ValueError, match=rf"{path}: a response of 22 tokens, over --max-response-length 12"):
        _replay(tmp_path, src, "--max-response-length", "12").check([1])
    with pytest.raises(ValueError, match=rf"{path}: a prompt of 5 tokens, over --max-prompt-length 4"):
        _replay(tmp_path, src, "--max-prompt-length", "4", "--max-response-length", "22").check([1])
    _replay(tmp_path, src, "--max-prompt-length", "5", "--max-response-length", "22").check([1])  # at the limits
