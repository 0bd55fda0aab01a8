"""The per-GPU memory estimate (megatron_gigpo.cluster.memory): parameter counts against a tiny Hugging Face model's
tensors and the published model sizes, and the documented formula on a recipe. The optimizer and gradient
bytes are checked against real Megatron ranks in test_memory_megatron.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_hf_model

from megatron_gigpo.config import load_config
from megatron_gigpo.cluster.memory import (
    GIB,
    estimate_memory,
    format_memory,
    hf_parameter_count,
    optimizer_bytes_per_param,
    policy_hf_config,
    rank_parameter_count,
)
from megatron_gigpo.models.specs import KNOWN_MODELS
from megatron_gigpo.cluster.placement import plan_placement

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _hf_tensors(model_dir: Path) -> int:
    """Elements of every tensor in the model's safetensors file."""
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())


@pytest.mark.parametrize("arch, tie", [("qwen2", False), ("qwen2", True), ("llama", True), ("qwen3", True),
                                       ("qwen3_moe", False)])
def test_parameter_count_matches_a_tiny_models_tensors(tmp_path, arch, tie):
    import json

    model_dir = make_tiny_hf_model(tmp_path, arch, tie=tie)
    hf = json.loads((model_dir / "config.json").read_text())
    assert hf_parameter_count(hf) == _hf_tensors(model_dir)
    # One Megatron rank at TP1 PP1 holds the same (the tiny vocabulary is a multiple of 128: no padding).
    assert rank_parameter_count(hf, 1, 1, 0) == hf_parameter_count(hf)


def test_known_models_match_their_published_sizes():
    # Model cards: Qwen2.5 "Number of Parameters" 0.49B / 1.54B / 3.09B / 7.61B; SmolLM2-135M: 134.5M.
    published = {"Qwen/Qwen2.5-0.5B-Instruct": 0.49, "Qwen/Qwen2.5-1.5B-Instruct": 1.54,
                 "Qwen/Qwen2.5-3B-Instruct": 3.09, "Qwen/Qwen2.5-7B-Instruct": 7.61,
                 "HuggingFaceTB/SmolLM2-135M-Instruct": 0.13}
    for name, billions in published.items():
        assert hf_parameter_count(KNOWN_MODELS[name]) / 1e9 == pytest.approx(billions, abs=0.006), name
    # Qwen3 model cards give one decimal: 0.6B / 1.7B / 4.0B / 8.2B / 14.8B / 32.8B.
    qwen3 = {"0.6B": 0.6, "1.7B": 1.7, "4B": 4.0, "8B": 8.2, "14B": 14.8, "32B": 32.8}
    for size, billions in qwen3.items():
        assert hf_parameter_count(KNOWN_MODELS[f"Qwen/Qwen3-{size}"]) / 1e9 == pytest.approx(billions, abs=0.05), size


def test_estimate_of_the_7b_recipe_follows_the_documented_formula():
    cfg = load_config(RECIPES / "alfworld/qwen2.5-7b-instruct.yaml")
    hf = policy_hf_config(cfg)
    rows = estimate_memory(cfg, plan_placement(cfg), hf, gpu_memory_gib=80)
    assert len(rows) == 8 and all(r.rank == r.gpu for r in rows)
    params = rank_parameter_count(hf, 4, 1, 0)  # TP4: 1/4 of every split weight, norms replicated
    r = rows[0]
    assert (r.weights, r.reference, r.gradients) == (2 * params, 2 * params, 4 * params)
    assert (r.optimizer_replicated, r.optimizer_distributed) == (12 * params, 12 * params // 2)  # DP2
    assert r.logprob_chunk == 4 * 1024 * 152064 // 4 * 4
    assert r.vllm == int(0.6 * 80 * GIB) and r.engine_weights == hf_parameter_count(hf) * 2 // 2
    assert r.kv_cache == r.vllm - r.engine_weights
    assert r.peak == 2 * params + 2 * params + 4 * params + 6 * params + r.vllm
    assert "OVER" in format_memory(rows, 60) and "OVER" not in format_memory(rows, 80)
    assert optimizer_bytes_per_param("float32") == 8
