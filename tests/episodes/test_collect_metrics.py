"""Collection metrics and the reset-seed rule."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_gigpo.envs.base import Task
from megatron_gigpo.episodes.collector import reset_seed, step_sampling
from megatron_gigpo.episodes.metrics import (
    EpisodeSummary,
    episode_metrics,
    no_effect_rate,
    row_metrics,
    step_group_metrics,
    step_group_sizes,
)
from megatron_gigpo.rollout.engine import SamplingConfig

pytestmark = pytest.mark.unit


def _episode(
    traj: str, task_type: str | None, won: bool, length: int, failed: bool = False, overflow: bool = False
) -> EpisodeSummary:
    return EpisodeSummary(
        traj_id=traj, uid=traj.split("-n")[0], task_id="t", task_type=task_type, length=length, won=won,
        episode_return=1.0 if won else 0.0, failed=failed, hit_step_limit=not won and not failed and not overflow,
        prompt_overflow=overflow,
    )


def test_step_groups_are_exact_per_uid_and_anchor():
    grid = np.zeros((3, 3), dtype=np.uint8)
    other = grid.copy()
    other[1, 1] = 4
    uids = ["a", "a", "a", "b", "a", "a"]
    anchors = ["room 1", "room 1", "room 2", "room 1", grid, grid.copy()]
    assert sorted(step_group_sizes(uids, anchors)) == [1, 1, 2, 2]
    # Same bytes but another dtype or shape is another state.
    assert sorted(step_group_sizes(["a"] * 3, [grid, grid.astype(np.int64), grid.reshape(1, 9)])) == [1, 1, 1]
    metrics = step_group_metrics(uids + ["a"], anchors + [other])
    assert metrics["step_group/count"] == 5
    assert metrics["step_group/hist_1"] == 3 and metrics["step_group/hist_2"] == 2
    assert metrics["step_group/singleton_row_frac"] == pytest.approx(3 / 7)
    with pytest.raises(TypeError, match="must be str or numpy.ndarray"):
        step_group_sizes(["a"], [3])


def test_no_effect_rate_compares_each_step_with_the_next_of_its_trajectory():
    grid = np.zeros((2, 2), dtype=np.uint8)
    moved = grid.copy()
    moved[0, 0] = 1
    # Rows out of order on purpose; b's last step and c's only step have no successor and are not counted.
    traj = ["a", "b", "a", "a", "b", "c"]
    step = [1, 0, 0, 2, 1, 0]
    anchors = ["s1", grid, "s1", "s2", moved, "s9"]
    # a: s1 -> s1 (no effect), s1 -> s2 (effect); b: grid -> moved (effect)
    assert no_effect_rate(traj, step, anchors) == {"action/no_effect_rate": pytest.approx(1 / 3)}
    assert no_effect_rate(["c"], [0], ["s"]) == {}
    with pytest.raises(ValueError, match="2 anchors"):
        no_effect_rate(["a"], [0], ["s", "t"])


def test_episode_metrics_per_task_type_exclude_failures():
    episodes = [
        _episode("g0-n0", "pick_and_place_simple", True, 3),
        _episode("g0-n1", "pick_and_place_simple", False, 10),
        _episode("g1-n0", "look_at_obj_in_light", True, 5),
        _episode("g1-n1", "look_at_obj_in_light", False, 2, failed=True),
    ]
    m = episode_metrics("alfworld", episodes)
    assert m["episode/alfworld/success_rate"] == pytest.approx(2 / 3)
    assert m["episode/alfworld/success_rate/pick_and_place_simple"] == 0.5
    assert m["episode/alfworld/success_rate/look_at_obj_in_light"] == 1.0
    assert m["episode/alfworld/count/look_at_obj_in_light"] == 1
    assert (m["episode/count"], m["episode/failed"]) == (3, 1)
    assert (m["episode/length_mean"], m["episode/length_max"]) == (6, 10)
    assert m["episode/step_limit_frac"] == pytest.approx(1 / 3)
    assert episode_metrics("sokoban", [_episode("g-n0", None, False, 1, failed=True)]) == {
        "episode/count": 0.0, "episode/failed": 1.0, "episode/prompt_overflow_rate": 0.0,
    }


def test_prompt_overflow_rate_counts_every_episode():
    episodes = [
        _episode("g0-n0", None, True, 3),
        _episode("g0-n1", None, False, 2, overflow=True),  # ended mid-episode: done, not won, rows kept
        _episode("g1-n0", None, False, 0, failed=True, overflow=True),  # overflow at step 0: a failed episode
        _episode("g1-n1", None, False, 0, failed=True, overflow=True),
    ]
    m = episode_metrics("alfworld", episodes)
    assert m["episode/prompt_overflow_rate"] == 0.75
    assert (m["episode/count"], m["episode/failed"]) == (2, 2)
    assert m["episode/alfworld/success_rate"] == 0.5 and m["episode/step_limit_frac"] == 0.0


def test_row_metrics():
    m = row_metrics([True, False, True, True], [10, 20, 30, 40], [5, 6, 7, 8], ["stop", "length", "stop", "stop"],
                    action_admissible=[False, False, True, True])
    # Penalised (format) and not admissible (executed, not penalised) are separate rates.
    assert m["action/invalid_rate"] == 0.25 and m["action/non_admissible_rate"] == 0.5
    assert m["response/clip_frac"] == 0.25
    assert m["prompt/length_max"] == 40 and m["response/length_mean"] == 6.5
    with pytest.raises(ValueError, match="3 action_admissible flags for 4 rows"):
        row_metrics([True] * 4, [1] * 4, [1] * 4, ["stop"] * 4, action_admissible=[True] * 3)


def test_reset_seeds_shared_by_group_and_deterministic():
    task = Task(env="sokoban", task_id="17", split="val")
    other = Task(env="sokoban", task_id="18", split="val")
    # Validation: depends on the task only (not on its position, the iteration or the worker layout).
    assert reset_seed(3, task, 0, 0, validation=True) == reset_seed(3, task, 5, 9, validation=True)
    assert reset_seed(3, task, 0, 0, validation=True) != reset_seed(3, other, 0, 0, validation=True)
    # Training: a fresh seed per iteration and group, reproducible from the base seed.
    train = {reset_seed(3, task, g, it, validation=False) for g in range(4) for it in range(4)}
    assert len(train) == 16
    assert all(0 <= s < 2**31 for s in train)
    # Reproducible across processes and Python versions: fixed values (the first 4 bytes of SHA-256 of
    # "val/3/17", "val/3/18", "train/3/2/1/17", little-endian, top bit cleared). Python's salted hash() would
    # give other values in every process.
    assert reset_seed(3, task, 0, 0, validation=True) == 1409738413
    assert reset_seed(3, other, 0, 0, validation=True) == 1034557869
    assert reset_seed(3, task, 1, 2, validation=False) == 1049791678


def test_step_sampling_seed_is_a_fixed_value():
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=7)
    # The first 4 bytes of SHA-256 of "train/7/0/3" / "val/7/0/3", little-endian, shifted right by 2.
    assert step_sampling(sampling, iteration=0, step=3, validation=False).seed == 366516508
    assert step_sampling(sampling, iteration=0, step=3, validation=True).seed == 933159912
    greedy = SamplingConfig.greedy(max_tokens=8)
    assert step_sampling(greedy, iteration=0, step=3, validation=False) is greedy
