"""Policy losses, edge cases: the registry, the exact validation errors, dtypes with float64 masks, the KL of a
token the policy gives probability 0, and compute_actor_loss passing every setting on to the policy loss.

Complements test_losses.py; written to kill the mutants that survived it (issue #43,
/work/notes/mutmut-s33/scatter.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gigpo.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_actor_loss,
    compute_policy_loss,
    get_policy_loss,
    kl_penalty,
    masked_mean,
    register_policy_loss,
)

pytestmark = pytest.mark.unit


def test_register_policy_loss_adds_a_new_name_and_refuses_a_taken_one():
    def my_loss(*args, **kwargs):
        raise AssertionError("never called")

    name = "test-edges-loss"
    assert name not in POLICY_LOSSES
    try:
        assert register_policy_loss(name)(my_loss) is my_loss
        assert get_policy_loss(name) is my_loss
        with pytest.raises(ValueError, match="policy loss 'test-edges-loss' is already registered"):
            register_policy_loss(name)(my_loss)
    finally:
        POLICY_LOSSES.pop(name, None)
    with pytest.raises(ValueError, match="policy loss 'vanilla' is already registered"):
        register_policy_loss("vanilla")(my_loss)
    assert POLICY_LOSSES["vanilla"] is compute_policy_loss


def test_agg_loss_checks_both_shapes():
    loss = torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss_mat must be 2-D \\(B, T\\), got shape \\(3,\\)"):
        agg_loss(torch.ones(3), torch.ones(3), "token-mean")
    # shapes that broadcast are still refused, whichever of the two is the odd one
    with pytest.raises(ValueError, match="same \\(B, T\\) shape"):
        agg_loss(loss, torch.ones(1, 3), "token-mean")
    with pytest.raises(ValueError, match="same \\(B, T\\) shape"):
        agg_loss(torch.ones(1, 3), loss.bool(), "token-mean")


def test_float64_masks_keep_the_float32_dtype_of_the_values():
    values = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mean = masked_mean(values, mask)
    assert mean.dtype == torch.float32 and mean.item() == pytest.approx(11.0 / 3)
    expected = {"token-mean": 11.0 / 3, "seq-mean-token-sum": (3.0 + 8.0) / 2, "seq-mean-token-mean": (1.5 + 8) / 2}
    for mode in LOSS_AGG_MODES:
        got = agg_loss(values, mask, mode)
        assert got.dtype == torch.float32, mode
        assert got.item() == pytest.approx(expected[mode]), mode


def test_kl_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"log_prob shape \(2, 3\) != ref_log_prob shape \(2, 4\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


def test_low_var_kl_of_a_token_with_zero_policy_probability_is_the_cap():
    """log_prob = -inf (the policy gives the sampled token probability 0 in float32): the log-ratio is clamped
    to 20 before exp, so the k3 estimate is the cap 10, not inf - inf = NaN."""
    log_prob = torch.tensor([[-math.inf, -60.0, 0.0]])
    ref = torch.tensor([[-1.0, 0.0, -60.0]])
    got = kl_penalty(log_prob, ref, "low_var_kl")
    assert got.tolist() == [[10.0, 10.0, 10.0]]


def test_negative_coefficients_are_refused_even_with_their_tensors():
    x = torch.zeros(1, 2)
    kw = dict(policy_loss="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
              loss_agg_mode="token-mean", entropy=x, ref_log_prob=x, kl_loss_type="k1")
    with pytest.raises(ValueError, match="entropy_coeff and kl_loss_coef must be >= 0, got -0.1, 0.0"):
        compute_actor_loss(x, x, x, x, entropy_coeff=-0.1, kl_loss_coef=0.0, **kw)
    with pytest.raises(ValueError, match="entropy_coeff and kl_loss_coef must be >= 0, got 0.0, -0.1"):
        compute_actor_loss(x, x, x, x, entropy_coeff=0.0, kl_loss_coef=-0.1, **kw)


def test_actor_loss_passes_every_policy_setting_on():
    """Non-default clip_ratio_c, aggregation and token weights, each changing the loss: compute_actor_loss with
    no entropy/KL term equals the policy loss called directly with the same settings."""
    old = torch.zeros(2, 3)
    log_prob = torch.tensor([[1.5, 0.1, -0.2], [1.5, 0.3, 0.0]])  # ratio e^1.5 = 4.5 trips the dual clip
    adv = torch.tensor([[-1.0, 0.5, 2.0], [-1.0, -0.5, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights = torch.tensor([[0.5, 1.0, 2.0], [3.0, 1.0, 1.0]])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.0, loss_agg_mode="seq-mean-token-sum",
              token_weights=weights)
    expected, expected_metrics = compute_policy_loss(log_prob, old, adv, mask, **kw)
    # the settings matter: each default gives another loss
    for default in (dict(clip_ratio_c=3.0), dict(loss_agg_mode="token-mean"), dict(token_weights=None)):
        other, _ = compute_policy_loss(log_prob, old, adv, mask, **dict(kw, **default))
        assert abs(other.item() - expected.item()) > 0.1, default
    got, metrics = compute_actor_loss(log_prob, old, adv, mask, policy_loss="vanilla", entropy=None,
                                      entropy_coeff=0.0, ref_log_prob=None, kl_loss_type="k1", kl_loss_coef=0.0,
                                      **kw)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(expected_metrics["pg_clipfrac_lower"].item())
