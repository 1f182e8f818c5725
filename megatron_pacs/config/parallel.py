"""The Megatron parallel layout: tensor, pipeline (optionally interleaved), sequence and expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pacs.config.base import bad, option

__all__ = ["MOE_DISPATCHERS", "ParallelConfig"]

MOE_DISPATCHERS = ("allgather", "alltoall")


@dataclass(kw_only=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism takes the remaining ranks (DP = world / (TP x PP))."""

    tensor_model_parallel_size: int = 1
    """TP: shards attention heads, MLP columns and the vocabulary across this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers into this many stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage for the interleaved 1F1B schedule (needs --overlap-p2p-comm and
    --no-batch-p2p-comm)."""
    sequence_parallel: bool = False
    """Shard the sequence dimension of norms and dropout across TP ranks (needs TP > 1)."""
    overlap_p2p_comm: bool = False
    """Overlap pipeline sends/receives with compute; required (with --no-batch-p2p-comm) when interleaved."""
    batch_p2p_comm: bool = True
    """Batch pipeline sends/receives into one call; must be off with --overlap-p2p-comm."""
    expert_model_parallel_size: int = 1
    """EP (MoE checkpoints): shards the experts across this many ranks of the data-parallel x tensor-parallel
    ranks; each rank holds num_experts / EP of them. Needs TP x PP x EP to divide the world size."""
    moe_token_dispatcher_type: str = option("allgather", choices=MOE_DISPATCHERS)
    """How MoE layers send tokens to their experts' ranks: allgather (every rank gathers every token) or alltoall
    (each token goes only where its experts are; less traffic at EP > 1)."""
    distributed_timeout_minutes: int = 10
    """Timeout of the training process groups' collectives (Megatron-LM's default): a rank whose peer is lost
    without closing its connections stops with an error after this long instead of hanging."""

    def __post_init__(self) -> None:
        if self.distributed_timeout_minutes < 1:
            raise bad("distributed_timeout_minutes", f"{self.distributed_timeout_minutes} must be >= 1")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise bad(name, f"{getattr(self, name)} must be >= 1")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if vpp < 2:
                raise bad("virtual_pipeline_model_parallel_size", f"{vpp} must be >= 2, or unset to disable it")
            if self.pipeline_model_parallel_size < 2:
                raise bad("virtual_pipeline_model_parallel_size", "needs --pipeline-model-parallel-size >= 2")
            # With the defaults Megatron's interleaved schedule runs but computes wrong losses and gradients
            # (no error or warning): refuse that combination instead of training on it.
            if not self.overlap_p2p_comm or self.batch_p2p_comm:
                raise bad(
                    "virtual_pipeline_model_parallel_size",
                    "interleaved pipelining needs --overlap-p2p-comm and --no-batch-p2p-comm; with other settings "
                    "Megatron silently computes wrong gradients",
                )
        if self.overlap_p2p_comm and self.batch_p2p_comm:
            raise bad("overlap_p2p_comm", "needs --no-batch-p2p-comm")
        if self.expert_model_parallel_size < 1:
            raise bad("expert_model_parallel_size", f"{self.expert_model_parallel_size} must be >= 1")
        if self.moe_token_dispatcher_type not in MOE_DISPATCHERS:
            raise bad(
                "moe_token_dispatcher_type", f"{self.moe_token_dispatcher_type!r}: use one of {list(MOE_DISPATCHERS)}"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise bad("sequence_parallel", "needs --tensor-model-parallel-size > 1; disable it at TP=1")

    @property
    def model_parallel_size(self) -> int:
        """TP x PP: ranks holding one copy of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP for ``world_size`` ranks, or a ``ValueError`` naming the sizes when the layout does not divide."""
        if world_size % self.model_parallel_size:
            raise bad(
                "tensor_model_parallel_size",
                f"world size {world_size} is not divisible by TP x PP = {self.tensor_model_parallel_size} x "
                f"{self.pipeline_model_parallel_size}; change the layout or the number of ranks",
            )
        expert_layout = self.model_parallel_size * self.expert_model_parallel_size
        if world_size % expert_layout:
            raise bad(
                "expert_model_parallel_size",
                f"world size {world_size} is not divisible by TP x PP x EP = {self.tensor_model_parallel_size} x "
                f"{self.pipeline_model_parallel_size} x {self.expert_model_parallel_size} (Megatron's expert "
                "layout); change the layout or the number of ranks",
            )
        return world_size // self.model_parallel_size
