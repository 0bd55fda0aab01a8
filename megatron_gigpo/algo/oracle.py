"""Slow, loop-based float64 reference of the advantage path. FOR TESTS AND BENCHMARKS ONLY.

Written independently of the vectorised code: plain Python lists and floats, one loop per definition
(``R_t`` as the literal sum ``sum_k gamma^k r_{t+k}``, group statistics with ``math.fsum``, single-linkage
similarity groups by union-find over every pair of rows, token scatter token by token). Product code never
imports this module; ``tests/algo`` compares the estimators against it and ``benchmarks/advantage.py`` times
them against it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from rapidfuzz.distance import Indel


def lcs_similarity(a: str, b: str) -> float:
    """Normalized Indel similarity ``1 - (len a + len b - 2 LCS(a, b)) / (len a + len b)`` (1.0 for two
    empty strings), with the LCS from the textbook dynamic programme and the same float formula as
    rapidfuzz's ``Indel.normalized_similarity``. Quadratic; only for short strings in tests."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    total = len(a) + len(b)
    return 1.0 - (total - 2 * prev[-1]) / total


def _key(anchor: Any) -> Hashable:
    if isinstance(anchor, str):
        return ("str", anchor)
    return ("array", str(anchor.dtype), tuple(anchor.shape), anchor.tobytes())


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = math.fsum(xs) / len(xs)
    var = math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var)


def _normalize(x: float, mean: float, std: float, mode: str, eps: float) -> float:
    return (x - mean) / (std + eps) if mode == "mean_std_norm" else x - mean


def oracle_step_returns(
    traj_id: Sequence[Hashable], step_index: Sequence[int], reward: Sequence[float], gamma: float
) -> list[float]:
    """``R_t = sum_{k >= 0} gamma^k r_{t+k}`` per row, summed literally over the rest of the trajectory."""
    steps: dict[Hashable, dict[int, int]] = defaultdict(dict)
    for row, (t, s) in enumerate(zip(traj_id, step_index)):
        assert s not in steps[t], f"repeated step {s} in trajectory {t!r}"
        steps[t][s] = row
    out = [0.0] * len(reward)
    for t, by_step in steps.items():
        assert sorted(by_step) == list(range(len(by_step))), f"gap in trajectory {t!r}"
        rewards = [reward[by_step[s]] for s in range(len(by_step))]
        for s in range(len(rewards)):
            out[by_step[s]] = math.fsum(gamma**k * r for k, r in enumerate(rewards[s:]))
    return out


def oracle_groups(
    uid: Sequence[Hashable],
    anchor: Sequence[Any],
    enable_similarity: bool,
    thresh: float,
    similarity: Callable[[str, str], float] = Indel.normalized_similarity,
) -> list[int]:
    """Step-group label per row (arbitrary labels; only the partition matters)."""
    n = len(uid)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if not enable_similarity:  # exact mode: one group per (uid, key)
        label: dict[Hashable, int] = {}
        return [label.setdefault((u, _key(a)), len(label)) for u, a in zip(uid, anchor)]
    rows_of: dict[Hashable, list[int]] = defaultdict(list)
    for i, u in enumerate(uid):
        rows_of[u].append(i)
    for rows in rows_of.values():  # single linkage: link every pair of rows at or above the threshold
        for x, i in enumerate(rows):
            for j in rows[x + 1 :]:
                if similarity(anchor[i], anchor[j]) >= thresh:
                    parent[find(i)] = find(j)
    return [find(i) for i in range(n)]


def _episode_advantage(
    name: str, uid: Sequence[Hashable], traj_id: Sequence[Hashable], score: list[float], mode: str,
    stats: str, eps: float,
) -> list[float]:
    out = [0.0] * len(score)
    trajs_of: dict[Hashable, dict[Hashable, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (u, t) in enumerate(zip(uid, traj_id)):
        trajs_of[u][t].append(i)
    for trajs in trajs_of.values():
        rows = [i for rs in trajs.values() for i in rs]
        if stats == "per_step_row":
            xs = [score[i] for i in rows]
            for i in rows:
                if len(rows) == 1:
                    out[i] = score[i] / (1 + eps) if (name != "rloo" and mode == "mean_std_norm") else score[i]
                elif name == "rloo":
                    out[i] = score[i] - (math.fsum(xs) - score[i]) / (len(rows) - 1)
                else:
                    mean, std = _mean_std(xs)
                    out[i] = _normalize(score[i], mean, std, mode, eps)
            continue
        n_traj = len(trajs)
        if n_traj == 1:
            continue  # one trajectory: no relative signal, advantage 0
        avg = {t: math.fsum(score[i] for i in rs) / len(rs) for t, rs in trajs.items()}
        mean = math.fsum(avg.values()) / n_traj
        var = math.fsum((score[i] - mean) ** 2 / len(rs) for rs in trajs.values() for i in rs) / (n_traj - 1)
        for t, rs in trajs.items():
            for i in rs:
                if name == "rloo":
                    out[i] = score[i] - math.fsum(a for t2, a in avg.items() if t2 != t) / (n_traj - 1)
                else:
                    out[i] = _normalize(score[i], mean, math.sqrt(var), mode, eps)
    return out


def oracle_advantages(
    name: str,
    uid: Sequence[Hashable],
    traj_id: Sequence[Hashable],
    step_index: Sequence[int],
    anchor: Sequence[Any],
    env_reward: Sequence[float],
    action_valid: Sequence[bool],
    params: Any,
    similarity: Callable[[str, str], float] = Indel.normalized_similarity,
) -> dict[str, list]:
    """Per-row ``advantage``, ``episode_advantage``, ``step_advantage``, ``step_returns``,
    ``episode_score`` and ``step_group`` (labels) as Python lists; ``params`` is the recipe's ``algorithm``
    section (:class:`~megatron_gigpo.algo.config.AlgorithmConfig`)."""
    penalty = params.invalid_action_penalty_coef if params.invalid_action_penalty else None
    pen = [penalty if (penalty is not None and not v) else 0.0 for v in action_valid]
    returns = oracle_step_returns(traj_id, step_index, env_reward, params.gamma)
    returns = [r - p for r, p in zip(returns, pen)]
    totals: dict[Hashable, list[float]] = defaultdict(list)
    for t, r in zip(traj_id, env_reward):
        totals[t].append(r)
    score = [math.fsum(totals[t]) - p for t, p in zip(traj_id, pen)]
    a_e = _episode_advantage(name, uid, traj_id, score, params.mode, params.episode_stats, params.epsilon)
    a_s = [0.0] * len(score)
    groups: list[int] = []
    if name == "gigpo":
        groups = oracle_groups(uid, anchor, params.enable_similarity, params.similarity_thresh, similarity)
        members: dict[int, list[int]] = defaultdict(list)
        for i, g in enumerate(groups):
            members[g].append(i)
        for rows in members.values():
            if len(rows) < 2:
                continue
            mean, std = _mean_std([returns[i] for i in rows])
            for i in rows:
                a_s[i] = _normalize(returns[i], mean, std, params.mode, params.epsilon)
    adv = [e + params.step_advantage_w * s for e, s in zip(a_e, a_s)]
    return {
        "advantage": adv,
        "episode_advantage": a_e,
        "step_advantage": a_s,
        "step_returns": returns,
        "episode_score": score,
        "step_group": groups,
    }


def oracle_scatter_padded(adv: Sequence[float], mask: Sequence[Sequence[Any]]) -> list[list[float]]:
    """Token by token: ``out[b][t] = adv[b] * mask[b][t]``."""
    return [[a * float(m) for m in row] for a, row in zip(adv, mask)]


def oracle_scatter_packed(
    adv: Sequence[float], offsets: Sequence[int], total_tokens: int, token_mask: Sequence[Any] | None = None
) -> list[float]:
    """Token by token: row ``b`` owns ``[offsets[b], offsets[b+1])``; everything else is 0."""
    out = [0.0] * total_tokens
    for b, a in enumerate(adv):
        for t in range(offsets[b], offsets[b + 1]):
            out[t] = a * (float(token_mask[t]) if token_mask is not None else 1.0)
    return out
