"""Dynamic sampling: train only on episode groups that carry a learning signal (recipe
``algorithm.dynamic_sampling``; DAPO's group filter, arXiv 2503.14476 Sec. 3.2, and verl-agent's GiGPO dynamic
trainer).

A group whose N trajectories all earn the same return gets zero episode advantage, so with group-relative
estimators it adds rows but no gradient signal (only the KL and entropy terms). One training iteration
therefore runs generation rounds: each round collects ``env.num_groups`` new groups (fresh tasks from the run's
seeded task stream, fresh reset and sampling seeds: ``round_index`` of
:meth:`~megatron_gigpo.episodes.collector.EpisodeCollector.collect`), drops the groups without signal and keeps
the rest, until ``env.num_groups`` informative groups are kept or ``max_rounds`` rounds ran. Surplus informative
groups of the last round are dropped deterministically (groups are kept in collection order: earlier rounds
first, then the round's group order). When the round limit is reached first, the iteration trains on the
informative groups it has (possibly none: then no update), logs a warning and reports
``dynamic_sampling/round_limit_hit = 1``.

Criteria (:data:`CRITERIA`):

- ``episode_return``: all trajectory returns ``R(tau) = sum_t r_t`` of the group (environment rewards, without
  the invalid-action penalty; failed trajectories have no rows and do not count) are equal within
  :data:`RETURN_ATOL`. A group with one surviving trajectory has no spread and is dropped.
- ``joint``: every row of the group has ``|A| <= ``:data:`ZERO_ADVANTAGE_ATOL` under the run's own estimator and
  parameters (GiGPO: ``A = A^E + omega * A^S``, invalid-action penalty included), so a group of equal returns
  whose anchor-state groups still differ in step returns is kept. Advantages are group-local (episode and step
  groups never cross uids), so a group's advantages are the same in its round's batch and in the final batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_gigpo.episodes.batch import TrainingBatch, concat_batches, select_groups

if TYPE_CHECKING:
    from megatron_gigpo.algo.config import AlgorithmConfig

log = logging.getLogger(__name__)

CRITERIA: tuple[str, ...] = ("episode_return", "joint")
#: Two trajectory returns closer than this are equal (sums of the same rewards in another order differ by ulps).
RETURN_ATOL = 1e-9
#: A row advantage at most this large in magnitude is zero (float rounding of equal values normalised by
#: ``std + epsilon`` leaves ~1e-10 relative residues).
ZERO_ADVANTAGE_ATOL = 1e-6

RoundFn = Callable[[int], tuple[TrainingBatch, dict[str, float]]]


def informative_uids(
    batch: TrainingBatch, criterion: str, *, estimator: str = "gigpo", params: AlgorithmConfig | None = None
) -> list[str]:
    """The episode groups of ``batch`` that carry signal under ``criterion``, in order of first appearance.

    Args:
        batch: one round's rows.
        criterion: ``episode_return`` or ``joint`` (module doc).
        estimator, params: the run's advantage estimator name and parameters (``joint`` only).
    Returns:
        the informative uids (a subset of ``batch.uid``).
    Raises:
        ValueError: an unknown criterion, or ``joint`` without ``params``.
    """
    uids = list(dict.fromkeys(batch.uid))
    if not uids:
        return []
    uid_code = dict(zip(uids, range(len(uids))))
    uid_index = torch.tensor([uid_code[u] for u in batch.uid], dtype=torch.int64)
    if criterion == "episode_return":
        trajs = list(dict.fromkeys(batch.traj_id))
        code = dict(zip(trajs, range(len(trajs))))
        traj_index = torch.tensor([code[t] for t in batch.traj_id], dtype=torch.int64)
        returns = torch.zeros(len(trajs), dtype=torch.float64).index_add_(0, traj_index, batch.env_reward.double())
        traj_uid = torch.zeros(len(trajs), dtype=torch.int64)
        traj_uid[traj_index] = uid_index
        hi = torch.full((len(uids),), -torch.inf, dtype=torch.float64).scatter_reduce(0, traj_uid, returns, "amax")
        lo = torch.full((len(uids),), torch.inf, dtype=torch.float64).scatter_reduce(0, traj_uid, returns, "amin")
        signal = (hi - lo) > RETURN_ATOL
    elif criterion == "joint":
        if params is None:
            raise ValueError("informative_uids: criterion 'joint' needs the advantage params")
        from megatron_gigpo.algo.advantages import compute_advantages

        adv = compute_advantages(estimator, batch.advantage_inputs(), params).advantage.double().abs().cpu()
        peak = torch.zeros(len(uids), dtype=torch.float64).scatter_reduce(0, uid_index, adv, "amax")
        signal = peak > ZERO_ADVANTAGE_ATOL
    else:
        raise ValueError(f"informative_uids: unknown criterion {criterion!r}; expected one of {', '.join(CRITERIA)}")
    return [u for u, keep in zip(uids, signal.tolist()) if keep]


def collect_informative(
    collect_round: RoundFn,
    *,
    num_groups: int,
    criterion: str,
    max_rounds: int,
    estimator: str = "gigpo",
    params: AlgorithmConfig | None = None,
    iteration: int = 0,
) -> tuple[TrainingBatch, dict[str, float]]:
    """Run generation rounds until ``num_groups`` informative groups are kept or ``max_rounds`` rounds ran.

    Args:
        collect_round: ``collect_round(k) -> (batch, metrics)`` collects round ``k`` (0-based) of this iteration:
            new tasks, ``EpisodeCollector.collect(..., round_index=k)``.
        num_groups: informative groups wanted (``env.num_groups``), >= 1.
        criterion, estimator, params: see :func:`informative_uids`.
        max_rounds: >= 1.
        iteration: 1-based iteration number used in the warning.
    Returns:
        ``(batch, metrics)``: the kept groups' rows (rounds concatenated, per-row extras aligned, per-trajectory
        extras of the kept groups only) and the rollout metrics: ``episode/*`` recomputed over every episode of
        every round (the policy's rollouts, before filtering), ``timing/*`` and ``workers/*`` summed over rounds,
        other collector metrics from round 0, plus ``dynamic_sampling/rounds``, ``dynamic_sampling/filtered_group_frac``
        (share of collected groups without signal; groups whose episodes all failed count as filtered),
        ``dynamic_sampling/informative_groups``, ``dynamic_sampling/trained_groups``,
        ``dynamic_sampling/trained_rows`` and ``dynamic_sampling/round_limit_hit`` (1.0 when fewer than
        ``num_groups`` groups are trained).
    Raises:
        ValueError: ``num_groups`` or ``max_rounds`` < 1, or an unknown criterion.
    """
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"collect_informative: num_groups={num_groups} and max_rounds={max_rounds} must be >= 1")
    kept: list[TrainingBatch] = []
    round_metrics: list[dict[str, float]] = []
    episodes: list = []
    collected = informative = trained = 0
    while len(round_metrics) < max_rounds and trained < num_groups:
        batch, metrics = collect_round(len(round_metrics))
        round_metrics.append(metrics)
        episodes += batch.extras.get("episodes", [])
        collected += int(batch.extras.get("num_groups", len(set(batch.uid))))
        uids = informative_uids(batch, criterion, estimator=estimator, params=params)
        informative += len(uids)
        take = uids[: num_groups - trained]
        trained += len(take)
        if take or not kept:  # the first round's (possibly empty) selection carries the per-batch extras
            kept.append(select_groups(batch, take))
    out = concat_batches(kept)
    metrics = _merge_round_metrics(round_metrics, out, episodes)
    metrics |= {
        "dynamic_sampling/rounds": float(len(round_metrics)),
        "dynamic_sampling/filtered_group_frac": 1.0 - informative / collected if collected else 1.0,
        "dynamic_sampling/informative_groups": float(informative),
        "dynamic_sampling/trained_groups": float(trained),
        "dynamic_sampling/trained_rows": float(out.num_rows),
        "dynamic_sampling/round_limit_hit": float(trained < num_groups),
    }
    if trained < num_groups:
        log.warning(
            "iteration %d: dynamic sampling found %d informative groups (criterion %s) of %d collected in %d "
            "generation rounds (algorithm.dynamic_sampling.max_rounds), %d wanted (env.num_groups); %s",
            iteration, informative, criterion, collected, len(round_metrics), num_groups,
            f"training on their {out.num_rows} rows" if out.num_rows else "no update this iteration",
        )
    return out, metrics


def _merge_round_metrics(rounds: list[dict[str, float]], batch: TrainingBatch, episodes: list) -> dict[str, float]:
    """One iteration's rollout metrics from its rounds' (see :func:`collect_informative`)."""
    from megatron_gigpo.episodes.metrics import episode_metrics

    merged = {k: v for k, v in rounds[0].items() if not k.startswith("episode/")}
    for m in rounds[1:]:
        for k, v in m.items():
            if k.startswith(("timing/", "workers/")):
                merged[k] = merged.get(k, 0.0) + v
    if "env_name" in batch.extras:
        merged |= episode_metrics(batch.extras["env_name"], episodes)
    else:
        merged |= {k: v for k, v in rounds[0].items() if k.startswith("episode/")}
    return merged
