"""Mismatch correction (#41 item 1): the token weights of tis / mis at token and sequence level against a hand
computation on a small batch, the policy loss they give, the mismatch metrics, and the config errors of the
settings (`validate` through the command line, each message naming the keys)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_gigpo.algo.losses import compute_policy_loss
from megatron_gigpo.algo.rollout_correction import correction_weights, mismatch_metrics
from megatron_gigpo.cli import main

pytestmark = pytest.mark.unit

SMOKE = str(Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "cpu.yaml")

# Two responses, 3 and 2 tokens. Token ratios rho = pi_actor_old / pi_engine chosen by hand:
#   row 0: 1.5, 3.0, 0.4     row 1: 1.0, 0.25 (then padding)
RHO = [[1.5, 3.0, 0.4], [1.0, 0.25, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
ENGINE = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -9.0]])
ACTOR = ENGINE + torch.log(torch.tensor(RHO))
BAND = dict(low=0.5, high=2.0)

# By hand (low 0.5, high 2.0):
#   tis token:    min(rho, 2)                         -> [1.5, 2.0, 0.4], [1.0, 0.25, 0]
#   mis token:    rho inside [0.5, 2] else 0          -> [1.5, 0, 0],     [1.0, 0, 0]
#   sequence rho: geometric means (1.5*3*0.4)^(1/3) = 1.8^(1/3) = 1.21644; (1*0.25)^(1/2) = 0.5
#   tis sequence: [1.21644] * 3, [0.5, 0.5]
#   mis sequence: [1.21644] * 3, [0.5, 0.5] (0.5 is inside the closed band)
#   mis sequence with low 0.6: row 1 masked -> [1.21644] * 3, [0, 0]
G0 = 1.8 ** (1 / 3)
EXPECTED = {
    ("tis", "token"): [[1.5, 2.0, 0.4], [1.0, 0.25, 0.0]],
    ("mis", "token"): [[1.5, 0.0, 0.0], [1.0, 0.0, 0.0]],
    ("tis", "sequence"): [[G0, G0, G0], [0.5, 0.5, 0.0]],
    ("mis", "sequence"): [[G0, G0, G0], [0.5, 0.5, 0.0]],
    ("none", "token"): [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]],
}


def _weights(actor, engine, mode, level, **band):
    return correction_weights(actor, engine, MASK, mode=mode, level=level, **(band or BAND))


@pytest.mark.parametrize("mode, level", list(EXPECTED))
def test_weights_equal_the_hand_computation(mode, level):
    weights, _ = _weights(ACTOR, ENGINE, mode, level)
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[mode, level]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode, level", [k for k in EXPECTED if k[0] != "none"])
def test_a_flipped_ratio_fails_the_hand_computation(mode, level):
    """engine / actor instead of actor / engine: the weights no longer match (the deliberate bug the test catches)."""
    flipped, _ = _weights(ENGINE, ACTOR, mode, level)
    assert not torch.allclose(flipped, torch.tensor(EXPECTED[mode, level]), atol=1e-3)


def test_sequence_mis_masks_whole_responses_and_reports_them():
    weights, affected = _weights(ACTOR, ENGINE, "mis", "sequence", low=0.6, high=2.0)
    torch.testing.assert_close(weights, torch.tensor([[G0, G0, G0], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert affected.tolist() == [[False, False, False], [True, True, False]]


def test_rollout_old_log_probs_mis_is_the_mask_alone_and_tis_is_refused():
    weights, _ = correction_weights(ACTOR, ENGINE, MASK, mode="mis", level="token", ratio_has_engine=True, **BAND)
    assert weights.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="use mis"):
        correction_weights(ACTOR, ENGINE, MASK, mode="tis", level="token", ratio_has_engine=True, **BAND)


def test_policy_loss_weights_each_token():
    """The PPO loss with weights equals the hand-weighted per-token PPO terms (ratio 1 here: old = current)."""
    adv = torch.tensor([[1.0, -2.0, 0.5], [2.0, 1.0, 0.0]])
    weights, _ = _weights(ACTOR, ENGINE, "tis", "token")
    loss, _ = compute_policy_loss(ACTOR, ACTOR, adv, MASK, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                  token_weights=weights)
    w = EXPECTED["tis", "token"]
    by_hand = -(1.0 * w[0][0] - 2.0 * w[0][1] + 0.5 * w[0][2] + 2.0 * w[1][0] + 1.0 * w[1][1]) / 5
    assert float(loss) == pytest.approx(by_hand, abs=1e-6)


def test_mismatch_metrics():
    actor = [ACTOR[0], ACTOR[1, :2]]
    engine = [ENGINE[0], ENGINE[1, :2]]
    m = mismatch_metrics(actor, engine, mode="tis", level="token", **BAND)
    rhos = [1.5, 3.0, 0.4, 1.0, 0.25]
    k3 = sum(r - math.log(r) - 1 for r in rhos) / 5
    assert m["rollout_correction/mismatch_kl"] == pytest.approx(k3, rel=1e-5)
    assert m["rollout_correction/rho_p50"] == pytest.approx(1.0, rel=1e-5)
    assert m["rollout_correction/rho_p5"] < 0.4 and m["rollout_correction/rho_p95"] > 2.0
    assert m["rollout_correction/truncated_frac"] == pytest.approx(1 / 5)
    m = mismatch_metrics(actor, engine, mode="mis", level="sequence", low=0.6, high=2.0)
    assert m["rollout_correction/masked_frac"] == pytest.approx(2 / 5)  # row 1's two tokens
    same = mismatch_metrics(engine, engine, mode="none", level="token", **BAND)
    assert same["rollout_correction/mismatch_kl"] == 0.0 and same["rollout_correction/rho_p50"] == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.rollout_correction.mode=is"], "algorithm.rollout_correction.mode='is' is not one of none, tis, mis"),
    (["algorithm.rollout_correction.level=batch"], "algorithm.rollout_correction.level='batch' is not one of"),
    (["algorithm.rollout_correction.low=1.5"], "algorithm.rollout_correction.low=1.5 must be in [0, 1)"),
    (["algorithm.rollout_correction.high=0.9"], "algorithm.rollout_correction.high=0.9 must be > 1"),
    (["trainer.old_log_probs=engine"], "trainer.old_log_probs='engine' is not one of recompute, rollout"),
    (["trainer.stale_engine_gap=0"], "trainer.stale_engine_gap=0.0 must be > 0"),
    (["algorithm.rollout_correction.mode=tis", "rollout.top_p=0.9"],
     "algorithm.rollout_correction.mode=tis need the engines' log-probs of the full distribution, but rollout.top_p=0.9"),
    (["trainer.old_log_probs=rollout", "rollout.top_k=20"], "trainer.old_log_probs=rollout need the engines'"),
    (["trainer.old_log_probs=rollout", "algorithm.rollout_correction.mode=tis"],
     "algorithm.rollout_correction.mode=tis with trainer.old_log_probs=rollout"),
])
def test_bad_settings_are_config_errors_naming_the_keys(overrides, message, capsys):
    assert main(["validate", SMOKE, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-gigpo: config error: ") and message in err, err


@pytest.mark.parametrize("overrides", [["algorithm.rollout_correction.mode=mis", "trainer.old_log_probs=rollout",
                                        "algorithm.rollout_correction.level=sequence", "trainer.stale_engine_gap=1e-3"],
                                       ["algorithm.rollout_correction.mode=tis", "rollout.temperature=0.7"]])
def test_good_settings_validate(overrides, capsys):
    assert main(["validate", SMOKE, *overrides]) == 0, capsys.readouterr().err
