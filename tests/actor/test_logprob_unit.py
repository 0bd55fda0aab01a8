"""Single-process checks of the log-prob math, the actor config and checkpoint folder handling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_gigpo.actor.checkpoint_layout import checkpoint_name, complete_checkpoints, latest_checkpoint
from megatron_gigpo.actor.config import ActorConfig
from megatron_gigpo.actor.logprob import vocab_parallel_log_probs
from megatron_gigpo.algo.losses import entropy_from_logits


def _reference(logits, labels, vocab_size):
    valid = logits[:, :vocab_size].double()
    log_probs = torch.log_softmax(valid, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(valid)


@pytest.mark.unit
@pytest.mark.parametrize("vocab_size", [40, 37])  # 37: three padded columns are masked
def test_log_probs_and_entropy_match_log_softmax(vocab_size):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 40, generator=generator) * 4).requires_grad_(True)
    labels = torch.randint(0, vocab_size, (9,), generator=generator)
    log_probs, entropy = vocab_parallel_log_probs(
        logits, labels, tp_group=None, vocab_start=0, vocab_size=vocab_size, with_entropy=True
    )
    ref_lp, ref_ent = _reference(logits, labels, vocab_size)
    torch.testing.assert_close(log_probs.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_ent, atol=1e-5, rtol=0)
    weights = torch.linspace(-1, 1, 9, dtype=torch.float64)
    grad = torch.autograd.grad(((log_probs + 0.3 * entropy).double() * weights).sum(), logits)[0]
    ref_grad = torch.autograd.grad(((ref_lp + 0.3 * ref_ent) * weights).sum(), logits)[0]
    torch.testing.assert_close(grad.double(), ref_grad.double(), atol=1e-5, rtol=0)
    assert torch.count_nonzero(grad[:, vocab_size:]) == 0  # padded columns get no gradient


@pytest.mark.unit
def test_log_probs_of_a_vocabulary_slice_ignore_foreign_labels():
    """A TP shard (vocab_start > 0) alone: labels it does not own contribute 0 to the picked logit."""
    logits = torch.zeros(2, 4)
    log_probs, entropy = vocab_parallel_log_probs(
        logits, torch.tensor([5, 0]), tp_group=None, vocab_start=4, vocab_size=8, with_entropy=False
    )
    assert entropy is None
    torch.testing.assert_close(log_probs, torch.full((2,), -torch.log(torch.tensor(4.0))))


@pytest.mark.unit
def test_actor_config_validation_names_the_field():
    """The actor runs its recipe sections' own checks (one range per setting) and names the section."""
    base = ActorConfig.build("m", lr=1e-5)
    base.validate(world_size=4)
    bad = {
        "params_dtype": ("float16", "params_dtype='float16' is not one of float32, bfloat16"),
        "temperature": (0.0, "temperature=0.0 must be > 0"),
        "trainer": ({"ppo_mini_batch_size": 0}, "trainer.ppo_mini_batch_size=0 must be >= 1"),
        "loss": ({"loss_agg_mode": "sum"}, "loss.loss_agg_mode='sum' is not one of"),
        "optim": ({"lr_decay_style": "step"}, "optim.lr_decay_style='step' is not one of constant, linear, cosine"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            base.replace(**{field: value}).validate()
    with pytest.raises(ValueError, match="not divisible"):
        base.replace(parallel={"tensor_model_parallel_size": 3}).validate(world_size=4)
    with pytest.raises(ValueError, match="smaller than the data-parallel size"):
        base.replace(trainer={"ppo_mini_batch_size": 2}).validate(world_size=4)
    with pytest.raises(TypeError, match="no section has a setting 'lrr'"):
        ActorConfig.build("m", lrr=1.0)


@pytest.mark.unit
def test_actor_config_from_recipe_passes_the_sections_whole(tmp_path):
    from megatron_gigpo.builders import actor_config
    from megatron_gigpo.config import load_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "cpu.yaml"
    cfg = load_config(recipe, ["trainer.logprob_chunk_size=128", "algorithm.policy_loss=vanilla"])
    actor = actor_config(cfg, tmp_path)
    assert actor.parallel is cfg.parallel and actor.optim is cfg.optim and actor.loss is cfg.algorithm
    assert actor.trainer is cfg.trainer and actor.trainer.logprob_chunk_size == 128
    assert actor.params_dtype == "float32" and actor.lr_decay_steps == cfg.trainer.total_iterations
    actor.validate(world_size=2)


@pytest.mark.unit
def test_only_complete_checkpoints_count(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for it, complete in [(3, True), (12, True), (20, False)]:
        folder = tmp_path / checkpoint_name(it)
        folder.mkdir()
        if complete:
            (folder / "meta.json").write_text("{}")
    (tmp_path / (checkpoint_name(30) + ".tmp")).mkdir()  # interrupted save
    (tmp_path / (checkpoint_name(30) + ".tmp") / "meta.json").write_text("{}")
    assert [it for it, _ in complete_checkpoints(tmp_path)] == [3, 12]
    assert latest_checkpoint(tmp_path) == (12, tmp_path / "iter_00000012")
    with pytest.raises(ValueError, match="iteration"):
        checkpoint_name(-1)
