"""On-policy update (``PolicyActor.update(..., old_log_probs=None, ...)``, verl's dp_actor shortcut) on real
Megatron ranks (gloo): with one epoch and one mini-batch the update uses its own detached log-probs as old
log-probs, returns the log-probs it computed before its step (equal to ``compute_log_probs``), reports a ratio
of exactly 1, takes the same step as an update given precomputed old log-probs, and is refused otherwise.

One spawn of two ranks runs DP2 (rows split over ranks, results all-gathered) and PP2 (log-probs exist on the
last stage only and are broadcast).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from actor_helpers import actor_config, export_full_weights, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAYOUTS = {"dp2": (1, 1), "pp2": (1, 2)}
REFUSED = {"two_epochs": {"ppo_epochs": 2}, "two_mini_batches": {"ppo_mini_batch_size": 4}}  # 8 rows


def _run_layout(model_dir, tp: int, pp: int) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    batch = make_batch()  # 8 rows; ppo_mini_batch_size=8, ppo_epochs=1: one optimizer step
    config = actor_config(model_dir, tp=tp, pp=pp)
    # lr 1e-4 with a larger Adam eps keeps the step continuous in the gradient (see test_actor_layouts), so two
    # updates whose gradients differ by float rounding give the same weights
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-4, adam_eps=1e-3))
    adv = row_advantages(batch)
    out: dict = {}
    actor = PolicyActor(config)
    out["computed"] = actor.compute_log_probs(batch)
    ref = actor.compute_log_probs(batch, reference=True)
    out["metrics"], out["returned"] = actor.update(batch, adv, None, ref)
    out["weights_on_policy"] = export_full_weights(actor)
    del actor
    distributed.destroy()

    actor = PolicyActor(config)
    given = actor.compute_log_probs(batch)
    out["given_metrics"], returned = actor.update(batch, adv, given, ref)
    # with given old log-probs the update returns those same tensors (in a list of its own)
    out["given_returned_same"] = isinstance(returned, list) and len(returned) == len(given) and all(
        got is want for got, want in zip(returned, given))
    out["weights_given"] = export_full_weights(actor)
    for name, change in REFUSED.items():
        actor.config = config.replace(trainer=change)
        try:
            actor.update(batch, adv, None, ref)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    del actor
    distributed.destroy()
    return out


def _layouts(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    return {name: _run_layout(model_dir, tp, pp) for name, (tp, pp) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("on_policy_update"), tie=True, vocab_size=511)


@pytest.fixture(scope="module")
def ranks(model_dir):
    return spawn(_layouts, 2, model_dir, timeout=900)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_policy_update_returns_the_log_probs_before_its_step(ranks, layout):
    for rank_out in ranks:  # every rank returns every row
        run = rank_out[layout]
        assert len(run["returned"]) == len(run["computed"]) == 8
        for i, (got, want) in enumerate(zip(run["returned"], run["computed"])):
            assert got.dtype == torch.float32 and got.shape == want.shape, i
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"row {i}")
        metrics = run["metrics"]
        assert metrics["actor/num_optimizer_steps"] == 1.0
        assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_policy_update_takes_the_step_of_precomputed_old_log_probs(ranks, layout):
    run = ranks[0][layout]  # weights are exported on global rank 0
    on_policy, given = run["weights_on_policy"], run["weights_given"]
    assert on_policy and on_policy.keys() == given.keys()
    for name, tensor in given.items():
        torch.testing.assert_close(on_policy[name], tensor, atol=1e-6, rtol=0, msg=name)
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert run["metrics"][key] == pytest.approx(run["given_metrics"][key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_with_given_old_log_probs_returns_them(ranks, layout):
    for rank_out in ranks:
        assert rank_out[layout]["given_returned_same"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", REFUSED)
def test_on_policy_update_is_refused_with_more_than_one_step(ranks, layout, case):
    for rank_out in ranks:
        message = rank_out[layout][case]
        assert message is not None, "update(old_log_probs=None) ran although it takes two optimizer steps"
        assert "old_log_probs=None" in message and "ppo_epochs" in message
