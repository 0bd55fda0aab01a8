"""Policy loss, KL penalties, entropy and aggregation against hand-written per-token formulas."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gigpo.algo.losses import (
    POLICY_LOSSES,
    agg_loss,
    compute_actor_loss,
    compute_policy_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
)

pytestmark = pytest.mark.unit


def _token_loss(lp: float, old: float, a: float, low: float, high: float, c: float) -> float:
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    return min(loss, -a * c) if a < 0 else loss


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    log_prob = old + torch.randn(4, 6, generator=gen) * 0.8  # ratios well outside the clip range
    adv = torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3] = False  # an empty row
    return log_prob, old, adv, mask


def test_clipped_surrogate_with_dual_clip_per_token():
    log_prob, old, adv, mask = _batch()
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                        clip_ratio_c=3.0, loss_agg_mode="token-mean")
    per_token = [
        _token_loss(log_prob[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.28, 3.0)
        for b in range(4) for t in range(6) if mask[b, t]
    ]
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-5)
    approx_kl = (old - log_prob)[mask].mean().item()
    assert metrics["ppo_kl"].item() == pytest.approx(approx_kl, rel=1e-5)
    assert 0 < metrics["pg_clipfrac"].item() < 1
    assert 0 <= metrics["pg_clipfrac_lower"].item() < 1


def test_dual_clip_bounds_negative_advantages():
    log_prob = torch.tensor([[5.0, 5.0]])  # ratio e^5 ~ 148
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                        clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(3.0 + -1.2)  # -A*c for A<0, -A*(1+high) for A>0
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.5)


def test_loss_gradient_flows_only_through_unclipped_tokens():
    log_prob = torch.tensor([[0.0, 1.0]], requires_grad=True)  # ratios 1 and e (clipped for A > 0)
    loss, _ = compute_policy_loss(log_prob, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                  clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                  loss_agg_mode="token-mean")
    loss.backward()
    assert log_prob.grad.tolist() == [[-0.5, 0.0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 10) / 4),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 10) / 2),  # the all-masked row is left out
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 10) / 2),
    ],
)
def test_agg_modes(mode, expected):
    loss = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected)


def test_agg_of_nothing_is_zero():
    assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "token-mean").item() == 0.0


@pytest.mark.parametrize(
    ("kl_type", "fn"),
    [
        ("k1", lambda lp, ref: lp - ref),
        ("kl", lambda lp, ref: lp - ref),
        ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
        ("mse", lambda lp, ref: 0.5 * (lp - ref) ** 2),
        ("low_var_kl", lambda lp, ref: min(max(math.exp(ref - lp) - (ref - lp) - 1, -10), 10)),
        ("k3", lambda lp, ref: min(max(math.exp(ref - lp) - (ref - lp) - 1, -10), 10)),
    ],
)
def test_kl_penalties(kl_type, fn):
    lp = torch.tensor([[-1.0, -2.0, -0.1, -30.0]])
    ref = torch.tensor([[-1.5, -0.5, -0.1, -1.0]])
    got = kl_penalty(lp, ref, kl_type)
    expected = [fn(a, b) for a, b in zip(lp[0].tolist(), ref[0].tolist())]
    assert got[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(got).all()


def test_low_var_kl_is_clamped():
    got = kl_penalty(torch.tensor([[-50.0]]), torch.tensor([[0.0]]), "low_var_kl")
    assert got.item() == 10.0


def test_entropy_from_logits_matches_distribution():
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(0)) * 4
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), ref, rtol=1e-5, atol=1e-6)


def test_actor_loss_adds_entropy_bonus_and_kl():
    log_prob, old, adv, mask = _batch(1)
    entropy = torch.rand(4, 6)
    ref_lp = old + 0.1
    kw = dict(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
              loss_agg_mode="token-mean")
    pg, _ = compute_policy_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                clip_ratio_c=3.0, loss_agg_mode="token-mean")
    total, metrics = compute_actor_loss(log_prob, old, adv, mask, entropy=entropy, entropy_coeff=0.01,
                                        ref_log_prob=ref_lp, kl_loss_type="low_var_kl", kl_loss_coef=0.1, **kw)
    ent = entropy[mask].mean()
    kl = kl_penalty(log_prob, ref_lp, "low_var_kl")[mask].mean()
    assert total.item() == pytest.approx((pg - 0.01 * ent + 0.1 * kl).item(), rel=1e-5)
    assert metrics["entropy"].item() == pytest.approx(ent.item(), rel=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(kl.item(), rel=1e-6)
    with pytest.raises(ValueError, match="no entropy tensor"):
        compute_actor_loss(log_prob, old, adv, mask, entropy=None, entropy_coeff=0.01, ref_log_prob=None,
                           kl_loss_type="k1", kl_loss_coef=0.0, **kw)
    with pytest.raises(ValueError, match="no ref_log_prob"):
        compute_actor_loss(log_prob, old, adv, mask, entropy=None, entropy_coeff=0.0, ref_log_prob=None,
                           kl_loss_type="k1", kl_loss_coef=0.1, **kw)


def test_bad_inputs_are_named():
    x = torch.zeros(2, 3)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="same \\(B, T\\) shape"):
        compute_policy_loss(x, torch.zeros(2, 4), x, x, **kw)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(x, x, x, x, **dict(kw, clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        compute_policy_loss(x, x, x, x, **dict(kw, loss_agg_mode="sum"))
    with pytest.raises(ValueError, match="unknown kl_type 'k4'"):
        kl_penalty(x, x, "k4")
    with pytest.raises(KeyError, match="unknown policy loss 'gspo'"):
        get_policy_loss("gspo")
    assert POLICY_LOSSES["vanilla"] is compute_policy_loss


def test_nll_loss_against_hand_computation():
    log_prob = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    unused = torch.full_like(log_prob, 7.0)  # old log-probs and advantages do not enter the NLL
    nll = get_policy_loss("nll")
    loss, metrics = nll(log_prob, unused, unused, mask, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx((0.5 + 2.0 + 1.0 + 3.0 + 0.25) / 5)
    assert metrics["nll"].item() == pytest.approx(loss.item())
    loss, _ = nll(log_prob, unused, unused, mask, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx((3.5 + 3.25) / 2)
    loss, _ = nll(log_prob, unused, unused, mask, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx((3.5 / 3 + 3.25 / 2) / 2)
    # Through the actor's full objective, selected by name: the gradient is -mask / tokens on every token.
    lp = log_prob.clone().requires_grad_(True)
    total, metrics = compute_actor_loss(
        lp, unused, unused, mask, policy_loss="nll", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        loss_agg_mode="token-mean", entropy=None, entropy_coeff=0.0, ref_log_prob=None, kl_loss_type="k1",
        kl_loss_coef=0.0,
    )
    total.backward()
    assert torch.allclose(lp.grad, -mask.float() / 5)
    assert set(metrics) == {"nll"}


def test_actor_config_refuses_an_unknown_policy_loss():
    from megatron_gigpo.actor.config import ActorConfig

    ActorConfig.build("m", policy_loss="nll").validate()
    with pytest.raises(ValueError, match=r"loss.policy_loss='sft' is not one of (vanilla, nll|nll, vanilla)"):
        ActorConfig.build("m", policy_loss="sft").validate()


def test_one_counted_token_is_its_own_mean():
    """A mask with a single token: the mean is that token's value (found by mutation testing: a clamp of the
    token count at 2 instead of 1 passed every other test)."""
    from megatron_gigpo.algo.losses import masked_mean

    values, mask = torch.tensor([[2.0, 5.0], [7.0, 9.0]]), torch.tensor([[True, False], [False, False]])
    assert masked_mean(values, mask).item() == 2.0
    assert agg_loss(values, mask, "token-mean").item() == 2.0
