"""The training batch: one row per (trajectory, step), as produced by the episode collector.

This is the single hand-off format between episode collection, the advantage estimators and the
Megatron actor. Token ids are stored per row as variable-length int64 tensors so that the actor can pack
them by a token budget without padding waste.

``extras`` holds two kinds of entries: per-row ones (:data:`ROW_EXTRAS`: one item per row, aligned with the
rows, selected and concatenated with them) and per-batch ones (everything else, shared by a row selection).
:func:`select_groups` and :func:`concat_batches` also keep the collector's per-trajectory entries
(:data:`TRAJECTORY_EXTRAS`) consistent with the episode groups they keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_gigpo.algo.advantages import AdvantageInputs
from megatron_gigpo.envs.base import Anchor

#: Per-row entries of ``TrainingBatch.extras`` written by the collector: one item per row (a list, a 1-D
#: tensor or a 1-D numpy array), kept aligned with the rows by :meth:`TrainingBatch.select`.
#: ``routed_experts`` (routing replay, ``algorithm.router_replay: rollout``): per row, the rollout engine's routed
#: experts of every token it ran through the model, uint8 tensor (P_i + R_i - 1, layers, top-k)
#: (:mod:`megatron_gigpo.actor.router_replay`).
ROW_EXTRAS: tuple[str, ...] = ("actions", "action_admissible", "routed_experts", "engine", "weight_version")
#: Per-trajectory entries of ``extras`` written by the collector (failed trajectories included):
#: ``episodes`` (list of EpisodeSummary, with ``.uid``), ``failed_traj_ids`` (list of ``<uid>-n<j>`` ids) and
#: ``failures`` (dict traj id -> error text).
TRAJECTORY_EXTRAS: tuple[str, ...] = ("episodes", "failed_traj_ids", "failures")


@dataclass
class TrainingBatch:
    """Rows of (trajectory, step). All per-row sequences have the same length ``num_rows``.

    Attributes:
        prompt_ids: per row, the prompt token ids, int64 tensor (P_i,).
        response_ids: per row, the generated token ids, int64 tensor (R_i,).
        rollout_log_probs: per row, the rollout engine's log-probs of ``response_ids``, float32 (R_i,).
        uid: per row, episode-group id (one task and initial state, N rollouts).
        traj_id: per row, trajectory id (unique across the batch).
        step_index: int64 (num_rows,), 0-based step within the trajectory.
        anchor: per row, the anchor observation of the state the action was taken in.
        env_reward: float64 (num_rows,), reward the environment returned for this step.
        action_valid: bool (num_rows,), the response followed its environment's format rule; False rows get
            the invalid-action penalty (rules per environment in :mod:`megatron_gigpo.envs.actions`).
        extras: per-row entries named in :data:`ROW_EXTRAS` (checked to hold ``num_rows`` items) and free-form
            per-batch metadata (environment name, task types, ...).

    Raises:
        ValueError: a per-row field or per-row extra with another number of rows, or a row whose response ids
            and log-probs differ in shape.
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    uid: list[str]
    traj_id: list[str]
    step_index: torch.Tensor
    anchor: list[Anchor]
    env_reward: torch.Tensor
    action_valid: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        lengths = {
            "response_ids": len(self.response_ids),
            "rollout_log_probs": len(self.rollout_log_probs),
            "uid": len(self.uid),
            "traj_id": len(self.traj_id),
            "step_index": int(self.step_index.shape[0]),
            "anchor": len(self.anchor),
            "env_reward": int(self.env_reward.shape[0]),
            "action_valid": int(self.action_valid.shape[0]),
        }
        lengths |= {f"extras[{k!r}]": len(self.extras[k]) for k in ROW_EXTRAS if k in self.extras}
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"TrainingBatch: prompt_ids has {n} rows but {bad}")
        for i, (r, lp) in enumerate(zip(self.response_ids, self.rollout_log_probs)):
            if r.shape != lp.shape:
                raise ValueError(
                    f"TrainingBatch row {i}: response_ids shape {tuple(r.shape)} != "
                    f"rollout_log_probs shape {tuple(lp.shape)}"
                )

    @property
    def num_rows(self) -> int:
        return len(self.prompt_ids)

    def response_lengths(self) -> torch.Tensor:
        """int64 (num_rows,): number of response tokens per row."""
        return torch.tensor([int(r.numel()) for r in self.response_ids], dtype=torch.int64)

    def advantage_inputs(self) -> AdvantageInputs:
        """What the advantage estimators read of these rows
        (:func:`megatron_gigpo.algo.advantages.compute_advantages`), as views: no copies."""
        return AdvantageInputs(uid=self.uid, traj_id=self.traj_id, step_index=self.step_index, anchor=self.anchor,
                               env_reward=self.env_reward, action_valid=self.action_valid)

    def select(self, index: np.ndarray | list[int] | torch.Tensor) -> "TrainingBatch":
        """A new batch with the given rows, in the given order (e.g. a mini-batch or the kept groups).

        Every per-row field and every per-row extra (:data:`ROW_EXTRAS`) is indexed the same way; the other
        extras are per-batch and shared (a shallow copy of the dict, so adding a key to one batch does not
        change the other).
        """
        idx = [int(i) for i in index]
        t = torch.as_tensor(idx, dtype=torch.int64)
        extras = dict(self.extras)
        for key in ROW_EXTRAS:
            if key in extras:
                extras[key] = _take(extras[key], idx, t)
        return TrainingBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            response_ids=[self.response_ids[i] for i in idx],
            rollout_log_probs=[self.rollout_log_probs[i] for i in idx],
            uid=[self.uid[i] for i in idx],
            traj_id=[self.traj_id[i] for i in idx],
            step_index=self.step_index[t],
            anchor=[self.anchor[i] for i in idx],
            env_reward=self.env_reward[t],
            action_valid=self.action_valid[t],
            extras=extras,
        )


def _take(values: Any, idx: list[int], t: torch.Tensor) -> Any:
    """Items ``idx`` of a per-row extra (list, 1-D tensor or 1-D numpy array), same container type."""
    if isinstance(values, torch.Tensor):
        return values[t]
    if isinstance(values, np.ndarray):
        return values[np.asarray(idx, dtype=np.int64)]
    return [values[i] for i in idx]


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [x for p in parts for x in p]


def _traj_uid(traj_id: str) -> str:
    """The group uid of a collector trajectory id ``<uid>-n<j>``."""
    return traj_id.rsplit("-n", 1)[0]


def select_groups(batch: TrainingBatch, uids: list[str]) -> TrainingBatch:
    """The rows of the episode groups ``uids``, in the order of ``uids`` (rows of a group keep their order).

    Per-row fields and extras stay aligned (:meth:`TrainingBatch.select`); the per-trajectory extras
    (:data:`TRAJECTORY_EXTRAS`) keep only the trajectories of those groups, failed ones included, and
    ``extras["num_groups"]`` becomes ``len(uids)``.

    Raises:
        ValueError: a uid given twice.
    """
    if len(set(uids)) != len(uids):
        raise ValueError(f"select_groups: repeated uids in {uids}")
    rows_of: dict[str, list[int]] = {u: [] for u in uids}
    for i, u in enumerate(batch.uid):
        if u in rows_of:
            rows_of[u].append(i)
    out = batch.select([i for u in uids for i in rows_of[u]])
    keep, ex = set(uids), out.extras
    if "episodes" in ex:
        ex["episodes"] = [e for e in ex["episodes"] if e.uid in keep]
    if "failed_traj_ids" in ex:
        ex["failed_traj_ids"] = [t for t in ex["failed_traj_ids"] if _traj_uid(t) in keep]
    if "failures" in ex:
        ex["failures"] = {t: err for t, err in ex["failures"].items() if _traj_uid(t) in keep}
    if "num_groups" in ex:
        ex["num_groups"] = len(uids)
    return out


def concat_batches(batches: list[TrainingBatch]) -> TrainingBatch:
    """One batch holding the rows of ``batches`` in order (e.g. the kept groups of several generation rounds).

    Per-row fields and :data:`ROW_EXTRAS` are concatenated, the per-trajectory extras joined, ``num_groups``
    summed; every other extra must be equal in all batches (it is per-batch metadata: environment, group
    size, ...) and is kept once.

    Raises:
        ValueError: no batch, a per-row extra present in some batches only, or per-batch extras that differ
            (names the key).
    """
    if not batches:
        raise ValueError("concat_batches: no batch")
    extras: dict[str, Any] = {}
    for key in dict.fromkeys(k for b in batches for k in b.extras):
        if not all(key in b.extras for b in batches):
            raise ValueError(f"concat_batches: extras[{key!r}] is missing in some batches")
        values = [b.extras[key] for b in batches]
        if key in ROW_EXTRAS or key in ("episodes", "failed_traj_ids"):
            extras[key] = _cat(values)
        elif key == "failures":
            extras[key] = {t: err for v in values for t, err in v.items()}
        elif key == "num_groups":
            extras[key] = sum(values)
        elif any(v != values[0] for v in values[1:]):
            raise ValueError(f"concat_batches: per-batch extras[{key!r}] differ: {values}")
        else:
            extras[key] = values[0]
    return TrainingBatch(
        prompt_ids=[x for b in batches for x in b.prompt_ids],
        response_ids=[x for b in batches for x in b.response_ids],
        rollout_log_probs=[x for b in batches for x in b.rollout_log_probs],
        uid=[x for b in batches for x in b.uid],
        traj_id=[x for b in batches for x in b.traj_id],
        step_index=torch.cat([b.step_index for b in batches]),
        anchor=[x for b in batches for x in b.anchor],
        env_reward=torch.cat([b.env_reward for b in batches]),
        action_valid=torch.cat([b.action_valid for b in batches]),
        extras=extras,
    )
