"""The suite's hooks and shared fixtures: the ../shared data folder (optional), a locally built tokenizer, the
session's launch queue and the test order it needs. Helpers the test modules import live in tests/helpers/."""

import os
import subprocess
from concurrent.futures import Future
from pathlib import Path

import pytest
from launch_queue import LaunchQueue

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# One OpenMP thread per process unless the caller set a count: the suite runs several processes per core, and the
# launches it starts inherit this. Without it numpy's OpenBLAS starts a thread per core at its import, and a fork
# server with a second thread serves nothing (tests/zygote.py): each such launch ran as a plain subprocess.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; tests that use it skip in a user's fresh clone, and fail under CI
    (``CI=true``), as the virtual-cluster tests do (``netns_ok``, tests/cluster/cluster_fixtures.py)."""
    marker = SHARED_DATA / "math500.jsonl"
    if not marker.is_file():
        why = f"{marker} is absent (the evaluation sets live beside the checkout in development only)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the shared data sets are missing: {why}")
        pytest.skip(why)
    return SHARED_DATA


@pytest.fixture(scope="session", autouse=True)
def _fleet_engines_forked():
    """The pytest process's own local Ray clusters (the fleet tests', the evaluation tool's) get a job
    ``runtime_env`` whose engine actors are forked by an engine server (tests/zygote.py, ``engine_runtime_env``:
    vLLM imported once; an engine actor's start was ~8.5 CPU-s, ~6 of them importing vLLM). Ray still starts every
    worker and the child runs Ray's own worker program; a worker of another environment runs the real interpreter.
    ``MEGATRON_PACS_ZYGOTE=0`` turns it off."""
    import zygote

    try:
        import ray
    except ImportError:  # a machine without the fleet stack
        ray = None
    if ray is None or not zygote.enabled():
        yield
        return
    init = ray.init

    def init_with_forked_engines(*args, **kwargs):
        if not args and kwargs.get("address") is None and "runtime_env" not in kwargs:
            # waited for: an engine started before the server is up runs the real interpreter (~9 CPU-s, not ~2)
            runtime_env = zygote.engine_runtime_env(dict(os.environ), wait=True)
            if runtime_env is not None:
                kwargs["runtime_env"] = runtime_env
        return init(*args, **kwargs)

    ray.init = init_with_forked_engines
    try:
        yield
    finally:
        ray.init = init


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
            "test_streaming",
            "test_resume",
            "test_moe",
            "test_convert_checkpoint",
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
    idle). While the early tests run, the queue is in the background, three launches at a low CPU priority
    (tests/launch_queue.py): the heartbeat and Slurm timings are measured on a machine whose idle CPU goes to those
    launches."""
    launching = sorted((i for i in items if _launches(i)), key=lambda i: _LONGEST_FIRST.get(i.path.stem, 0))
    early = [i for i in items if _early(i)]
    items[:] = early + [i for i in items if not _launches(i) and not _early(i)] + launching


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
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test ends with the process environment it started with. Libraries write ``os.environ`` in-process as a
    side effect: ``ray.init`` sets ``PYTHONBREAKPOINT``, vLLM's CPU platform ``LD_PRELOAD`` and
    ``NUMEXPR_MAX_THREADS`` when an engine is configured, the engine module vLLM's own variables, torch's inductor
    a data-pointer variable. Kept, they reached every later launch, whose environment then depended on the tests
    that ran before it (a trainer launched after a vLLM test ran with tcmalloc preloaded), and each such
    environment cost a fork server of its own and a plain first launch (tests/zygote.py; a full run started 20
    servers, 13 with this). Megatron's model builder sets ``NVTE_*_ATTN`` too. Restored key by key, never
    cleared: the launch threads read the environment meanwhile."""
    before = dict(os.environ)
    yield
    for name in [n for n in os.environ if n not in before]:
        os.environ.pop(name, None)
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


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
    """The modules whose selected tests read their trainer launches (``LAUNCHES``), in the order pytest runs them;
    the queue starts with the first test. A module's fast tests alone (``make test-quick``) launch nothing: the
    quick run once ran three deselected MoE launches (82 s) before the one it waited for."""
    modules = []
    for item in session.items:
        module = getattr(item, "module", None)
        uses = {"launched", "launch_queue"} & set(getattr(item, "fixturenames", ()))
        if module is not None and hasattr(module, "LAUNCHES") and uses and module not in modules:
            modules.append(module)
    session.config.stash[_LAUNCHING] = modules
    if modules:
        # the fixture's closure read by pytest's setup (Function.fixturenames), extended after collection
        session.items[0].fixturenames.insert(0, "launch_queue")  # type: ignore[attr-defined]
    cluster = [i for i in session.items if i.path.parent.name == "cluster"]
    if any("jobs" in getattr(i, "fixturenames", ()) for i in cluster):
        # The Slurm tests' five jobs (tests/cluster/cluster_fixtures.py) start with the first cluster test and run
        # while the other cluster tests do: the Slurm tests, run after those, mostly read finished jobs (they waited
        # ~110 s for them at the end of the cluster tests).
        cluster[0].fixturenames.insert(0, "jobs")  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def launch_queue(request, tmp_path_factory):
    """Every selected module's launches, queued with the session's first test (tests/launch_queue.py); each
    module's ``prepare`` runs here, in the main thread, before its launches are queued."""
    # Imported here, in the main thread: the launch threads' zygote.popen reads the engines' actor environment, and a
    # first import of it in a launch thread raced a test's numpy ("partially initialized module 'numpy'").
    import megatron_pacs.rollout.vllm_backend.engine  # noqa: F401

    queue = LaunchQueue(workers=2)
    queue.background(True)  # until the first test outside tests/cluster/ (pytest_runtest_setup)
    request.config.stash[_QUEUE] = queue
    for module in request.config.stash.get(_LAUNCHING, []):
        root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
        queue.plan(
            module.__name__, module.prepare, module.LAUNCHES, root, getattr(module, "LIGHT_LAUNCHES", frozenset())
        )
    yield queue
    queue.close()


@pytest.fixture(scope="module")
def launched(launch_queue, request) -> dict[str, Future]:
    """The test module's launches (its ``LAUNCHES``) by name, queued for the session; a test reads its own."""
    return launch_queue.futures(request.module.__name__)


_STARTED = pytest.StashKey[float]()


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    session.config.stash[_STARTED] = time.monotonic()


def pytest_report_header(config: pytest.Config) -> str | None:
    """Says so at the start when the fork servers will serve nothing (tests/zygote.py: the suite runs ~1.5x slower)."""
    import zygote

    why = zygote.off_reason()
    return None if why is None else f"fork servers off: {why}; launches run as plain subprocesses (~1.5x slower)"


def _area(nodeid: str) -> str:
    """A test's area: its folder under tests/ (``cluster``, ``mcore``, ...), or its module for the top-level ones."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 else parts[-1].removesuffix(".py")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each area's seconds of set-up, call and tear-down (pytest_terminal_summary prints the slowest), and the
    lines the cluster tests print about their own phases (which pytest shows only for a failure)."""
    area = _area(report.nodeid)
    _SECONDS[area] = _SECONDS.get(area, 0.0) + report.duration
    if area == "cluster" and report.when == "call" and report.passed:
        name = report.nodeid.rsplit("::", 1)[-1]
        _PHASES.extend(f"{name[:60]}: {line.strip()}" for line in report.capstdout.splitlines() if line.strip())


_SECONDS: dict[str, float] = {}  # area -> seconds (the hook has no config at hand to stash them in)
_PHASES: list[str] = []  # the passed cluster tests' own timing lines


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The session's wall time and its five slowest areas; every trainer launch's wall seconds (two run at once,
    beside the in-process tests), and each module's total."""
    import time

    tr = terminalreporter
    started = config.stash.get(_STARTED, None)
    if started is not None and _SECONDS:
        tr.write_sep(
            "=", f"suite: {time.monotonic() - started:.0f} s; the five slowest areas (set-up, call, tear-down)"
        )
        for area, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:5]:
            tr.write_line(f"{seconds:8.1f}s  {area}")
    if _PHASES:  # e.g. how long a reconnect took: the cluster tests' times vary 2-4x between runs
        tr.write_sep("=", "the cluster tests' phases (their own lines)")
        for line in _PHASES:
            tr.write_line(line)
    queue = config.stash.get(_QUEUE, None)
    timings = queue.timings() if queue is not None else {}
    if not timings:
        return
    tr.write_sep("=", "trainer launches (wall seconds, two at a time; three in the background)")
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


@pytest.fixture(scope="module")
def single_rank_gloo():
    """A one-rank gloo process group with the CPU support applied, for a module's in-process Megatron checkpoints
    (``pytestmark = pytest.mark.usefixtures("single_rank_gloo")``); one already up is used as it is."""
    import socket

    import torch.distributed as dist

    from megatron_pacs.mcore.cpu_support import apply_cpu_support

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    apply_cpu_support()
    yield
    dist.destroy_process_group()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, for a disk that fills during a write (tests run as root in CI; elsewhere mounting may not be
    permitted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs as root and must mount a tmpfs: {proc.stderr.strip()}")
        pytest.skip(f"a full disk needs a small tmpfs, and mounting one is not permitted here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
