"""The ``--dry-run`` planner: layout checks, batch arithmetic and a per-GPU memory estimate; no torch or backends.

``plan_run`` checks a :class:`~megatron_pacs.config.TrainConfig` for a world size against a model shape read from a
Hugging Face ``config.json`` (what the config cannot know: TP against the heads and vocabulary, PP x VPP against the
layers), raising ``ValueError`` that names the Megatron-LM flag and the fix, and returns a ``RunPlan`` whose
``format()`` is what ``dry_run`` prints.

Memory is the standard Megatron accounting, per GPU of the most loaded pipeline stage (bytes per parameter):

    bf16 weights 2 | fp32 main params 4 (/DP with the distributed optimizer) | fp32 main grads 4 (Megatron DDP's
    grad buffer, never sharded) | Adam m, v 8 (/DP with the distributed optimizer); fp32 runs: weights 4, no copy.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") in
its flash-attention form (the ``5as/h`` softmax term vanishes): ``34 * s*b * h`` bytes per layer, divided by TP
with sequence parallelism (``s*b*h * (10 + 24/TP)`` without it); full recompute keeps only each layer's input,
``2 * s*b * h`` (/TP with SP), plus one layer's full activations while it is recomputed. The formula is derived
for a 4h GELU MLP; a SwiGLU MLP of ~5.3h (Qwen2.5) holds up to ~40% more per layer, so read activations as a lower
bound. Each stage holds one set per micro-batch in flight under 1F1B (Megatron's warm-up counts, interleaved
included). The last stage also holds the output layer's logits shard ``[s*b, V/TP]`` and its gradient, and the
chunked log-prob work buffers ``2 * 512 * V/TP * 4`` bytes. PPO's critic (``--loss ppo``) adds a second model with
the actor's layout and the same per-parameter bytes (weights, main params, grads, Adam), its LM head a one-output
value head and its embeddings untied; its activations come at other times than the actor's and are not added.
Sizes are GiB (2^30 bytes).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from megatron_pacs.config import TrainConfig, flag

__all__ = ["LOGPROB_CHUNK_TOKENS", "OVERHEAD_GB", "MemoryEstimate", "ModelShape", "RunPlan", "dry_run", "plan_run"]

GiB = 1024**3
LOGPROB_CHUNK_TOKENS = 512
OVERHEAD_GB = 2.0  # CUDA context, NCCL buffers and allocator fragmentation: a flat allowance, not a derivation
WARN_FRACTION = 0.9
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(kw_only=True)
class ModelShape:
    """The parameter-bearing shape of a Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama decoder (field names as in HF)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Biases on q/k/v (always for Qwen2; ``attention_bias`` for Llama/Qwen3)."""
    o_bias: bool = False
    """Bias on the attention output projection (``attention_bias`` for Llama/Qwen3)."""
    mlp_bias: bool = False
    """Biases on gate/up/down (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    num_experts: int = 0
    """Routed experts per layer (Qwen3-MoE; 0: a dense MLP of ``intermediate_size``)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width."""
    model_type: str = ""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """Build from a parsed HF ``config.json``.

        Raises:
            ValueError: a required field is missing.
        """
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"HF config.json lacks {missing}; point --hf-model at a Qwen2/Qwen3/Llama checkpoint")
        model_type = str(cfg.get("model_type", ""))
        heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            # HF's PretrainedConfig default is True; every shipped Qwen/Llama config states it explicitly.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            # transformers 5 writes num_experts as num_local_experts
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            if model_type == "qwen3_moe"
            else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if model_type == "qwen3_moe" else 0,
            model_type=model_type,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelShape:
        """Build from ``<path>/config.json`` (a HF checkpoint directory)."""
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))

    def replicated_layer_params(self) -> int:
        """Parameters of one layer that tensor parallelism replicates (norms, row-parallel biases)."""
        h = self.hidden_size
        return 2 * h + 2 * self.head_dim * self.qk_norm + h * self.o_bias + h * self.mlp_bias

    def expert_layer_params(self) -> int:
        """Parameters of one layer's experts (0 for a dense model); expert parallelism splits them."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, the SwiGLU MLP or the router and experts, both RMSNorms)."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        if self.num_experts:
            mlp = h * self.num_experts + self.expert_layer_params()  # router + experts
        else:
            mlp = 3 * h * f + (2 * f if self.mlp_bias else 0)
        return attn + mlp + self.replicated_layer_params()

    def embedding_params(self) -> int:
        """Parameters of the input word embedding ``[V, h]``."""
        return self.vocab_size * self.hidden_size

    def output_layer_params(self) -> int:
        """Parameters of a separate output layer (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """Exact parameter count, equal to ``sum(p.numel() for p in hf_model.parameters())``."""
        layers = self.num_hidden_layers * self.layer_params()
        return layers + self.embedding_params() + self.output_layer_params() + self.hidden_size  # + final norm


@dataclass(kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one pipeline stage, GiB. ``total_gb`` sums every ``*_gb`` field."""

    stage: str
    """``only`` (PP=1), ``first`` or ``last``."""
    params_per_gpu: int
    weights_gb: float
    reference_gb: float
    critic_gb: float = 0.0
    """PPO's critic: its weights, fp32 main params and grads and Adam state (0 without --loss ppo)."""
    main_params_gb: float
    grads_gb: float
    adam_gb: float
    fp8_cache_gb: float
    activations_gb: float
    recompute_gb: float
    logits_gb: float
    overhead_gb: float
    in_flight_micro_batches: float

    @property
    def total_gb(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name.endswith("_gb"))


@dataclass(kw_only=True)
class RunPlan:
    """A validated layout with its batch arithmetic and the memory of the most loaded stage (GiB)."""

    shape: ModelShape
    world_size: int
    tp: int
    pp: int
    vpp: int | None
    dp: int
    ep: int = 1
    """Expert parallelism (MoE): each rank holds 1 / EP of every layer's experts."""
    sequence_parallel: bool
    bf16: bool
    fp8: str | None
    use_distributed_optimizer: bool
    recompute_activations: bool
    reference_on_gpu: bool
    critic_shape: ModelShape | None = None
    """PPO's critic (``--loss ppo``; from ``--critic-hf-model``, else the actor's shape), or None."""
    num_engines: int
    rollout_tp: int
    responses_per_step: int
    optimizer_steps_per_step: int
    prompts_per_dp_rank_per_minibatch: int
    responses_per_dp_rank_per_minibatch: int
    micro_batches_per_minibatch: int
    """Per DP rank; with a token budget the worst case (every sequence at full length)."""
    token_budget: bool
    sequence_packing: bool
    max_sequence_length: int
    tokens_per_micro_batch: int
    max_tokens_per_step: int
    gpu_memory_gb: float
    stages: list[MemoryEstimate] = field(default_factory=list)
    """The first and last pipeline stages (one entry when PP=1)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def memory(self) -> MemoryEstimate:
        """The most loaded stage."""
        return max(self.stages, key=lambda m: m.total_gb)

    def format(self) -> str:
        """A readable multi-section table for ``--dry-run``."""
        s, m = self.shape, self.memory
        vpp = self.vpp if self.vpp is not None else "-"
        mb_note = " (worst case: every sequence at full length)" if self.token_budget else ""
        layout = "packed rows" if self.sequence_packing else "padded rows"
        lines = [
            f"model: {s.model_type or '?'} {s.num_params() / 1e9:.2f}B params, {s.num_hidden_layers} layers, "
            f"hidden {s.hidden_size}, heads {s.num_attention_heads}/{s.num_key_value_heads} kv, vocab {s.vocab_size}",
            "",
            "== layout ==",
            f"  world size {self.world_size} = TP {self.tp} x PP {self.pp} x DP {self.dp}   VPP {vpp}   "
            f"sequence parallel {'on' if self.sequence_parallel else 'off'}"
            + (
                f"   EP {self.ep} ({s.num_experts // self.ep} of {s.num_experts} experts per rank)"
                if s.num_experts
                else ""
            ),
            f"  {'bf16' if self.bf16 else 'fp32'}{f' + fp8 {self.fp8}' if self.fp8 else ''}, "
            f"recompute {'full' if self.recompute_activations else 'off'}, "
            f"{'distributed' if self.use_distributed_optimizer else 'replicated'} optimizer",
            f"  rollout fleet: {self.num_engines} engines x TP {self.rollout_tp} = "
            f"{self.num_engines * self.rollout_tp} GPUs (separate Ray cluster), "
            f"{2 * s.num_params() / self.rollout_tp / GiB:.1f} GiB bf16 weights per GPU",
            "",
            "== batch arithmetic ==",
            f"  responses per step              {self.responses_per_step}",
            f"  optimizer steps per step        {self.optimizer_steps_per_step}",
            f"  prompts per DP rank/mini-batch  {self.prompts_per_dp_rank_per_minibatch} "
            f"({self.responses_per_dp_rank_per_minibatch} responses)",
            f"  micro-batches per mini-batch    {self.micro_batches_per_minibatch}{mb_note}",
            f"  tokens per micro-batch          {self.tokens_per_micro_batch} "
            f"(max sequence {self.max_sequence_length}; {layout})",
            f"  tokens per step (max)           {self.max_tokens_per_step}",
            "",
            f"== memory per GPU, GiB (most loaded stage: {m.stage}; {m.params_per_gpu / 1e9:.2f}B params) ==",
        ]
        rows = [
            ("weights", m.weights_gb),
            ("reference policy weights", m.reference_gb),
            ("critic (weights, main params, grads, Adam)", m.critic_gb),
            ("fp32 main params", m.main_params_gb),
            ("fp32 main grads", m.grads_gb),
            ("Adam m, v", m.adam_gb),
            ("fp8 weight caches", m.fp8_cache_gb),
            (f"activations ({m.in_flight_micro_batches:g} micro-batch(es) in flight)", m.activations_gb),
            ("recompute working set (one layer)", m.recompute_gb),
            ("logits shard + grad + log-prob chunks", m.logits_gb),
            ("overhead (CUDA context, NCCL, fragmentation)", m.overhead_gb),
        ]
        lines += [f"  {name:<46} {gb:8.2f}" for name, gb in rows if gb > 0]
        pct = 100 * m.total_gb / self.gpu_memory_gb
        lines.append(f"  {'total memory':<46} {m.total_gb:8.2f}  of {self.gpu_memory_gb:g} ({pct:.0f}%)")
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def _require(ok: bool, option: str, problem: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{option}: {problem}; {fix}")


def _in_flight(pp: int, vpp: int | None, rank: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at the 1F1B peak, in whole-stage units."""
    if vpp is None:
        return float(min(num_micro_batches, pp - rank))
    chunks = min(num_micro_batches * vpp, (pp - rank - 1) * 2 + (vpp - 1) * pp + 1)  # Megatron's interleaved warm-up
    return chunks / vpp


def _stage_params(plan: RunPlan, shape: ModelShape, rank: int, *, value_head: bool = False) -> tuple[float, float]:
    """``(parameters, their optimizer-sharded count)`` of one GPU of pipeline rank ``rank``; ``value_head``: the
    critic's model (a ``[1, h]`` head and a bias in place of the LM head, embeddings untied)."""
    tp, pp, h = plan.tp, plan.pp, shape.hidden_size
    rep, experts = shape.replicated_layer_params(), shape.expert_layer_params()  # experts: whole per TP rank, / EP
    layer_p = (shape.layer_params() - rep - experts) / tp + rep + experts / plan.ep
    layers = shape.num_hidden_layers // pp
    params = layers * layer_p
    expert_params = layers * experts / plan.ep
    if rank == 0:
        params += shape.embedding_params() / tp
    if rank == pp - 1 and value_head:
        params += h + h + 1  # final norm, the value head's weight and bias (replicated over TP)
    elif rank == pp - 1:  # with PP > 1 a tied output layer is a second copy of the embedding on the last stage
        params += h + (shape.output_layer_params() if pp == 1 else shape.vocab_size * h) / tp
    # the distributed optimizer shards dense parameters over DP and experts over the ranks holding the same ones
    shard, expert_shard = (plan.dp, plan.dp * tp // plan.ep) if plan.use_distributed_optimizer else (1, 1)
    return params, (params - expert_params) / shard + expert_params / expert_shard


def _trained_bytes(plan: RunPlan, params: float, sharded: float) -> float:
    """Weights, fp32 main params (bf16 runs), fp32 grads and Adam m, v of ``params`` (``sharded`` for the state
    the distributed optimizer splits)."""
    return (2 if plan.bf16 else 4) * params + (4 * sharded if plan.bf16 else 0.0) + 4 * params + 8 * sharded


def _stage_memory(plan: RunPlan, stage: str, rank: int) -> MemoryEstimate:
    """Memory of one GPU of pipeline rank ``rank``; see the module docstring for the accounting."""
    shape, tp, pp = plan.shape, plan.tp, plan.pp
    h, v_tp = shape.hidden_size, shape.vocab_size / tp
    layers = shape.num_hidden_layers // pp
    layer_p = (shape.layer_params() - shape.replicated_layer_params() - shape.expert_layer_params()) / tp
    layer_p += shape.replicated_layer_params() + shape.expert_layer_params() / plan.ep
    params, sharded = _stage_params(plan, shape, rank)
    critic = 0.0
    if plan.critic_shape is not None:
        critic = _trained_bytes(plan, *_stage_params(plan, plan.critic_shape, rank, value_head=True))
    wbytes = 2 if plan.bf16 else 4
    sbh = plan.tokens_per_micro_batch * h
    sp = plan.sequence_parallel or tp == 1
    full_layer = (34 * sbh / tp if sp else sbh * (10 + 24 / tp)) * wbytes / 2
    in_flight = _in_flight(pp, plan.vpp, rank, plan.micro_batches_per_minibatch)
    if plan.recompute_activations:
        activations, recompute = 2 * sbh / (tp if sp else 1) * wbytes / 2 * layers * in_flight, full_layer
    else:
        activations, recompute = full_layer * layers * in_flight, 0.0
    logits = 0.0
    if rank == pp - 1:
        logits = 2 * plan.tokens_per_micro_batch * v_tp * wbytes + 2 * LOGPROB_CHUNK_TOKENS * v_tp * 4
    return MemoryEstimate(
        stage=stage,
        params_per_gpu=round(params),
        weights_gb=wbytes * params / GiB,
        reference_gb=wbytes * params / GiB if plan.reference_on_gpu else 0.0,  # a frozen copy: no grads or state
        critic_gb=critic / GiB,
        main_params_gb=4 * sharded / GiB if plan.bf16 else 0.0,
        grads_gb=4 * params / GiB,
        adam_gb=8 * sharded / GiB,
        fp8_cache_gb=2 * layers * layer_p / GiB if plan.fp8 else 0.0,  # approx: fp8 weight + transpose per GEMM
        activations_gb=activations / GiB,
        recompute_gb=recompute / GiB,
        logits_gb=logits / GiB,
        overhead_gb=OVERHEAD_GB,
        in_flight_micro_batches=in_flight,
    )


def plan_run(
    shape: ModelShape,
    cfg: TrainConfig,
    *,
    world_size: int,
    gpu_memory_gb: float = 80.0,
    critic_shape: ModelShape | None = None,
) -> RunPlan:
    """Check a run's layout and batch arithmetic against the model and estimate its per-GPU memory.

    Runs ``cfg.validate(world_size, need_files=False)`` (TP x PP must divide the world size, a mini-batch must split
    over the DP ranks, FP8 needs Transformer Engine importable), then what only the model's shape tells: TP must
    divide the attention heads, KV heads and vocabulary, PP x VPP the layers, the rollout TP the attention heads,
    and interleaving needs at least PP micro-batches per mini-batch. Batch sizes count prompts except
    ``--micro-batch-size`` (responses per micro-batch, used without ``--max-tokens-per-microbatch``) and the token
    budget (tokens per packed micro-batch); a sequence is ``--max-prompt-length`` + ``--max-response-length`` tokens.

    Args:
        shape: The model.
        cfg: The run, as :func:`~megatron_pacs.config.parse_config` builds it (each section already checked).
        world_size: Training ranks to plan for (``--world-size``).
        gpu_memory_gb: The device memory the estimate is compared with.

    Returns:
        The plan; memory over 90% of ``gpu_memory_gb`` is a warning in ``RunPlan.warnings``, never an error.

    Raises:
        ValueError: an impossible layout or batch split, naming the flag and the fix.
    """
    _require(world_size >= 1, "--world-size", f"got {world_size}", "use a positive integer")
    dp = cfg.validate(world_size, need_files=False)
    par, b = cfg.parallel, cfg.batch
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    vpp, rollout_tp = par.virtual_pipeline_model_parallel_size, cfg.rollout.rollout_tensor_parallel_size
    for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        n = getattr(shape, name)
        _require(
            n % tp == 0,
            flag("tensor_model_parallel_size"),
            f"TP {tp} does not divide the model's {name}={n}",
            f"use a divisor of {n}",
        )
    _require(
        shape.num_hidden_layers % (pp * (vpp or 1)) == 0,
        flag("virtual_pipeline_model_parallel_size" if vpp else "pipeline_model_parallel_size"),
        f"PP {pp} x VPP {vpp or 1} does not divide num_hidden_layers={shape.num_hidden_layers}",
        "choose sizes whose product divides the number of layers",
    )
    ep = par.expert_model_parallel_size
    _require(
        shape.num_experts % ep == 0 if shape.num_experts else ep == 1,
        flag("expert_model_parallel_size"),
        f"EP {ep} with {shape.num_experts or 'no'} experts per layer",
        "use a divisor of the number of experts (1 for a dense model)",
    )
    _require(
        shape.num_attention_heads % rollout_tp == 0,
        flag("rollout_tensor_parallel_size"),
        f"{rollout_tp} does not divide num_attention_heads={shape.num_attention_heads}",
        "use a divisor",
    )

    seq_len = b.max_prompt_length + b.max_response_length
    budget = b.packing_budget if b.sequence_packing else b.max_tokens_per_microbatch
    prompts_per_rank = b.ppo_mini_batch_size // dp
    responses_per_rank = prompts_per_rank * b.group_size
    if budget is None:
        num_mb, tokens_mb = math.ceil(responses_per_rank / b.micro_batch_size), b.micro_batch_size * seq_len
    else:  # any greedy packer fits >= floor(budget / seq_len) sequences in every micro-batch but the last
        num_mb, tokens_mb = math.ceil(responses_per_rank / (budget // seq_len)), budget
    if vpp is not None and b.sequence_packing:  # packing rounds the count up to a multiple of PP when interleaved
        num_mb = math.ceil(num_mb / pp) * pp
    _require(
        vpp is None or budget is not None or num_mb >= pp,
        "--micro-batch-size",
        f"{num_mb} micro-batches per mini-batch, fewer than PP={pp} as interleaving requires",
        "use a smaller micro-batch, or drop interleaving",
    )

    plan = RunPlan(
        shape=shape,
        world_size=world_size,
        tp=tp,
        pp=pp,
        vpp=vpp,
        dp=dp,
        ep=par.expert_model_parallel_size,
        sequence_parallel=par.sequence_parallel,
        bf16=cfg.model.bf16,
        fp8=cfg.model.fp8_format,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
        recompute_activations=cfg.model.recompute_activations,
        reference_on_gpu=cfg.needs_reference and not cfg.reference.ref_offload,
        critic_shape=(critic_shape or shape) if cfg.loss.loss == "ppo" else None,
        num_engines=cfg.rollout.num_engines,
        rollout_tp=rollout_tp,
        responses_per_step=b.global_batch_size * b.group_size,
        optimizer_steps_per_step=b.global_batch_size // b.ppo_mini_batch_size * b.ppo_epochs,
        prompts_per_dp_rank_per_minibatch=prompts_per_rank,
        responses_per_dp_rank_per_minibatch=responses_per_rank,
        micro_batches_per_minibatch=num_mb,
        token_budget=budget is not None,
        sequence_packing=b.sequence_packing,
        max_sequence_length=seq_len,
        tokens_per_micro_batch=tokens_mb,
        max_tokens_per_step=b.global_batch_size * b.group_size * seq_len,
        gpu_memory_gb=gpu_memory_gb,
    )
    ranks = {"only": 0} if pp == 1 else {"first": 0, "last": pp - 1}
    plan.stages = [_stage_memory(plan, stage, rank) for stage, rank in ranks.items()]
    if plan.memory.total_gb > WARN_FRACTION * gpu_memory_gb:
        plan.warnings.append(
            f"estimated {plan.memory.total_gb:.1f} GiB exceeds {WARN_FRACTION:.0%} of {gpu_memory_gb:g} GiB: add "
            "--recompute-activations / --use-distributed-optimizer, raise TP or PP, or lower the micro-batch"
        )
    if pp > 1 and num_mb < pp:
        plan.warnings.append(f"{num_mb} micro-batches per mini-batch for PP={pp}: the pipeline bubble dominates")
    return plan


def dry_run(cfg: TrainConfig) -> int:
    """``--dry-run``: check the configuration for ``--world-size`` ranks and print the layout and memory plan.

    Reads only ``<--hf-model>/config.json``; the world size defaults to ``WORLD_SIZE`` (1 when unset).

    Raises:
        ValueError: the model directory has no ``config.json``, or :func:`plan_run` refuses the layout.
    """
    world = cfg.run.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if not Path(cfg.model.hf_model, "config.json").is_file():
        raise ValueError(f"--hf-model: {cfg.model.hf_model!r} has no config.json (the dry run needs the shapes)")
    critic = cfg.critic.critic_hf_model if cfg.loss.loss == "ppo" else None
    critic_shape = ModelShape.from_pretrained(critic) if critic else None
    shape = ModelShape.from_pretrained(cfg.model.hf_model)
    from megatron_pacs.compute_plan import format_compute  # it imports this module

    plan = plan_run(shape, cfg, world_size=world, critic_shape=critic_shape)
    print(plan.format())
    print(format_compute(plan, cfg))
    return 0
