"""Advantage estimators for grouped multi-turn episodes: ``gigpo``, ``grpo``, ``rloo``.

A batch is a set of rows, one per (trajectory, step) (see :class:`AdvantageInputs`); rows of the same
``uid`` are the N rollouts of one task from one initial state (the episode group). Estimators are pure tensor
functions over rows (float64 inside, float32 advantage out) without Python loops over rows, registered by
their config name in :data:`ADVANTAGE_ESTIMATORS`. The per-row tensors may live on the CPU or a GPU and the
results are the same; anchor grouping always runs on the CPU (it hashes and compares Python objects) and its
group ids are moved to the inputs' device.

GiGPO (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training", arXiv 2505.10978):

1. step returns ``R_t = sum_k gamma^k r_{t+k}`` (Sec. 4.2): :func:`megatron_gigpo.algo.returns.discounted_step_returns`;
2. episode relative advantage ``A^E`` (Sec. 4.1): :func:`episode_relative_advantage`;
3. anchor-state groups (Sec. 4.2): :func:`megatron_gigpo.algo.grouping.anchor_state_groups`;
4. step relative advantage ``A^S`` (Sec. 4.2): :func:`step_relative_advantage`;
5. joint advantage ``A = A^E + omega * A^S`` (Sec. 4.3): :func:`combine_advantages`.

Invalid-action penalty (``invalid_action_penalty_coef = c``, as verl-agent's trainer applies it): a row whose
action was invalid has ``c`` subtracted from its episode score and from its own step return; the penalty is
not discounted back into earlier steps' returns.

``episode_stats``: ``trajectory`` (paper default: each trajectory is one sample of the episode group, a group
with one trajectory gets 0) or ``per_step_row`` (parity with verl-agent: every step row is a sample, so long
trajectories weigh more, and a one-row group keeps its raw score).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_gigpo.algo import group_stats
from megatron_gigpo.algo.grouping import anchor_state_groups, factorize
from megatron_gigpo.algo.returns import discounted_step_returns, episode_returns
from megatron_gigpo.algo.config import AlgorithmConfig
from megatron_gigpo.fields import field_errors


MODES = group_stats.MODES
EPISODE_STATS = ("trajectory", "per_step_row")


def check_params(params: AlgorithmConfig) -> None:
    """The recipe's own range and choice checks of the ``algorithm`` section (the ones ``validate`` runs), for
    callers that build an :class:`~megatron_gigpo.algo.config.AlgorithmConfig` in code.

    Raises:
        ValueError: every value outside its field's range or choices (``algorithm.gamma=0.0 must be in (0, 1]``).
    """
    errors = field_errors(params)
    if errors:
        raise ValueError("; ".join(f"algorithm.{e}" for e in errors))


@dataclass
class AdvantageInputs:
    """Per-row inputs; every field has one entry per row (R rows, any order).

    Attributes:
        uid: episode-group id per row (hashable, e.g. str).
        traj_id: trajectory id per row (hashable, unique across the batch); a trajectory lies in one uid.
        step_index: int64 (R,), 0-based step; each trajectory holds steps 0..len-1 exactly once.
        anchor: anchor observation per row (str or numpy array, see :mod:`megatron_gigpo.algo.grouping`).
        env_reward: float64 (R,), finite environment reward of the step.
        action_valid: bool (R,), the action was well-formed.
        (``step_index``, ``env_reward`` and ``action_valid`` share one device, CPU or GPU.)
    Raises:
        ValueError: lengths differ, wrong dtype, shape or device, or non-finite rewards (message names the
            field).
    """

    uid: Sequence[Hashable]
    traj_id: Sequence[Hashable]
    step_index: torch.Tensor
    anchor: Sequence[Any]
    env_reward: torch.Tensor
    action_valid: torch.Tensor

    def __post_init__(self) -> None:
        n = len(self.uid)
        lengths = {
            "traj_id": len(self.traj_id),
            "step_index": _rows_of(self.step_index, "step_index"),
            "anchor": len(self.anchor),
            "env_reward": _rows_of(self.env_reward, "env_reward"),
            "action_valid": _rows_of(self.action_valid, "action_valid"),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"AdvantageInputs: uid has {n} rows but {bad}")
        for name, tensor, dtype in (
            ("step_index", self.step_index, torch.int64),
            ("env_reward", self.env_reward, torch.float64),
            ("action_valid", self.action_valid, torch.bool),
        ):
            if tensor.dtype != dtype:
                raise ValueError(f"AdvantageInputs.{name} must be {dtype}, got {tensor.dtype}")
        devices = {t.device for t in (self.step_index, self.env_reward, self.action_valid)}
        if len(devices) > 1:
            raise ValueError(f"AdvantageInputs: step_index, env_reward and action_valid are on {devices}")
        finite = torch.isfinite(self.env_reward)
        if not bool(finite.all()):
            rows = torch.nonzero(~finite).flatten()[:5].tolist()
            raise ValueError(f"AdvantageInputs.env_reward must be finite; rows {rows} are not")

    @property
    def num_rows(self) -> int:
        return len(self.uid)


def _rows_of(t: Any, name: str) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"AdvantageInputs.{name} must be a 1-D torch tensor (rows,), got {t!r:.80}")
    return int(t.shape[0])


@dataclass
class AdvantageOutputs:
    """Per-row outputs (R rows, aligned with the inputs).

    Attributes:
        advantage: float32 (R,), the advantage to scatter onto the row's response tokens.
        episode_advantage: float64 (R,), ``A^E`` (for ``grpo``/``rloo``: their whole advantage).
        step_advantage: float64 (R,) ``A^S`` (zeros for estimators without a step level).
        step_returns: float64 (R,), discounted step returns after the invalid-action penalty.
        episode_score: float64 (R,), the row's episode score ``R(tau) - penalty``.
        step_group_id: int64 (R,) anchor-state group ids, or None for estimators without a step level.
        step_group_size: int64 (R,) rows in the row's step group, or None.
    """

    advantage: torch.Tensor
    episode_advantage: torch.Tensor
    step_advantage: torch.Tensor
    step_returns: torch.Tensor
    episode_score: torch.Tensor
    step_group_id: torch.Tensor | None
    step_group_size: torch.Tensor | None


@dataclass(frozen=True)
class EncodedRows:
    """Integer codes and per-row scores shared by the estimators (built by :func:`encode_rows`).

    Attributes:
        uid_index: int64 (R,), episode-group code per row.
        traj_index: int64 (R,), trajectory code per row.
        episode_score: float64 (R,), ``R(tau)`` of the row's trajectory minus the row's penalty.
        step_returns: float64 (R,), discounted step return minus the row's penalty.
    """

    uid_index: torch.Tensor
    traj_index: torch.Tensor
    episode_score: torch.Tensor
    step_returns: torch.Tensor


def encode_rows(inputs: AdvantageInputs, params: AlgorithmConfig) -> EncodedRows:
    """Factorize ids, compute episode scores and step returns, apply the invalid-action penalty.

    Raises:
        ValueError: a trajectory spans two uids, or its steps are not 0..len-1 (names the trajectory).
    """
    device = inputs.env_reward.device
    uid_index = factorize(inputs.uid)[0].to(device)
    traj_index, traj_ids = factorize(inputs.traj_id)
    traj_index = traj_index.to(device)
    num_traj = len(traj_ids)
    traj_uid = torch.full((num_traj,), -1, dtype=torch.int64, device=device)
    traj_uid[traj_index] = uid_index
    split = traj_uid[traj_index] != uid_index
    if bool(split.any()):
        row = int(torch.nonzero(split)[0])
        raise ValueError(f"trajectory {inputs.traj_id[row]!r} appears under more than one uid")
    returns = discounted_step_returns(traj_index, inputs.step_index, inputs.env_reward, params.gamma, traj_ids)
    score = episode_returns(traj_index, inputs.env_reward, num_traj)
    for name, value in (("episode return", score), ("discounted step return", returns)):
        if not bool(torch.isfinite(value).all()):
            row = int(torch.nonzero(~torch.isfinite(value))[0])
            raise ValueError(
                f"the {name} of trajectory {inputs.traj_id[row]!r} overflows float64 (rewards too large)"
            )
    if params.invalid_action_penalty:
        penalty = (~inputs.action_valid).to(torch.float64) * params.invalid_action_penalty_coef  # (R,)
        score = score - penalty
        returns = returns - penalty
    return EncodedRows(uid_index, traj_index, score, returns)


def episode_relative_advantage(
    episode_score: torch.Tensor,
    uid_index: torch.Tensor,
    traj_index: torch.Tensor,
    *,
    mode: str,
    episode_stats: str,
    epsilon: float,
) -> torch.Tensor:
    """Episode relative advantage, GiGPO Sec. 4.1:
    ``A^E(tau_i) = (R(tau_i) - mean({R(tau_j)}_{j=1..N})) / F_norm({R(tau_j)})`` with ``F_norm = std + epsilon``
    (``mean_std_norm``) or 1 (``mean_norm``), over the episode group (uid).

    Args:
        episode_score: float64 (R,), the row's episode score.
        uid_index: int64 (R,), episode-group code.
        traj_index: int64 (R,), trajectory code.
        mode: ``mean_norm`` | ``mean_std_norm``.
        episode_stats: ``trajectory`` (each trajectory one sample; one trajectory -> 0) or ``per_step_row``
            (each row one sample; one row -> raw score, verl-agent's rule).
        epsilon: > 0.
    Returns:
        float64 (R,).
    """
    if episode_stats == "trajectory":
        return group_stats.trajectory_group_normalize(episode_score, uid_index, traj_index, mode=mode, epsilon=epsilon)
    if episode_stats == "per_step_row":
        return group_stats.row_group_normalize(episode_score, uid_index, mode=mode, epsilon=epsilon, singleton="raw")
    raise ValueError(f"unknown episode_stats {episode_stats!r}; expected one of {EPISODE_STATS}")


def step_relative_advantage(
    step_returns: torch.Tensor, step_group_id: torch.Tensor, *, mode: str, epsilon: float
) -> torch.Tensor:
    """Step relative advantage, GiGPO Sec. 4.2:
    ``A^S(a_t^(i)) = (R_t^(i) - mean({R_t^(j)} in G^S)) / F_norm({R_t^(j)} in G^S)`` over the anchor-state
    group ``G^S`` of the row; every row is one sample and a group of one gets exactly 0.

    Args:
        step_returns: float64 (R,), discounted step returns.
        step_group_id: int64 (R,), anchor-state group labels.
        mode: ``mean_norm`` | ``mean_std_norm``.
        epsilon: > 0.
    Returns:
        float64 (R,).
    """
    return group_stats.row_group_normalize(step_returns, step_group_id, mode=mode, epsilon=epsilon, singleton="zero")


def combine_advantages(
    episode_advantage: torch.Tensor, step_advantage: torch.Tensor, step_advantage_w: float
) -> torch.Tensor:
    """Joint advantage, GiGPO Sec. 4.3: ``A = A^E + omega * A^S``. float64 (R,) in, float64 (R,) out."""
    return episode_advantage + step_advantage_w * step_advantage


def gigpo_from_scores(
    episode_score: torch.Tensor,
    step_returns: torch.Tensor,
    uid_index: torch.Tensor,
    traj_index: torch.Tensor,
    step_group_id: torch.Tensor,
    params: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GiGPO core on already computed per-row scores, returns and step groups.

    Args:
        episode_score, step_returns: float64 (R,).
        uid_index, traj_index, step_group_id: int64 (R,).
        params: uses ``mode``, ``episode_stats``, ``epsilon``, ``step_advantage_w``.
    Returns:
        ``(advantage, episode_advantage, step_advantage)``, float64 (R,) each.
    """
    a_e = episode_relative_advantage(
        episode_score, uid_index, traj_index, mode=params.mode, episode_stats=params.episode_stats,
        epsilon=params.epsilon,
    )
    a_s = step_relative_advantage(step_returns, step_group_id, mode=params.mode, epsilon=params.epsilon)
    return combine_advantages(a_e, a_s, params.step_advantage_w), a_e, a_s


EstimatorFn = Callable[[AdvantageInputs, AlgorithmConfig], AdvantageOutputs]
ADVANTAGE_ESTIMATORS: dict[str, EstimatorFn] = {}
#: The registered estimators that compare the N rollouts of a group (the recipe check needs ``rollout.n`` >= 2
#: for them, and dynamic sampling filters groups only for them), in registration order.
GROUP_RELATIVE_ESTIMATORS: list[str] = []


def register_advantage_estimator(name: str, *, group_relative: bool = True) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register an estimator ``fn(inputs, params) -> AdvantageOutputs`` under ``name``;
    ``group_relative``: it normalises within groups of rollouts of one task (all of GiGPO, GRPO and RLOO do).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        if group_relative:
            GROUP_RELATIVE_ESTIMATORS.append(name)
        return fn

    return deco


def get_advantage_estimator(name: str) -> EstimatorFn:
    """The estimator registered as ``name``.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(name: str, inputs: AdvantageInputs, params: AlgorithmConfig) -> AdvantageOutputs:
    """Run the estimator registered as ``name`` (``gigpo`` | ``grpo`` | ``rloo``) on ``inputs`` with the
    recipe's ``algorithm`` section ``params`` (gamma, step_advantage_w, mode, episode_stats, similarity,
    epsilon, invalid-action penalty; the loss fields are not read here).

    Raises:
        KeyError: unknown estimator.
        ValueError: a field of ``params`` outside its range (:func:`check_params`).
        ValueError / TypeError: malformed inputs (see :class:`AdvantageInputs`, :func:`encode_rows`).
    """
    estimator = get_advantage_estimator(name)
    check_params(params)
    return estimator(inputs, params)


def _outputs(
    enc: EncodedRows,
    advantage: torch.Tensor,
    a_e: torch.Tensor,
    a_s: torch.Tensor,
    group: torch.Tensor | None,
    size: torch.Tensor | None,
) -> AdvantageOutputs:
    return AdvantageOutputs(
        advantage=advantage.to(torch.float32),
        episode_advantage=a_e,
        step_advantage=a_s,
        step_returns=enc.step_returns,
        episode_score=enc.episode_score,
        step_group_id=group,
        step_group_size=size,
    )


@register_advantage_estimator("gigpo")
def gigpo_advantage(inputs: AdvantageInputs, params: AlgorithmConfig) -> AdvantageOutputs:
    """GiGPO: ``A = A^E + omega A^S`` per row (module doc lists the parts)."""
    enc = encode_rows(inputs, params)
    # Grouping hashes and compares Python objects: it runs on the CPU; the statistics follow the inputs.
    group, size = anchor_state_groups(
        enc.uid_index.cpu(), inputs.anchor, enable_similarity=params.enable_similarity,
        similarity_thresh=params.similarity_thresh,
    )
    group, size = group.to(enc.uid_index.device), size.to(enc.uid_index.device)
    adv, a_e, a_s = gigpo_from_scores(enc.episode_score, enc.step_returns, enc.uid_index, enc.traj_index, group, params)
    return _outputs(enc, adv, a_e, a_s, group, size)


@register_advantage_estimator("grpo")
def grpo_advantage(inputs: AdvantageInputs, params: AlgorithmConfig) -> AdvantageOutputs:
    """GRPO for multi-turn episodes: the episode relative advantage on every step (Shao et al. 2024,
    arXiv 2402.03300, Eq. 3 with outcome supervision); honours ``mode`` (``mean_norm`` is Dr. GRPO's
    unscaled form) and ``episode_stats``. Equal to GiGPO with ``step_advantage_w = 0``."""
    enc = encode_rows(inputs, params)
    a_e = episode_relative_advantage(
        enc.episode_score, enc.uid_index, enc.traj_index, mode=params.mode,
        episode_stats=params.episode_stats, epsilon=params.epsilon,
    )
    return _outputs(enc, a_e, a_e, torch.zeros_like(a_e), None, None)


@register_advantage_estimator("rloo")
def rloo_advantage(inputs: AdvantageInputs, params: AlgorithmConfig) -> AdvantageOutputs:
    """RLOO: the row's episode score minus the mean score of the other samples of its episode group
    (Ahmadian et al. 2024, arXiv 2402.14740, Eq. 7). Samples are trajectories (``episode_stats: trajectory``;
    one trajectory -> 0) or rows (``per_step_row``; one row keeps its score, like verl).

    Raises:
        ValueError: ``mode`` is not ``mean_norm`` (RLOO does not divide by a std).
    """
    if params.mode != "mean_norm":
        raise ValueError(
            f"rloo does not normalise by the std; set algorithm.mode to 'mean_norm' (got {params.mode!r})"
        )
    enc = encode_rows(inputs, params)
    if params.episode_stats == "trajectory":
        a_e = group_stats.trajectory_leave_one_out(enc.episode_score, enc.uid_index, enc.traj_index)
    else:
        a_e = group_stats.row_leave_one_out(enc.episode_score, enc.uid_index)
    return _outputs(enc, a_e, a_e, torch.zeros_like(a_e), None, None)
