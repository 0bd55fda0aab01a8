"""Per-row returns of a batch of (trajectory, step) rows: discounted step returns and episode scores.

Rows may come in any order; each row carries its trajectory (an int64 code, see
:func:`megatron_gigpo.algo.grouping.factorize`) and its 0-based step index. Everything is float64 and
vectorised over rows; the only Python loop runs over time steps (at most the longest trajectory).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _name(traj_names: Sequence[Hashable] | None, code: int) -> str:
    return repr(traj_names[code]) if traj_names is not None else f"code {code}"


def _check_rows(traj_index: torch.Tensor, step_index: torch.Tensor, rewards: torch.Tensor) -> None:
    n = rewards.shape[0] if rewards.dim() == 1 else -1
    if rewards.dim() != 1:
        raise ValueError(f"env_reward must be 1-D (rows,), got shape {tuple(rewards.shape)}")
    if rewards.dtype != torch.float64:
        raise ValueError(f"env_reward must be float64, got {rewards.dtype}")
    for name, t in (("traj_index", traj_index), ("step_index", step_index)):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be ({n},) like env_reward, got shape {tuple(t.shape)}")
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:5].tolist()
        raise ValueError(f"env_reward must be finite; non-finite at rows {bad}")


def trajectory_layout(
    traj_index: torch.Tensor, step_index: torch.Tensor, traj_names: Sequence[Hashable] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that each trajectory's steps are exactly 0..len-1 and locate every row's successor.

    Args:
        traj_index: int64 (R,), trajectory code per row, values in [0, num_traj).
        step_index: int64 (R,), 0-based step within the trajectory.
        traj_names: optional trajectory id per code, only for error messages.
    Returns:
        ``(traj_len, next_row)``: int64 (num_traj,) number of rows per trajectory; int64 (R,) the row holding
        step ``t + 1`` of the same trajectory, or -1 for a trajectory's last step.
    Raises:
        ValueError: a negative step, a repeated (trajectory, step) pair, or a gap in a trajectory's steps.
    """
    num_rows = traj_index.shape[0]
    if num_rows == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=traj_index.device)
        return empty, empty
    if bool((step_index < 0).any()):
        raise ValueError(f"step_index must be >= 0; row {int(torch.nonzero(step_index < 0)[0])} is negative")
    traj_len = torch.bincount(traj_index)  # (num_traj,)
    bad = step_index >= traj_len[traj_index]
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"trajectory {_name(traj_names, int(traj_index[row]))} has {int(traj_len[traj_index[row]])} rows "
            f"but row {row} "
            f"has step_index {int(step_index[row])}: steps must be 0..len-1 without gaps or repeats"
        )
    # Counting-sort placement: trajectory-major slot of each row, O(rows).
    traj_start = torch.cumsum(traj_len, 0) - traj_len  # (num_traj,)
    slot = traj_start[traj_index] + step_index  # (R,)
    row_at_slot = torch.full((num_rows,), -1, dtype=torch.int64, device=traj_index.device)
    row_at_slot[slot] = torch.arange(num_rows, device=traj_index.device)
    if bool((row_at_slot < 0).any()):
        # A free slot means another slot was written twice: a repeated (trajectory, step) pair.
        counts = torch.bincount(slot, minlength=num_rows)
        row = int(torch.nonzero(counts[slot] > 1)[0])
        raise ValueError(
            f"trajectory {_name(traj_names, int(traj_index[row]))} has step_index {int(step_index[row])} "
            "more than once "
            f"(row {row}): steps must be 0..len-1 without gaps or repeats"
        )
    has_next = step_index + 1 < traj_len[traj_index]
    next_row = torch.where(has_next, row_at_slot[(slot + 1).clamp(max=num_rows - 1)], -1)  # (R,)
    return traj_len, next_row


def discounted_step_returns(
    traj_index: torch.Tensor,
    step_index: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    traj_names: Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """Discounted return from each step to the end of its trajectory.

    GiGPO (arXiv 2505.10978) Sec. 4.2: ``R_t^(i) = sum_{k >= 0} gamma^k r_{t+k}^(i)``, the return that the
    step-relative advantage compares within an anchor-state group. Computed by the backward recursion
    ``R_t = r_t + gamma R_{t+1}`` for all trajectories at once, one vectorised update (a gather and an
    ``index_add_``) per time step, so the cost is O(rows + max steps) and any ``gamma`` in [0, 1] is exact
    (no ``gamma^-t`` rescaling that would overflow on long trajectories).

    Args:
        traj_index: int64 (R,), trajectory code per row (rows in any order).
        step_index: int64 (R,), 0-based step within the trajectory; each trajectory must hold 0..len-1.
        rewards: float64 (R,), the environment reward of each step, finite.
        gamma: discount; exact for any value in [0, 1]. Its range is checked once, on the recipe field
            ``algorithm.gamma`` (:class:`megatron_gigpo.algo.config.AlgorithmConfig`), not here.
        traj_names: optional trajectory id per code, only for error messages.
    Returns:
        float64 (R,), aligned with the input rows.
    Raises:
        ValueError: shapes/dtypes disagree, non-finite rewards, or malformed steps.
    """
    _check_rows(traj_index, step_index, rewards)
    _, next_row = trajectory_layout(traj_index, step_index, traj_names)
    returns = rewards.clone()  # (R,)
    has_next = torch.nonzero(next_row >= 0).flatten()  # rows that are not their trajectory's last step
    if has_next.numel() == 0:
        return returns
    # Those rows, latest step first: a successor's return is final before any row reads it.
    steps = step_index[has_next]
    rows = has_next[torch.argsort(steps, descending=True, stable=True)]
    succ = next_row[rows]
    per_step = torch.bincount(steps).flip(0).tolist()  # rows per step, from the last step down
    pos = 0
    for count in per_step:
        if count:
            r, n = rows[pos : pos + count], succ[pos : pos + count]
            returns.index_add_(0, r, returns[n], alpha=gamma)  # R_t += gamma * R_{t+1}
            pos += count
    return returns


def episode_returns(traj_index: torch.Tensor, rewards: torch.Tensor, num_traj: int) -> torch.Tensor:
    """Undiscounted episode return ``R(tau) = sum_t r_t`` of each row's trajectory, repeated on its rows.

    GiGPO Sec. 4.1 uses the episode's total reward as ``R(tau_i)``; the reference implementation
    (verl-agent's episode reward manager) sums the step rewards of the trajectory the same way.

    Args:
        traj_index: int64 (R,), values in [0, num_traj).
        rewards: float64 (R,).
        num_traj: number of trajectory codes.
    Returns:
        float64 (R,).
    """
    totals = torch.zeros(num_traj, dtype=torch.float64, device=rewards.device)  # (num_traj,)
    totals.index_add_(0, traj_index, rewards)
    return totals[traj_index]
