"""Policy losses: PPO clipped surrogate (dual clip), supervised NLL, KL penalties, entropy and loss aggregation.

All tensors are token level, ``(B, T)`` float32, aligned with a ``response_mask`` of the same shape (1 on
response tokens that count, 0 on padding). Names follow verl's ``core_algos`` vocabulary
(``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``, ``loss_agg_mode``, ``low_var_kl``) so that recipes
read the same; the code is written for this project.

Sources:
- PPO clipped surrogate: Schulman et al. 2017, arXiv 1707.06347, Eq. 7; separate low/high clip ("clip-higher")
  from DAPO, arXiv 2503.14476, Eq. 10.
- Dual clip: Ye et al. 2020, arXiv 1912.09729, Eq. 5 (lower bound ``c * A`` for negative advantages).
- KL estimators k1/k2/k3: J. Schulman, "Approximating KL divergence" (2020); k3 is verl's ``low_var_kl``.
- ``nll``: the token-level cross-entropy of supervised fine-tuning (the cold-start stage, :mod:`megatron_gigpo.sft`).
"""

from __future__ import annotations

from typing import Callable

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Accepted names of each KL estimator; the first is the canonical one.
_KL_ALIASES = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}

# exp() of a log-ratio above ~88 overflows float32; 20 already means a ratio of 5e8, far outside any clip.
#: KL estimator names of :func:`kl_penalty` (``algorithm.kl_loss_type``).
KL_ESTIMATORS: tuple[str, ...] = tuple(_KL_ALIASES)
_LOG_RATIO_CLAMP = 20.0
# low_var_kl is clamped like verl does so that one token with a vanishing reference probability cannot
# dominate the batch.
_LOW_VAR_KL_CLAMP = 10.0

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` in :data:`POLICY_LOSSES`.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"token-level tensors must have the same (B, T) shape, got {shapes}")
    for k, v in tensors.items():
        if v.dim() != 2:
            raise ValueError(f"{k} must be 2-D (B, T), got shape {tuple(v.shape)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is non-zero; 0 when the mask is empty.

    Args:
        values: any shape, float.
        mask: same shape, bool or {0, 1}.
    Returns:
        scalar tensor, dtype of ``values``.
    """
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Aggregate a token-level loss into a scalar.

    Args:
        loss_mat: (B, T) float, per-token loss.
        loss_mask: (B, T) bool or {0, 1}, tokens that count.
        loss_agg_mode: ``token-mean`` (sum over all counted tokens / their number),
            ``seq-mean-token-sum`` (per-sequence token sum, averaged over sequences),
            ``seq-mean-token-mean`` (per-sequence token mean, averaged over sequences). Sequences whose mask
            is all zero are left out of the sequence averages.
    Returns:
        scalar tensor (0 when nothing is counted).
    Raises:
        ValueError: unknown mode, or shapes differ.
    """
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1.0)
    seq_tokens = mask.sum(dim=-1)  # (B,)
    seq_present = (seq_tokens > 0).to(loss_mat.dtype)  # (B,)
    num_seqs = seq_present.sum().clamp(min=1.0)
    seq_sum = (loss_mat * mask).sum(dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sum / seq_tokens.clamp(min=1.0)).sum() / num_seqs
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


@register_policy_loss("vanilla")
def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip.

    Per token, with ratio ``r = exp(log_prob - old_log_prob)`` and advantage ``A``:
    ``L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))`` (PPO Eq. 7 with DAPO's separate
    bounds); for ``A < 0`` additionally ``L = min(L, -A c)`` with ``c = clip_ratio_c`` (dual clip, Ye et al.
    Eq. 5), which bounds the loss of a token whose ratio has exploded.

    Args:
        log_prob: (B, T) float32, current policy log-probs of the taken tokens.
        old_log_prob: (B, T) float32, behaviour (rollout / old actor) log-probs.
        advantages: (B, T) float32, per-token advantages.
        response_mask: (B, T) bool or {0, 1}.
        clip_ratio_low, clip_ratio_high: clip bounds, >= 0.
        clip_ratio_c: dual-clip constant, > 1.
        loss_agg_mode: see :func:`agg_loss`.
        token_weights: (B, T) float32 without gradient, or None (all 1): each token's loss is multiplied by its
            weight before aggregation (the mismatch correction, :mod:`megatron_gigpo.algo.rollout_correction`).
    Returns:
        ``(loss, metrics)``: scalar loss; metrics (scalars, detached): ``pg_loss``, ``pg_clipfrac`` (fraction of
        tokens where the clipped branch is active), ``pg_clipfrac_lower`` (dual clip active), ``ppo_kl``
        (approximate KL(old || new) as the masked mean of ``old_log_prob - log_prob``).
    Raises:
        ValueError: shapes differ, a clip bound is negative, ``clip_ratio_c <= 1`` or an unknown agg mode.
    """
    _check_same_shape(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_low/high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    neg_approx_kl = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(neg_approx_kl)  # (B, T)
    ppo_kl = masked_mean(-neg_approx_kl, mask)

    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).to(log_prob.dtype), mask)

    loss_dual = -advantages * clip_ratio_c  # (B, T)
    loss_dual_clipped = torch.minimum(loss_dual, loss_ppo)
    negative = advantages < 0
    clipfrac_lower = masked_mean(((loss_ppo > loss_dual) & negative).to(log_prob.dtype), mask)
    loss_mat = torch.where(negative, loss_dual_clipped, loss_ppo)
    if token_weights is not None:
        _check_same_shape(log_prob=log_prob, token_weights=token_weights)
        loss_mat = loss_mat * token_weights.detach()

    loss = agg_loss(loss_mat, mask, loss_agg_mode)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return loss, metrics


@register_policy_loss("nll")
def compute_nll_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.0,
    clip_ratio_high: float = 0.0,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response tokens: supervised fine-tuning on demonstrations.

    Per token ``L = -log_prob``, aggregated by ``loss_agg_mode`` over the response mask (prompt tokens never
    enter: the actor computes log-probs of response tokens only). The registry's common signature is kept
    so the actor's loss head can select this loss by name; ``old_log_prob``, ``advantages`` and the clip
    settings are accepted and not used.

    Args:
        log_prob: (B, T) float32, current policy log-probs of the target tokens.
        old_log_prob, advantages: (B, T), ignored (shape-checked only).
        response_mask: (B, T) bool or {0, 1}.
        clip_ratio_low, clip_ratio_high, clip_ratio_c, token_weights: ignored (demonstrations have no engine).
        loss_agg_mode: see :func:`agg_loss`.
    Returns:
        ``(loss, metrics)``; metrics: ``nll`` (the aggregated loss, detached).
    Raises:
        ValueError: shapes differ or an unknown agg mode.
    """
    _check_same_shape(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    loss = agg_loss(-log_prob, response_mask.to(log_prob.dtype), loss_agg_mode)
    return loss, {"nll": loss.detach()}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    Args:
        log_prob: (B, T) float32, current policy log-probs.
        ref_log_prob: (B, T) float32, reference policy log-probs.
        kl_type: ``k1`` (alias ``kl``): ``log_prob - ref_log_prob``; ``k2`` (alias ``mse``):
            ``0.5 (log_prob - ref_log_prob)^2``; ``low_var_kl`` (alias ``k3``):
            ``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10] (Schulman 2020's k3).
    Returns:
        (B, T) tensor, dtype of ``log_prob``.
    Raises:
        ValueError: unknown ``kl_type`` or shapes differ.
    """
    if kl_type not in _KL_ALIASES:
        raise ValueError(f"unknown kl_type {kl_type!r}; expected one of {sorted(_KL_ALIASES)}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob shape {tuple(log_prob.shape)} != ref_log_prob shape {tuple(ref_log_prob.shape)}"
        )
    kind = _KL_ALIASES[kl_type]
    diff = log_prob - ref_log_prob
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(pi_ref / pi)
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kl, -_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` over the last dimension.

    Args:
        logits: (..., V) float.
    Returns:
        (...) tensor, dtype of ``logits``: ``logsumexp(z) - sum(softmax(z) * z)`` (nats).
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    policy_loss: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    entropy: torch.Tensor | None,
    entropy_coeff: float,
    ref_log_prob: torch.Tensor | None,
    kl_loss_type: str,
    kl_loss_coef: float,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's full objective: ``policy_loss - entropy_coeff * H + kl_loss_coef * KL``.

    Args:
        log_prob, old_log_prob, advantages, response_mask: (B, T), see :func:`compute_policy_loss`.
        policy_loss: name in :data:`POLICY_LOSSES`.
        clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode: passed to the policy loss.
        entropy: (B, T) float32 per-token entropy, or None (no bonus; then ``entropy_coeff`` must be 0).
        entropy_coeff: weight of the entropy bonus (>= 0).
        ref_log_prob: (B, T) reference log-probs, or None (no KL loss; then ``kl_loss_coef`` must be 0).
        kl_loss_type: see :func:`kl_penalty`.
        kl_loss_coef: weight of the KL loss (>= 0).
        token_weights: (B, T) mismatch-correction weights of the policy loss, or None.
    Returns:
        ``(loss, metrics)``; metrics add ``entropy`` and ``kl_loss`` (aggregated like the loss) to the policy
        loss's metrics.
    Raises:
        ValueError: a coefficient is non-zero while its tensor is None, or a coefficient is negative.
    """
    if entropy_coeff < 0 or kl_loss_coef < 0:
        raise ValueError(f"entropy_coeff and kl_loss_coef must be >= 0, got {entropy_coeff}, {kl_loss_coef}")
    if entropy is None and entropy_coeff != 0:
        raise ValueError(f"entropy_coeff={entropy_coeff} but no entropy tensor was given")
    if ref_log_prob is None and kl_loss_coef != 0:
        raise ValueError(f"kl_loss_coef={kl_loss_coef} but no ref_log_prob was given")
    loss, metrics = get_policy_loss(policy_loss)(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        token_weights=token_weights,
    )
    if entropy is not None:
        ent = agg_loss(entropy, response_mask, loss_agg_mode)
        loss = loss - entropy_coeff * ent
        metrics["entropy"] = ent.detach()
    if ref_log_prob is not None:
        kl = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode)
        loss = loss + kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
    return loss, metrics
