"""Single-process checks of the HF <-> Megatron mapping rules, configs and the tiny-model factory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_hf_model, tiny_config

from megatron_gigpo.models.builder import layer_spec, padded_vocab_size, rope_settings, transformer_config_from_hf
from megatron_gigpo.models.mapping import (
    GateUpRule,
    QKVRule,
    ShardLayout,
    UnsupportedModelError,
    VocabRule,
    WeightShapeError,
    get_model_mapping,
    supported_architectures,
)
from megatron_gigpo.models.weights import HFCheckpointReader


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), "qwen2", tie=False, vocab_size=500)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), "qwen3", tie=False, vocab_size=500)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("m"), "qwen3_moe", tie=False, vocab_size=500)


def _layout(tp_rank: int, tp_size: int, head_dim: int = 16) -> ShardLayout:
    # tiny config: 4 heads, 2 KV groups, head_dim 16 (Qwen3: 32), vocab 500; experts split like the dense layers
    # (megatron-core's default expert_tensor_parallel_size = TP)
    return ShardLayout(tp_rank, tp_size, num_query_groups=2, heads_per_group=2, head_dim=head_dim, vocab_size=500,
                       expert_tp_rank=tp_rank, expert_tp_size=tp_size)


def _local_shape(rule, reader: HFCheckpointReader, tp_size: int) -> tuple[int, ...]:
    """Megatron shard shape implied by the HF tensors (inverse of TensorRule.hf_shapes)."""
    shapes = [reader.shape(name) for name in rule.hf_names]
    if isinstance(rule, VocabRule):
        return (padded_vocab_size(tiny_config(vocab_size=500), tp_size) // tp_size, *shapes[0][1:])
    rows = sum(shape[0] for shape in shapes) if isinstance(rule, (QKVRule, GateUpRule)) else shapes[0][0]
    full = [rows, *shapes[0][1:]]
    if rule.tp_dim is not None:
        full[rule.tp_dim] //= tp_size
    return tuple(full)


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_rules_shard_and_merge_back_bit_exactly(request, arch, tp_size):
    hf_config = tiny_config(arch, vocab_size=500)
    head_dim = hf_config.head_dim if arch.startswith("qwen3") else 16
    rules = get_model_mapping(hf_config).rules(hf_config)
    reader = HFCheckpointReader(request.getfixturevalue(f"{arch}_dir"))
    assert {n for r in rules.values() for n in r.hf_names} == set(reader.names())
    for rule in rules.values():
        local_shape = _local_shape(rule, reader, tp_size)
        shards = [rule.load_shard(reader, _layout(r, tp_size, head_dim), local_shape) for r in range(tp_size)]
        assert all(tuple(s.shape) == local_shape for s in shards), rule.megatron_name
        for name, tensor in rule.merge_shards(shards, _layout(0, tp_size, head_dim)):
            assert torch.equal(tensor, reader.read(name)), name


@pytest.mark.unit
def test_qwen3_query_and_key_norms_map_to_megatron_qk_layernorm():
    hf_config = tiny_config("qwen3")
    rules = get_model_mapping(hf_config).rules(hf_config)
    attention = "decoder.layers.3.self_attention."
    assert rules[attention + "q_layernorm.weight"].hf_names == ("model.layers.3.self_attn.q_norm.weight",)
    assert rules[attention + "k_layernorm.weight"].hf_names == ("model.layers.3.self_attn.k_norm.weight",)
    assert rules[attention + "q_layernorm.weight"].tp_dim is None  # one gain per head_dim, on every TP rank
    assert attention + "linear_qkv.bias" not in rules
    qwen2 = tiny_config("qwen2")
    assert not any("layernorm.weight" in n and "self_attention" in n for n in get_model_mapping(qwen2).rules(qwen2))


@pytest.mark.unit
def test_qwen3_moe_router_and_experts_map_to_megatron_moe_layer():
    """Router and every expert of every layer, by global expert index; the routing fields of megatron-core."""
    from megatron_gigpo.models.builder import moe_settings
    from megatron_gigpo.models.mapping import ExpertCopyRule, ExpertGateUpRule, canonical_name

    hf_config = tiny_config("qwen3_moe")
    rules = get_model_mapping(hf_config).rules(hf_config)
    m, h = "decoder.layers.2.mlp.", "model.layers.2.mlp."
    assert rules[m + "router.weight"].hf_names == (h + "gate.weight",) and rules[m + "router.weight"].tp_dim is None
    fc1, fc2 = rules[m + "experts.local_experts.3.linear_fc1.weight"], rules[m + "experts.local_experts.3.linear_fc2.weight"]
    assert isinstance(fc1, ExpertGateUpRule) and fc1.hf_names == (h + "experts.3.gate_proj.weight",
                                                                  h + "experts.3.up_proj.weight")
    assert isinstance(fc2, ExpertCopyRule) and fc2.hf_names == (h + "experts.3.down_proj.weight",)
    assert not any(".mlp.linear_fc" in name for name in rules)  # no dense MLP in any layer
    assert canonical_name("decoder.layers.2.mlp.experts.linear_fc2.weight3") == m + "experts.local_experts.3.linear_fc2.weight"
    settings = moe_settings(hf_config, 2)
    assert (settings["num_moe_experts"], settings["moe_router_topk"], settings["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert settings["moe_router_score_function"] == "softmax" and settings["moe_router_pre_softmax"] is False
    assert moe_settings(tiny_config("qwen3_moe", norm_topk_prob=False))["moe_router_pre_softmax"] is True
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by expert_model_parallel_size 3"):
        moe_settings(hf_config, 3)
    with pytest.raises(ValueError, match="expert_model_parallel_size 2 needs a mixture-of-experts model"):
        moe_settings(tiny_config("qwen3"), 2)
    with pytest.raises(UnsupportedModelError, match=r"qwen3_moe: dense MLP layers \(mlp_only_layers=\[1\]"):
        get_model_mapping(tiny_config("qwen3_moe", mlp_only_layers=[1]))


@pytest.mark.unit
def test_qkv_and_fc1_layouts_match_megatron_grouping(qwen2_dir):
    reader = HFCheckpointReader(qwen2_dir)
    p = "model.layers.0."
    q, k, v = (reader.read(p + f"self_attn.{x}_proj.weight") for x in "qkv")
    qkv_names = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
    rule = QKVRule("decoder.layers.0.self_attention.linear_qkv.weight", qkv_names, 0)
    rank1 = rule.load_shard(reader, _layout(1, 2), (64, 64))
    # TP rank 1 holds KV group 1: its 2 query heads, then its k head, then its v head
    torch.testing.assert_close(rank1, torch.cat([q[32:64], k[16:32], v[16:32]]), rtol=0, atol=0)
    gate_up_names = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
    gate_up = GateUpRule("decoder.layers.0.mlp.linear_fc1.weight", gate_up_names, 0)
    shard = gate_up.load_shard(reader, _layout(1, 2), (128, 64))
    gate, up = reader.read(p + "mlp.gate_proj.weight"), reader.read(p + "mlp.up_proj.weight")
    torch.testing.assert_close(shard, torch.cat([gate[64:], up[64:]]), rtol=0, atol=0)


@pytest.mark.unit
def test_wrong_shape_names_tensor_and_both_shapes(qwen2_dir):
    hf_config = tiny_config("qwen2", vocab_size=500)
    rule = get_model_mapping(hf_config).rules(hf_config)["decoder.layers.2.mlp.linear_fc2.weight"]
    with pytest.raises(WeightShapeError, match=r"'model\.layers\.2\.mlp\.down_proj\.weight'.*\[64, 128\].*\[64, 96\]"):
        rule.load_shard(HFCheckpointReader(qwen2_dir), _layout(0, 2), (64, 48))


@pytest.mark.unit
def test_unsupported_architectures_are_clear_errors():
    from transformers import GPT2Config

    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                         "Qwen3MoeForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        get_model_mapping(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        get_model_mapping(tiny_config("llama", attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="qwen3: attention_bias"):
        get_model_mapping(tiny_config("qwen3", attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="qwen3: use_sliding_window"):
        get_model_mapping(tiny_config("qwen3", use_sliding_window=True))
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        get_model_mapping(tiny_config("qwen2", use_sliding_window=True))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        rope_settings(tiny_config("qwen2", rope_parameters=yarn))


@pytest.mark.unit
def test_transformer_config_from_hf():
    hf_config = tiny_config("qwen2", tie=True)
    config = transformer_config_from_hf(
        hf_config, params_dtype=torch.bfloat16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 64, 128)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 2, 16)
    assert config.add_qkv_bias and not config.add_bias_linear and config.gated_linear_unit
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-6 and config.bf16
    assert rope_settings(hf_config).theta == 1_000_000.0
    llama = transformer_config_from_hf(
        tiny_config("llama"), params_dtype=torch.float32, tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    assert not llama.add_qkv_bias and not llama.qk_layernorm
    qwen3 = transformer_config_from_hf(
        tiny_config("qwen3"), params_dtype=torch.float32, tensor_model_parallel_size=2, pipeline_model_parallel_size=1
    )
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and (qwen3.hidden_size, qwen3.kv_channels) == (64, 32)
    from megatron.core.transformer.identity_op import IdentityOp

    attention = layer_spec(qwen3).submodules.self_attention.submodules
    assert attention.q_layernorm is not IdentityOp and attention.k_layernorm is not IdentityOp
    assert layer_spec(llama).submodules.self_attention.submodules.q_layernorm is IdentityOp
    assert not config.qk_layernorm
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible by tensor_model_parallel_size 4"):
        transformer_config_from_hf(
            hf_config, params_dtype=torch.float32, tensor_model_parallel_size=4, pipeline_model_parallel_size=1
        )
    assert padded_vocab_size(tiny_config(vocab_size=500), 2) == 512
    assert padded_vocab_size(tiny_config(vocab_size=151936), 8) == 151936


@pytest.mark.unit
def test_tiny_model_has_working_tokenizer(qwen2_dir):
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_dir))
    assert len(tokenizer) == AutoConfig.from_pretrained(str(qwen2_dir)).vocab_size == 500
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "go to desk 1"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert max(ids) < 500 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(ids) == "<|im_start|>user\ngo to desk 1<|im_end|>\n<|im_start|>assistant\n"
