"""The driver's teardown and dumps. ``Trainer.close`` neither hangs nor stops half-way: the real
close on a real rollout producer with a generation stuck in flight and a real reward pool, beside a fleet whose
shutdown fails (a fault injected in place of the Ray fleet, which this test does not start; the other tests close
real fleets)."""

import logging
import threading
import time
from types import SimpleNamespace

from megatron_pacs import trainer as trainer_module
from megatron_pacs.producer import RolloutProducer
from megatron_pacs.rewards import RewardScorer
from megatron_pacs.sources import FleetSource


class FleetWhoseShutdownFails:
    """Stopping the engines ends a generation stuck on them (``release``), then the shutdown itself fails."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def shutdown(self) -> None:
        self.release.set()
        raise RuntimeError("lost the connection to the Ray head")


def test_close_bounds_its_wait_and_a_failing_fleet_shutdown_skips_nothing(monkeypatch, caplog, tmp_path):
    from megatron_pacs.utils.stacks import StackDumps

    monkeypatch.setattr(trainer_module, "CLOSE_WAIT_S", 1.0)
    release = threading.Event()
    producer = RolloutProducer(lambda rows, step: release.wait(120))  # a generation that never returns by itself
    producer.submit([], 2, 1)
    scorer = RewardScorer(num_workers=1, timeout_s=5.0)
    assert scorer.score(["\\boxed{1}"], ["1"]).scores == [1.0]  # the pool's worker is running
    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)  # the teardown's state only, no models
    source = FleetSource.__new__(FleetSource)  # the fleet source's own close, without starting a fleet
    source.scorer = scorer
    trainer.producer, trainer.writer, trainer.source = producer, None, source
    trainer.fleet = FleetWhoseShutdownFails(release)
    trainer.exit_signal, trainer.heartbeat = None, None  # one process: no heartbeat
    # no save in flight: the checkpoints' wait returns at once, its bound read from the config
    trainer.cfg = SimpleNamespace(parallel=SimpleNamespace(distributed_timeout_minutes=1))
    trainer.checkpoints = SimpleNamespace(wait=lambda timeout: None)
    trainer.stacks = StackDumps(tmp_path / "stacks", rank=0)
    trainer.stacks.install()
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="megatron_pacs"):
        trainer.close()
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"close took {elapsed:.1f}s with a 1 s bound"
    assert "could not shut the fleet down" in caplog.text and "lost the connection" in caplog.text
    assert scorer._workers == []  # the reward pool was still stopped after the fleet's failure
    assert release.is_set() and producer.close(timeout=5.0)  # the stuck generation ended once the fleet stopped
    assert trainer.stacks._signum is None  # SIGUSR1 restored after the rest


def test_rollout_dumps_follow_the_flag(tmp_path):
    """``--no-dump-rollouts`` skips the per-step dump (about 45 MB per step at recipe scale)."""
    from megatron_pacs.config import parse_config
    from megatron_pacs.sources import StepRollouts, dump_rollouts

    rollouts = StepRollouts(None, [{"prompt": "p", "response": "r", "reward": 1.0}], {})  # type: ignore[arg-type]
    for argv, expected in (([], ["step_000003.jsonl"]), (["--no-dump-rollouts"], [])):
        log_dir = tmp_path / str(len(argv))
        dump_rollouts(parse_config([*argv, "--log-dir", str(log_dir)]).run, 3, rollouts)
        folder = log_dir / "rollouts"
        assert (sorted(p.name for p in folder.iterdir()) if folder.exists() else []) == expected
