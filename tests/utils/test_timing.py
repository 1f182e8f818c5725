"""PhaseTimer: seconds per named phase, nested, reset on collect."""

import time

import pytest

from megatron_pacs.utils import timing
from megatron_pacs.utils.timing import PhaseTimer


def test_phase_timer_sums_nested_phases_and_resets(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])  # a manual clock
    timer = PhaseTimer()
    with timer.phase("step"):
        with timer.phase("generate"):
            now[0] += 2.0
        now[0] += 1.0
        with timer.phase("generate"):
            now[0] += 3.0
        with pytest.raises(RuntimeError):
            with timer.phase("train"):
                now[0] += 4.0
                raise RuntimeError
    assert timer.collect() == {"perf/time/step": 10.0, "perf/time/generate": 5.0, "perf/time/train": 4.0}
    assert timer.collect() == {}
    with timer.phase("x"):
        now[0] += 0.5
    assert timer.collect(prefix="t/") == {"t/x": 0.5}


def test_phase_timer_measures_wall_time():
    timer = PhaseTimer()
    with timer.phase("sleep"):
        time.sleep(0.05)
    assert 0.05 <= timer.collect()["perf/time/sleep"] < 5.0
