"""LoRA checkpoints on gloo: the checkpoint holds only adapters and their optimizer state plus ``lora.json``
naming the base; kill-and-resume is bit-identical; ``convert megatron-to-hf`` writes merged HF weights and a
PEFT adapter folder that transformers + peft load onto the base with the same log-probs as the actor.

Two spawns of two ranks (TP2): the first trains (update, save, two more updates); the second resumes and
repeats the two updates, then converts the checkpoint (merged at PP2, PEFT at TP2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from actor_helpers import actor_config, hf_log_probs_and_entropy, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.multiprocess

TRAINER_STATE = {"iteration": 1}


def _lora_actor(model_dir, **lora_overrides):
    from megatron_gigpo.actor.policy import PolicyActor
    from megatron_gigpo.config import LoraConfig

    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, dropout=0.1, **lora_overrides)
    config = actor_config(model_dir, tp=2, ppo_mini_batch_size=3, lora=lora)
    return PolicyActor(dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-2)))


def _two_updates(actor, batch) -> dict:
    adv, out = row_advantages(batch), {}
    ref = actor.compute_log_probs(batch, reference=True)
    out["log_probs_before"] = actor.compute_log_probs(batch)
    out["second"], _ = actor.update(batch, adv, out["log_probs_before"], ref)
    out["log_probs_mid"] = actor.compute_log_probs(batch)
    out["third"], _ = actor.update(batch, adv, out["log_probs_mid"], ref)
    out["log_probs_end"] = actor.compute_log_probs(batch)
    return out


def _train_and_save(rank: int, world_size: int, model_dir, root) -> dict:
    start_rank()
    batch = make_batch()
    actor = _lora_actor(model_dir)
    log_probs = actor.compute_log_probs(batch)
    actor.update(batch, row_advantages(batch), log_probs, actor.compute_log_probs(batch, reference=True))
    folder = actor.save_checkpoint(str(root), 1, TRAINER_STATE, keep_last=2)
    return {"folder": folder, **_two_updates(actor, batch)}


def _resume_and_convert(rank: int, world_size: int, model_dir, root, out) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor
    from megatron_gigpo.actor.convert import convert_megatron_to_hf

    start_rank()
    batch, results = make_batch(), {}
    actor = _lora_actor(model_dir)
    results["trainer_state"] = actor.load_checkpoint(str(root))
    results.update(_two_updates(actor, batch))
    del actor
    distributed.destroy()
    try:  # a full-weight actor refuses the adapter-only checkpoint
        PolicyActor(actor_config(model_dir, tp=2)).load_checkpoint(str(root))
        results["full_actor_error"] = None
    except ValueError as exc:
        results["full_actor_error"] = str(exc)
    distributed.destroy()
    folder = Path(root) / "iter_00000001"
    for name, (tp, pp, peft) in {"merged": (1, 2, False), "peft": (2, 1, True)}.items():
        distributed.initialize(tp, pp)
        convert_megatron_to_hf(folder, Path(out) / name, peft=peft)
        distributed.destroy()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_checkpoint")
    model_dir = make_tiny_hf_model(tmp, tie=False, vocab_size=511)
    root, out = tmp / "checkpoints", tmp / "converted"
    trained = spawn(_train_and_save, 2, model_dir, root, timeout=900)
    resumed = spawn(_resume_and_convert, 2, model_dir, root, out, timeout=900)
    return model_dir, root, out, trained, resumed


def test_resume_is_bit_identical(runs):
    _, _, _, trained, resumed = runs
    for rank in range(2):
        before, after = trained[rank], resumed[rank]
        assert after["trainer_state"] == TRAINER_STATE
        assert after["second"] == before["second"] and after["third"] == before["third"]
        for key in ("log_probs_before", "log_probs_mid", "log_probs_end"):
            assert all(a.equal(b) for a, b in zip(after[key], before[key])), key


def test_checkpoint_holds_only_adapters_and_names_the_base(runs):
    from megatron.core import dist_checkpointing

    from megatron_gigpo.actor.lora_files import base_fingerprint, read_lora_reference

    model_dir, root, _, trained, resumed = runs
    folder = Path(trained[0]["folder"])
    keys = list(dist_checkpointing.load_tensors_metadata(str(folder)))
    assert keys and all(".lora." in key for key in keys), [k for k in keys if ".lora." not in k][:4]
    assert any(key.startswith("optimizer.") for key in keys)  # Adam moments of the adapters
    doc = read_lora_reference(folder)
    assert doc["base_model_path"] == str(model_dir.resolve()) and doc["base_fingerprint"] == base_fingerprint(model_dir)
    assert (doc["rank"], doc["alpha"]) == (4, 8.0)
    assert "holds only LoRA adapters" in resumed[0]["full_actor_error"]


def test_another_base_is_refused(runs, tmp_path):
    from megatron_gigpo.actor.lora_files import check_lora_reference
    from megatron_gigpo.config import LoraConfig

    _, _, _, trained, _ = runs
    other = make_tiny_hf_model(tmp_path, tie=False, vocab_size=511, num_hidden_layers=2)
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="differs from"):
        check_lora_reference(trained[0]["folder"], lora, other)
    with pytest.raises(ValueError, match="rank=4"):
        check_lora_reference(trained[0]["folder"], dataclasses.replace(lora, rank=8), other)


def _peft_log_probs(model_dir: Path, adapter_dir: Path, batch) -> list[torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_ids, batch.response_ids):
            ids = torch.cat([prompt, response]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : ids.shape[1] - 1].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1).float())
    return out


def test_merged_and_peft_exports_match_the_actor(runs):
    import json

    model_dir, _, out, trained, _ = runs
    batch = make_batch()
    saved = trained[0]["log_probs_before"]  # the adapters in the checkpoint
    merged, _ = hf_log_probs_and_entropy(out / "merged", batch)
    peft = _peft_log_probs(model_dir, out / "peft", batch)
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base, _ = hf_log_probs_and_entropy(model_dir, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(saved, base)) > 1e-3  # the adapters changed the model
    for name, got in {"merged": merged, "peft": peft}.items():
        assert max(float((a - b).abs().max()) for a, b in zip(got, saved)) < 1e-4, name
