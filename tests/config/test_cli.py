"""Flags and configuration: every flag documented, bad flags and data refused before anything is built."""

import re
import subprocess
import sys

import pytest

from megatron_pacs.config import build_parser, parse_config


def test_help_documents_every_flag():
    parser = build_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 50
    assert all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    flags = {s for a in actions for s in a.option_strings}
    for megatron_flag in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--micro-batch-size",
        "--global-batch-size",
        "--lr",
        "--seq-length",
        "--bf16",
        "--fp8-format",
        "--use-distributed-optimizer",
        "--recompute-activations",
    ):
        assert megatron_flag in flags


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--group-size", "1"], "--group-size"),
        (["--global-batch-size", "10", "--ppo-mini-batch-size", "4"], "--ppo-mini-batch-size"),
        (["--loss", "a2c"], "--loss"),
        (["--pacs-advantage", "mean"], "--pacs-advantage"),
        (["--fp8-format", "e4m3"], "--fp8-format"),
        (["--sequence-parallel"], "--sequence-parallel"),
        (["--max-tokens-per-microbatch", "100"], "--max-tokens-per-microbatch"),
        (["--keep-groups-in-microbatch", "--micro-batch-size", "6"], "--micro-batch-size"),
        (["--val-n", "4"], "--val-n"),
        (["--temperature", "0"], "--temperature"),
        (["--kl-estimator", "k4"], "--kl-estimator"),
        (["--loss", "grpo", "--pacs-score-reference", "ref"], "--pacs-score-reference"),
        (["--pacs-score", "mean_logp", "--pacs-score-reference", "ref"], "--pacs-score-reference"),
        (["--ref-reset-interval", "-1"], "--ref-reset-interval"),
        (["--off-policy-steps", "2"], "--off-policy-steps"),
        (["--colocate", "--off-policy-steps", "1"], "--off-policy-steps"),
        (["--offload-optimizer-during-rollout"], "--offload-optimizer-during-rollout"),
        (["--off-policy-correction", "is"], "--off-policy-correction"),
        (["--tis-cap", "1"], "--tis-cap"),
        (["--off-policy-correction", "tis", "--tis-level", "token"], "--tis-level"),
        (["--loss", "grpo", "--off-policy-correction", "tis", "--tis-level", "geometric"], "--tis-level"),
        (["--tis-level", "sequence"], "--tis-level"),
        (["--max-logprob-diff", "0"], "--max-logprob-diff"),
        (["--lr", "-1e-6"], "--lr"),
        (["--fp8-score-precision", "fp16"], "--fp8-score-precision"),
        (["--first-last-layers-bf16"], "--first-last-layers-bf16"),
        (["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16"], "--first-last-layers-bf16"),
        # settings whose switch is off would be ignored: refused instead
        (["--fp8-recipe", "tensorwise"], "--fp8-recipe"),
        (["--fp8-score-precision", "bf16"], "--fp8-score-precision"),
        (["--bf16", "--fp8-format", "hybrid", "--num-layers-at-end-in-bf16", "2"], "--num-layers-at-end-in-bf16"),
        (["--tis-cap", "3"], "--tis-cap"),
        (["--kl-estimator", "k1"], "--kl-estimator"),
        (["--pacs-score-reference", "ref", "--no-ref-reset-optimizer"], "--no-ref-reset-optimizer"),
        (["--pacs-score-reference", "ref", "--ref-reset-lr-warmup-steps", "4"], "--ref-reset-lr-warmup-steps"),
        (["--ref-reset-lr-warmup-steps", "-1"], "--ref-reset-lr-warmup-steps"),
        # more flags a parsed config would ignore, and bad values, refused
        (["--save-interval", "5"], "--save-interval"),
        (["--keep-last", "3"], "--keep-last"),
        (["--save-hf"], "--save-hf"),
        (["--load-optional"], "--load-optional"),
        (["--val-temperature", "0.6"], "--val-temperature"),
        (["--val-n", "4", "--val-temperature", "0.6"], "--val-temperature"),
        (["--loss", "grpo", "--pacs-beta", "2"], "--pacs-beta"),
        (["--loss", "grpo", "--pacs-score", "mean_logp"], "--pacs-score"),
        (["--loss", "grpo", "--pacs-advantage", "grpo"], "--pacs-advantage"),
        (["--loss", "grpo", "--pacs-weights", "none"], "--pacs-weights"),
        (["--clip-ratio", "0.3"], "--clip-ratio"),
        (["--world-size", "8"], "--world-size"),
        (["--wandb-exp-name", "x"], "--wandb-exp-name"),
        (["--ray-address", "auto", "--ray-object-store-gb", "2"], "--ray-object-store-gb"),
        (["--top-k", "-2"], "--top-k"),
        # the Ray job's runtime_env: what Ray would refuse only once the fleet starts, after the model is built
        (["--ray-runtime-env", "env_vars=A"], "--ray-runtime-env"),
        (["--ray-runtime-env", '["pip"]'], "--ray-runtime-env"),
        (["--ray-runtime-env", '{"env_vars": {"OMP_NUM_THREADS": 1}}'], "--ray-runtime-env"),
        (["--ray-runtime-env", '{"env_vars": ["A=1"]}'], "--ray-runtime-env"),
        (["--ray-runtime-env", '{"py_executable": 3}'], "--ray-runtime-env"),
        (["--reward-max-chars", "-1"], "--reward-max-chars"),
        # multi-host flags
        (["--weight-sync", "object_store", "--weight-sync-address", "10.0.0.1"], "--weight-sync-address"),
        (["--exit-signal-grace-seconds", "30"], "--exit-signal-grace-seconds"),
        (["--exit-signal-handler", "--exit-signal-grace-seconds", "0"], "--exit-signal-grace-seconds"),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
        # heartbeats: 0 (off) or at least 2 s
        (["--heartbeat-timeout-seconds", "1"], "--heartbeat-timeout-seconds"),
        (["--heartbeat-timeout-seconds", "-5"], "--heartbeat-timeout-seconds"),
        (["--heartbeat-timeout-seconds", "nan"], "--heartbeat-timeout-seconds"),
        # seeds derive independent streams (numpy SeedSequence), which take non-negative entropy
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv, flag, capsys):
    """Each refusal is one usage line and the error (issue 53: argparse's 124-line usage block came first)."""
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err
    usage, error = err.splitlines()
    assert usage.startswith("usage: python -m megatron_pacs.train [-h] [--config FILE.yaml] [FLAGS ...]")
    assert error.startswith("python -m megatron_pacs.train: error: ")


def test_validate_checks_layout_and_files(tmp_path):
    cfg = parse_config(["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--ppo-mini-batch-size", "4"])
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        cfg.validate(3, need_files=False)
    with pytest.raises(ValueError, match="--ppo-mini-batch-size"):
        cfg.validate(16, need_files=False)  # DP = 8 does not divide 4 prompts
    assert cfg.validate(8, need_files=False) == 4
    with pytest.raises(ValueError, match="--hf-model"):
        cfg.validate(2)
    (tmp_path / "config.json").write_text("{}")
    cfg = parse_config(["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "nope.jsonl")])
    with pytest.raises(ValueError, match=r"--train-data: .*nope.jsonl does not exist"):
        cfg.validate(1)
    cfg = parse_config(
        ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "config.json"), "--eval-interval", "5"]
    )
    with pytest.raises(ValueError, match="--eval-interval"):
        cfg.validate(1)


def test_cross_section_refusals_before_anything_starts():
    """Flags that cannot work together, or have no effect, are refused naming the flag (never ignored)."""
    cases = [
        (["--ref-load", "/models/x"], "--ref-load: no reference policy is built"),
        (["--ref-reset-interval", "5"], "--ref-reset-interval: no reference policy is built"),
        (["--off-policy-correction", "tis", "--temperature", "0.7"], "--off-policy-correction: tis compares"),
        (
            [*("--bf16", "--fp8-format", "hybrid", "--fp8-score-precision", "bf16"), "--keep-groups-in-microbatch"],
            "--fp8-score-precision: bf16 scores with --keep-groups-in-microbatch",
        ),
    ]
    tis = ["--off-policy-correction", "tis"]
    cases.append(
        (
            [*tis, "--tis-level", "sequence", "--bf16", "--fp8-format", "hybrid", "--fp8-score-precision", "fp8"],
            "--off-policy-correction: a seq",
        )
    )
    cases.append(
        (["--colocate", "--offload-optimizer-during-rollout"], "--offload-optimizer-during-rollout: without --bf16")
    )
    for argv, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_config(argv).validate(1, need_files=False)
    parse_config(["--pacs-score-reference", "ref", "--ref-reset-interval", "5"]).validate(1, need_files=False)
    parse_config([*tis, "--tis-cap", "3"]).validate(1, need_files=False)
    parse_config(["--kl-coef", "0.1", "--kl-estimator", "k1"]).validate(1, need_files=False)
    reset = ["--pacs-score-reference", "ref", "--ref-reset-interval", "5", "--no-ref-reset-optimizer"]
    assert parse_config(reset).reference.ref_reset_optimizer is False
    parse_config(["--lr", "0"]).validate(1, need_files=False)  # a frozen-policy measurement run


def test_flags_that_apply_are_accepted():
    """The counterparts of the refusals above: each flag with the switch it needs."""
    parse_config(["--save", "c", "--save-interval", "5", "--keep-last", "3", "--save-hf"])
    parse_config(["--load", "c", "--load-optional"])
    parse_config(["--eval-interval", "5", "--val-temperature", "0.6", "--val-n", "4"])
    parse_config(["--loss", "grpo", "--clip-ratio", "0.3"])
    parse_config(["--pacs-beta", "2", "--pacs-weights", "none"])
    parse_config(["--dry-run", "--world-size", "8"])
    parse_config(["--wandb-project", "p", "--wandb-exp-name", "x", "--top-k", "20", "--reward-max-chars", "0"])
    assert parse_config(["--heartbeat-timeout-seconds", "0"]).run.heartbeat_timeout_seconds == 0  # off
    parse_config(["--heartbeat-timeout-seconds", "2.5"])
    env = '{"env_vars": {"HF_HOME": "/shared/hf"}, "py_executable": "/opt/py/bin/python"}'
    rollout = parse_config(["--ray-address", "ray://head:10001", "--ray-runtime-env", env]).rollout
    assert rollout.ray_runtime_env == {"env_vars": {"HF_HOME": "/shared/hf"}, "py_executable": "/opt/py/bin/python"}
    with pytest.raises(ValueError, match=r"--val-data: validation is off without --eval-interval"):
        parse_config(["--val-data", "v.jsonl"]).validate(1, need_files=False)


def _ckpt(root, step):
    folder = root / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "megatron_pacs.json").write_text("{}")
    return folder


def test_checkpoint_directories_checked_before_anything_starts(tmp_path):
    """a mistyped --load is refused (not a silent fresh start) unless --load-optional or it is --save's
    own directory (a requeued job's first start); --save over existing checkpoints needs --load pointing there."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    run, typo = tmp_path / "run", str(tmp_path / "rnu")

    def check(*argv):
        parse_config([*files, *argv]).validate(1)

    with pytest.raises(ValueError, match=r"--load: .*rnu' holds no complete checkpoint \(mistyped\?\)"):
        check("--load", typo)
    check("--load", typo, "--load-optional")
    check("--save", str(run), "--load", str(run))  # first start: nothing to resume yet
    _ckpt(run, 20)
    with pytest.raises(ValueError, match=r"--save: .*already holds checkpoints"):
        check("--save", str(run))
    with pytest.raises(ValueError, match=r"--save: .*already holds checkpoints"):
        check("--save", str(run), "--load", typo, "--load-optional")
    check("--save", str(run), "--load", str(run))
    check("--save", str(run), "--load", str(run / "iter_0000020"))  # a rollback
    check("--save", str(tmp_path / "other"), "--load", str(run / "iter_0000020"))  # a branch elsewhere
    with pytest.raises(ValueError, match=r"--load: .*holds no complete checkpoint"):
        check("--load", str(tmp_path))  # a directory, but no checkpoint in it


def test_engine_flags_the_machine_would_ignore_are_refused(tmp_path, monkeypatch):
    """--gpu-memory-utilization on CPU engines, --kv-cache-gb on GPU engines (simulated: the check reads
    ``_cuda_available``), and --no-keep-weights-for-restart with the object-store transport, which keeps the update
    anyway."""
    from megatron_pacs.config import train as train_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    monkeypatch.setattr(train_config, "_cuda_available", lambda: False)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization: applies to GPU engines"):
        parse_config([*files, "--gpu-memory-utilization", "0.7"]).validate(1)
    with pytest.raises(ValueError, match=r"--no-keep-weights-for-restart: the object-store transport keeps"):
        parse_config([*files, "--no-keep-weights-for-restart"]).validate(1)
    parse_config([*files, "--kv-cache-gb", "2"]).validate(1)
    monkeypatch.setattr(train_config, "_cuda_available", lambda: True)
    with pytest.raises(ValueError, match=r"--kv-cache-gb: sizes CPU engines' KV cache"):
        parse_config([*files, "--kv-cache-gb", "2"]).validate(1)
    with pytest.raises(ValueError, match=r"--no-keep-weights-for-restart"):
        parse_config([*files, "--weight-sync", "object_store", "--no-keep-weights-for-restart"]).validate(1)
    parse_config([*files, "--gpu-memory-utilization", "0.7", "--no-keep-weights-for-restart"]).validate(1)


def test_seq_length_beyond_the_models_positions_is_refused_before_any_model_loads(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    parse_config([*files, "--max-prompt-length", "256", "--max-response-length", "256"]).validate(1)
    cfg = parse_config([*files, "--max-prompt-length", "256", "--max-response-length", "512"])
    with pytest.raises(ValueError, match=r"--seq-length: 768 .*exceeds the model's max_position_embeddings 512"):
        cfg.validate(1)


def test_fp8_score_precision_auto_is_bf16_for_two_phase_pacs_and_fp8_where_a_term_comes_from_training():
    fp8 = ["--bf16", "--fp8-format", "hybrid"]
    assert parse_config([]).score_fp8 is False  # no FP8: nothing to choose
    assert parse_config(fp8).score_fp8 is False  # two-phase PACS: every score term from a bf16 pass
    assert parse_config([*fp8, "--loss", "grpo"]).score_fp8 is True  # the ratio's current term is the FP8 pass
    direct = [*fp8, "--keep-groups-in-microbatch", "--micro-batch-size", "8"]
    assert parse_config(direct).score_fp8 is True
    assert parse_config([*fp8, "--fp8-score-precision", "fp8"]).score_fp8 is True
    assert parse_config([*fp8, "--loss", "grpo", "--fp8-score-precision", "bf16"]).score_fp8 is False


def test_train_refuses_bad_data_before_building_anything(tmp_path):
    """The entry point exits 2 with the fix in the message, in about a second (no Megatron, Ray or vLLM)."""
    (tmp_path / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "megatron_pacs.train", "--hf-model", str(tmp_path), "--train-data", "missing.jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--train-data" in proc.stderr and "tools/prepare_data.py" in proc.stderr


def _leaf_fields(cls, prefix=""):
    """Every (dotted path, section class, field) of the config tree under ``cls``."""
    import dataclasses
    from typing import get_type_hints

    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f


def test_every_config_field_has_a_flag_and_a_docstring():
    """Walk the whole config tree: each field is reachable from exactly one flag and documented."""
    from megatron_pacs.config import TrainConfig, field_docs, flag

    parser = build_parser()
    flags = {s: a for a in parser._actions for s in a.option_strings}
    leaves = list(_leaf_fields(TrainConfig))
    assert len(leaves) > 60
    missing_flag = [path for path, _, f in leaves if flag(f.name) not in flags]
    missing_doc = [path for path, cls, f in leaves if not field_docs(cls).get(f.name)]
    assert not missing_flag, f"fields without a flag: {missing_flag}"
    assert not missing_doc, f"fields without a docstring: {missing_doc}"
    names = [f.name for _, _, f in leaves]
    assert len(names) == len(set(names)), "two sections declare the same field name (one flag for two fields)"
    for path, _, f in leaves:
        assert flags[flag(f.name)].dest == path, f"{flag(f.name)} sets {flags[flag(f.name)].dest}, not {path}"
    assert all(field_docs(TrainConfig).get(f) for f in ("model", "batch", "rollout", "run"))


def test_command_line_defaults_are_the_library_defaults():
    """One definition: the parser's defaults build exactly the config a library user gets from ``TrainConfig()``."""
    from megatron_pacs.config import TrainConfig

    assert parse_config([]) == TrainConfig()


def test_colocate_is_refused_before_anything_starts_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --colocate is allowed here")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    cfg = parse_config(["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl"), "--colocate"])
    with pytest.raises(ValueError, match=r"--colocate: .*needs CUDA"):
        cfg.validate(1)
    help_text = build_parser().format_help()
    assert "GPU only; refused on a machine without CUDA" in " ".join(help_text.split())


def test_logprob_impl_fused_is_refused_where_triton_cannot_run_and_chunked_always_works(tmp_path, monkeypatch):
    """--logprob-impl chunked is the escape hatch where Triton fails to compile; fused is refused before
    anything starts without CUDA (or TRITON_INTERPRET=1) and Triton, with the flag named. The GPU is simulated."""
    from megatron_pacs.config import train as train_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    from megatron_pacs.config import ModelConfig

    with pytest.raises(ValueError, match=r"--logprob-impl: 'triton': use one of \['auto', 'fused', 'chunked'\]"):
        ModelConfig(logprob_impl="triton")
    parse_config([*files, "--logprob-impl", "chunked"]).validate(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(train_config, "_cuda_available", lambda: False)
    fused = parse_config([*files, "--logprob-impl", "fused"])
    with pytest.raises(ValueError, match=r"--logprob-impl: the fused kernels need Triton and CUDA"):
        fused.validate(1)
    monkeypatch.setattr(train_config, "_cuda_available", lambda: True)
    monkeypatch.setattr(train_config, "_importable", lambda module: module == "triton")
    fused.validate(1)
    monkeypatch.setattr(train_config, "_importable", lambda module: False)
    with pytest.raises(ValueError, match=r"--logprob-impl: the fused kernels need Triton"):
        fused.validate(1)


def test_gpu_only_refusals_with_a_gpu_simulated(tmp_path, monkeypatch):
    """Refusals that depend on the GPU (mxfp8 before Blackwell; colocation and CUDA IPC beyond one node), checked
    on CPU by simulating what the checks read (Transformer Engine importable, CUDA present, the device's compute
    capability, torchrun's LOCAL_WORLD_SIZE): this machine has none of them."""
    from megatron_pacs.config import train as train_config

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    files = ["--hf-model", str(tmp_path), "--train-data", str(tmp_path / "train.jsonl")]
    monkeypatch.setattr(train_config, "_importable", lambda module: True)
    monkeypatch.setattr(train_config, "_cuda_available", lambda: True)
    monkeypatch.setattr(train_config, "_cuda_capability", lambda: (9, 0))  # Hopper
    mxfp8 = parse_config([*files, "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"])
    with pytest.raises(ValueError, match=r"--fp8-recipe: mxfp8 needs a Blackwell GPU"):
        mxfp8.validate(1)
    monkeypatch.setattr(train_config, "_cuda_capability", lambda: (10, 0))
    mxfp8.validate(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    colocated = parse_config([*files, "--colocate", "--global-batch-size", "16", "--ppo-mini-batch-size", "16"])
    colocated.validate(8)
    assert colocated.rollout.engine_memory_fraction == 0.5  # engines beside the trainer's state
    # fp32: the optimizer holds the parameters themselves, so offloading it would take the weights off the GPU
    offload = ["--colocate", "--offload-optimizer-during-rollout", "--global-batch-size", "16"]
    with pytest.raises(ValueError, match=r"--offload-optimizer-during-rollout: without --bf16"):
        parse_config([*files, *offload, "--ppo-mini-batch-size", "16"]).validate(8)
    parse_config([*files, *offload, "--ppo-mini-batch-size", "16", "--bf16"]).validate(8)
    with pytest.raises(ValueError, match=r"--colocate: weights reach the engines by CUDA IPC"):
        colocated.validate(16)
    beside = parse_config([*files, "--global-batch-size", "16", "--ppo-mini-batch-size", "16"])
    assert beside.rollout.engine_memory_fraction == 0.85  # engines on GPUs of their own


def test_a_reference_anchor_never_reset_is_warned_about():
    """--pacs-score-reference ref without --ref-reset-interval works, but the score measures all drift since the
    start and can grow without bound: a warning the trainer logs at start (its range is then logged every step)."""
    (warning,) = parse_config(["--pacs-score-reference", "ref"]).warnings()
    assert "--ref-reset-interval" in warning and "without bound" in warning
    assert parse_config(["--pacs-score-reference", "ref", "--ref-reset-interval", "5"]).warnings() == []
    assert parse_config([]).warnings() == []
    rewarm = ["--pacs-score-reference", "ref", "--ref-reset-interval", "5", "--ref-reset-lr-warmup-steps", "4"]
    assert parse_config(rewarm).reference.ref_reset_lr_warmup_steps == 4


def test_colocated_engines_are_one_engine_of_one_gpu_and_ipc_needs_colocation():
    """a colocated engine maps trainer rank 0's CUDA IPC handles, which only an engine on that GPU can;
    more engines or a TP > 1 engine would each get GPU 0's handle. ``--weight-sync ipc`` without ``--colocate``
    (engines on GPUs of their own) cannot map them either."""
    from megatron_pacs.config import RolloutConfig

    RolloutConfig(colocate=True)
    with pytest.raises(ValueError, match=r"--colocate: one engine of one GPU only \(got --num-engines 2"):
        RolloutConfig(colocate=True, num_engines=2)
    with pytest.raises(ValueError, match=r"--rollout-tensor-parallel-size 2\)"):
        RolloutConfig(colocate=True, rollout_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"--weight-sync: 'ipc' maps trainer rank 0's GPU memory"):
        RolloutConfig(weight_sync="ipc")
    RolloutConfig(weight_sync="ipc", colocate=True)
    with pytest.raises(ValueError, match=r"--engine-call-timeout-seconds: 0.0 must be > 0"):
        RolloutConfig(engine_call_timeout_seconds=0.0)
    assert RolloutConfig().keep_weights_for_restart is None  # resolved by the fleet: on for CPU, off for GPU engines
