"""The engine contract: every registered backend against both protocols, read with ``inspect`` (no engine starts).

- Each method of :class:`RolloutEngine` and :class:`FleetEngine` exists on the backend's class with the protocol's
  parameters (names, kinds, order, defaults; extra parameters only with defaults) and is a classmethod where the
  protocol's is; the types are pyright's (the static assertions at the end of each backend module).
- The backend's ``engine_kwargs`` are keywords its constructor takes; the vLLM backend's are the fleet's former ones.
- The fleet names every engine call by a :class:`FleetEngine` method (no string literal), so a rename is caught.
- An unknown backend name is refused naming ``--rollout-backend`` and the choices; the registry and the config
  import no torch, Ray or vLLM.
"""

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_pacs.config import RolloutConfig
from megatron_pacs.rollout.backends import BACKENDS, backend_class
from megatron_pacs.rollout.types import FleetEngine, RolloutEngine

FLEET = Path(__file__).resolve().parents[2] / "megatron_pacs" / "rollout" / "fleet"


def _methods(protocol: type) -> list[str]:
    return [
        n for n, v in vars(protocol).items() if not n.startswith("_") and isinstance(v, classmethod | type(_methods))
    ]


def _check_signature(name: str, protocol: type, backend: type) -> None:
    """``backend.name`` accepts every call the protocol's ``name`` allows, spelled the same way."""
    assert hasattr(backend, name), f"{backend.__name__} lacks {protocol.__name__}.{name}"
    want_cm = isinstance(inspect.getattr_static(protocol, name), classmethod)
    got_cm = isinstance(inspect.getattr_static(backend, name), classmethod)
    assert want_cm == got_cm, f"{backend.__name__}.{name}: classmethod in the protocol: {want_cm}, here: {got_cm}"
    want = list(inspect.signature(getattr(protocol, name)).parameters.values())
    got = list(inspect.signature(getattr(backend, name)).parameters.values())
    where = f"{backend.__name__}.{name}{inspect.signature(getattr(backend, name))} against {protocol.__name__}"
    assert [(p.name, p.kind) for p in got[: len(want)]] == [(p.name, p.kind) for p in want], where
    for w, g in zip(want, got, strict=False):
        assert (w.default is inspect.Parameter.empty) == (g.default is inspect.Parameter.empty), where
        if w.default is not inspect.Parameter.empty:
            assert w.default == g.default, where
    extra = [p for p in got[len(want) :] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert all(p.default is not p.empty for p in extra), f"{where}: extra parameters need defaults"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_implements_both_protocols(name):
    backend = backend_class(name)
    assert inspect.isclass(backend) and backend.__module__.startswith("megatron_pacs.rollout.")
    for protocol in (RolloutEngine, FleetEngine):
        methods = _methods(protocol)
        assert methods, protocol
        for method in methods:
            _check_signature(method, protocol, backend)
    assert next(iter(inspect.signature(backend).parameters)) == "model"  # built as cls(model, **engine_kwargs)


def test_the_protocols_list_what_the_trainer_and_the_fleet_call():
    assert set(_methods(RolloutEngine)) == {"generate", "update_weights", "sleep", "wake_up", "shutdown"}
    assert set(_methods(FleetEngine)) == {
        *("engine_kwargs", "actor_env", "generate", "prompt_logprobs", "sleep", "wake_up", "shutdown"),
        *("begin_weight_update", "load_bucket", "init_broadcast_group", "receive_broadcast", "load_ipc"),
        "finish_weight_update",
    }


CONFIGS = [
    RolloutConfig(),
    RolloutConfig(colocate=True),
    RolloutConfig(rollout_tensor_parallel_size=2, gpu_memory_utilization=0.7, kv_cache_gb=2.0),
]


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "colocate", "tp2"])
def test_engine_kwargs_are_keywords_of_the_backend_constructor(name, on_gpu, config):
    backend = backend_class(name)
    kwargs = backend.engine_kwargs(config, dtype="float32", max_model_len=256, seed=3, on_gpu=on_gpu)
    inspect.signature(backend).bind("/models/m", **kwargs)
    env = backend.actor_env(on_gpu=on_gpu)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_vllm_backend_kwargs_and_actor_env_are_the_fleets_former_ones(monkeypatch):
    vllm = backend_class("vllm")
    base: dict[str, Any] = dict(dtype="float32", max_model_len=256, seed=3)
    cpu = vllm.engine_kwargs(RolloutConfig(), **base, on_gpu=False)
    assert cpu == dict(
        tensor_parallel_size=1, **base, gpu_memory_utilization=0.85, kv_cache_gb=1.0, enable_sleep_mode=False
    )
    colocated = vllm.engine_kwargs(RolloutConfig(colocate=True), **base, on_gpu=True)
    assert colocated["enable_sleep_mode"] is True and colocated["gpu_memory_utilization"] == 0.5
    assert "engine_kwargs" not in colocated
    tp2 = vllm.engine_kwargs(RolloutConfig(rollout_tensor_parallel_size=2), **base, on_gpu=True)
    assert tp2["tensor_parallel_size"] == 2 and tp2["engine_kwargs"] == {"distributed_executor_backend": "ray"}
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert vllm.actor_env(on_gpu=True) == {"VLLM_LOGGING_LEVEL": "WARNING"}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert vllm.actor_env(on_gpu=False) == {
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TORCH_COMPILE_DISABLE": "1",
    }


def _engine_calls(tree: ast.AST) -> list[ast.expr]:
    """The method-name argument of every ``<actor>.call.remote(...)`` and ``self._call_all(...)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            remote = f.attr == "remote" and isinstance(f.value, ast.Attribute) and f.value.attr == "call"
            if remote or f.attr == "_call_all":
                found.append(node.args[0])
    return found


def test_the_fleet_names_every_engine_call_by_a_fleet_engine_method():
    calls = []
    for path in sorted(FLEET.glob("*.py")):
        calls += [(path.name, arg) for arg in _engine_calls(ast.parse(path.read_text()))]
    named = set()
    for file, arg in calls:
        if file == "engines.py" and isinstance(arg, ast.Name) and arg.id == "method":
            continue  # _call_all's own forwarding
        method = arg.value if isinstance(arg, ast.Attribute) and arg.attr == "__name__" else None
        protocol = method.value if isinstance(method, ast.Attribute) else None
        ok = isinstance(protocol, ast.Name) and protocol.id == "FleetEngine"
        assert ok and isinstance(method, ast.Attribute), (
            f"{file}:{arg.lineno}: name the engine call as FleetEngine.<method>.__name__"
        )
        named.add(method.attr)
    assert named <= set(_methods(FleetEngine))
    assert len(named) >= 9, named  # the walk found the calls (generate, the update's, the probe, lifecycle)


def test_an_unknown_backend_is_refused_naming_the_flag_and_the_choices(capsys):
    from megatron_pacs.config import parse_config

    for refuse in (lambda: RolloutConfig(rollout_backend="sglang"), lambda: backend_class("sglang")):
        with pytest.raises(ValueError, match=r"--rollout-backend: .*'sglang'.*\['vllm'\]"):
            refuse()
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--rollout-backend", "sglang"])
    assert exit_info.value.code == 2 and "--rollout-backend" in capsys.readouterr().err
    assert parse_config([]).rollout.rollout_backend == "vllm"


def test_the_configs_backend_choices_are_the_registry_and_the_default_is_registered():
    """config/ spells the backend names and their engine-argument checks out (it imports nothing of the package
    above it); they must agree."""
    from megatron_pacs.config.rollout import ENGINE_ARG_CHECKS, ROLLOUT_BACKENDS
    from megatron_pacs.rollout.backends import DEFAULT_BACKEND

    assert sorted(ROLLOUT_BACKENDS) == sorted(BACKENDS)
    for name, target in ENGINE_ARG_CHECKS.items():  # every check names a backend and a function that exists
        module, _, function = target.partition(":")
        assert name in BACKENDS and callable(getattr(importlib.import_module(module), function))
    assert RolloutConfig().rollout_backend == DEFAULT_BACKEND


def test_the_registry_and_the_config_import_no_backend_library():
    code = (
        "import sys, megatron_pacs.rollout.backends, megatron_pacs.config\n"
        "print(sorted({'torch', 'ray', 'vllm'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for path in BACKENDS.values():
        module, _, cls = path.partition(":")
        assert module.startswith("megatron_pacs.rollout.") and cls.isidentifier(), path
