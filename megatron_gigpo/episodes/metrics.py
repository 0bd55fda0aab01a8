"""Collection metrics: success rates, episode lengths, invalid actions, step-group sizes, truncation.

All functions return flat ``{name: float}`` dicts ready for a scalar logger (TensorBoard, W&B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_gigpo.algo.grouping import anchor_keys, exact_anchor_groups, factorize
from megatron_gigpo.envs.base import Anchor

#: Step-group size buckets (inclusive bounds) of the size histogram; the last one is open-ended.
STEP_GROUP_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, None),
)


@dataclass(frozen=True)
class EpisodeSummary:
    """The outcome of one trajectory.

    Attributes:
        traj_id: trajectory id (as in the training batch).
        uid: group id.
        task_id: the task's id.
        task_type: task family (ALFWorld task type, ...) when the environment reports one, else None.
        length: steps taken.
        won: the environment reported success.
        episode_return: sum of the step rewards (environment units).
        failed: the episode ended by an environment or worker failure; such episodes carry no training rows
            and are left out of success rates and lengths.
        hit_step_limit: the episode was cut by the collector's ``max_steps`` before the env said done.
        prompt_overflow: the episode was ended by the collector because a step's prompt could not fit
            ``max_prompt_length`` (``rollout.prompt_overflow: end_episode``); such an episode is done and not
            won, and failed too when the overflow was at step 0 (it has no rows then).
    """

    traj_id: str
    uid: str
    task_id: str
    task_type: str | None
    length: int
    won: bool
    episode_return: float
    failed: bool
    hit_step_limit: bool
    prompt_overflow: bool


def step_group_sizes(uids: Sequence[str], anchors: Sequence[Anchor]) -> list[int]:
    """Sizes of the exact step groups: rows sharing a uid and an identical anchor (GiGPO Sec. 4.2).

    Uses :func:`megatron_gigpo.algo.grouping.exact_anchor_groups`, the algorithm's own grouping.
    Returns one size per step group, in order of first appearance; ``sum == len(uids)``.

    Raises:
        ValueError: different numbers of uids and anchors.
        TypeError: an anchor is neither str nor a numpy array.
    """
    if len(uids) != len(anchors):
        raise ValueError(f"{len(uids)} uids but {len(anchors)} anchors")
    if not uids:
        return []
    uid_index, _ = factorize(uids)
    groups = exact_anchor_groups(uid_index, anchor_keys(anchors))  # (R,)
    return torch.bincount(groups).tolist()


def step_group_metrics(uids: Sequence[str], anchors: Sequence[Anchor]) -> dict[str, float]:
    """Step-group count, mean size, share of rows in singleton groups, and the bucketed size histogram.

    ``step_group/hist_<lo>-<hi>`` counts step groups whose size falls in the bucket (see
    :data:`STEP_GROUP_BUCKETS`). Singleton groups give GiGPO no step-level signal.
    """
    sizes = step_group_sizes(uids, anchors)
    metrics: dict[str, float] = {"step_group/count": float(len(sizes))}
    if not sizes:
        return metrics
    metrics["step_group/size_mean"] = float(np.mean(sizes))
    metrics["step_group/size_max"] = float(max(sizes))
    metrics["step_group/singleton_row_frac"] = sum(1 for s in sizes if s == 1) / len(uids)
    for lo, hi in STEP_GROUP_BUCKETS:
        name = f"{lo}" if lo == hi else (f"{lo}+" if hi is None else f"{lo}-{hi}")
        metrics[f"step_group/hist_{name}"] = float(sum(1 for s in sizes if s >= lo and (hi is None or s <= hi)))
    return metrics


def no_effect_rate(traj_ids: Sequence[str], step_index: Sequence[int], anchors: Sequence[Anchor]) -> dict[str, float]:
    """``action/no_effect_rate``: the share of steps after which the observation anchor did not change.

    Counted over the rows that have a next step in their trajectory (row t and row t + 1 of one ``traj_id``).
    A step without effect (Sokoban: walking into a wall or pushing a box against one) leaves the agent in the
    same anchor state, so it lands in the same GiGPO step group as the step after it. Where the anchor is the
    observation text (ALFWorld), only a repeated identical observation counts. Empty dict when no row has a
    successor.

    Raises:
        ValueError: the three sequences differ in length.
    """
    if not len(traj_ids) == len(step_index) == len(anchors):
        raise ValueError(f"no_effect_rate: {len(traj_ids)} traj ids, {len(step_index)} step indices, {len(anchors)} anchors")
    keys = anchor_keys(anchors)
    position = {(t, int(s)): i for i, (t, s) in enumerate(zip(traj_ids, step_index))}
    same = [keys[i] == keys[j] for (t, s), i in position.items() if (j := position.get((t, s + 1))) is not None]
    return {"action/no_effect_rate": float(np.mean(same))} if same else {}


def episode_metrics(env_name: str, episodes: Sequence[EpisodeSummary]) -> dict[str, float]:
    """Success rates (overall and per task type), lengths, returns and failures.

    Keys: ``episode/{env}/success_rate``, ``episode/{env}/success_rate/{task_type}`` for each task type
    seen, ``episode/{env}/count/{task_type}``, ``episode/length_mean|min|max``, ``episode/return_mean``,
    ``episode/step_limit_frac``, ``episode/count``, ``episode/failed``, and ``episode/prompt_overflow_rate``:
    the share of all episodes (failed ones included, as an overflow at step 0 fails the episode) ended
    because a prompt could not fit ``max_prompt_length``.
    """
    done = [e for e in episodes if not e.failed]
    metrics: dict[str, float] = {
        "episode/count": float(len(done)),
        "episode/failed": float(len(episodes) - len(done)),
        "episode/prompt_overflow_rate": float(np.mean([e.prompt_overflow for e in episodes])) if episodes else 0.0,
    }
    if not done:
        return metrics
    lengths = [e.length for e in done]
    metrics[f"episode/{env_name}/success_rate"] = float(np.mean([e.won for e in done]))
    metrics["episode/length_mean"] = float(np.mean(lengths))
    metrics["episode/length_min"] = float(min(lengths))
    metrics["episode/length_max"] = float(max(lengths))
    metrics["episode/return_mean"] = float(np.mean([e.episode_return for e in done]))
    metrics["episode/step_limit_frac"] = float(np.mean([e.hit_step_limit for e in done]))
    by_type: dict[str, list[bool]] = {}
    for e in done:
        if e.task_type is not None:
            by_type.setdefault(e.task_type, []).append(e.won)
    for task_type, wins in sorted(by_type.items()):
        metrics[f"episode/{env_name}/success_rate/{task_type}"] = float(np.mean(wins))
        metrics[f"episode/{env_name}/count/{task_type}"] = float(len(wins))
    return metrics


def row_metrics(
    action_valid: Sequence[bool],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    finish_reasons: Sequence[str],
    *,
    action_admissible: Sequence[bool],
) -> dict[str, float]:
    """Per-row rates: invalid and non-admissible actions, prompt/response lengths (tokens), clipped responses.

    ``action/invalid_rate`` is the fraction of rows the invalid-action penalty applies to (the response broke
    the environment's format rule, ``action_valid`` False); ``action/non_admissible_rate`` the fraction whose
    action the environment did not recognise as admissible (``action_admissible`` False, executed and not
    penalised; see :mod:`megatron_gigpo.envs.actions`). ``response/clip_frac``: responses cut by ``max_tokens``.

    Raises:
        ValueError: ``action_admissible`` and ``action_valid`` differ in length.
    """
    n = len(action_valid)
    if len(action_admissible) != n:
        raise ValueError(f"row_metrics: {len(action_admissible)} action_admissible flags for {n} rows")
    metrics: dict[str, float] = {"batch/rows": float(n)}
    if n == 0:
        return metrics
    metrics["action/invalid_rate"] = 1.0 - float(np.mean(np.asarray(action_valid, dtype=bool)))
    metrics["action/non_admissible_rate"] = 1.0 - float(np.mean(np.asarray(action_admissible, dtype=bool)))
    metrics["prompt/length_mean"] = float(np.mean(prompt_lengths))
    metrics["prompt/length_max"] = float(max(prompt_lengths))
    metrics["response/length_mean"] = float(np.mean(response_lengths))
    metrics["response/length_max"] = float(max(response_lengths))
    metrics["response/clip_frac"] = float(np.mean([r == "length" for r in finish_reasons]))
    return metrics
