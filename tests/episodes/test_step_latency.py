"""``env.step_latency_s``: every :meth:`EnvWorker.step` call waits that long before returning, once per call
(so a pool's workers wait in parallel); the setting defaults to 0 and is range-checked. The worker runs here in
this process (it is a plain class that the pool hosts as a Ray actor) on real Sokoban environments."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest

from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.envs.sokoban import SokobanEnv, load_tasks
from megatron_gigpo.episodes.collector import reset_seed
from megatron_gigpo.episodes.workers import EnvWorker, EnvWorkerPool

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "sokoban.yaml"
SOKOBAN = functools.partial(SokobanEnv, dim_room=(6, 6), num_boxes=1, max_steps=10)
STEP_TEXT = "<think>try</think><action>up</action>"


def _stepped_worker(latency_s: float, slots: int) -> tuple[EnvWorker, list[tuple[int, str]]]:
    worker = EnvWorker(SOKOBAN, 0, call_timeout_s=120, step_latency_s=latency_s)
    tasks = load_tasks("train", slots)
    outcomes = worker.reset([(s, t, reset_seed(0, t, s, 0, validation=False)) for s, t in enumerate(tasks)])
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    return worker, [(s, STEP_TEXT) for s in range(slots)]


def test_a_step_call_waits_the_latency_once(monkeypatch):
    """Three slots in one call: one wait of the latency, after the steps (their outcomes are unchanged)."""
    worker, requests = _stepped_worker(0.25, 3)
    sleeps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), real_sleep(s))[1])
    start = time.monotonic()
    outcomes = worker.step(requests)
    elapsed = time.monotonic() - start
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert sleeps == [0.25]
    assert elapsed >= 0.25  # time.sleep waits at least its argument


def test_no_latency_by_default(monkeypatch):
    worker, requests = _stepped_worker(0.0, 2)
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    assert all(o.ok for o in worker.step(requests))
    assert sleeps == []
    assert load_config(RECIPE).env.step_latency_s == 0.0


def test_the_setting_is_range_checked():
    assert load_config(RECIPE, ["env.step_latency_s=0.5"]).env.step_latency_s == 0.5
    with pytest.raises(ConfigError, match=r"env.step_latency_s=-1.0 must be >= 0"):
        load_config(RECIPE, ["env.step_latency_s=-1"])
    with pytest.raises(ValueError, match="step_latency_s must be a finite number of seconds >= 0, got -1"):
        EnvWorkerPool(SOKOBAN, 1, num_cpus_per_worker=0.1, call_timeout_s=10, step_latency_s=-1)
