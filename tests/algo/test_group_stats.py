"""Leave-one-out baselines (RLOO) by hand, at the group sizes where their corner cases live: 1, 2 and 3.

Found by mutation testing (mutmut, issue #43): clamping ``n - 1`` at 2 instead of 1, or treating groups of two
like groups of one, passed every other test.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gigpo.algo.group_stats import row_leave_one_out, trajectory_leave_one_out

pytestmark = pytest.mark.unit


def test_row_leave_one_out_by_hand():
    values = torch.tensor([1.0, 3.0, 0.0, 3.0, 6.0, 4.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1, 1, 2])
    # x_i - mean of the others: group of two (1, 3), of three (0, 3, 6); a group of one keeps its value.
    expected = [1 - 3, 3 - 1, 0 - 4.5, 3 - 3, 6 - 1.5, 4.0]
    assert row_leave_one_out(values, group).tolist() == pytest.approx(expected)


def test_trajectory_leave_one_out_by_hand():
    # Group 0: trajectories 0 (two rows, mean 2) and 1 (one row, 5); group 1: trajectory 2 alone -> 0.
    values = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1])
    traj = torch.tensor([0, 0, 1, 2])
    expected = [1 - 5, 3 - 5, 5 - 2, 0.0]
    assert trajectory_leave_one_out(values, group, traj).tolist() == pytest.approx(expected)
