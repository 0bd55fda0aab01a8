"""GPU tier: the estimators and the Triton scatter kernel on CUDA against the CPU / torch reference.
Skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from algo_batches import random_rows

from megatron_gigpo.config import AlgorithmConfig
from megatron_gigpo.algo.advantages import compute_advantages
from megatron_gigpo.algo.returns import trajectory_layout
from megatron_gigpo.algo.scatter import scatter_advantages_packed, scatter_advantages_padded

pytestmark = pytest.mark.gpu


def _params(**kw) -> AlgorithmConfig:
    """The recipe's algorithm section; ``invalid_action_penalty_coef=None`` turns the penalty off."""
    base = dict(gamma=0.9, step_advantage_w=1.0, mode="mean_std_norm", episode_stats="trajectory",
                enable_similarity=False, similarity_thresh=0.95, epsilon=1e-6, invalid_action_penalty_coef=0.1)
    base.update(kw)
    if base["invalid_action_penalty_coef"] is None:
        base.update(invalid_action_penalty=False, invalid_action_penalty_coef=0.0)
    return AlgorithmConfig(**base)


def packed_case(seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(rows, generator=gen)
    lengths = torch.randint(0, 6, (rows,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]) + 2
    total = int(offsets[-1]) + 3
    return adv, offsets, total, torch.rand(total, generator=gen) > 0.3


@pytest.mark.parametrize("name", ["gigpo", "grpo", "rloo"])
def test_cuda_matches_cpu(name):
    rows = random_rows(np.random.default_rng(11), num_uids=6, trajs=5, max_steps=8)
    params = _params(mode="mean_norm", step_advantage_w=0.5)
    cpu_in = rows.inputs()
    cuda_in = dataclasses.replace(cpu_in, step_index=cpu_in.step_index.cuda(), env_reward=cpu_in.env_reward.cuda(),
                                  action_valid=cpu_in.action_valid.cuda())
    cpu, cuda = compute_advantages(name, cpu_in, params), compute_advantages(name, cuda_in, params)
    assert cuda.advantage.is_cuda
    torch.testing.assert_close(cuda.advantage.cpu(), cpu.advantage, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cuda.episode_advantage.cpu(), cpu.episode_advantage, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cuda.step_returns.cpu(), cpu.step_returns, rtol=1e-12, atol=1e-12)


def test_empty_layout_stays_on_cuda():
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    traj_len, next_row = trajectory_layout(empty, empty)
    assert traj_len.is_cuda and next_row.is_cuda


@pytest.mark.parametrize("rows", [1, 1000, 100_000])
def test_triton_matches_torch_on_cuda(rows):
    dev = torch.device("cuda")
    adv, offsets, total, token_mask = packed_case(rows, rows)
    adv, offsets, token_mask = adv.to(dev), offsets.to(dev), token_mask.to(dev)
    for mask in (None, token_mask):
        ref = scatter_advantages_packed(adv, offsets, total, token_mask=mask, backend="torch")
        got = scatter_advantages_packed(adv, offsets, total, token_mask=mask)  # auto -> Triton on CUDA
        assert torch.equal(ref, got)
    mask = torch.rand(rows, 512, device=dev) > 0.5
    assert torch.equal(scatter_advantages_padded(adv, mask, backend="torch"), scatter_advantages_padded(adv, mask))
