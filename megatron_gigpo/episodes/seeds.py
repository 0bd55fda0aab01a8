"""The seeds of a rollout (:class:`~megatron_gigpo.episodes.collector.EpisodeCollector`, the demonstration writer):
pure functions of ``(seed, iteration, round, group, step, task)``, never of the weights, so a resumed run or an
asynchronous producer regenerates exactly the episodes of an uninterrupted synchronous run."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

from megatron_gigpo.envs.base import Task

if TYPE_CHECKING:
    from megatron_gigpo.rollout.engine import SamplingConfig

__all__ = ["reset_seed", "step_sampling"]


def reset_seed(
    base_seed: int, task: Task, group_index: int, iteration: int, validation: bool, round_index: int = 0
) -> int:
    """The environment seed of a group, shared by all its members; in ``[0, 2**31)``.

    Training seeds depend on ``(base_seed, iteration, round_index, group_index, task_id)`` (``round_index``:
    the generation round of dynamic sampling; round 0 keeps the key it had before rounds existed); validation
    seeds only on ``(base_seed, task_id)``, so a validation task starts from the same state in every
    evaluation, whatever the batch it is in and however many workers run it. A stable hash (SHA-256), not
    Python's salted ``hash``.
    """
    if validation:
        key = f"val/{base_seed}/{task.task_id}"
    else:
        rnd = f"r{round_index}/" if round_index else ""
        key = f"train/{base_seed}/{iteration}/{rnd}{group_index}/{task.task_id}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFFFFFF


def step_sampling(
    sampling: SamplingConfig, iteration: int, step: int, validation: bool, round_index: int = 0
) -> SamplingConfig:
    """The sampling config of one step's ``generate`` call.

    The engines seed prompt ``i`` of a call with ``seed + i``; a fixed seed would replay the same random
    draws at every step and iteration. This derives the call's seed from ``(seed, iteration, round_index,
    step, split)`` with a stable hash (round 0 keeps its pre-rounds key), so sampling stays reproducible (a
    resumed run regenerates the same episodes) while differing between steps, rounds and iterations. Greedy or
    unseeded configs are returned unchanged.
    """
    if sampling.seed is None or sampling.temperature == 0:
        return sampling
    rnd = f"r{round_index}/" if round_index else ""
    key = f"{'val' if validation else 'train'}/{sampling.seed}/{iteration}/{rnd}{step}"
    return dataclasses.replace(sampling, seed=int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") >> 2)
