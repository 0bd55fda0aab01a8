"""Mismatch correction and engine old log-probs in the real Megatron update (two gloo ranks, DP2; #41 items 1-2).

- An engine whose log-probs differ from the actor's by a known amount per token: the update's policy loss equals
  the hand computation ``-sum_t A_row * w_t / tokens`` with ``w`` the tis / mis weights computed here by hand
  (on-policy update: the PPO ratio is exactly 1, so the loss is the weighted advantage alone).
- ``trainer.old_log_probs: rollout`` and ``recompute`` take the same update (loss, gradient norm, weights) when
  the engine's log-probs equal the actor's, over two mini-batches (the recompute mode's own forward pass).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from actor_helpers import actor_config, export_full_weights, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# (mode, level, low, high): tis truncates rho above 1.2; mis keeps responses whose geometric-mean rho is in [0.9, 1.1]
CASES = {"tis_token": ("tis", "token", 0.5, 1.2), "mis_sequence": ("mis", "sequence", 0.9, 1.1)}


def _engine_offset(row: int, t: int) -> float:
    """log pi_engine - log pi_actor of token t of row: a fixed pattern in [-0.4, 0.4]."""
    return 0.4 * math.sin(1.7 * row + 0.9 * t + 0.3)


def _hand_weights(mode: str, level: str, low: float, high: float, lengths: list[int]) -> list[list[float]]:
    out = []
    for row, n in enumerate(lengths):
        rhos = [math.exp(-_engine_offset(row, t)) for t in range(n)]  # pi_actor / pi_engine
        if level == "sequence":
            rhos = [math.exp(sum(math.log(r) for r in rhos) / n)] * n
        if mode == "tis":
            out.append([min(r, high) for r in rhos])
        else:
            out.append([r if low <= r <= high else 0.0 for r in rhos])
    return out


def _weighted_updates(model_dir) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor
    from megatron_gigpo.algo.config import RolloutCorrectionConfig

    batch = make_batch()  # 8 rows, one mini-batch: on-policy, ratio 1
    adv = row_advantages(batch)
    config = actor_config(model_dir, use_kl_loss=False, entropy_coeff=0.0, lr=1e-5)
    actor = PolicyActor(config)
    out = {}
    for name, (mode, level, low, high) in CASES.items():
        actor.config = config.replace(loss={"rollout_correction": RolloutCorrectionConfig(mode, level, low, high)})
        actor_lp = actor.compute_log_probs(batch)
        engine = [lp + torch.tensor([_engine_offset(r, t) for t in range(lp.numel())], dtype=torch.float32)
                  for r, lp in enumerate(actor_lp)]
        metrics, _ = actor.update(dataclasses.replace(batch, rollout_log_probs=engine), adv, None, None)
        out[name] = metrics["actor/pg_loss"]
    del actor
    distributed.destroy()
    return out


def _old_log_prob_modes(model_dir) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor
    from megatron_gigpo.algo.config import RolloutCorrectionConfig

    batch = make_batch()
    adv = row_advantages(batch)
    out = {}
    for mode in ("recompute", "rollout"):
        # two mini-batches of 4 rows: the old log-probs come from a pass (recompute) or the engine (rollout)
        correction = RolloutCorrectionConfig("mis") if mode == "rollout" else RolloutCorrectionConfig("tis")
        config = actor_config(model_dir, ppo_mini_batch_size=4, old_log_probs=mode, rollout_correction=correction)
        config = config.replace(optim={"lr": 1e-4, "adam_eps": 1e-3})
        actor = PolicyActor(config)
        recomputed = actor.compute_log_probs(batch)
        ref = actor.compute_log_probs(batch, reference=True)
        engine_batch = dataclasses.replace(batch, rollout_log_probs=recomputed)  # the engine agrees exactly
        old = recomputed if mode == "recompute" else list(engine_batch.rollout_log_probs)
        out[mode], _ = actor.update(engine_batch, adv, old, ref)
        out[f"{mode}_weights"] = export_full_weights(actor)
        del actor
        distributed.destroy()
    return out


def _ranks_main(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    from actor_helpers import make_batch as _mb

    lengths = [int(r.numel()) for r in _mb().response_ids]
    return {"weighted": _weighted_updates(model_dir), "modes": _old_log_prob_modes(model_dir), "lengths": lengths}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("rollout_correction"), tie=True, vocab_size=511)


@pytest.fixture(scope="module")
def ranks(model_dir):
    return spawn(_ranks_main, 2, model_dir, timeout=900)


@pytest.mark.parametrize("case", CASES)
def test_update_loss_equals_the_hand_weighted_loss(ranks, case):
    lengths = ranks[0]["lengths"]
    adv = row_advantages(make_batch()).tolist()
    weights = _hand_weights(*CASES[case], lengths)
    expected = -sum(adv[r] * w for r, row in enumerate(weights) for w in row) / sum(lengths)
    unweighted = -sum(adv[r] * n for r, n in enumerate(lengths)) / sum(lengths)
    assert abs(expected - unweighted) > 3e-3, "the case must change the loss"
    for rank_out in ranks:
        assert rank_out["weighted"][case] == pytest.approx(expected, abs=1e-5), (case, unweighted)


def test_rollout_and_recompute_old_log_probs_take_the_same_update(ranks):
    run = ranks[0]["modes"]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/ppo_kl"):
        assert run["rollout"][key] == pytest.approx(run["recompute"][key], rel=1e-5, abs=1e-7), key
    assert run["recompute"]["actor/num_optimizer_steps"] == 2.0
    for name, tensor in run["recompute_weights"].items():
        torch.testing.assert_close(run["rollout_weights"][name], tensor, atol=1e-6, rtol=0, msg=name)
