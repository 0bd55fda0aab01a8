"""Activation recomputation (``actor.recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``)
and sequence parallelism (``parallel.sequence_parallel``) on real Megatron ranks (gloo, TP2): the actor really
uses them (the decoder sees 1/TP of the sequence; recomputed layers and core attention run again in backward)
and they change nothing else: log-probs, entropies, the update's loss and gradient norm and the updated weights
equal those of the plain TP2 actor.

One spawn of two ranks builds the actor once per variant, one after the other.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from actor_helpers import actor_config, export_full_weights, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.multiprocess

FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
VARIANTS = {
    "plain": {},
    "sequence_parallel": {"sequence_parallel": True},
    "full_uniform": FULL,
    "selective": {"recompute_granularity": "selective"},
    # block: the first 2 of the 4 layers recomputed, with sequence parallelism
    "full_block_sp": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2,
                      "sequence_parallel": True},
}


class _Calls:
    """Forward calls of the first decoder layer and of its core attention during one update, and the sequence
    length the decoder's layers receive."""

    def __init__(self, gpt) -> None:
        self.layer = self.attention = 0
        self.seq: set[int] = set()
        layer = gpt.decoder.layers[0]
        layer.register_forward_pre_hook(self._layer, with_kwargs=True)
        layer.self_attention.core_attention.register_forward_pre_hook(self._attention)

    def _layer(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.layer += 1
        self.seq.add(int(hidden.shape[0]))

    def _attention(self, module, args):
        self.attention += 1


def _run_variant(model_dir, settings: dict) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor
    from megatron_gigpo.models.builder import unwrap_gpt_model

    batch = make_batch()
    config = actor_config(model_dir, tp=2, use_kl_loss=False, **settings)  # no reference model: a cheaper test
    # lr 1e-4 with a larger Adam eps keeps the step continuous in the gradient (see test_actor_layouts)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-4, adam_eps=1e-3))
    actor = PolicyActor(config)
    gpt = unwrap_gpt_model(actor.model_chunks[0])
    out = {"config": {k: getattr(gpt.config, k) for k in ("sequence_parallel", *FULL)}}
    out["log_probs"], out["entropy"] = actor.compute_log_probs_and_entropy(batch)
    calls = _Calls(gpt)
    out["metrics"], _ = actor.update(batch, row_advantages(batch), out["log_probs"])
    out["calls"] = {"layer": calls.layer, "attention": calls.attention, "seq": sorted(calls.seq)}
    out["micro_batches"] = len(actor._plan(range(batch.num_rows), [p.numel() + r.numel() for p, r in
                                                                    zip(batch.prompt_ids, batch.response_ids)],
                                           config.trainer.micro_batch_tokens))
    out["longest"] = max(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids))
    out["weights"] = export_full_weights(actor)
    del actor
    distributed.destroy()
    return out


def _variants(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    return {name: _run_variant(model_dir, settings) for name, settings in VARIANTS.items()}


@pytest.fixture(scope="module")
def runs():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model(Path(tmp), tie=False, vocab_size=511)  # untied: the output layer's own weight
        yield spawn(_variants, 2, model_dir, timeout=900)[0]


def test_the_settings_reach_megatron(runs):
    for name, settings in VARIANTS.items():
        want = {"sequence_parallel": False, "recompute_granularity": None, "recompute_method": None,
                "recompute_num_layers": None} | settings
        assert runs[name]["config"] == want, name


def test_the_actor_really_uses_them(runs):
    plain = runs["plain"]["calls"]
    mbs = runs["plain"]["micro_batches"]
    assert mbs > 1 and plain["layer"] == plain["attention"] == mbs  # one forward per micro-batch
    # full recompute runs every layer again in backward; selective only the core attention
    assert runs["full_uniform"]["calls"]["layer"] == runs["full_block_sp"]["calls"]["layer"] == 2 * mbs
    assert runs["selective"]["calls"] == {**plain, "attention": 2 * mbs}
    # sequence parallelism: the layers see half of each (even-padded) micro-batch's sequence
    full_lengths = set(plain["seq"])
    assert max(full_lengths) == runs["plain"]["longest"]
    for name in ("sequence_parallel", "full_block_sp"):
        seq = runs[name]["calls"]["seq"]
        assert sorted({-(-n // 2) for n in full_lengths}) == seq, (name, seq, full_lengths)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "plain"])
def test_log_probs_and_one_update_equal_the_plain_actor(runs, name):
    plain, run = runs["plain"], runs[name]
    assert plain["metrics"]["actor/grad_norm"] > 1e-3  # the step moves the weights
    for key in ("log_probs", "entropy"):
        for got, want in zip(run[key], plain[key]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} {key}")
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert run["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5, abs=1e-6), (name, key)
    assert run["weights"].keys() == plain["weights"].keys() and "lm_head.weight" in plain["weights"]
    for hf_name, tensor in plain["weights"].items():
        # one Adam step moves weights by up to lr = 1e-4; a wrong or missing step shows far above 1e-6
        torch.testing.assert_close(run["weights"][hf_name], tensor, atol=1e-6, rtol=0, msg=f"{name} {hf_name}")
