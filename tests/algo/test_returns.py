"""Discounted step returns: any row order, exact recursion, long trajectories, malformed steps."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gigpo.algo.grouping import factorize
from megatron_gigpo.algo.oracle import oracle_step_returns
from megatron_gigpo.algo.returns import discounted_step_returns, episode_returns, trajectory_layout

pytestmark = pytest.mark.unit


def _returns(traj: list, steps: list, rewards: list, gamma: float) -> torch.Tensor:
    codes, _ = factorize(traj)
    return discounted_step_returns(codes, torch.tensor(steps, dtype=torch.int64),
                                   torch.tensor(rewards, dtype=torch.float64), gamma)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    gamma=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    data=st.data(),
)
def test_any_row_order_matches_literal_sum(lengths, gamma, data):
    traj = [f"t{i}" for i, n in enumerate(lengths) for _ in range(n)]
    steps = [s for n in lengths for s in range(n)]
    rewards = data.draw(st.lists(st.floats(-10, 10), min_size=len(traj), max_size=len(traj)))
    perm = data.draw(st.permutations(range(len(traj))))
    traj, steps, rewards = ([x[i] for i in perm] for x in (traj, steps, rewards))
    got = _returns(traj, steps, rewards, gamma)
    np.testing.assert_allclose(got.numpy(), oracle_step_returns(traj, steps, rewards, gamma), rtol=1e-12, atol=1e-12)


def test_gamma_edge_cases():
    traj, steps, rewards = ["a"] * 3, [0, 1, 2], [1.0, 2.0, 4.0]
    assert _returns(traj, steps, rewards, 0.0).tolist() == rewards
    assert _returns(traj, steps, rewards, 1.0).tolist() == [7.0, 6.0, 4.0]
    assert _returns(traj, steps, rewards, 0.5).tolist() == [3.0, 4.0, 4.0]


def test_long_trajectory_is_exact():
    # A gamma^-t rescaling would overflow here (0.6^-2000 > 1e443); the recursion does not.
    n = 2000
    rewards = np.random.default_rng(0).normal(size=n)
    got = _returns(["a"] * n, list(range(n))[::-1], rewards[::-1].tolist(), 0.6)
    ref = np.empty(n)
    acc = 0.0
    for t in range(n - 1, -1, -1):
        acc = rewards[t] + 0.6 * acc
        ref[t] = acc
    np.testing.assert_allclose(got.numpy()[::-1], ref, rtol=1e-12, atol=1e-12)


def test_episode_returns_sum_each_trajectory():
    codes, _ = factorize(["a", "b", "a"])
    got = episode_returns(codes, torch.tensor([1.0, 5.0, 2.0], dtype=torch.float64), 2)
    assert got.tolist() == [3.0, 5.0, 3.0]


def test_empty_batch():
    assert _returns([], [], [], 0.9).numel() == 0


@pytest.mark.parametrize(
    ("traj", "steps", "match"),
    [
        (["a", "a"], [0, 0], "step_index 0 more than once"),
        (["a", "a"], [0, 2], "has 2 rows but row 1 has step_index 2"),
        (["a"], [-1], "step_index must be >= 0"),
    ],
)
def test_malformed_steps(traj, steps, match):
    with pytest.raises(ValueError, match=match):
        _returns(traj, steps, [0.0] * len(traj), 0.9)


def test_bad_rewards():
    codes = torch.tensor([0, 0])
    steps = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="non-finite at rows \\[1\\]"):
        discounted_step_returns(codes, steps, torch.tensor([0.0, float("nan")], dtype=torch.float64), 0.9)
    with pytest.raises(ValueError, match="must be float64"):
        discounted_step_returns(codes, steps, torch.tensor([0.0, 1.0]), 0.9)
    with pytest.raises(ValueError, match="step_index must be \\(2,\\)"):
        discounted_step_returns(codes, torch.tensor([0]), torch.tensor([0.0, 1.0], dtype=torch.float64), 0.9)


def test_one_row_with_a_successor_is_discounted():
    # Exactly one row has a successor: trajectory "a" has two steps, "b" and "c" one each.
    got = _returns(["b", "a", "c", "a"], [0, 1, 0, 0], [5.0, 2.0, 7.0, 1.0], 0.5)
    assert got.tolist() == [5.0, 2.0, 7.0, 2.0]


def test_trajectory_layout_gives_lengths_and_successor_rows():
    traj_len, next_row = trajectory_layout(torch.tensor([0, 1, 0, 0]), torch.tensor([2, 0, 0, 1]))
    assert traj_len.tolist() == [3, 1] and next_row.tolist() == [-1, -1, 3, 0]
    assert traj_len.dtype == next_row.dtype == torch.int64


def test_trajectory_layout_of_no_rows_is_int64():
    traj_len, next_row = trajectory_layout(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert traj_len.shape == next_row.shape == (0,)
    assert traj_len.dtype == next_row.dtype == torch.int64


@pytest.mark.parametrize(
    ("traj", "steps", "match"),
    [
        ([0, 0], [0, -1], r"^step_index must be >= 0; row 1 is negative$"),
        ([0, 1, 1], [0, 0, 0], r"^trajectory 'b' has step_index 0 more than once \(row 1\)"),
    ],
)
def test_step_errors_name_the_first_bad_row(traj, steps, match):
    with pytest.raises(ValueError, match=match):
        trajectory_layout(torch.tensor(traj), torch.tensor(steps), ["a", "b"])


@pytest.mark.parametrize(
    ("rewards", "shape"), [(torch.tensor(1.0, dtype=torch.float64), "()"), (torch.zeros(2, 1, dtype=torch.float64), "(2, 1)")]
)
def test_rewards_not_1d_raise_value_error(rewards, shape):
    codes, steps = torch.tensor([0, 0]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=rf"^env_reward must be 1-D \(rows,\), got shape {re.escape(shape)}$"):
        discounted_step_returns(codes, steps, rewards, 0.9)


@pytest.mark.parametrize("name", ["traj_index", "step_index"])
def test_index_errors_name_the_index(name):
    good = dict(traj_index=torch.tensor([0, 0]), step_index=torch.tensor([0, 1]))
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{name} must be \(2,\) like env_reward, got shape \(1,\)$"):
        discounted_step_returns(**{**good, name: torch.tensor([0])}, rewards=rewards, gamma=0.9)
    with pytest.raises(ValueError, match=rf"^{name} must be int64, got torch.int32$"):
        discounted_step_returns(**{**good, name: good[name].to(torch.int32)}, rewards=rewards, gamma=0.9)


def test_non_finite_rewards_name_the_first_five_rows():
    rewards = torch.tensor([0.0] + [float("nan")] * 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"non-finite at rows \[1, 2, 3, 4, 5\]$"):
        discounted_step_returns(torch.zeros(7, dtype=torch.int64), torch.arange(7), rewards, 0.9)
