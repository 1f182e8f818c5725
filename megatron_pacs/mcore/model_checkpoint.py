"""Model checkpoints (weights only): Megatron distributed checkpoints of the model (any TP/PP layout in or out)
and Hugging Face safetensors directories, both written to a temporary folder and renamed only when complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_pacs.mcore.cpu_support import cuda_to_cpu
from megatron_pacs.utils.checkpoint_dirs import META_FILE, read_metadata

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

__all__ = ["HF_SIDE_FILES", "apply_model_state", "load_model_checkpoint", "save_hf_checkpoint", "save_model_checkpoint"]

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
)


#: torch's deprecations that megatron-core's torch_dist strategy trips on every load (it still calls
#: ``torch.distributed.checkpoint.load_state_dict`` and builds ``ShardedTensor`` objects, megatron-core 0.16-0.19):
#: nothing a user can act on, so they are filtered around our loads by their exact text.
DIST_CHECKPOINT_LOAD_DEPRECATIONS = (
    "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
    "Please use DTensor instead and we are deprecating ShardedTensor.",
)


def load_distributed(sharded: dict[str, Any], ckpt_dir: str | os.PathLike, strategy: Any = None) -> dict[str, Any]:
    """``dist_checkpointing.load`` of ``sharded`` from ``ckpt_dir`` (CUDA allocations on the CPU under the CPU
    shims), without the deprecation warnings of :data:`DIST_CHECKPOINT_LOAD_DEPRECATIONS`; ``strategy``: the sharded
    load strategy (None: Megatron's default for the checkpoint)."""
    with warnings.catch_warnings(), cuda_to_cpu():
        for message in DIST_CHECKPOINT_LOAD_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=FutureWarning)
        # A dict: load returns a tuple only for the strict="return_*" modes.
        return cast(dict[str, Any], dist_checkpointing.load(sharded, str(ckpt_dir), sharded_strategy=strategy))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state_dict(models: Sequence[MegatronModule]) -> dict[str, Any]:
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def _broadcast_path(path: str | None) -> str:
    obj = [path]
    if dist.is_initialized():
        dist.broadcast_object_list(obj, src=0)
    assert obj[0] is not None, "rank 0 makes the folder and broadcasts its path"
    return obj[0]


def save_model_checkpoint(models: Sequence[MegatronModule], ckpt_dir: str | os.PathLike, metadata: dict) -> None:
    """Save the model chunks as a Megatron distributed checkpoint, atomically.

    All ranks write their shards into a sibling temporary folder; rank 0 adds ``megatron_pacs.json``
    (``metadata``) and renames the folder into place after every rank is done, so a checkpoint interrupted
    mid-write never appears under ``ckpt_dir``. Collective: call on every rank.
    """
    ckpt_dir = Path(ckpt_dir)
    tmp = None
    if _rank() == 0:
        ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{ckpt_dir.name}.tmp-", dir=ckpt_dir.parent)
    tmp = _broadcast_path(tmp)
    with cuda_to_cpu():
        dist_checkpointing.save(_sharded_state_dict(models), tmp)
    _barrier()
    if _rank() == 0:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(metadata, f, indent=2, default=str)
        if ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)
        os.replace(tmp, ckpt_dir)
    _barrier()


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """The ``megatron_pacs.json`` of a checkpoint.

    Raises:
        ValueError: one line naming the file when the folder is not a complete checkpoint or its metadata is
            missing, empty or not a JSON object.
    """
    return read_metadata(ckpt_dir)


def load_model_checkpoint(models: Sequence[MegatronModule], ckpt_dir: str | os.PathLike) -> dict:
    """Load a distributed checkpoint into the model chunks, resharding to their TP/PP layout.

    Returns:
        The checkpoint's metadata.

    Raises:
        ValueError: naming the missing or misshaped tensor when the checkpoint does not fit the model.
    """
    meta = read_checkpoint_metadata(ckpt_dir)
    load_model_weights(models, ckpt_dir)
    return meta


def load_model_weights(models: Sequence[MegatronModule], folder: str | os.PathLike) -> None:
    """Load the model entries of a sharded checkpoint folder (a checkpoint, or a model saved beside the policy's in
    a subfolder: ``critic/``, ``reference/``) into the chunks, resharding to their layout.

    Raises:
        ValueError: when the folder does not fit the model.
    """
    try:
        state = load_distributed(_sharded_state_dict(models), folder)
    except Exception as e:  # noqa: BLE001 - Megatron raises several exception types here
        raise ValueError(f"{folder} does not fit the model: {type(e).__name__}: {e}") from None
    apply_model_state(models, state, str(folder))


def apply_model_state(models: Sequence[torch.nn.Module], state: dict[str, Any], where: str) -> None:
    """Load a checkpoint's model entries (``model``, or ``model0``, ``model1``, ... per chunk) into this rank's
    (possibly DDP-wrapped) chunks; every weight must be there (Transformer Engine's ``_extra_state`` may not).

    Raises:
        ValueError: naming ``where`` and the first missing or unexpected keys.
    """
    for i, m in enumerate(models):
        inner = getattr(m, "module", m)  # DDP wraps the GPTModel
        key = "model" if len(models) == 1 else f"model{i}"
        missing, unexpected = inner.load_state_dict(state[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"{where}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    side_files_from: str | os.PathLike | None = None,
    hf_config: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    total: int | None = None,
) -> None:
    """Write ``(hf_name, tensor)`` pairs as a Hugging Face directory: safetensors shards with an index, the
    config, and tokenizer files. Streams: at most one shard is held in memory.

    Collective when the iterator is (weights export): every rank must call it; only rank 0 writes. The
    directory appears complete or not at all (temporary folder, then rename).

    Args:
        named_tensors: e.g. :func:`megatron_pacs.mcore.weights.export_hf_weights`.
        out_dir: Destination (replaced if it exists; callers check ``--force``).
        side_files_from: A HF directory whose config, generation config and tokenizer files are copied.
        hf_config: A config to save instead of copying ``config.json``.
        max_shard_bytes: Shard size limit.
        dtype: Cast tensors to this dtype (default: keep).
        progress: Show a progress bar on rank 0.
        total: Expected tensor count, for the progress bar.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    writer = _rank() == 0
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent)) if writer else None
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shards, weight_map, total_size = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        assert tmp is not None, "only the writer flushes"
        if shard:
            name = f"part-{len(shards):05d}.safetensors"
            save_file(shard, tmp / name, metadata={"format": "pt"})
            shards.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    try:
        bar = tqdm(total=total, desc="export", unit="tensor", disable=not (writer and progress))
        for name, tensor in named_tensors:
            bar.update(1)
            if not writer:
                continue
            t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
            size = t.numel() * t.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[name] = t
            shard_bytes += size
            total_size += size
        bar.close()
        if tmp is not None:  # the writer
            flush()
            n = len(shards)
            for i, (part, names) in enumerate(shards):
                final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(tmp / part, tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            if n > 1:
                index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            if side_files_from is not None:
                for fname in HF_SIDE_FILES:
                    src = Path(side_files_from) / fname
                    if src.is_file():
                        shutil.copy2(src, tmp / fname)
            if hf_config is not None:
                hf_config.save_pretrained(tmp)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
    except BaseException:
        if tmp is not None:  # a full disk, an interrupt: no half-written directory left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
