"""Group statistics at their edges: input checks, exact zeros, the raw singleton rule, trajectory codes with
gaps and one-trajectory groups with uneven rows.

Found by mutation testing (mutmut, issue #43 item 3): each test pins a branch that the by-hand and oracle
tests did not reach (a centred value of exactly 1, an ``epsilon / unit`` that underflows, unused trajectory
codes, ``n <= 1`` vs ``n < 1``).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gigpo.algo.group_stats import (
    row_group_normalize,
    row_leave_one_out,
    trajectory_group_normalize,
    trajectory_leave_one_out,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


@pytest.mark.parametrize(
    "values, group, mode, singleton, message",
    [
        (torch.zeros(3), torch.zeros(3, dtype=torch.int64), "mean_norm", "zero", "float64, got torch.float32"),
        (torch.zeros(3, dtype=F64), torch.zeros(4, dtype=torch.int64), "mean_norm", "zero",
         r"values \(3,\) and group \(4,\) must be equal 1-D shapes"),
        (torch.zeros(2, 2, dtype=F64), torch.zeros(2, 2, dtype=torch.int64), "mean_norm", "zero",
         r"values \(2, 2\) and group \(2, 2\) must be equal 1-D shapes"),
        (torch.zeros(3, dtype=F64), torch.zeros(3, dtype=torch.int64), "std", "zero", "unknown mode 'std'"),
        (torch.zeros(3, dtype=F64), torch.zeros(3, dtype=torch.int64), "mean_norm", "one",
         "unknown singleton rule 'one'"),
    ],
)
def test_bad_inputs_are_value_errors_naming_the_problem(values, group, mode, singleton, message):
    with pytest.raises(ValueError, match=message):
        row_group_normalize(values, group, mode=mode, epsilon=1e-6, singleton=singleton)


def test_a_centred_value_of_exactly_one_keeps_its_advantage():
    # Scaled units are the input's here (largest magnitude 0.75 < 1); the last value's centred value is 1.0.
    values = _t([-0.5, -0.5, -0.5, -0.5, 0.75])
    out = row_group_normalize(values, torch.zeros(5, dtype=torch.int64), mode="mean_std_norm", epsilon=0.0,
                              singleton="zero")
    expected = (values - values.mean()) / values.std()
    assert out.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert out[-1].item() == pytest.approx(1.0 / math.sqrt(1.25 / 4), rel=1e-12)


def test_equal_huge_values_stay_exactly_zero_when_epsilon_over_unit_underflows():
    # Group 0: 1e300 twice (unit 2^997, so 1e-30 / unit underflows to 0 and the std is 0): exactly 0, no 0 / 0.
    values = _t([1e300, 1e300, 3.0, 5.0])
    group = torch.tensor([0, 0, 1, 1])
    out = row_group_normalize(values, group, mode="mean_std_norm", epsilon=1e-30, singleton="zero")
    assert out[:2].tolist() == [0.0, 0.0]
    assert out[2:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-12)


@pytest.mark.parametrize(
    "mode, singleton, expected",
    [
        ("mean_std_norm", "raw", [3.0 / 1.5, -0.5 / (math.sqrt(0.5) + 0.5), 0.5 / (math.sqrt(0.5) + 0.5)]),
        ("mean_norm", "raw", [3.0, -0.5, 0.5]),
        ("mean_std_norm", "zero", [0.0, -0.5 / (math.sqrt(0.5) + 0.5), 0.5 / (math.sqrt(0.5) + 0.5)]),
        ("mean_norm", "zero", [0.0, -0.5, 0.5]),
    ],
)
def test_singleton_rules_by_hand(mode, singleton, expected):
    # Group 0 is one sample (3.0): "raw" gives 3 / (1 + eps) under mean_std_norm and 3 under mean_norm.
    out = row_group_normalize(_t([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]), mode=mode, epsilon=0.5,
                              singleton=singleton)
    assert out.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_unused_trajectory_codes_change_nothing(mode):
    # Codes 1 and 4 have no rows: they belong to no group (not to group 1, not to any count).
    values, group = _t([1.0, 3.0, 5.0, 7.0]), torch.tensor([0, 0, 1, 1])
    dense, gappy = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 3, 5])
    ref = trajectory_group_normalize(values, group, dense, mode=mode, epsilon=0.0)
    assert ref.tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0] if mode == "mean_norm" else [-0.5**0.5, 0.5**0.5] * 2)
    assert trajectory_group_normalize(values, group, gappy, mode=mode, epsilon=0.0).tolist() == ref.tolist()
    assert trajectory_leave_one_out(values, group, gappy).tolist() == [-2.0, 2.0, -2.0, 2.0]


def test_one_trajectory_with_uneven_rows_gets_zero():
    # One trajectory (rows 1 and 3) is the whole group: no other trajectory, so no baseline and no signal.
    values, group, traj = _t([1.0, 3.0]), torch.tensor([0, 0]), torch.tensor([0, 0])
    assert trajectory_leave_one_out(values, group, traj).tolist() == [0.0, 0.0]
    for mode in ("mean_norm", "mean_std_norm"):
        assert trajectory_group_normalize(values, group, traj, mode=mode, epsilon=1e-6).tolist() == [0.0, 0.0]
    assert row_leave_one_out(values, group).tolist() == [-2.0, 2.0]  # rows are samples there
