"""The whole run: one field per concern, and the checks that need more than one section or the world size."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from megatron_pacs.config.base import bad, is_set
from megatron_pacs.config.batch import BatchConfig
from megatron_pacs.config.cpu_isa import half_engine_refusal
from megatron_pacs.config.critic import CriticConfig
from megatron_pacs.config.loss import LossConfig
from megatron_pacs.config.model import ModelConfig
from megatron_pacs.config.objectives import OBJECTIVES
from megatron_pacs.config.optim import OptimConfig
from megatron_pacs.config.parallel import ParallelConfig
from megatron_pacs.config.reference import ReferenceConfig
from megatron_pacs.config.rollout import RolloutConfig, check_reconnect_window
from megatron_pacs.config.run import CheckpointConfig, DataConfig, EvalConfig, RewardConfig, RunConfig
from megatron_pacs.config.source import SourceConfig, check_source_flags
from megatron_pacs.config.sources import SOURCES

__all__ = ["TrainConfig"]


@dataclass(kw_only=True)
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batch arithmetic."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Objective."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's critic."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Fleet and sampling."""
    source: SourceConfig = field(default_factory=SourceConfig)
    """Where the rollouts come from."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward pool."""
    run: RunConfig = field(default_factory=RunConfig)
    """Length of the run, seed, logging."""

    def validate(self, world_size: int, *, need_files: bool = True) -> int:
        """Checks across sections for ``world_size`` ranks, before anything is built; returns the DP size.

        Args:
            world_size: Ranks of the launch (or the planned launch, for the dry run).
            need_files: Also check that the model directory and data files exist.

        Raises:
            ValueError: naming the flag and the fix.
        """
        b = self.batch
        dp = self.parallel.data_parallel_size(world_size)
        if b.ppo_mini_batch_size % dp:
            raise bad(
                "ppo_mini_batch_size",
                f"{b.ppo_mini_batch_size} prompts must split into whole groups over {dp} data-parallel ranks; use "
                f"a multiple of {dp}",
            )
        self._check_critic_flags()
        ref = self.reference
        if not self.needs_reference:
            for name in ("ref_load", "ref_offload", "ref_reset_interval"):
                if getattr(ref, name):
                    raise bad(
                        name,
                        "no reference policy is built without --kl-coef > 0 or --pacs-score-reference ref; drop it "
                        "or ask for one of those",
                    )
        if self.loss.overlong_buffer_len >= b.max_response_length:
            raise bad(
                "overlong_buffer_len",
                f"{self.loss.overlong_buffer_len} must be < --max-response-length {b.max_response_length} (the "
                "penalty grows over the buffer's last tokens before it)",
            )
        sections = {"rollout": self.rollout, "loss": self.loss, "reward": self.reward, "eval": self.eval}
        check_source_flags(self.source, {**sections, "data": self.data, "model": self.model, "run": self.run})
        check_reconnect_window(self.rollout, self.parallel.distributed_timeout_minutes)
        r = self.rollout
        if self.loss.off_policy_correction == "tis" and (r.temperature != 1.0 or r.top_p < 1.0 or r.top_k != -1):
            raise bad(
                "off_policy_correction",
                "tis compares with the engines' raw log-probs, which are the behaviour policy only when sampling at "
                "--temperature 1 with --top-p 1 and --top-k -1; drop it or sample so",
            )
        if self.model.fp8_format and self.model.fp8_score_precision == "bf16" and self.batch.keep_groups_in_microbatch:
            raise bad(
                "fp8_score_precision",
                "bf16 scores with --keep-groups-in-microbatch would subtract a bf16 anchor from the FP8 training "
                "pass's log-likelihoods (direct mode scores in the training pass); use --fp8-score-precision fp8, "
                "or drop --keep-groups-in-microbatch (the two-phase gradient takes every score from bf16 passes)",
            )
        if self.loss.tis_ratio_level == "sequence" and self.score_fp8:
            raise bad(
                "off_policy_correction",
                "a sequence-level ratio against FP8 score passes turns FP8's per-token bias into a factor of "
                "exp(bias x length) (docs/algorithm.md §5.1); use --tis-level geometric, --fp8-score-precision "
                "bf16, or drop the correction",
            )
        if r.offload_optimizer_during_rollout and not self.model.bf16:
            raise bad(
                "offload_optimizer_during_rollout",
                "without --bf16 Megatron's fp32 optimizer holds the model's parameters themselves, so offloading it "
                "would move the weights to the host before the weight sync; add --bf16 (the optimizer then keeps "
                "fp32 copies of its own) or drop the flag",
            )
        if self.model.fp8_format and not _importable("transformer_engine"):
            raise bad("fp8_format", "needs Transformer Engine (pip install .[gpu] on a CUDA machine)")
        if self.data.val_data and not self.eval.eval_interval:
            raise bad("val_data", "validation is off without --eval-interval N; add it or drop the validation files")
        if not need_files:
            return dp
        if self.model.fp8_format and self.model.fp8_recipe == "mxfp8" and _cuda_capability() < (10, 0):
            raise bad("fp8_recipe", "mxfp8 needs a Blackwell GPU (compute capability 10); use tensorwise or blockwise")
        if self.rollout.colocate and not _cuda_available():
            raise bad(
                "colocate",
                "shares GPUs between the trainer and the engines and needs CUDA; this machine has none, so drop "
                "--colocate (the engines then run beside the trainer)",
            )
        self._check_engine_memory_flags()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if (self.rollout.colocate or self.rollout.weight_sync == "ipc") and world_size > local_world:
            raise bad(
                "colocate" if self.rollout.colocate else "weight_sync",
                "weights reach the engines by CUDA IPC from rank 0's GPU, which engines on other nodes cannot map: "
                "one node only; for a multi-node run drop --colocate and use --weight-sync broadcast",
            )
        m = self.model
        if m.logprob_impl == "fused" and not (
            _importable("triton") and (_cuda_available() or os.environ.get("TRITON_INTERPRET") == "1")
        ):
            raise bad(
                "logprob_impl",
                "the fused kernels need Triton and CUDA (or TRITON_INTERPRET=1, Triton's slow CPU interpreter); use "
                "auto or chunked on this machine",
            )
        if m.bias_swiglu_fusion and not _cuda_available():
            raise bad("bias_swiglu_fusion", "the fused SwiGLU kernel needs CUDA; drop the flag on this machine")
        if m.rope_fusion and not (_cuda_available() and _importable("transformer_engine")):
            raise bad("rope_fusion", "the fused RoPE kernel is Transformer Engine's (CUDA); drop the flag")
        if m.masked_softmax_fusion and not (_importable("scaled_masked_softmax_cuda") and _cuda_available()):
            raise bad("masked_softmax_fusion", "needs Apex's fused softmax kernels (CUDA); drop the flag")
        if ref.ref_offload and not _cuda_available():
            raise bad(
                "ref_offload", "keeps the reference in pinned host memory between GPU uses; this machine has no CUDA"
            )
        if ref.ref_load is not None and not os.path.isfile(os.path.join(ref.ref_load, "config.json")):
            raise bad("ref_load", f"{ref.ref_load!r} has no config.json; pass a Hugging Face model directory")
        if not self.model.hf_model or not os.path.isfile(os.path.join(self.model.hf_model, "config.json")):
            raise bad("hf_model", f"{self.model.hf_model!r} has no config.json; pass a Hugging Face model directory")
        self._check_positions()
        self._check_critic_model()
        self.model.check_router_replay(cuda=_cuda_available(), engines=SOURCES[self.source.rollout_source].engines)
        self._check_checkpoint_dirs()
        if not self.data.train_data:
            raise bad("train_data", "give at least one prepared training file (tools/prepare_data.py)")
        for name in ("train_data", "val_data"):
            for path in getattr(self.data, name):
                if not os.path.isfile(path):
                    raise bad(name, f"{path} does not exist; prepare it with tools/prepare_data.py")
        if self.eval.eval_interval and not self.data.val_data:
            raise bad("eval_interval", "validation needs --val-data files")
        return dp

    def _check_critic_flags(self) -> None:
        """The critic's flags belong to --loss ppo; its reward KL excludes the KL loss term."""
        if self.loss.loss != "ppo":
            for name in self.critic.set_fields():
                raise bad(
                    name,
                    f"configures PPO's critic; it has no meaning for --loss {self.loss.loss}: drop it or "
                    "use --loss ppo",
                )
        if self.critic.reward_kl_coef > 0 and self.loss.kl_coef > 0:
            raise bad(
                "reward_kl_coef",
                "a KL in the reward and --kl-coef's KL in the loss would penalise the same drift twice; keep one "
                "(PPO puts it in the reward, which the critic's returns see)",
            )

    def _check_critic_model(self) -> None:
        """--critic-hf-model must embed the actor's token ids and be a family the trainer builds (config.json alone)."""
        path = self.critic.critic_hf_model
        if self.loss.loss != "ppo" or path is None:
            return
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise bad("critic_hf_model", f"{path!r} has no config.json; pass a Hugging Face model directory")
        with open(os.path.join(path, "config.json")) as f:
            critic = json.load(f)
        with open(os.path.join(self.model.hf_model, "config.json")) as f:
            actor = json.load(f)
        if critic.get("model_type") != actor.get("model_type"):
            raise bad(
                "critic_hf_model",
                f"model_type {critic.get('model_type')!r} differs from --hf-model's {actor.get('model_type')!r}; the "
                "critic is built on the actor's layout from a checkpoint of the same family",
            )
        if critic.get("vocab_size") != actor.get("vocab_size"):
            raise bad(
                "critic_hf_model",
                f"vocab_size {critic.get('vocab_size')} differs from --hf-model's {actor.get('vocab_size')}: the "
                "critic must embed the actor's token ids; pass a checkpoint with the actor's tokenizer",
            )

    @property
    def needs_reference(self) -> bool:
        """The loss (a KL term, a reference-anchored score) or the critic's reward KL needs the reference policy."""
        return self.loss.needs_reference or (self.loss.loss == "ppo" and self.critic.reward_kl_coef > 0)

    def _check_engine_memory_flags(self) -> None:
        """Engine settings that the machine's kind (CUDA or not, as the fleet decides) would ignore, and CPU engines
        in half precision that this process's environment would make abort (config/cpu_isa.py)."""
        r, cuda = self.rollout, _cuda_available()
        if cuda and is_set(r, "kv_cache_gb"):
            raise bad("kv_cache_gb", "sizes CPU engines' KV cache; GPU engines take --gpu-memory-utilization instead")
        if not cuda and r.gpu_memory_utilization is not None:
            raise bad("gpu_memory_utilization", "applies to GPU engines; this machine's CPU engines take --kv-cache-gb")
        transport = r.weight_sync
        if transport == "auto":
            transport = "object_store" if not cuda else ("ipc" if r.colocate else "broadcast")
        local = SOURCES[self.source.rollout_source].engines and r.ray_address is None  # engines in this machine's env
        if local and not cuda and (why := half_engine_refusal(self.engine_dtype)):
            raise ValueError(why)
        if r.keep_weights_for_restart is False and transport == "object_store":
            raise ValueError(
                "--no-keep-weights-for-restart: the object-store transport keeps the last update anyway (the engines "
                "load it from there, and a restarted engine too); drop the flag"
            )

    def _check_positions(self) -> None:
        """--seq-length within the model's position embeddings (read from config.json; no model is loaded)."""
        with open(os.path.join(self.model.hf_model, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
        seq = self.batch.seq_length
        if isinstance(positions, int) and seq is not None and seq > positions:
            raise bad(
                "seq_length",
                f"{seq} (prompt + response) exceeds the model's max_position_embeddings {positions}; lower "
                "--max-prompt-length / --max-response-length (or --seq-length)",
            )

    def _check_checkpoint_dirs(self) -> None:
        """A mistyped or damaged --load must not train from scratch, and a fresh run must not overwrite --save's
        checkpoints; which checkpoint --load resumes is decided here, so damaged metadata is named before anything
        is built (:mod:`megatron_pacs.utils.checkpoint_dirs`)."""
        from megatron_pacs.utils.checkpoint_dirs import choose_checkpoint

        ck = self.checkpoint
        same = ck.load is not None and ck.save is not None and _same_path(ck.load, ck.save)
        if ck.load is not None:
            try:
                choice = choose_checkpoint(ck.load)
            except ValueError as exc:
                raise bad("load", str(exc)) from None
            if choice.checkpoint is None and choice.holds_checkpoints and not ck.load_optional:
                damaged = "; ".join(choice.damaged) or "its iter_* folders hold no metadata"
                raise bad(
                    "load",
                    f"{ck.load!r} holds checkpoints but none is readable and complete: {damaged}. Repair or move "
                    "them aside and --load one that is complete, or add --load-optional to start from --hf-model",
                )
            if choice.checkpoint is None and not choice.holds_checkpoints and not (ck.load_optional or same):
                raise bad(
                    "load",
                    f"{ck.load!r} holds no complete checkpoint (mistyped?); pass a checkpoint directory, or add "
                    "--load-optional to start from --hf-model when it holds none yet",
                )
        if ck.save is not None and _holds_checkpoints(ck.save):
            inside = ck.load is not None and (same or _same_path(os.path.dirname(os.path.abspath(ck.load)), ck.save))
            if not inside:
                raise bad(
                    "save",
                    f"{ck.save!r} already holds checkpoints, which this run would overwrite step by step; resume "
                    f"with --load {ck.save} (or one of its iter_* folders), or save to a new directory",
                )

    def warnings(self) -> list[str]:
        """Settings that work but that a user should know about (the trainer logs them at start)."""
        out = []
        if self.loss.pacs_score_reference == "ref" and not self.reference.ref_reset_interval:  # PACS's own flag
            out.append(
                "--pacs-score-reference ref without --ref-reset-interval: the score beta * (l - l_ref) measures the "
                "whole drift since the start and can grow without bound, saturating the sigmoid; its range is "
                "logged every step (pacs/score/{min,max}); consider --ref-reset-interval N (docs/algorithm.md §2.2)"
            )
        return out

    @property
    def engine_dtype(self) -> str:
        """The engines' dtype: --rollout-dtype, or for ``auto`` the trainer's own (vLLM's "auto" would run an fp32
        checkpoint in half precision)."""
        r = self.rollout
        return r.rollout_dtype if r.rollout_dtype != "auto" else ("bfloat16" if self.model.bf16 else "float32")

    @property
    def score_fp8(self) -> bool:
        """Whether the score passes (old, phase-1 current, reference) run in FP8 (``--fp8-score-precision``)."""
        precision = self.model.fp8_score_precision
        if not self.model.fp8_format or precision == "bf16":
            return False
        fp8_by_default = OBJECTIVES.get(self.loss.loss).fp8_scores or self.batch.keep_groups_in_microbatch
        return precision == "fp8" or fp8_by_default

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for checkpoints and metric sinks)."""
        return dataclasses.asdict(self)


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _holds_checkpoints(path: str) -> bool:
    """Whether ``path`` holds ``iter_*`` folders or a tracker (complete or not: a fresh run would write over them)."""
    from megatron_pacs.utils.checkpoint_dirs import choose_checkpoint

    try:
        return choose_checkpoint(path).holds_checkpoints
    except ValueError:  # a damaged newest checkpoint: still checkpoints
        return True


@cache
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda_capability() -> tuple[int, int]:
    import torch  # deferred, as below

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _cuda_available() -> bool:
    import torch  # deferred: --help and the dry run stay instant

    return torch.cuda.is_available()
