"""GPU tier of LoRA: the adapted PolicyActor on one CUDA device (the layer spec the recipes get there: Transformer-
Engine's when it is installed, whose fused norm + QKV / fc1 layers the adapters must see through).

One spawned rank: float32 and bfloat16 (fp32 master copies of the adapters only). Zero adapters leave the
log-probs bit-identical; with nonzero adapters the log-probs match transformers + peft loading the actor's own
PEFT export; one update lowers the loss and moves only adapters. Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from actor_helpers import actor_config, make_batch, row_advantages
from multiproc import spawn
from test_lora import lora_settings, nonzero_adapter
from tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _cuda_rank(rank: int, world_size: int, model_dir, peft_root) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    batch, out = make_batch(), {}
    for dtype in ("float32", "bfloat16"):
        config = actor_config(model_dir, params_dtype=dtype)
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-3, adam_eps=1e-3))
        actor = PolicyActor(config)
        base = actor.compute_log_probs(batch)
        del actor
        distributed.destroy()
        actor = PolicyActor(dataclasses.replace(config, lora=lora_settings()))
        run = {"base": base, "zero_b": actor.compute_log_probs(batch)}
        actor.set_adapter_weights(nonzero_adapter)
        run["lora"] = actor.compute_log_probs(batch)
        actor.save_peft_adapter(str(peft_root / dtype))
        ref = actor.compute_log_probs(batch, reference=True)
        adv = row_advantages(batch)
        run["first"], _ = actor.update(batch, adv, run["lora"], ref)
        run["second"], _ = actor.update(batch, adv, run["lora"], ref)
        run["reference_after"] = actor.compute_log_probs(batch, reference=True)
        out[dtype] = run
        del actor
        distributed.destroy()
    return out


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_cuda")
    model_dir = make_tiny_hf_model(tmp, tie=True, vocab_size=511)
    return model_dir, tmp, spawn(_cuda_rank, 1, model_dir, tmp, timeout=900)[0]


def _max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_adapters_and_the_reference_are_the_base(cuda_run, dtype):
    run = cuda_run[2][dtype]
    assert all(x.equal(y) for x, y in zip(run["zero_b"], run["base"]))
    assert all(x.equal(y) for x, y in zip(run["reference_after"], run["base"]))  # the base stays frozen
    assert _max_diff(run["lora"], run["base"]) > 1e-2


def test_float32_log_probs_match_transformers_with_peft(cuda_run):
    from test_lora_checkpoint import _peft_log_probs

    model_dir, tmp, run = cuda_run
    peft = _peft_log_probs(model_dir, tmp / "float32", make_batch())
    diff = _max_diff(run["float32"]["lora"], peft)
    print(f"max |log p - HF+PEFT fp32|: {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_lowers_the_loss(cuda_run, dtype):
    run = cuda_run[2][dtype]
    assert run["first"]["actor/update_skipped"] == 0.0
    assert run["second"]["actor/loss"] < run["first"]["actor/loss"]
