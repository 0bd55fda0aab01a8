"""Mini-batches with fewer rows than data-parallel ranks (issue #12): at DP2, 3 rows with ppo_mini_batch_size=2
(mini-batches of 2 and 1 rows) and a batch of a single row train on real Megatron ranks (gloo), and take exactly
the optimizer steps a single rank takes on the same rows: the rank without rows runs a zero-weight stand-in row
and still joins every collective (gradient all-reduce; with the distributed optimizer, its reduce-scatter and
all-gather)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from actor_helpers import actor_config, export_full_weights, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROW_COUNTS = (3, 1)


def _train(model_dir, num_rows: int, distributed_optimizer: bool) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    config = actor_config(model_dir, ppo_mini_batch_size=2, use_distributed_optimizer=distributed_optimizer)
    # A larger Adam eps keeps the first step continuous in the gradient (see test_actor_layouts).
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-4, adam_eps=1e-3))
    actor = PolicyActor(config)
    batch = make_batch(num_rows)
    old = actor.compute_log_probs(batch)
    ref = actor.compute_log_probs(batch, reference=True)
    metrics, _ = actor.update(batch, row_advantages(batch), old, ref)
    out = {"old": old, "metrics": metrics, "weights": export_full_weights(actor)}
    del actor
    distributed.destroy()
    return out


def _runs(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    layouts = {"dp": False, "dp_distopt": True} if world_size > 1 else {"dp": False}
    return {(name, rows): _train(model_dir, rows, distopt) for name, distopt in layouts.items() for rows in ROW_COUNTS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("small_mini_batches"), tie=True, vocab_size=511)


@pytest.fixture(scope="module")
def runs(model_dir):
    return {"dp1": spawn(_runs, 1, model_dir, timeout=900)[0], "dp2": spawn(_runs, 2, model_dir, timeout=900)[0]}


@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("layout", ["dp", "dp_distopt"])
def test_fewer_rows_than_ranks_take_the_single_rank_step(runs, layout, num_rows):
    single, dp2 = runs["dp1"][("dp", num_rows)], runs["dp2"][(layout, num_rows)]
    # 3 rows in mini-batches of 2 and 1; 1 row in one mini-batch: every optimizer step is taken.
    assert dp2["metrics"]["actor/num_optimizer_steps"] == (2.0 if num_rows == 3 else 1.0)
    assert dp2["metrics"]["actor/update_skipped"] == 0.0
    assert len(dp2["old"]) == num_rows
    for a, b in zip(dp2["old"], single["old"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert dp2["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-5), key
    assert dp2["weights"].keys() == single["weights"].keys()
    for name, tensor in single["weights"].items():
        # a stand-in row that contributed a gradient, or a skipped step, shows far above 1e-6 (lr = 1e-4)
        torch.testing.assert_close(dp2["weights"][name], tensor, atol=1e-6, rtol=0, msg=name)
    other = runs["dp1"][("dp", 1 if num_rows == 3 else 3)]["weights"]  # a different step, for contrast
    assert max(float((tensor - other[name]).abs().max()) for name, tensor in single["weights"].items()) > 1e-5
