"""The activation term of the memory estimate (megatron_gigpo.cluster.activations), worked out by hand for a
small model in each mode (the formula's terms, one by one), and the plan's use of it. Its agreement with what
megatron-core's GPTModel really keeps is measured by benchmarks/activation_memory.py (docs/recipes-and-placement.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gigpo.actor.config import RecomputeConfig
from megatron_gigpo.cluster.activations import activation_bytes
from megatron_gigpo.cluster.memory import estimate_memory, policy_hf_config
from megatron_gigpo.cluster.placement import plan_placement
from megatron_gigpo.config import load_config

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# h=64, f=96, a=4 heads, g=2 KV heads, d=16, 4 layers; micro-batches of T=32 tokens, rows up to s=16
HF = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2}
T, S = 32, 16

# Megatron's local spec in fp32 (e = 4), TP1, one layer, one micro-batch:
NORMS = T * (6 * 64 * 4 + 8)  # two norms (input, normalised output, fp32 inverse RMS) + q/k/v and fc1 inputs
ATTENTION = T * ((64 + 64 + 64 + 64) * 4 + 4 * S * 4)  # q, k and v (repeated to 4 heads), projection input; probs
MLP = T * 5 * 96 * 4  # fc1 output (2f), GLU up + offset, SiLU output, fc2 input
ROPE, MASK = 4 * S * 16 * 4, S * S  # cos/sin for q and k; the causal mask (bytes)
LAYER = NORMS + ATTENTION + MLP + ROPE + MASK
IDS, FINAL_NORM = T * 8, T * (2 * 64 * 4 + 4)


def test_local_fp32_layer_by_hand():
    assert LAYER == 49408 + 40960 + 61440 + 4096 + 256 == 156160
    est = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4)
    assert (est.layer, est.micro_batches, est.recomputed) == (LAYER, 1, 0)
    assert est.kept == est.total == 4 * LAYER + IDS + FINAL_NORM == 641408


def test_a_row_longer_than_the_micro_batch_counts_as_the_micro_batch():
    assert activation_bytes(HF, tokens=T, row_tokens=10 * T, element_bytes=4) == activation_bytes(
        HF, tokens=T, row_tokens=T, element_bytes=4)


def test_multi_head_attention_keeps_the_whole_qkv_output():
    mha = activation_bytes(HF | {"num_key_value_heads": 4}, tokens=T, row_tokens=S, element_bytes=4)
    assert mha.layer - LAYER == T * ((4 + 2 * 4) * 16 - 64) * 4  # v is a view of the (a + 2g)d fused output


def test_selective_recompute_drops_the_softmax_probabilities_and_mask():
    est = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4,
                           recompute=RecomputeConfig("selective"))
    attention = T * ((2 * 4 + 3 * 2) * 16 + 64) * 4  # q/k/v output, q and k after RoPE, projection input
    assert est.total == 4 * (NORMS + attention + MLP + ROPE) + IDS + FINAL_NORM


def test_full_recompute_keeps_group_inputs_and_recomputes_a_group():
    group_input, rope_freqs = T * 64 * 4, 4 * S * 16
    uniform = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4,
                               recompute=RecomputeConfig("full", "uniform", 1))
    assert uniform.kept == 4 * group_input + rope_freqs + IDS + FINAL_NORM == 50560
    # backward: the final norm is released, then one layer is recomputed (its first norm keeps the kept input)
    assert uniform.recomputed == LAYER - group_input - FINAL_NORM and uniform.total == 182016
    uniform3 = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4,
                                recompute=RecomputeConfig("full", "uniform", 3))
    assert uniform3.kept == 2 * group_input + rope_freqs + IDS + FINAL_NORM
    assert uniform3.recomputed == 3 * LAYER - group_input - FINAL_NORM
    block = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4, recompute=RecomputeConfig("full", "block", 2))
    assert (block.kept, block.recomputed) == (2 * group_input + 2 * LAYER + rope_freqs + IDS + FINAL_NORM, 0)
    every = activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4, recompute=RecomputeConfig("full", "block", 4))
    assert every.total == uniform.total  # all four recomputed, one at a time
    with pytest.raises(ValueError, match="recompute_method uniform|block"):
        activation_bytes(HF, tokens=T, row_tokens=S, element_bytes=4, recompute=RecomputeConfig("full"))


def test_transformer_engine_bf16_sequence_parallel_pipeline_by_hand():
    """TE's fused layers, bf16, TP2 with sequence parallelism (everything / 2), PP2 (two layers per stage; the
    first stage holds both micro-batches of 1F1B)."""
    norms = T * (4 * 64 * 2 + 8) // 2  # fused norm + linear: input and normalised output, twice; / r = 2
    attention = T * ((2 * 4 + 3 * 2) * 16 * 2 + 4 * 4 + 64 * 2) // 2  # q/k/v output, q, k, fp32 stats, output
    mlp = T * 5 * 96 * 2 // 2
    layer = norms + attention + mlp + 4 * S * 16 * 2  # RoPE; no mask, no s x s term
    assert (norms, attention, mlp, layer) == (8320, 9472, 15360, 35200)
    kw = dict(tokens=T, row_tokens=S, element_bytes=2, tp=2, pp=2, sequence_parallel=True, fused_attention=True)
    first, last = activation_bytes(HF, stage=0, **kw), activation_bytes(HF, stage=1, **kw)
    assert (first.layer, first.kept, first.micro_batches, first.total) == (layer, 2 * layer + IDS, 2, 141312)
    assert (last.kept, last.micro_batches, last.total) == (2 * layer + T * (64 * 2 + 4) // 2, 1, 72512)
    no_sp = activation_bytes(HF, stage=1, **(kw | {"sequence_parallel": False}))
    assert no_sp.kept - last.kept == 2 * norms + T * (64 * 2 + 4) // 2  # the norms and their inputs, whole
    selective = activation_bytes(HF, stage=1, recompute=RecomputeConfig("selective"), **kw)
    assert selective == last  # fused attention keeps no s x s term to recompute


def test_the_plan_counts_activations_with_the_same_function():
    cfg = load_config(RECIPES / "alfworld/qwen2.5-7b-instruct.yaml",
                      ["actor.recompute_granularity=full", "actor.recompute_method=block",
                       "actor.recompute_num_layers=4", "parallel.sequence_parallel=true"])
    hf = policy_hf_config(cfg)
    rows = estimate_memory(cfg, plan_placement(cfg), hf, gpu_memory_gib=80)
    want = activation_bytes(hf, tokens=16384, row_tokens=2048 + 512, element_bytes=2, tp=4, sequence_parallel=True,
                            recompute=cfg.actor, fused_attention=True)
    assert all(r.activations == want.total for r in rows)
    r = rows[0]
    assert r.update == r.actor + r.activations + r.logprob_chunk and r.peak == max(r.update, r.actor + r.vllm)
