"""Actor checkpoints on gloo: kill-and-resume is bit-identical (also with the DistributedOptimizer, whose Adam
``step`` must be restored per parameter, and for a tiny Qwen3-MoE at expert parallelism 2), a TP2 checkpoint loads
at PP2 and at TP1/DP2, incomplete checkpoints are ignored and only the last ``keep_last`` are kept.

Two spawns of two ranks: the first trains (update, save, two more updates) at TP2, at DP2 with the
DistributedOptimizer and the MoE at EP2; the second is the restarted job, which resumes all three and loads the TP2
checkpoint at other layouts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from actor_helpers import actor_config, adam_steps, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

# name -> (TP, PP, DistributedOptimizer, MoE model with its settings): the MoE run is a tiny Qwen3-MoE at EP2 (two
# experts per rank; one row per micro-batch, as in test_actor_layouts) with the distributed optimizer over its
# expert-data-parallel group
RUNS = {"tp2": (2, 1, False, None), "dp2_distopt": (1, 1, True, None),
        "moe_ep2": (1, 1, True, dict(expert_model_parallel_size=2, micro_batch_tokens=1,
                                      log_prob_micro_batch_tokens=1))}
TRAINER_STATE = {"iteration": 1, "data_position": 8, "sampler": {"epoch": 0}}


def _actor(model_dir, tp: int, pp: int, distributed_optimizer: bool, moe: dict | None = None):
    from megatron_gigpo.actor.policy import PolicyActor

    # 8 rows / mini-batches of 3 -> 3 optimizer steps per update; shuffled
    config = actor_config(
        model_dir, tp=tp, pp=pp, use_distributed_optimizer=distributed_optimizer, ppo_mini_batch_size=3,
        lr=1e-3, lr_warmup_steps=2, lr_decay_steps=8, lr_decay_style="cosine", min_lr=1e-4, **(moe or {}),
    )
    return PolicyActor(config)


def _two_updates(actor, batch) -> dict:
    """Update -> log-probs -> update: what must be identical after a resume."""
    adv = row_advantages(batch)
    out = {}
    ref = actor.compute_log_probs(batch, reference=True)
    out["log_probs_before"] = actor.compute_log_probs(batch)
    out["second"], _ = actor.update(batch, adv, out["log_probs_before"], ref)
    out["log_probs_mid"] = actor.compute_log_probs(batch)
    out["third"], _ = actor.update(batch, adv, out["log_probs_mid"], ref)
    out["steps"], out["own_step_tensors"] = adam_steps(actor)
    return out


def _train_and_save(rank: int, world_size: int, model_dir, root, moe_dir) -> dict:
    from megatron_gigpo.actor import distributed

    start_rank()
    batch, results = make_batch(), {}
    for name, (tp, pp, distopt, moe) in RUNS.items():
        actor = _actor(moe_dir if moe else model_dir, tp, pp, distopt, moe)
        log_probs = actor.compute_log_probs(batch)
        actor.update(batch, row_advantages(batch), log_probs, actor.compute_log_probs(batch, reference=True))
        actor.save_checkpoint(str(Path(root) / name), 1, TRAINER_STATE, keep_last=2)
        results[name] = _two_updates(actor, batch)
        del actor
        distributed.destroy()
    return results


def _resume(rank: int, world_size: int, model_dir, root, moe_dir) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.checkpoint_layout import complete_checkpoints

    start_rank()
    batch, results = make_batch(), {}
    for name, (tp, pp, distopt, moe) in RUNS.items():
        actor = _actor(moe_dir if moe else model_dir, tp, pp, distopt, moe)
        trainer_state = actor.load_checkpoint(str(Path(root) / name))
        results[name] = {"trainer_state": trainer_state, "counters": (actor.update_calls, actor.optimizer_steps)}
        results[name].update(_two_updates(actor, batch))
        if name == "tp2":  # keep_last=1: saving iterations 2 and 3 leaves only iteration 3
            prune_root = Path(root) / "prune"
            actor.save_checkpoint(str(prune_root), 2, TRAINER_STATE, keep_last=1)
            actor.save_checkpoint(str(prune_root), 3, TRAINER_STATE, keep_last=1)
            results["pruned"] = sorted(os.listdir(prune_root)), [it for it, _ in complete_checkpoints(prune_root)]
        del actor
        distributed.destroy()
    for name, (tp, pp) in {"pp2_from_tp2": (1, 2), "tp1_from_tp2": (1, 1)}.items():
        actor = _actor(model_dir, tp, pp, False)
        results[name] = {
            "trainer_state": actor.load_checkpoint(str(Path(root) / "tp2")),
            "log_probs": actor.compute_log_probs(batch),
        }
        del actor
        distributed.destroy()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("actor_checkpoint")
    model_dir = make_tiny_hf_model(tmp, tie=False, vocab_size=511)
    moe_dir = make_tiny_hf_model(tmp, "qwen3_moe", tie=True, vocab_size=511, seed=4)
    root = tmp / "checkpoints"
    trained = spawn(_train_and_save, 2, model_dir, root, moe_dir, timeout=900)
    for name in RUNS:  # what a crash mid-save leaves behind must be ignored by the resume
        (root / name / "iter_00000009.tmp").mkdir()
        (root / name / "iter_00000009.tmp" / "meta.json").write_text("{}")
        (root / name / "iter_00000005").mkdir()
    (root / "prune" / "iter_00000001.tmp").mkdir(parents=True)  # removed by the next successful save
    resumed = spawn(_resume, 2, model_dir, root, moe_dir, timeout=900)
    return trained, resumed


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS))
def test_resume_is_bit_identical(runs, name):
    trained, resumed = runs
    for rank in range(2):
        before, after = trained[rank][name], resumed[rank][name]
        assert after["trainer_state"] == TRAINER_STATE
        assert after["counters"] == (1, 3)
        assert after["second"] == before["second"]  # every metric, bit for bit
        assert after["third"] == before["third"]
        # The schedule advances once per update (iteration), whatever the number of optimizer steps:
        # update 2 ends the 2-update warmup at lr; update 3 is 1/6 into the cosine decay to min_lr.
        assert after["second"]["actor/lr"] == pytest.approx(1e-3)
        assert after["third"]["actor/lr"] == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi / 6) + 1) * 9e-4)
        for a, b in zip(after["log_probs_mid"], before["log_probs_mid"]):
            assert a.equal(b)


@pytest.mark.multiprocess
def test_distributed_optimizer_restores_each_parameters_step(runs):
    trained, resumed = runs
    for rank in range(2):
        after = resumed[rank]["dp2_distopt"]
        assert after["own_step_tensors"] and trained[rank]["dp2_distopt"]["own_step_tensors"]
        # 3 updates x 3 mini-batches; a shared step tensor would have advanced once per parameter
        assert set(after["steps"]) == {9.0} == set(trained[rank]["dp2_distopt"]["steps"])


@pytest.mark.multiprocess
def test_tp2_checkpoint_loads_at_other_layouts(runs):
    trained, resumed = runs
    saved = trained[0]["tp2"]["log_probs_before"]  # the weights right after the save
    for name in ("pp2_from_tp2", "tp1_from_tp2"):
        for rank in range(2):
            run = resumed[rank][name]
            assert run["trainer_state"] == TRAINER_STATE
            assert max(float((a - b).abs().max()) for a, b in zip(run["log_probs"], saved)) < 1e-5, name


@pytest.mark.multiprocess
def test_keep_last_removes_older_checkpoints(runs):
    _, resumed = runs
    names, complete = resumed[0]["pruned"]
    assert names == ["iter_00000003"] and complete == [3]
