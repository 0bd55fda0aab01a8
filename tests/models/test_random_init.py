"""Random models (``model.init: random``) with a truncated vocabulary (``model.architecture.vocab_size``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gigpo.config import ArchitectureConfig
from megatron_gigpo.models.random_init import random_model_dir, truncate_tokenizer

pytestmark = pytest.mark.unit

BASE = "builtin:smollm2-135m-instruct"
SOKOBAN_PROMPT = "Now:\n# # # # # #\n# _ P X O #\n# # # # # #\n\nReply <think>reasoning</think><action>up|down</action>"


@pytest.fixture(scope="module")
def small_dir():
    """Built once in the model cache (keyed by a digest of its config and seed), as a recipe would."""
    return random_model_dir(BASE, ArchitectureConfig(vocab_size=4096), seed=3)


def test_truncated_tokenizer_round_trips_and_stays_in_range(small_dir):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_dir)
    assert len(tok) == 4096 and AutoConfig.from_pretrained(small_dir).vocab_size == 4096
    messages = [{"role": "user", "content": SOKOBAN_PROMPT},
                {"role": "assistant", "content": "<think></think><action>right</action>"}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert max(ids) < 4096
    assert tok.decode(ids).endswith("<think></think><action>right</action><|im_end|>\n")
    text = "Sokoban √ 42 ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text
    # fewer merges: the same text takes more tokens than with the full vocabulary
    full = AutoTokenizer.from_pretrained(random_model_dir(BASE, ArchitectureConfig(), seed=3))
    assert len(tok(SOKOBAN_PROMPT)["input_ids"]) > len(full(SOKOBAN_PROMPT)["input_ids"])


def test_truncated_model_weights_have_the_new_vocabulary(small_dir):
    from safetensors import safe_open

    with safe_open(str(small_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").shape == (4096, 128)
    assert json.loads((small_dir / "config.json").read_text())["vocab_size"] == 4096


def test_bad_vocab_sizes_are_refused(small_dir):
    with pytest.raises(ValueError, match=r"model.architecture.vocab_size=60000 exceeds"):
        random_model_dir(BASE, ArchitectureConfig(vocab_size=60000), seed=3)
    tokenizer = json.loads((small_dir / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 4000, "content": "<|late|>", "special": True})
    with pytest.raises(ValueError, match=r"vocab_size=1024 would drop the special tokens \[\('<\|late\|>', 4000\)\]"):
        truncate_tokenizer(tokenizer, 1024)
    with pytest.raises(ValueError, match=r"vocab_size=200 drops \d+ byte tokens"):
        truncate_tokenizer(json.loads((small_dir / "tokenizer.json").read_text()), 200)
    with pytest.raises(ValueError, match="needs a BPE tokenizer"):
        truncate_tokenizer({"model": {"type": "Unigram"}}, 1024)


def test_builtin_conversion_says_one_line_once(tmp_path):
    """The first use converts the GGUF file with one line of output (no tensor-by-tensor progress bars in a
    log file); later uses read the cache and say nothing."""
    import os
    import subprocess
    import sys

    code = f"from megatron_gigpo.models.builtin import resolve_model_path; resolve_model_path({BASE!r})"
    env = {**os.environ, "MEGATRON_GIGPO_CACHE": str(tmp_path)}
    first, again = (subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
                    for _ in range(2))
    lines = (first.stdout + first.stderr).splitlines()
    assert lines == [f"megatron-gigpo: converting {BASE} from its GGUF file, once (cached in "
                     f"{tmp_path}/models/smollm2-135m-instruct)"], lines
    assert again.stdout + again.stderr == ""


def test_random_qwen3_keeps_its_family_with_the_new_head_size(tmp_path, monkeypatch):
    """A Qwen3 base gives a random Qwen3 (q/k norms of the new head size, no q/k/v biases) that transformers loads
    with the chat template of the base; ``head_dim`` null derives it from the new shape, not the base's."""
    from safetensors import safe_open
    from tiny_models import make_tiny_hf_model
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("MEGATRON_GIGPO_CACHE", str(tmp_path / "cache"))
    base = make_tiny_hf_model(tmp_path, "qwen3", tie=True, vocab_size=600)  # head_dim 32 (hidden 64, 4 heads)
    for head_dim, expected in ((64, 64), (None, 128 // 4)):
        out = random_model_dir(str(base), ArchitectureConfig(head_dim=head_dim), seed=1)
        config = AutoConfig.from_pretrained(out)
        assert (config.model_type, config.head_dim, config.hidden_size) == ("qwen3", expected, 128)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.get_slice("model.layers.1.self_attn.q_norm.weight").get_shape() == [expected]
            assert f.get_slice("model.layers.1.self_attn.q_proj.weight").get_shape() == [4 * expected, 128]
            assert "model.layers.1.self_attn.q_proj.bias" not in f.keys()
        assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_random_qwen3_moe_has_per_expert_weights_of_the_new_shape(tmp_path, monkeypatch):
    """A Qwen3-MoE base gives a random Qwen3-MoE with ``model.architecture``'s expert count, top-k and expert FFN
    size, written under the checkpoint's per-expert names (transformers fuses the experts in memory) that the
    Megatron mapping reads; the MoE fields are refused for a dense base, naming the key."""
    from safetensors import safe_open
    from tiny_models import make_tiny_hf_model
    from transformers import AutoConfig

    from megatron_gigpo.models.mapping import get_model_mapping

    monkeypatch.setenv("MEGATRON_GIGPO_CACHE", str(tmp_path / "cache"))
    base = make_tiny_hf_model(tmp_path, "qwen3_moe", tie=True, vocab_size=600, num_hidden_layers=1)  # 4 experts
    out = random_model_dir(str(base), ArchitectureConfig(num_experts=8, num_experts_per_tok=2,
                                                         moe_intermediate_size=48), seed=1)
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == \
        ("qwen3_moe", 8, 2, 48)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.1.mlp.experts.7.gate_proj.weight").get_shape() == [48, 128]
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_shape() == [8, 128]
    mapped = {n for rule in get_model_mapping(config).rules(config).values() for n in rule.hf_names}
    assert names == mapped - {"lm_head.weight"}
    dense = make_tiny_hf_model(tmp_path, "qwen3", tie=True, vocab_size=600, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"model.architecture.num_experts=8 needs a mixture-of-experts base"):
        random_model_dir(str(dense), ArchitectureConfig(num_experts=8), seed=1)


def test_builtin_qwen3_moe_base_is_offline_and_random_only():
    """builtin:qwen3-moe-base: Qwen3-30B-A3B's architecture over SmolLM2's tokenizer, no weights; a random model over
    it is a Qwen3-MoE with the recipe's experts; ``model.init: pretrained`` over it is refused by the preflight."""
    from transformers import AutoConfig, AutoTokenizer

    from megatron_gigpo.cluster.preflight import _check_model
    from megatron_gigpo.config import load_config
    from megatron_gigpo.models.builtin import resolve_model_path

    base = resolve_model_path("builtin:qwen3-moe-base")
    assert not list(base.glob("*.safetensors"))
    hf = json.loads((base / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] == 128 and hf["vocab_size"] == len(
        AutoTokenizer.from_pretrained(base))
    shape = ArchitectureConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=4096,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = AutoConfig.from_pretrained(random_model_dir("builtin:qwen3-moe-base", shape, seed=1))
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.head_dim) == ("qwen3_moe", 4, 2, 32)
    recipe = Path(__file__).resolve().parents[2] / "recipes/smoke/qwen3-moe-cpu.yaml"
    assert _check_model(load_config(recipe)) == []
    assert "model.init: random only" in _check_model(load_config(recipe, ["model.init=pretrained"]))[0]
