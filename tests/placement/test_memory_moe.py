"""The memory plan of mixture-of-experts models (megatron_gigpo.cluster.memory, .activations): parameters per rank
under expert parallelism, the optimizer state over the expert-data-parallel group, the routed tokens' activations,
and the layout refusals of ``validate``; numbers computed by hand in the comments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_gigpo.cli import main
from megatron_gigpo.cluster.activations import activation_bytes
from megatron_gigpo.cluster.memory import (
    RankParameters,
    estimate_memory,
    hf_parameter_count,
    policy_hf_config,
    rank_parameters,
)
from megatron_gigpo.cluster.placement import plan_placement
from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.models.specs import KNOWN_MODELS

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
A3B = RECIPES / "alfworld/qwen3-30b-a3b.yaml"
QWEN3_32B = RECIPES / "alfworld/qwen3-32b.yaml"

# h 64, 4 heads of 16, 2 KV heads, 4 layers, 256 ids (a multiple of 128: no padding), 8 experts of FFN 32, top-2.
SMALL_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
             "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# One layer: attention q 64*4*16 = 4096, k and v 2*64*2*16 = 4096, o 4*16*64 = 4096 -> 12288 (no biases);
# replicated: two RMSNorms 2*64 = 128, q/k norms 2*16 = 32, router 8*64 = 512 -> 672; experts 8*3*64*32 = 49152.
ATTENTION, REPLICATED, EXPERTS = 12288, 672, 49152
EMBEDDING = 256 * 64  # 16384, and as much again for the untied output layer


def test_small_moe_parameters_by_hand():
    assert hf_parameter_count(SMALL_MOE) == 4 * (ATTENTION + REPLICATED + EXPERTS) + 2 * EMBEDDING + 64 == 281280
    # TP1 PP1 EP2 (expert TP1): every dense parameter, half the experts.
    assert rank_parameters(SMALL_MOE, 1, 1, 0, ep=2, etp=1) == RankParameters(84672, 98304)
    assert 84672 == 4 * (ATTENTION + REPLICATED) + 2 * EMBEDDING + 64 and 98304 == 4 * EXPERTS // 2
    # TP2 PP2 EP2, first stage (2 layers, the embedding): attention and embedding halved over TP, norms and router
    # on every TP rank; experts over EP2 x expert TP1, or EP2 x expert TP2 (null: the TP size).
    assert rank_parameters(SMALL_MOE, 2, 2, 0, ep=2, etp=1) == RankParameters(2 * (6144 + 672) + 8192, 49152)
    assert rank_parameters(SMALL_MOE, 2, 2, 0, ep=2) == RankParameters(21824, 24576)
    # the last stage: the final norm and the output layer instead of the embedding
    assert rank_parameters(SMALL_MOE, 2, 2, 1, ep=2) == RankParameters(13632 + 64 + 8192, 24576)


def test_small_moe_activations_by_hand():
    """The MoE MLP term against the dense SwiGLU term of the same layer (everything else is shared)."""
    dense = {**{k: v for k, v in SMALL_MOE.items() if not k.startswith(("num_experts", "moe_"))},
             "model_type": "qwen3", "intermediate_size": 32}
    kw = dict(tokens=64, row_tokens=64, element_bytes=2)
    # TP1: dense 64 tokens x 5 x 32 x 2 B = 20480 per layer. MoE: router 64 x 8 experts x 8 B = 4096; 128 routed
    # copies (64 tokens x top-2) x (2 x 64 x 2 B + 4) = 33280; their expert MLP 128 x 5 x 32 x 2 B = 40960.
    moe_minus_dense = activation_bytes(SMALL_MOE, **kw).total - activation_bytes(dense, **kw).total
    assert moe_minus_dense == 4 * (4096 + 33280 + 40960 - 20480)
    # TP2 with sequence parallelism, expert TP1: the router sees 32 tokens (2048); 64 routed copies (16640 + 20480);
    # dense: 10240.
    kw.update(tp=2, sequence_parallel=True)
    moe_minus_dense = activation_bytes(SMALL_MOE, expert_tp=1, **kw).total - activation_bytes(dense, **kw).total
    assert moe_minus_dense == 4 * (2048 + 16640 + 20480 - 10240)


def test_qwen3_30b_a3b_matches_its_model_card():
    hf = KNOWN_MODELS["Qwen/Qwen3-30B-A3B"]
    assert hf_parameter_count(hf) / 1e9 == pytest.approx(30.5, abs=0.05)  # "30.5B in total, 3.3B activated"
    assert hf_parameter_count({**hf, "num_experts": 8}) / 1e9 == pytest.approx(3.3, abs=0.05)  # 8 of 128 experts


def test_qwen3_30b_a3b_recipe_by_hand():
    """TP1 x PP2 x DP8, EP8, expert TP1, bf16, the distributed optimizer (12 B per parameter: two fp32 moments, an
    fp32 master copy). One layer: attention 2048*32*128 + 2*2048*4*128 + 32*128*2048 = 18,874,368; norms, q/k norms
    and router 2*2048 + 2*128 + 128*2048 = 266,496; experts 128 * 3*2048*768 = 603,979,776. The first stage: 24 layers
    and the embedding 151,936*2048 = 311,164,928."""
    cfg = load_config(A3B)
    hf = policy_hf_config(cfg)
    dense = 24 * (18_874_368 + 266_496) + 311_164_928
    expert = 24 * 603_979_776 // 8
    assert (dense, expert) == (770_545_664, 1_811_939_328)
    rows = estimate_memory(cfg, plan_placement(cfg), hf, gpu_memory_gib=80)
    first, last = rows[0], rows[8]
    assert (first.rank, last.rank) == (0, 8)  # rank 8 is the first of the second stage (node 1)
    assert first.weights == first.reference == 2 * (dense + expert) and first.gradients == 4 * (dense + expert)
    # dense state sharded over DP8; expert state over the expert-DP group TP x DP / (EP x expert TP) = 1
    assert first.optimizer_distributed == 12 * dense // 8 + 12 * expert == 22_899_090_432
    assert first.optimizer_replicated == 12 * (dense + expert)
    assert last.weights == 2 * (dense + 2048 + expert)  # the final norm; the output layer replaces the embedding


def test_qwen3_32b_needs_pipeline_parallelism(capsys):
    assert main(["validate", str(QWEN3_32B), "--plan"]) == 0
    assert main(["validate", str(QWEN3_32B), "--plan", "parallel.pipeline_model_parallel_size=1"]) == 2
    assert "GPU(s) over 80 GiB" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("parallel.expert_model_parallel_size=3",
     "parallel.expert_model_parallel_size=3 must divide the model's 128 experts per layer"),
    ("parallel.expert_model_parallel_size=16",
     "parallel.expert_tensor_parallel_size (1) x expert_model_parallel_size (16) x pipeline_model_parallel_size (2) "
     "must divide the actor's 16 ranks"),
])
def test_expert_layouts_that_do_not_divide_are_refused_naming_the_numbers(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(A3B, [override])


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match=re.escape("parallel.tensor_model_parallel_size=2 with a mixture-of-experts "
                                                    "model needs parallel.sequence_parallel=true")):
        load_config(A3B, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=4"])
    load_config(A3B, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=4",
                      "parallel.sequence_parallel=true"])


def test_expert_parallelism_on_a_dense_model_is_refused():
    with pytest.raises(ConfigError, match=re.escape("parallel.expert_model_parallel_size=2 needs a mixture-of-experts "
                                                    "model; 'Qwen/Qwen3-32B' is dense")):
        load_config(QWEN3_32B, ["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"])
