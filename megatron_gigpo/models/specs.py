"""Architecture facts of the models the recipes name, so recipes validate and plan without the weights.

:data:`KNOWN_MODELS` holds, per model id, the subset of its Hugging Face ``config.json`` that the layout checks
(:mod:`megatron_gigpo.config`) and the memory estimate (:mod:`megatron_gigpo.cluster.memory`) read. A local model
directory, or a hub id in the Hugging Face cache, is read from its own ``config.json`` instead (:func:`hf_config_for`). Sources: each model's
``config.json`` on the Hugging Face hub (Qwen/Qwen2.5-*-Instruct, Qwen/Qwen3-*,
Qwen/Qwen3-30B-A3B, HuggingFaceTB/SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_MODELS", "hf_config_for", "moe_shape", "padded_vocab_size"]


def _qwen25(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, tie: bool) -> dict[str, Any]:
    return {"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tie, "max_position_embeddings": 32768}


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    """Qwen3 dense: 8 KV heads and head_dim 128 at every size, 151,936 ids; 32,768 positions natively plus 8,192
    for the output (``max_position_embeddings`` 40,960; longer contexts need YaRN, which is not supported)."""
    return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": tie, "max_position_embeddings": 40960}


#: Qwen3-30B-A3B (``Qwen3MoeForCausalLM``): Qwen3's attention (32 heads, 4 KV heads, head_dim 128, q/k norms) and 48
#: MoE layers of 128 experts (FFN 768), 8 per token renormalised (``norm_topk_prob``); 30.5B parameters, 3.3B active.
#: ``intermediate_size`` (6144) is the dense MLP size of ``mlp_only_layers``, which this model has none of.
_QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                  "tie_word_embeddings": False, "max_position_embeddings": 40960, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": []}

_SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                 "tie_word_embeddings": True, "max_position_embeddings": 8192}

#: model id -> Hugging Face config.json subset (``max_position_embeddings``: the longest context vLLM accepts for
#: it, prompt + response). Whether q/k/v carry biases is the model family's fact
#: (:meth:`megatron_gigpo.models.mapping.ModelMapping.qkv_bias`), as are Qwen3's q/k norms (``qk_layernorm``), not
#: repeated here.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "builtin:smollm2-135m-instruct": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
    "Qwen/Qwen2.5-0.5B-Instruct": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B-Instruct": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B-Instruct": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B-Instruct": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, True),
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32, True),
    "Qwen/Qwen3-8B": _qwen3(4096, 12288, 36, 32, False),
    "Qwen/Qwen3-14B": _qwen3(5120, 17408, 40, 40, False),
    "Qwen/Qwen3-32B": _qwen3(5120, 25600, 64, 64, False),
    "Qwen/Qwen3-30B-A3B": _QWEN3_30B_A3B,
    # config-only base of model.init: random (models.builtin): Qwen3-30B-A3B's shape, SmolLM2's tokenizer
    "builtin:qwen3-moe-base": {**_QWEN3_30B_A3B, "vocab_size": _SMOLLM2_135M["vocab_size"]},
}


def hf_config_for(path: str, revision: str | None = None) -> dict[str, Any] | None:
    """The ``config.json`` of ``path``: a local Hugging Face directory, else a hub id's cached snapshot at
    ``revision`` (:func:`megatron_gigpo.models.hub.cached_snapshot`; no download), else a known model id
    (:data:`KNOWN_MODELS`); None if none of these.

    Raises:
        ValueError: the ``config.json`` found is not valid JSON.
    """
    from megatron_gigpo.models.hub import cached_snapshot, is_hub_id

    cfg_file = Path(os.path.expanduser(path)) / "config.json"
    snapshot = cached_snapshot(path, revision) if not cfg_file.is_file() and is_hub_id(path) else None
    if snapshot is not None:
        cfg_file = snapshot / "config.json"
    if cfg_file.is_file():
        try:
            return json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_file}: not valid JSON ({exc})") from None
    known = KNOWN_MODELS.get(path)
    return dict(known) if known is not None else None


def padded_vocab_size(hf_config: Any, tensor_model_parallel_size: int) -> int:
    """Vocabulary rounded up to a multiple of lcm(128, TP) (Megatron's ``make_vocab_size_divisible_by``).

    The multiple does not change with TP (for TP dividing 128), so a Megatron checkpoint saved at one TP
    loads at another. Real Qwen2/Llama vocabularies are multiples of 128 already, so this is usually the HF
    size; otherwise logits at ids >= ``hf_config.vocab_size`` come from zero padding rows and must be
    masked (set to -inf) before any softmax.
    """
    vocab = int(hf_config.vocab_size)
    multiple = math.lcm(128, tensor_model_parallel_size)
    return -(-vocab // multiple) * multiple


def moe_shape(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts E, experts per token k, each expert's FFN size f_e) of a mixture-of-experts config.json
    (``num_experts`` or transformers 5's ``num_local_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``;
    every layer a MoE layer, as the Qwen3-MoE mapping requires); (0, 0, 0) for a dense model.

    Raises:
        KeyError: a config.json with experts but without ``num_experts_per_tok`` or ``moe_intermediate_size``.
    """
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        return 0, 0, 0
    return int(experts), int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"])
