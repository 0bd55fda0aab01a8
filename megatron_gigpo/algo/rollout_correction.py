"""Train-inference mismatch: the importance weights of ``algorithm.rollout_correction`` and the per-iteration
mismatch metrics.

The vLLM engine samples with its own kernels (another dtype, other reduction orders), so the distribution it
samples from, ``pi_engine``, differs from the actor's ``pi_actor`` on the same weights. Per response token, with
``d = log pi_actor_old - log pi_engine`` (the actor's old log-prob minus the engine's sampling log-prob, both of
``logits / temperature`` over the whole vocabulary; :func:`megatron_gigpo.algo.config.off_policy_errors` refuses the
truncated sampling distributions this does not hold for):

- ``rho = exp(d)``; at ``level: sequence`` one ``rho`` per response, ``exp(mean_t d_t)`` (geometric mean of the
  token ratios), given to each of its tokens;
- ``tis``: weight ``min(rho, high)`` (truncated importance sampling; "affected" tokens: ``rho > high``);
- ``mis``: weight ``rho`` where ``low <= rho <= high``, else 0 (masked importance sampling; affected: outside);
- ``none``: weight 1.

The policy loss multiplies each token's PPO term by its weight (:func:`megatron_gigpo.algo.losses.compute_policy_loss`,
``token_weights``); weights carry no gradient, and a masked token still counts in the loss's token or sequence
mean (it contributes 0). With ``trainer.old_log_probs: rollout`` the PPO ratio is ``pi_theta / pi_engine`` and
already contains ``rho``, so the weight is the ``mis`` mask alone, with ``rho`` from the current policy's detached
log-probs (``ratio_has_engine=True``): the actor's old log-probs on the update's first optimizer step, after which
the mask also drops tokens the update itself moved out of the band; ``tis`` is refused there.

Sources: truncated IS for the rollout-training mismatch, Yao et al. 2025 ("Your efficient RL framework secretly
brings you off-policy RL training"); masked IS / rejection of mismatched tokens and sequences, Liu et al. 2025
("When speed kills stability"); k3 KL estimator, J. Schulman, "Approximating KL divergence" (2020).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["MODES", "LEVELS", "correction_weights", "mismatch_metrics"]

#: ``algorithm.rollout_correction.mode`` values.
MODES = ("none", "tis", "mis")
#: ``algorithm.rollout_correction.level`` values.
LEVELS = ("token", "sequence")

_LOG_CLAMP = 20.0  # exp(20) = 5e8: far outside any band; keeps exp finite in float32


def _log_rho(prox_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
             level: str) -> torch.Tensor:
    """(B, T) log importance ratio per token (token level) or per response, broadcast to its tokens."""
    m = mask.to(prox_log_prob.dtype)
    d = (prox_log_prob - rollout_log_prob) * m
    if level == "sequence":
        d = (d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(d) * m
    elif level != "token":
        raise ValueError(f"rollout_correction.level={level!r} is not one of {', '.join(LEVELS)}")
    return d.clamp(-_LOG_CLAMP, _LOG_CLAMP)


def correction_weights(prox_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, *,
                       mode: str, level: str, low: float, high: float,
                       ratio_has_engine: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of the mismatch correction (module docstring).

    Args:
        prox_log_prob: (B, T) float32, the actor's old log-probs (``recompute``) or the current policy's
            (``rollout``); detached here.
        rollout_log_prob: (B, T) float32, the engine's sampling log-probs.
        mask: (B, T) bool or {0, 1}, response tokens.
        mode: ``none`` | ``tis`` | ``mis``; level: ``token`` | ``sequence``; low, high: the band.
        ratio_has_engine: the PPO ratio already divides by ``pi_engine`` (``trainer.old_log_probs: rollout``):
            ``mis`` weights are the mask alone.
    Returns:
        ``(weights, affected)``: (B, T) float32 weights (0 on padding) and (B, T) bool, the tokens truncated
        (``tis``) or masked (``mis``).
    Raises:
        ValueError: an unknown mode or level, shapes that differ, or ``tis`` with ``ratio_has_engine``.
    """
    if prox_log_prob.shape != rollout_log_prob.shape or prox_log_prob.shape != mask.shape:
        raise ValueError(f"shapes differ: {tuple(prox_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, "
                         f"{tuple(mask.shape)}")
    on = mask.bool()
    if mode == "none":
        return on.to(torch.float32), torch.zeros_like(on)
    rho = torch.exp(_log_rho(prox_log_prob.detach().float(), rollout_log_prob.float(), mask, level))
    if mode == "tis":
        if ratio_has_engine:
            raise ValueError("rollout_correction.mode=tis with trainer.old_log_probs=rollout: the PPO ratio already "
                             "holds the engine ratio (use mis)")
        return torch.clamp(rho, max=high) * on, (rho > high) & on
    if mode == "mis":
        inside = (rho >= low) & (rho <= high)
        weights = inside.to(torch.float32) if ratio_has_engine else rho * inside
        return weights * on, ~inside & on
    raise ValueError(f"rollout_correction.mode={mode!r} is not one of {', '.join(MODES)}")


def mismatch_metrics(actor_log_probs: Sequence[torch.Tensor], rollout_log_probs: Sequence[torch.Tensor], *,
                     mode: str, level: str, low: float, high: float) -> dict[str, float]:
    """The batch's train-inference mismatch, from the actor's old log-probs and the engine's of the same tokens.

    Args:
        actor_log_probs, rollout_log_probs: per row float32 (R_i,).
        mode, level, low, high: ``algorithm.rollout_correction`` (what counts as truncated / masked).
    Returns:
        ``rollout_correction/mismatch_kl``: KL(pi_engine || pi_actor) per token, the k3 estimator
        ``exp(d) - d - 1`` on the engine's samples, averaged over tokens; ``rollout_correction/rho_p5``, ``_p50``,
        ``_p95``: percentiles of ``rho`` over tokens (token level) or responses (sequence level);
        ``rollout_correction/truncated_frac`` (``tis``) or ``masked_frac`` (``mis``): share of response tokens
        the weights truncate or mask. Empty for a batch without response tokens.
    """
    rows = [(a.float(), r.float()) for a, r in zip(actor_log_probs, rollout_log_probs, strict=True) if r.numel()]
    if not rows:
        return {}
    actor = pad_sequence([a for a, _ in rows], batch_first=True)
    engine = pad_sequence([r for _, r in rows], batch_first=True)
    mask = pad_sequence([torch.ones(r.numel(), dtype=torch.bool) for _, r in rows], batch_first=True)
    d = (actor - engine).clamp(-_LOG_CLAMP, _LOG_CLAMP)[mask].double()  # float64: k3 of d ~ 1e-5 is ~1e-10
    log_rho = _log_rho(actor, engine, mask, level)
    per = log_rho[:, 0] if level == "sequence" else log_rho[mask]
    q = torch.quantile(per.exp().double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    out = {"rollout_correction/mismatch_kl": float((torch.expm1(d) - d).mean()),
           "rollout_correction/rho_p5": float(q[0]), "rollout_correction/rho_p50": float(q[1]),
           "rollout_correction/rho_p95": float(q[2])}
    if mode != "none":
        _, affected = correction_weights(actor, engine, mask, mode=mode, level=level, low=low, high=high)
        key = "truncated_frac" if mode == "tis" else "masked_frac"
        out[f"rollout_correction/{key}"] = float(affected[mask].double().mean())
    return out
