"""Environment worker pool: identical group resets across workers, failures that end episodes, not runs."""

from __future__ import annotations

import functools

import pytest

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.sokoban import SokobanEnv, load_tasks
from megatron_gigpo.episodes.collector import reset_seed
from megatron_gigpo.episodes.workers import EnvWorkerPool

pytestmark = pytest.mark.integration

SOKOBAN = functools.partial(SokobanEnv, dim_room=(6, 6), num_boxes=1, max_steps=10)
STEP_TEXT = "<think>try</think><action>up</action>"


def _group_requests(tasks: list[Task], group_size: int) -> list[tuple[Task, int]]:
    return [(t, reset_seed(0, t, g, 0, validation=True)) for g, t in enumerate(tasks) for _ in range(group_size)]


def test_group_members_identical_at_reset_across_workers(ray_local):
    import ray

    tasks = load_tasks("train", 2)
    pool = EnvWorkerPool(SOKOBAN, 2, num_cpus_per_worker=0.25, call_timeout_s=120)
    try:
        outcomes = pool.reset(_group_requests(tasks, 2))
        pids = [ray.get(pool.worker_handle(w).pid.remote()) for w in range(2)]
    finally:
        pool.close()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    # Round-robin placement puts the two members of every group on different worker processes.
    assert [pool.placement(i)[0] for i in range(4)] == [0, 1, 0, 1]
    assert pids[0] != pids[1]
    for g in range(2):
        a, b = outcomes[2 * g].result, outcomes[2 * g + 1].result
        assert a.observation.encode() == b.observation.encode()
        assert a.anchor == b.anchor and a.admissible_actions == b.admissible_actions
    assert outcomes[0].result.observation != outcomes[2].result.observation


def test_validation_resets_independent_of_worker_count(ray_local):
    tasks = load_tasks("val", 3)
    observations = []
    for num_workers in (1, 3):
        pool = EnvWorkerPool(SOKOBAN, num_workers, num_cpus_per_worker=0.25, call_timeout_s=120)
        try:
            outcomes = pool.reset(_group_requests(tasks, 1))
        finally:
            pool.close()
        observations.append([o.result.observation for o in outcomes])
    assert observations[0] == observations[1]


def test_env_exception_fails_only_its_episode(ray_local, tmp_path):
    from fault_envs import FaultySokoban

    factory = functools.partial(FaultySokoban, str(tmp_path / "fault"), "raise")
    pool = EnvWorkerPool(factory, 2, num_cpus_per_worker=0.25, call_timeout_s=120)
    try:
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
        outcomes = pool.step({i: STEP_TEXT for i in range(4)})
        failed = [i for i, o in outcomes.items() if not o.ok]
        assert len(failed) == 1
        assert "injected environment fault" in outcomes[failed[0]].error
        assert not outcomes[failed[0]].worker_died
        assert pool.worker_failures == 0
        # The broken slot gets a fresh environment at the next reset.
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
    finally:
        pool.close()


def test_dead_worker_fails_its_episodes_and_is_replaced(ray_local, tmp_path):
    from fault_envs import FaultySokoban

    factory = functools.partial(FaultySokoban, str(tmp_path / "fault"), "exit")
    pool = EnvWorkerPool(factory, 2, num_cpus_per_worker=0.25, call_timeout_s=120)
    try:
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
        outcomes = pool.step({i: STEP_TEXT for i in range(4)})
        failed = sorted(i for i, o in outcomes.items() if not o.ok)
        # Exactly the slots of one worker fail (worker w hosts environments w and w + 2).
        assert failed in ([0, 2], [1, 3])
        assert all(outcomes[i].worker_died for i in failed)
        assert pool.worker_failures == 1
        # The run goes on: the next reset replaces the dead worker and every environment works again.
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
        assert all(o.ok for o in pool.step({i: STEP_TEXT for i in range(4)}).values())
    finally:
        pool.close()


def test_environment_step_past_its_deadline_ends_only_its_episode(ray_local, tmp_path):
    """A step that sleeps for an hour fails its own episode at the 10 s deadline; the other slot of the same
    worker still steps, and the next reset replaces that worker (which ends the stray thread)."""
    import time

    import ray
    from fault_envs import FaultySokoban

    marker = tmp_path / "fault"
    factory = functools.partial(FaultySokoban, str(marker), "hang")
    # 10 s: the first reset of a worker builds its environments (imports gym) under the same deadline.
    pool = EnvWorkerPool(factory, 2, num_cpus_per_worker=0.25, call_timeout_s=10)
    try:
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
        pids = [ray.get(pool.worker_handle(w).pid.remote()) for w in range(2)]
        start = time.monotonic()
        outcomes = pool.step({i: STEP_TEXT for i in range(4)})
        waited = time.monotonic() - start
        failed = [i for i, o in outcomes.items() if not o.ok]
        assert len(failed) == 1, {i: o.error for i, o in outcomes.items()}
        late = outcomes[failed[0]]
        assert late.timed_out and not late.worker_died
        hung_pid = int(marker.read_text())
        worker, slot = pool.placement(failed[0])
        assert pids[worker] == hung_pid
        assert (f"environment step did not return within its deadline of 10 s" in late.error
                and f"in worker {worker}, slot {slot}, on node " in late.error and f"(pid {hung_pid})" in late.error)
        assert waited < 600  # the environment sleeps 3600 s: the pool did not wait for it
        assert (pool.env_timeouts, pool.worker_failures) == (1, 0)
        # Next collection: the worker that ran the late call is a fresh process; everything works again.
        assert all(o.ok for o in pool.reset(_group_requests(load_tasks("train", 2), 2)))
        assert ray.get(pool.worker_handle(worker).pid.remote()) != hung_pid
        assert ray.get(pool.worker_handle(1 - worker).pid.remote()) == pids[1 - worker]
        assert all(o.ok for o in pool.step({i: STEP_TEXT for i in range(4)}).values())
    finally:
        pool.close()


def test_pool_refuses_waiting_forever():
    with pytest.raises(ValueError, match="call_timeout_s must be a positive, finite number"):
        EnvWorkerPool(SOKOBAN, 1, num_cpus_per_worker=0.25, call_timeout_s=None)
