"""The recipe's ``algorithm`` section (:class:`AlgorithmConfig`, with ``algorithm.dynamic_sampling``): the
advantage estimator (GiGPO paper Sec. 4) and the policy loss.

Passed whole to the advantage estimators (:func:`megatron_gigpo.algo.advantages.compute_advantages`), to the
policy update as the actor's ``loss`` (:mod:`megatron_gigpo.actor.update`) and to dynamic sampling
(:mod:`megatron_gigpo.episodes.dynamic_sampling`). Names that a registry or a torch module defines are checked
against it where it lives (``"module:NAME"``, :func:`megatron_gigpo.fields.choice`), so this module imports no
torch and none of the code it configures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.fields import choice, num

__all__ = ["AlgorithmConfig", "DynamicSamplingConfig", "RolloutCorrectionConfig", "off_policy_errors", "router_replay_errors"]

_LOSSES = "megatron_gigpo.algo.losses"


@dataclass
class DynamicSamplingConfig:
    """Dynamic sampling (``algorithm.dynamic_sampling``; DAPO's group filter, verl-agent's GiGPO dynamic trainer):
    drop episode groups that carry no learning signal and collect new groups, round after round, until the
    batch holds ``env.num_groups`` informative groups or ``max_rounds`` generation rounds ran (then it trains
    on the informative groups it has, with a warning). Surplus groups of the last round are dropped, the latest
    first. Validation never filters. :mod:`megatron_gigpo.episodes.dynamic_sampling`."""

    enabled: bool = False
    # episode_return (default; verl-agent / DAPO): all N trajectory returns of the group are equal |
    # joint: every row's advantage (GiGPO: A^E + omega * A^S) is zero, so equal returns with step signal stay
    criterion: str = choice("episode_return", "megatron_gigpo.episodes.dynamic_sampling:CRITERIA")
    max_rounds: int = num(10, ge=1)  # generation rounds per iteration, the first included


@dataclass
class RolloutCorrectionConfig:
    """Train-inference mismatch correction (``algorithm.rollout_correction``): the policy loss weights each response
    token by the importance ratio ``rho = pi_actor_old / pi_engine`` of the actor's old probability to the
    probability the vLLM engine sampled it with (exp of the log-prob difference). ``tis`` (truncated importance
    sampling): weight ``min(rho, high)``; ``mis`` (masked importance sampling): weight ``rho`` inside ``[low, high]``
    and 0 outside. ``level: sequence`` uses one ratio per response, the geometric mean of its token ratios.
    With ``trainer.old_log_probs: rollout`` the PPO ratio already divides by the engine's probability, so only
    ``mis`` applies there (its mask, from the current policy's detached log-probs: after the update's first optimizer
    step it also drops tokens the update moved out of the band). Weights, metrics and the exact
    formulas: :mod:`megatron_gigpo.algo.rollout_correction`."""

    mode: str = choice("none", "megatron_gigpo.algo.rollout_correction:MODES")  # none | tis | mis
    level: str = choice("token", "megatron_gigpo.algo.rollout_correction:LEVELS")  # token | sequence
    low: float = num(0.5, ge=0, lt=1)  # mis: tokens / sequences with rho < low get weight 0
    high: float = num(2.0, gt=1)  # tis: rho truncated at high; mis: rho > high gets weight 0


@dataclass
class AlgorithmConfig:
    """Advantage estimator (GiGPO paper Sec. 4) and policy loss (PPO clip + KL). Passed whole to the advantage
    estimators (:func:`megatron_gigpo.algo.advantages.compute_advantages`) and, as the actor's ``loss``, to the
    policy update (:mod:`megatron_gigpo.actor.update`)."""

    # megatron_gigpo.algo.advantages.ADVANTAGE_ESTIMATORS
    adv_estimator: str = choice("gigpo", "megatron_gigpo.algo.advantages:ADVANTAGE_ESTIMATORS")
    gamma: float = num(0.95, gt=0, le=1)  # discount of the step returns (GiGPO Sec. 4.2)
    step_advantage_w: float = num(1.0, ge=0)  # omega in A = A_E + omega * A_S
    # mean_std_norm: (x - mean) / (std + epsilon) over the group | mean_norm: x - mean
    mode: str = choice("mean_std_norm", "megatron_gigpo.algo.group_stats:MODES")
    # trajectory (paper) | per_step_row (verl-agent parity)
    episode_stats: str = choice("trajectory", "megatron_gigpo.algo.advantages:EPISODE_STATS")
    enable_similarity: bool = False
    similarity_thresh: float = num(0.95, gt=0, lt=1)
    epsilon: float = num(1e-6, gt=0)
    # c is subtracted from the episode score and the step return of a row whose action was invalid
    invalid_action_penalty: bool = True
    invalid_action_penalty_coef: float = num(0.1, ge=0)
    # vanilla: PPO clipped surrogate (RL) | nll: supervised NLL (megatron_gigpo.algo.losses.POLICY_LOSSES)
    policy_loss: str = choice("vanilla", f"{_LOSSES}:POLICY_LOSSES")
    use_kl_loss: bool = True  # a frozen reference model is built only when true
    kl_loss_type: str = choice("low_var_kl", f"{_LOSSES}:KL_ESTIMATORS")
    kl_loss_coef: float = num(0.01, ge=0)
    clip_ratio_low: float = num(0.2, ge=0, lt=1)  # the ratio is clipped to [1 - low, 1 + high]
    clip_ratio_high: float = num(0.2, ge=0)
    clip_ratio_c: float = num(3.0, gt=1)  # dual-clip bound for negative advantages
    entropy_coeff: float = num(0.001, ge=0)  # entropy bonus weight (subtracted from the loss)
    # mixture-of-experts models: weight of megatron-core's load-balancing loss of each MoE layer (Switch
    # Transformer's, moe_router_load_balancing_type aux_loss), added to the policy loss; 0: off. Dense models: unread
    moe_aux_loss_coeff: float = num(0.0, ge=0)
    # mixture-of-experts models: off (the actor's routers choose) | rollout: the rollout engine returns each token's
    # routed experts and the actor's log-prob and update passes replay them (megatron-core's router replay;
    # megatron_gigpo.actor.router_replay). Refused for dense models
    router_replay: str = choice("off", ("off", "rollout"))
    # the mean is over the whole mini-batch (all micro-batches and data-parallel ranks)
    loss_agg_mode: str = choice("token-mean", f"{_LOSSES}:LOSS_AGG_MODES")
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


def router_replay_errors(router_replay: str, *, num_experts: int | None, model: str, pipeline_stages: int,
                         recompute_granularity: str | None) -> list[str]:
    """Why ``algorithm.router_replay`` cannot run with this model and layout, as messages naming the keys.

    Args:
        router_replay: ``"off"`` or ``"rollout"``.
        num_experts: the model's routed experts per MoE layer; None or 0 for a dense model.
        model: the model's path or id, for the message.
        pipeline_stages, recompute_granularity: the actor's layout.
    """
    if router_replay == "off":
        return []
    errors = []
    if not num_experts:
        errors.append(f"algorithm.router_replay={router_replay!r} needs a mixture-of-experts model; '{model}' is dense "
                      "(no num_experts): set algorithm.router_replay=off")
    if pipeline_stages > 1 and recompute_granularity == "full":
        errors.append(f"algorithm.router_replay={router_replay!r} with pipeline_model_parallel_size={pipeline_stages} "
                      "and recompute_granularity=full: a recomputed layer would replay a later micro-batch's experts; "
                      "use selective or no recomputation")
    return errors


def off_policy_errors(algorithm: AlgorithmConfig, old_log_probs: str, top_p: float, top_k: int) -> list[str]:
    """Combinations of ``algorithm.rollout_correction``, ``trainer.old_log_probs`` and the rollout's sampling
    truncation that cannot be made consistent, as messages naming the keys (empty: valid).

    The engines return log-probs of the distribution they sample from after temperature and top-k / top-p
    (vLLM ``logprobs_mode: processed_logprobs``, :mod:`megatron_gigpo.rollout.engine`): with a truncation on, that
    distribution is renormalised over the kept tokens, which the actor (logits / temperature over the whole
    vocabulary) does not compute, so the engine's log-probs cannot stand in for the actor's nor be compared with
    them token by token.
    """
    errors = []
    truncated = top_p < 1.0 or top_k > 0
    uses_engine = [f"algorithm.rollout_correction.mode={algorithm.rollout_correction.mode}"] * (
        algorithm.rollout_correction.mode != "none") + [f"trainer.old_log_probs={old_log_probs}"] * (
        old_log_probs == "rollout")
    if truncated and uses_engine:
        errors.append(f"{' and '.join(uses_engine)} need the engines' log-probs of the full distribution, but "
                      f"rollout.top_p={top_p} / rollout.top_k={top_k} truncate it (vLLM returns the renormalised "
                      "truncated distribution the actor cannot compute); set rollout.top_p=1.0 and rollout.top_k=-1, "
                      "or rollout_correction.mode=none and trainer.old_log_probs=recompute")
    if old_log_probs == "rollout" and algorithm.rollout_correction.mode == "tis":
        errors.append("algorithm.rollout_correction.mode=tis with trainer.old_log_probs=rollout: the PPO ratio "
                      "already divides by the engine's probability and its clip bounds it; use mode=mis (masks "
                      "mismatched tokens) or trainer.old_log_probs=recompute")
    return errors
