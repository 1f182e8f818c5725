"""The rollout fleet (Ray-managed engines of a registered backend, vLLM by default) and how training rollouts are
sampled."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any

from megatron_pacs.config.base import bad, is_set, option

__all__ = ["RAY_CLIENT_GRACE_S", "RolloutConfig", "check_reconnect_window"]

RAY_CLIENT_GRACE_S = 30.0
"""Ray Client's default reconnect grace period (``RAY_CLIENT_RECONNECT_GRACE_PERIOD``): how long a lost head goes
unnoticed before ``--rollout-cluster-reconnect-seconds`` starts counting."""

# The names megatron_pacs/rollout/backends.py registers, spelled out so that config/ imports nothing of the package
# above it; tests/rollout/test_backends.py proves they agree.
ROLLOUT_BACKENDS = ("vllm",)

ENGINE_ARG_CHECKS = {"vllm": "megatron_pacs.rollout.vllm_backend.engine_args:check_engine_kwargs"}
"""Backend name -> ``"module:function"`` that refuses bad ``--rollout-engine-kwargs`` (a ``ValueError`` naming the
flag), imported by name when the flag is given: its module imports neither torch nor the backend's library."""

WEIGHT_SYNC = ("auto", "object_store", "broadcast", "ipc")
STALENESS_POLICIES = ("wait", "drop")

# --help groups (flags and fields keep their names)
_ENGINES, _SAMPLING, _SYNC = "engines", "sampling", "weight sync"
_CLUSTER, _SCHEDULING = "cluster and faults", "scheduling"


@dataclass(kw_only=True)
class RolloutConfig:
    """The engine fleet and sampling."""

    rollout_backend: str = option("vllm", choices=ROLLOUT_BACKENDS, group=_ENGINES)
    """The engines' inference backend, a name registered in megatron_pacs/rollout/backends.py (vllm: vLLM); the
    backend turns the settings below into its own engine arguments."""
    num_engines: int = option(1, group=_ENGINES)
    """Independent vLLM engines (data-parallel generation)."""
    rollout_tensor_parallel_size: int = option(1, group=_ENGINES)
    """GPUs per engine (vLLM tensor parallelism); 1 on CPU."""
    temperature: float = option(1.0, group=_SAMPLING)
    """Sampling temperature (also the temperature of the trainer's log-probs)."""
    top_p: float = option(1.0, group=_SAMPLING)
    """Nucleus sampling."""
    top_k: int = option(-1, group=_SAMPLING)
    """Top-k sampling; -1 = off."""
    rollout_dtype: str = option("auto", group=_ENGINES)
    """Engine dtype; auto: the trainer's (bfloat16 with --bf16, else float32)."""
    ray_address: str | None = option(None, group=_CLUSTER)
    """Existing Ray cluster for the fleet (auto, ray://host:10001, host:6379); default: a local one inside
    --log-dir."""
    ray_runtime_env: str | dict[str, Any] = field(default_factory=dict, metadata={"help_group": _CLUSTER})
    """The fleet's Ray job ``runtime_env``, one JSON object (e.g. '{"env_vars": {"HF_HOME": "/shared/hf"}}'), for
    the local Ray or the --ray-address cluster: the engines inherit it, their own variables on top (docs/cluster.md).
    ``env_vars`` maps names to strings; Ray checks the rest when the fleet starts."""
    ray_object_store_gb: float = option(0.5, group=_CLUSTER)
    """Object store of a locally started Ray, GiB (weight updates pass through it on CPU)."""
    colocate: bool = option(False, group=_ENGINES)
    """Engines share the trainer's GPUs, sleeping while it trains (GPU only; refused on a machine without CUDA)."""
    gpu_memory_utilization: float | None = option(None, group=_ENGINES)
    """GPU memory share per engine for weights and KV cache; default: 0.85 when the engines own their GPUs, 0.5 with
    --colocate (the trainer stays on the GPU while the engines generate). Set on one GPU without --colocate: one
    engine shares the trainer's GPU, both resident."""
    kv_cache_gb: float = option(1.0, group=_ENGINES)
    """CPU only: KV cache per engine, GiB (fractions too: vLLM's ``kv_cache_memory_bytes``; vLLM's own
    VLLM_CPU_KVCACHE_SPACE, whole GiB, wins where set)."""
    weight_sync: str = option("auto", choices=WEIGHT_SYNC, group=_SYNC)
    """How new weights reach the engines: object_store, broadcast (NCCL side group) or ipc (CUDA IPC, colocated);
    auto: object_store on CPU, ipc when colocated, else broadcast."""
    weight_sync_address: str | None = option(None, group=_SYNC)
    """With --weight-sync broadcast: the address (IP or host name) of trainer rank 0 that the engines connect to;
    default: this host's source address towards the engines' nodes (docs/training.md)."""
    weight_sync_bucket_mb: int = option(256, group=_SYNC)
    """Weight-sync bucket size in MiB."""
    keep_weights_for_restart: bool | None = option(None, group=_SYNC)
    """Keep a host copy of the last weight update in Ray's object store, so that a restarted engine is re-synced at
    once; default: on with CPU engines, off with GPU engines (a host copy of the whole model per step;
    docs/training.md)."""
    chunks_per_engine: int = option(4, group=_SCHEDULING)
    """Work units per engine per generate call: more balances better and loses less on a crash, fewer costs less
    RPC."""
    max_engine_restarts: int = option(3, group=_CLUSTER)
    """Engine restarts allowed within one fleet call (a generation, a weight sync, a sync probe, a sleep or wake-up)
    before the step fails."""
    engine_call_timeout_seconds: float = option(1800.0, group=_CLUSTER)
    """The longest one engine call may take (a generation chunk, a weight bucket, a probe, sleep or wake-up, an
    engine's start): an engine that has not answered by then is taken as hung, killed and restarted like a dead
    one. Raise it for very long generations per chunk (or raise --chunks-per-engine)."""
    rollout_cluster_reconnect_seconds: float = option(0.0, group=_CLUSTER)
    """With --ray-address ray://host:10001: when the rollout cluster's head is lost mid-run, wait up to this many
    seconds for it, then restart and re-sync the engines and repeat the call; 0: off (docs/training.md)."""
    off_policy_steps: int = option(0, group=_SCHEDULING)
    """0: generate, then train, every step (synchronous). 1: the engines generate step k+1's rollouts while the
    actor trains on step k's, so every step after the first trains on rollouts one update old (docs/algorithm.md
    §5.1)."""
    max_staleness: int | None = option(None, group=_SCHEDULING)
    """Asynchronous rollouts: the engines generate continuously across steps, and prompts are admitted so that every
    group is trained within this many weight updates of the weights that began it (pacing admission; 0: on-policy).
    None: --off-policy-steps decides (docs/algorithm.md §5.2)."""
    staleness_policy: str = option("wait", choices=STALENESS_POLICIES, group=_SCHEDULING)
    """With --max-staleness: a group still generating when it is due (it would exceed the budget) is waited for
    (wait) or dropped and counted in rollout/dropped_groups (drop)."""
    partial_rollouts: bool = option(False, group=_SCHEDULING)
    """With --max-staleness: a weight update does not wait for the responses being generated; they stop at a round's
    token boundary and continue under the new weights (every token records its weights' version)."""
    rollout_round_tokens: int = option(32, group=_SCHEDULING)
    """With --partial-rollouts: the tokens each response may grow by between two points where new prompts are
    admitted and weight updates land (smaller: updates land sooner, more engine calls)."""
    offload_optimizer_during_rollout: bool = option(False, group=_ENGINES)
    """With --colocate: move the optimizer state and gradient buffers to host memory while the engines generate
    (GPU only)."""
    rollout_engine_kwargs: str | dict[str, Any] = field(default_factory=dict, metadata={"help_group": _ENGINES})
    """Extra keyword arguments for every engine, one JSON object (e.g. '{"enforce_eager": true}'); with vLLM, any
    engine argument except those set from this project's own flags (each refused naming its flag), applied last
    (docs/training.md)."""
    max_logprob_diff: float | None = option(None, group=_SYNC)
    """Stop the run when the largest |engine - trainer| token log-prob exceeds this (weights not synced, a wrong
    tokenizer or dtype), on fresh rollouts and after every weight sync; None: report only (docs/algorithm.md §7.1)."""

    def __post_init__(self) -> None:
        for name in ("num_engines", "rollout_tensor_parallel_size", "weight_sync_bucket_mb", "chunks_per_engine"):
            if getattr(self, name) < 1:
                raise bad(name, f"{getattr(self, name)} must be >= 1")
        if self.max_engine_restarts < 0:
            raise bad("max_engine_restarts", "must be >= 0")
        if not self.engine_call_timeout_seconds > 0:
            raise bad("engine_call_timeout_seconds", f"{self.engine_call_timeout_seconds} must be > 0")
        if self.temperature <= 0:
            raise bad("temperature", "training rollouts must be sampled: use a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must lie in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", f"{self.top_k}: use -1 (off) or a number of tokens >= 1")
        if self.ray_address and is_set(self, "ray_object_store_gb"):
            raise bad("ray_object_store_gb", "sizes a locally started Ray; --ray-address uses the cluster's own")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must lie in (0, 1]")
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise bad("rollout_backend", f"{self.rollout_backend!r}: use one of {list(ROLLOUT_BACKENDS)}")
        if self.weight_sync not in WEIGHT_SYNC:
            raise bad("weight_sync", f"{self.weight_sync!r}: use one of {list(WEIGHT_SYNC)}")
        if self.weight_sync == "ipc" and not self.colocate:
            raise bad(
                "weight_sync",
                "'ipc' maps trainer rank 0's GPU memory, which only a colocated engine on that GPU can; add --colocate "
                "or use broadcast",
            )
        if self.weight_sync_address is not None and self.weight_sync in ("object_store", "ipc"):
            raise bad("weight_sync_address", f"only applies to --weight-sync broadcast, not {self.weight_sync!r}")
        if self.off_policy_steps not in (0, 1):
            raise bad("off_policy_steps", f"{self.off_policy_steps}: use 0 (synchronous) or 1 (one step off)")
        if self.colocate and self.off_policy_steps:
            raise bad(
                "off_policy_steps",
                "generation cannot overlap training when the engines share the trainer's GPUs (--colocate); use 0",
            )
        if self.colocate and (self.num_engines > 1 or self.rollout_tensor_parallel_size > 1):
            raise bad(
                "colocate",
                f"one engine of one GPU only (got --num-engines {self.num_engines}, --rollout-tensor-parallel-size "
                f"{self.rollout_tensor_parallel_size}): colocated weights arrive by CUDA IPC from trainer rank 0's "
                "GPU, which only an engine on that GPU can map; drop --colocate to run more or larger engines",
            )
        self._check_async()
        if self.offload_optimizer_during_rollout and not self.colocate:
            raise bad("offload_optimizer_during_rollout", "only frees memory for colocated engines; add --colocate")
        if self.max_logprob_diff is not None and not self.max_logprob_diff > 0:
            raise bad("max_logprob_diff", f"{self.max_logprob_diff} must be > 0")
        w = self.rollout_cluster_reconnect_seconds
        if w < 0:
            raise bad("rollout_cluster_reconnect_seconds", f"{w:g} must be >= 0 (0: off)")
        if w and not (self.ray_address or "").startswith("ray://"):
            raise bad(
                "rollout_cluster_reconnect_seconds",
                f"waits for a remote rollout cluster reached through Ray Client, not {self.ray_address!r}; pass "
                "--ray-address ray://<head>:10001 or drop this flag",
            )
        if w and self.off_policy_steps:
            raise bad(
                "rollout_cluster_reconnect_seconds",
                "cannot stop every rank alike yet when the head stays lost during a generation one step off (it "
                "fails in the middle of a step); use --off-policy-steps 0 with it",
            )
        if self.ray_object_store_gb <= 0 or self.kv_cache_gb <= 0:
            raise bad("ray_object_store_gb" if self.ray_object_store_gb <= 0 else "kv_cache_gb", "must be > 0")
        self.rollout_engine_kwargs = _json_object(self.rollout_engine_kwargs)
        self.ray_runtime_env = _runtime_env(self.ray_runtime_env)
        if self.rollout_engine_kwargs and self.rollout_backend in ENGINE_ARG_CHECKS:
            # the backend's own check module (standard library only: neither torch nor vLLM is imported)
            module, _, function = ENGINE_ARG_CHECKS[self.rollout_backend].partition(":")
            getattr(importlib.import_module(module), function)(self.rollout_engine_kwargs)

    def _check_async(self) -> None:
        """--max-staleness and the flags that only mean something with it, or cannot work beside it."""
        k = self.max_staleness
        if k is None:
            for name in ("staleness_policy", "partial_rollouts", "rollout_round_tokens"):
                if is_set(self, name):
                    raise bad(name, "only means something with --max-staleness K; add it or drop this")
            return
        if k < 0:
            raise bad("max_staleness", f"{k}: use 0 (on-policy) or a number of weight updates >= 1")
        if self.staleness_policy not in STALENESS_POLICIES:
            raise bad("staleness_policy", f"{self.staleness_policy!r}: use one of {list(STALENESS_POLICIES)}")
        if self.rollout_round_tokens < 1:
            raise bad("rollout_round_tokens", f"{self.rollout_round_tokens} must be >= 1")
        if is_set(self, "rollout_round_tokens") and not self.partial_rollouts:
            raise bad("rollout_round_tokens", "sizes the rounds of --partial-rollouts; add it or drop this")
        if self.off_policy_steps:
            raise bad(
                "off_policy_steps",
                f"--max-staleness {k} already schedules the rollouts (--max-staleness 1 is one step off); drop one",
            )
        if self.colocate:
            raise bad(
                "max_staleness",
                "asynchronous rollouts generate while the actor trains, and colocated engines sleep then "
                "(--colocate); drop one",
            )

    @property
    def engine_extra_kwargs(self) -> dict[str, Any]:
        """``--rollout-engine-kwargs`` as a dict (the field holds its JSON text until ``__post_init__`` parses it)."""
        return _json_object(self.rollout_engine_kwargs)

    @property
    def job_runtime_env(self) -> dict[str, Any]:
        """``--ray-runtime-env`` as a dict (the field holds its JSON text until ``__post_init__`` parses it)."""
        return _runtime_env(self.ray_runtime_env)

    @property
    def engine_memory_fraction(self) -> float:
        """``--gpu-memory-utilization``, or its default for the placement (see the field)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.5 if self.colocate else 0.85


def _json_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """``--rollout-engine-kwargs``'s value as a dict: JSON text (the command line) or a dict (Python).

    Raises:
        ValueError: naming the flag, for text that is not JSON, JSON that is not an object, or a key that is not a
            keyword name.
    """
    example = """pass one JSON object of engine arguments, e.g. '{"enforce_eager": true}'"""
    parsed = _parse_object("rollout_engine_kwargs", value, example)
    names = [k for k in parsed if not k.isidentifier()]
    if names:
        raise bad("rollout_engine_kwargs", f"{names} are not keyword names; {example}")
    return parsed


def _runtime_env(value: str | dict[str, Any]) -> dict[str, Any]:
    """``--ray-runtime-env``'s value as a dict, its ``env_vars`` and ``py_executable`` checked (what Ray would
    refuse only once the fleet starts, after the model is built).

    Raises:
        ValueError: naming the flag, for text that is not a JSON object, ``env_vars`` that is not an object of
            strings, or a ``py_executable`` that is not a string.
    """
    example = """pass one JSON object, e.g. '{"env_vars": {"HF_HOME": "/shared/hf"}}'"""
    parsed = _parse_object("ray_runtime_env", value, example)
    env_vars = parsed.get("env_vars", {})
    if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
        raise bad("ray_runtime_env", f"env_vars must map names to strings (quote numbers), got {env_vars!r}; {example}")
    if not isinstance(parsed.get("py_executable", ""), str):
        raise bad("ray_runtime_env", f"py_executable must be a string, got {parsed['py_executable']!r}")
    return parsed


def _parse_object(name: str, value: str | dict[str, Any], example: str) -> dict[str, Any]:
    """A JSON-object flag's value (JSON text from the command line, or a dict) as a dict with string keys."""
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad(name, f"{value!r} is not valid JSON ({exc.msg}, column {exc.colno}); {example}") from None
    if not isinstance(parsed, dict):
        raise bad(name, f"{value!r} is a JSON {type(parsed).__name__}, not an object; {example}")
    keys = [k for k in parsed if not isinstance(k, str)]
    if keys:
        raise bad(name, f"{keys} are not names; {example}")
    return dict(parsed)


def check_reconnect_window(rollout: RolloutConfig, distributed_timeout_minutes: int) -> None:
    """``--rollout-cluster-reconnect-seconds`` against ``--distributed-timeout-minutes``: while rank 0 waits for the
    head, the other ranks wait for its rollouts in a collective, which fails after that timeout (heartbeats do not
    bound it: every rank still beats). Ray Client's grace comes first, and the fleet's start, re-sync and the
    repeated generation after; they get the other half of the timeout.

    Raises:
        ValueError: naming both flags, when the window cannot fit.
    """
    import os

    window = rollout.rollout_cluster_reconnect_seconds
    grace = float(os.environ.get("RAY_CLIENT_RECONNECT_GRACE_PERIOD", RAY_CLIENT_GRACE_S))
    limit = distributed_timeout_minutes * 60 / 2
    if window and window + grace > limit:
        raise bad(
            "rollout_cluster_reconnect_seconds",
            f"{window:g} s + Ray Client's {grace:g} s grace exceeds half of --distributed-timeout-minutes "
            f"{distributed_timeout_minutes} ({limit:g} s): the other ranks' wait for rank 0's rollouts would time out "
            f"first; lower it to at most {max(0.0, limit - grace):g} or raise --distributed-timeout-minutes to "
            f"{int(-(-2 * (window + grace) // 60))}",
        )
