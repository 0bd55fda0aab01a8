"""The asynchronous rollout producer (docs/async-rollout-design.md section 5, unit tests 1-5): admission, the
draining pause, the driver's group guard, dynamic sampling over the gated round, errors and stop.

The producer runs its real thread; its collect function is a stand-in written here (our code under test, no
library mock): each round runs a few "steps", and every step reads the producer's served version as an engine
reports the weights it sampled with, so a sync that lands inside a round gives a group two versions. A driver
loop (``_drive``) takes items, "trains" and "syncs" inside ``pause()`` as the driver does.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from megatron_gigpo.deadlines import DeadlineError
from megatron_gigpo.episodes.batch import TrainingBatch
from megatron_gigpo.episodes.collector import RolloutStopped
from megatron_gigpo.episodes.dynamic_sampling import collect_informative
from megatron_gigpo.run.async_rollout import AsyncRolloutError, RolloutProducer, check_groups

pytestmark = pytest.mark.unit

GROUPS = 2  # groups per round (the task cursor advances by this per round)


def _batch(rows: list[tuple[str, str, int, float]]) -> TrainingBatch:
    """Rows ``(uid, traj_id, weight_version, reward)``; one token of prompt and response each."""
    n = len(rows)
    return TrainingBatch(
        prompt_ids=[torch.tensor([1]) for _ in rows], response_ids=[torch.tensor([2]) for _ in rows],
        rollout_log_probs=[torch.tensor([-1.0]) for _ in rows], uid=[r[0] for r in rows],
        traj_id=[r[1] for r in rows], step_index=torch.zeros(n, dtype=torch.int64), anchor=["s"] * n,
        env_reward=torch.tensor([r[3] for r in rows], dtype=torch.float64), action_valid=torch.ones(n, dtype=torch.bool),
        extras={"weight_version": [r[2] for r in rows], "num_groups": len({r[0] for r in rows})},
    )


class StandInRollout:
    """``collect_item`` for the producer: ``rounds`` gated rounds per item, each of ``steps`` steps of
    ``step_s()`` seconds; every (group, member, step) row reports the served version read at that step.

    Attributes:
        started: item iteration -> served version when its first round started.
        round_log: ``(iteration, round, version at start, version at end)`` per round.
    """

    def __init__(self, steps: int = 3, step_s=lambda: 0.002, fail_at: int | None = None) -> None:
        self.steps, self.step_s, self.fail_at = steps, step_s, fail_at
        self.started: dict[int, int] = {}
        self.round_log: list[tuple[int, int, int, int]] = []
        self.in_round = threading.Event()  # set at a round's first step, cleared at its end

    def one_round(self, producer: RolloutProducer, iteration: int, k: int) -> tuple[TrainingBatch, dict]:
        with producer.gate() as start_version:
            self.started.setdefault(iteration, start_version)
            rows = []
            for step in range(self.steps):
                if why := producer.stopped():
                    raise RolloutStopped(why)
                self.in_round.set()
                version = producer.served_version
                time.sleep(self.step_s())
                for g in range(GROUPS):
                    uid = f"it{iteration}-r{k}-g{g}"
                    # even groups: the members' returns differ (informative); odd groups: equal
                    rows += [(uid, f"{uid}-n{m}", version, float(m * (g % 2 == 0))) for m in range(2)]
            self.round_log.append((iteration, k, start_version, producer.served_version))
            self.in_round.clear()
        return _batch(rows), {"timing/collect_s": 0.0}

    def __call__(self, iteration: int, cursor: int, producer: RolloutProducer):
        if iteration == self.fail_at:
            raise ValueError(f"stand-in failure at iteration {iteration}")
        batch, metrics = self.one_round(producer, iteration, 0)
        return batch, metrics, cursor + GROUPS


def _producer(collect, *, k: int = 1, start: int = 0, end: int = 8, **kw) -> RolloutProducer:
    kw = {"round_timeout_s": 5.0, "item_timeout_s": 5.0} | kw
    return RolloutProducer(collect, start_iteration=start, task_cursor=start * GROUPS, max_staleness=k,
                           end_iteration=end, **kw)


def _drive(producer: RolloutProducer, start: int, end: int, k: int, train_s, sync_s) -> list[dict]:
    """The driver's loop: take item ``it``, check its groups, "train", then sync and publish ``it + 1`` inside
    ``pause()``. Returns each iteration's guard metrics."""
    out = []
    for it in range(start, end):
        item = producer.take(it)
        assert item is not None and item.iteration == it
        assert item.cursor_after == (it + 1) * GROUPS
        out.append(check_groups(item.batch, it, k))
        time.sleep(train_s())
        with producer.pause():
            time.sleep(sync_s())
            producer.publish(it + 1)
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_admission_item_j_starts_at_version_j_minus_k_at_the_earliest(k):
    """Training-bound (an item takes ~6 ms, an update 20 ms): the producer runs ahead to its limit."""
    rollout = StandInRollout()
    producer = _producer(rollout, k=k)
    try:
        metrics = _drive(producer, 0, 8, k, train_s=lambda: 0.02, sync_s=lambda: 0.0)
    finally:
        producer.stop()
    assert all(rollout.started[j] >= j - k for j in range(8)), rollout.started
    # the producer did run ahead: else the bound was never approached and this test could not fail
    assert any(rollout.started[j] == j - k for j in range(k, 8)), rollout.started
    assert max(m["async/staleness_max"] for m in metrics) == k
    assert all(m["async/group_versions_max"] == 1 for m in metrics)
    assert producer.wait_metrics()["async/engine_wait_s"] > 0  # parked at admission


def test_pause_drains_the_round_in_flight():
    rollout = StandInRollout(steps=4, step_s=lambda: 0.05)
    producer = _producer(rollout, end=1)
    try:
        assert rollout.in_round.wait(5.0)  # mid-way through the first round
        with producer.pause():
            assert not rollout.in_round.is_set() and len(rollout.round_log) == 1
            producer.publish(1)
        item = producer.take(0)
    finally:
        producer.stop()
    assert set(item.batch.extras["weight_version"]) == {0}
    assert producer.wait_metrics()["async/drain_wait_s"] > 0.05


@pytest.mark.parametrize("k", [1, 2])
def test_no_group_spans_two_versions_with_random_durations(k):
    rng = random.Random(k)
    rollout = StandInRollout(steps=3, step_s=lambda: rng.uniform(0.0, 0.004))
    producer = _producer(rollout, k=k, end=20)
    try:
        metrics = _drive(producer, 0, 20, k, train_s=lambda: rng.uniform(0.0, 0.012),
                         sync_s=lambda: rng.uniform(0.0, 0.004))
    finally:
        producer.stop()
    assert all(start == end for _, _, start, end in rollout.round_log), rollout.round_log
    assert all(m["async/group_versions_max"] == 1 for m in metrics)
    assert all(m["async/staleness_max"] <= k for m in metrics)


def test_check_groups_names_a_mixed_group_and_a_too_stale_one():
    ok = _batch([("it5-g0", "t0", 4, 0.0), ("it5-g0", "t1", 4, 1.0), ("it5-g1", "t2", 5, 0.0)])
    assert check_groups(ok, 5, 1) == {"async/staleness_mean": 0.5, "async/staleness_max": 1.0,
                                      "async/group_versions_max": 1.0}
    mixed = _batch([("it5-g0", "t0", 4, 0.0), ("it5-g0", "t1", 5, 1.0)])
    with pytest.raises(AsyncRolloutError, match=r"group it5-g0 holds rows of policy versions \[4, 5\]"):
        check_groups(mixed, 5, 1)
    stale = _batch([("it5-g0", "t0", 5, 0.0), ("it5-g1", "t1", 3, 1.0)])
    with pytest.raises(AsyncRolloutError, match=r"group it5-g1 was sampled by policy version 3, 2 version\(s\) "
                                                r"behind .*\(rollout.asynchronous.max_staleness=1\)"):
        check_groups(stale, 5, 1)
    assert check_groups(stale, 5, 2)["async/staleness_max"] == 2.0
    assert check_groups(_batch([]), 5, 1) == {}


def test_dynamic_sampling_over_the_gated_round_keeps_one_version_per_group():
    rng = random.Random(3)
    rollout = StandInRollout(steps=3, step_s=lambda: rng.uniform(0.0, 0.004))

    def collect_item(iteration, cursor, producer):
        # half the groups of a round are informative: two rounds per item, which a sync may fall between
        batch, metrics = collect_informative(lambda k: rollout.one_round(producer, iteration, k), num_groups=GROUPS,
                                             criterion="episode_return", max_rounds=3, iteration=iteration + 1)
        return batch, metrics, cursor + GROUPS * int(metrics["dynamic_sampling/rounds"])

    producer = RolloutProducer(collect_item, start_iteration=0, task_cursor=0, max_staleness=1, end_iteration=12,
                               round_timeout_s=5.0, item_timeout_s=5.0)
    try:
        for it in range(12):
            item = producer.take(it)
            assert item.cursor_after == 2 * GROUPS * (it + 1)
            assert item.batch.extras["num_groups"] == GROUPS
            assert check_groups(item.batch, it, 1)["async/group_versions_max"] == 1
            time.sleep(rng.uniform(0.0, 0.01))
            with producer.pause():
                producer.publish(it + 1)
    finally:
        producer.stop()
    assert all(start == end for _, _, start, end in rollout.round_log)


def test_a_producer_failure_reaches_take_chained():
    producer = _producer(StandInRollout(fail_at=1), end=4)
    try:
        assert producer.take(0).iteration == 0  # queued before item 1 failed
        with pytest.raises(AsyncRolloutError, match="failed while collecting the batch of iteration 2") as err:
            producer.take(1)
        assert isinstance(err.value.__cause__, ValueError)
        with pytest.raises(AsyncRolloutError, match="ValueError: stand-in failure at iteration 1"):
            with producer.pause():
                pass
    finally:
        producer.stop()


def test_stop_names_the_dropped_items_and_take_returns_none(caplog):
    producer = _producer(StandInRollout(steps=2), k=2, end=8)
    assert producer.take(0).iteration == 0
    deadline = time.monotonic() + 5.0
    while producer.queued() != [1, 2] and time.monotonic() < deadline:  # k = 2: items 1 and 2, then admission
        time.sleep(0.005)
    with caplog.at_level(logging.WARNING, logger="megatron_gigpo.run.async_rollout"):
        assert producer.stop() == [1, 2]
    assert "batches of iteration(s) 2, 3 are dropped" in caplog.text
    assert producer.take(1) is None
    assert producer.stop() == []  # idempotent


def test_a_stop_request_ends_the_producer_mid_round_and_take_returns_none():
    request: list[str] = []
    rollout = StandInRollout(steps=1000, step_s=lambda: 0.002)
    producer = _producer(rollout, end=2, stop=lambda: request[0] if request else None)
    assert rollout.in_round.wait(5.0)
    request.append("SIGTERM")
    assert producer.take(0) is None
    assert producer.stop(timeout_s=5.0) == [0]


def test_waits_name_what_they_waited_for():
    release = threading.Event()

    def stuck(iteration, cursor, producer):
        with producer.gate():
            release.wait(5.0)
        raise RolloutStopped("released")

    producer = _producer(stuck, round_timeout_s=0.1, item_timeout_s=0.1)
    try:
        with pytest.raises(DeadlineError, match=r"batch of iteration 1: no answer after .* collecting iteration 1, "
                                                r"a round in flight"):
            producer.take(0)
        with pytest.raises(DeadlineError, match="the round in flight before a weight sync"):
            with producer.pause():
                pass
        with pytest.raises(AsyncRolloutError, match="only inside pause"):
            producer.publish(1)
    finally:
        release.set()
        producer.stop()
