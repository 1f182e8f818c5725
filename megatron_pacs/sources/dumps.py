"""Rollout dumps: what a run keeps of each step's rollouts, for people to read and for a replay to train on.

Per step, under ``<--log-dir>/rollouts/`` (``--no-dump-rollouts`` turns both off):

- ``step_NNNNNN.jsonl``: one readable line per response (prompt, response text, ground truth, score);
- ``step_NNNNNN.safetensors``: everything the update needs, bit for bit: the token ids of every prompt and
  response (int32), the engines' per-token log-probs (float32, NaN where an engine gave none), the rewards, and in
  the metadata the group structure (group size, the prompts' ids), the finish reasons, the sampling temperature,
  the tokenizer's fingerprint and the model's vocabulary size, the step's rollout metrics, and a SHA-256 of the
  tensors. With ``--router-replay r3`` also the experts the engines routed every token to (int16, ``[sum L_i,
  layers, k]``, -1 where none), so that a replay of the dump replays that routing too (format 2; a dump without
  routing stays format 1, which older versions read). With ``--max-staleness`` also the weights' version that sampled
  every response token (int32, ``[sum R_i]``; format 3). No pickle: loading a dump runs no code.

Legend: S responses of the step, P prompts, L_i sequence i's length (prompt + response), R_i its response length.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_pacs.config import RunConfig
from megatron_pacs.data.batching import RolloutBatch
from megatron_pacs.sources.base import StepRollouts
from megatron_pacs.utils.log_writes import log_write

__all__ = [
    "DUMP_FORMAT",
    "ROUTED_DUMP_FORMAT",
    "VERSIONED_DUMP_FORMAT",
    "DumpContext",
    "dump_path",
    "dump_rollouts",
    "load_dump",
    "read_dump_metadata",
    "tokenizer_fingerprint",
]

DUMP_FORMAT = "megatron_pacs.rollouts/1"
"""A dump without routed experts."""
ROUTED_DUMP_FORMAT = "megatron_pacs.rollouts/2"
"""A dump with the engines' routed experts (``--router-replay r3``)."""
VERSIONED_DUMP_FORMAT = "megatron_pacs.rollouts/3"
"""A dump with the weights' version of every response token (``--max-staleness``)."""
_FORMATS = (DUMP_FORMAT, ROUTED_DUMP_FORMAT, VERSIONED_DUMP_FORMAT)
_TENSORS = ("token_ids", "offsets", "prompt_lens", "response_lens", "rewards", "engine_logprobs")


@dataclass(frozen=True)
class DumpContext:
    """What every dump of a run records besides its rollouts: enough to refuse a replay that cannot be exact.

    Attributes:
        tokenizer_size: ``len(tokenizer)``.
        tokenizer_sha256: :func:`tokenizer_fingerprint` of the tokenizer.
        vocab_size: The model's ``vocab_size`` (config.json).
        temperature: The sampling temperature (the update's log-probs refer to it).
    """

    tokenizer_size: int
    tokenizer_sha256: str
    vocab_size: int
    temperature: float


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id, sorted) and special tokens."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()


def dump_path(log_dir: str | Path, step: int, suffix: str = ".safetensors") -> Path:
    """``<log_dir>/rollouts/step_NNNNNN<suffix>``."""
    return Path(log_dir) / "rollouts" / f"step_{step:06d}{suffix}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    engine = batch.engine_logprobs
    if engine is None:
        engine = torch.full((int(batch.response_lens.sum()),), float("nan"), dtype=torch.float32)
    if batch.token_ids.numel() and int(batch.token_ids.max()) >= 2**31:
        raise ValueError(f"token id {int(batch.token_ids.max())} does not fit the dump's int32 token ids")
    values = {
        "token_ids": batch.token_ids.to(torch.int32),  # half the bytes of the batch's int64; read back as int64
        "offsets": batch.offsets,
        "prompt_lens": batch.prompt_lens,
        "response_lens": batch.response_lens,
        "rewards": batch.rewards,
        "engine_logprobs": engine,
    }
    if batch.routed_experts is not None:
        values["routed_experts"] = batch.routed_experts.to(torch.int16)
    return {k: v.detach().cpu().contiguous() for k, v in values.items()}


def dump_rollouts(run: RunConfig, step: int, rollouts: StepRollouts, context: DumpContext | None = None) -> list[Path]:
    """Write step ``step``'s dumps (the readable records, and with ``context`` the replayable rollouts) unless
    ``--no-dump-rollouts``; returns the files written.

    Raises:
        LogWriteError: naming the file and the step, when a write fails (a full disk).
    """
    if not run.dump_rollouts:
        return []
    text = dump_path(run.log_dir, step, ".jsonl")
    with log_write(text, step):
        text.parent.mkdir(parents=True, exist_ok=True)
        with open(text, "w", encoding="utf-8") as f:
            for rec in rollouts.records:
                f.write(json.dumps(rec) + "\n")
    if context is None:
        return [text]
    from safetensors.torch import save_file

    tensors = _tensors(rollouts.batch)
    routed = rollouts.batch.routed_experts is not None
    versioned = rollouts.token_versions is not None
    if rollouts.token_versions is not None:
        tensors["token_versions"] = rollouts.token_versions.to(torch.int32).contiguous()
    meta = {
        "format": VERSIONED_DUMP_FORMAT if versioned else ROUTED_DUMP_FORMAT if routed else DUMP_FORMAT,
        "step": step,
        "group_size": rollouts.batch.group_size,
        "has_engine_logprobs": rollouts.batch.engine_logprobs is not None,
        "has_routed_experts": routed,
        "has_token_versions": versioned,
        "prompt_ids": rollouts.prompt_ids,
        "finish_reasons": rollouts.finish_reasons,
        "metrics": {k: v for k, v in rollouts.metrics.items() if not k.startswith("perf/")},
        "context": asdict(context),
        "sha256": _digest(tensors),
    }
    path = dump_path(run.log_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    with log_write(path, step):
        try:
            save_file(tensors, str(tmp), metadata={"megatron_pacs": json.dumps(meta)})
        except Exception as exc:  # safetensors raises its own error for a failed write; the OS error is what counts
            tmp.unlink(missing_ok=True)
            raise _os_error(exc) from exc
        os.replace(tmp, path)  # a dump cut short by a crash is never found under the step's name
    return [text, path]


def _os_error(exc: Exception) -> Exception:
    """The ``OSError`` behind a failed write (safetensors' Rust writer reports one as its own error type, with the
    OS error's text), else ``exc`` itself."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS):
        if os.strerror(code) in text or f"os error {code}" in text:
            return OSError(code, os.strerror(code))
    return exc


def read_dump_metadata(path: str | Path) -> dict[str, Any]:
    """A dump's metadata, after checking that the file holds every byte its header promises (no tensor is read).

    Raises:
        ValueError: Naming the file, when it is missing, truncated, not a rollout dump, or of another format.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("its header is cut short")
            header = json.loads(f.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if size != 8 + header_len + end:
            raise ValueError(f"it holds {size} bytes where its header promises {8 + header_len + end} (truncated?)")
        meta = json.loads(header["__metadata__"]["megatron_pacs"])
    except FileNotFoundError:
        raise ValueError(f"{path}: no such rollout dump") from None
    except (ValueError, KeyError, TypeError, struct.error, OSError) as exc:
        raise ValueError(f"{path}: not a readable rollout dump ({exc}); dump the step again") from exc
    if meta.get("format") not in _FORMATS:
        raise ValueError(
            f"{path}: a rollout dump of format {meta.get('format')!r}; this version reads {', '.join(_FORMATS)}"
        )
    meta.setdefault("has_routed_experts", False)
    meta.setdefault("has_token_versions", False)
    return meta


def load_dump(path: str | Path, records: Iterable[dict[str, Any]] = ()) -> StepRollouts:
    """A dump's rollouts, exactly as they were dumped (the tensors' SHA-256 is checked).

    Args:
        path: The ``step_NNNNNN.safetensors`` file.
        records: The step's readable records, to dump again with the replay.

    Raises:
        ValueError: Naming the file, when it is unreadable or its tensors do not match their SHA-256.
    """
    from safetensors.torch import load_file

    meta = read_dump_metadata(path)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path}: not a readable rollout dump ({exc}); dump the step again") from exc
    expected = (
        *_TENSORS,
        *(("routed_experts",) if meta["has_routed_experts"] else ()),
        *(("token_versions",) if meta["has_token_versions"] else ()),
    )
    if sorted(tensors) != sorted(expected) or _digest(tensors) != meta["sha256"]:
        raise ValueError(f"{path}: the tensors do not match the SHA-256 recorded with them (corrupt); dump it again")
    batch = RolloutBatch(
        token_ids=tensors["token_ids"].long(),
        offsets=tensors["offsets"],
        prompt_lens=tensors["prompt_lens"],
        response_lens=tensors["response_lens"],
        rewards=tensors["rewards"],
        group_size=int(meta["group_size"]),
        engine_logprobs=tensors["engine_logprobs"] if meta["has_engine_logprobs"] else None,
        routed_experts=tensors.get("routed_experts"),
    )
    return StepRollouts(
        batch,
        records=list(records),
        metrics=dict(meta["metrics"]),
        prompt_ids=list(meta["prompt_ids"]),
        finish_reasons=list(meta["finish_reasons"]),
        token_versions=tensors.get("token_versions"),
    )
