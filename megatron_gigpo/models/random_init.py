"""Randomly initialised policies (``model.init: random``): a CPU demonstrator that learns within minutes.

A small model is written as a plain Hugging Face directory, so it goes through exactly the same Megatron
actor, vLLM engine, weight sync and converters as any pretrained model. Its ``config.json`` is the base
model's (``model.path``: architecture class, vocabulary, RoPE, norms, tied embeddings) with the shape fields
of :class:`~megatron_gigpo.models.config.ArchitectureConfig` replaced; its tokenizer files (and chat template) are
the base model's (with ``architecture.vocab_size``: truncated to its first ids, :func:`truncate_tokenizer`); its
weights are drawn by ``transformers`` (``AutoModelForCausalLM.from_config``: normal with
``initializer_range`` std, norms at 1) under ``torch.manual_seed(seed)``.

The directory lives under ``$MEGATRON_GIGPO_CACHE/models/random-<digest>``, the digest covering the resolved
config and the seed, so a recipe always gets the same weights and two shapes never share a folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from megatron_gigpo.models.builtin import cache_root, resolve_model_path, write_hf_dir_atomic

__all__ = ["random_model_dir", "resolve_model", "truncate_tokenizer"]

# Files of the base directory that describe weights or shape, not the tokenizer: never copied.
_NOT_TOKENIZER = ("config.json", "generation_config.json")


def truncate_tokenizer(tokenizer_json: dict, vocab_size: int, *, source: str = "tokenizer.json") -> dict:
    """A byte-level BPE ``tokenizer.json`` (Hugging Face ``tokenizers`` format) keeping its first ``vocab_size`` ids.

    The kept vocabulary is every id ``< vocab_size``; a merge is kept when its result is kept (BPE ranks follow
    ids in GPT-2-style tokenizers, so both parts of a kept merge are kept too). Text still encodes (into more,
    shorter tokens) as long as the 256 byte tokens are kept.

    Args:
        tokenizer_json: the parsed ``tokenizer.json`` (not modified).
        vocab_size: ids to keep.
        source: named in errors.

    Returns:
        the truncated ``tokenizer.json`` dict.

    Raises:
        ValueError: not a BPE model; a special (added) token or a byte token has an id ``>= vocab_size``; or a
            kept merge needs a dropped token.
    """
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"model.architecture.vocab_size needs a BPE tokenizer; {source} has {model.get('type')!r}")
    dropped = [(t["content"], t["id"]) for t in tokenizer_json.get("added_tokens", []) if t["id"] >= vocab_size]
    if dropped:
        raise ValueError(f"model.architecture.vocab_size={vocab_size} would drop the special tokens {dropped[:3]} of "
                         f"{source}; choose a vocab_size above their ids")
    vocab = {tok: i for tok, i in model["vocab"].items() if i < vocab_size}
    from tokenizers.pre_tokenizers import ByteLevel

    missing = [c for c in ByteLevel.alphabet() if c in model["vocab"] and c not in vocab]
    if missing:
        raise ValueError(f"model.architecture.vocab_size={vocab_size} drops {len(missing)} byte tokens "
                         f"of {source}; choose a larger vocab_size")
    merges = []
    for merge in model.get("merges", []):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if left + right in vocab:
            if left not in vocab or right not in vocab:
                raise ValueError(f"{source}: kept merge {merge!r} needs a token with an id >= {vocab_size}")
            merges.append(merge)
    return {**tokenizer_json, "model": {**model, "vocab": vocab, "merges": merges}}


def _default_head_dim(hf: dict) -> int | None:
    """The head size the model family's transformers config class gives ``hf`` without a ``head_dim`` (Qwen2 and
    Llama derive hidden_size / num_attention_heads; Qwen3 has a fixed default)."""
    from transformers import AutoConfig

    shape = {k: hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads") if k in hf}
    return getattr(AutoConfig.for_model(hf["model_type"], **shape), "head_dim", None)


# MoE bases only: model.architecture key -> its config.json names (transformers >= 5 writes Qwen3-MoE's
# num_experts as num_local_experts; the released Qwen3-MoE configs say num_experts)
_MOE_FIELDS = {"num_experts": ("num_experts", "num_local_experts"), "num_experts_per_tok": ("num_experts_per_tok",),
               "moe_intermediate_size": ("moe_intermediate_size",)}


def _random_config(base_dir: Path, architecture) -> dict:
    hf = json.loads((base_dir / "config.json").read_text())
    shape = dataclasses.asdict(architecture)
    if shape.get("vocab_size") is None:
        shape.pop("vocab_size", None)
    elif shape["vocab_size"] > hf["vocab_size"]:
        raise ValueError(f"model.architecture.vocab_size={shape['vocab_size']} exceeds the base model's "
                         f"vocabulary ({hf['vocab_size']} ids in {base_dir / 'config.json'})")
    for key, aliases in _MOE_FIELDS.items():
        if shape.get(key) is None:
            shape.pop(key, None)
        elif not any(alias in hf for alias in aliases):
            raise ValueError(f"model.architecture.{key}={shape[key]} needs a mixture-of-experts base; "
                             f"{base_dir / 'config.json'} (model_type {hf.get('model_type')!r}) has no {key}")
        else:
            for alias in aliases:
                hf.pop(alias, None)
    hf.pop("head_dim", None)  # the base's head size does not fit the new shape: derived unless given
    if shape.get("head_dim") is None:
        shape.pop("head_dim", None)
    hf.update(shape)
    if "head_dim" not in hf and _default_head_dim(hf) != hf["hidden_size"] // hf["num_attention_heads"]:
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]  # Qwen3's class defaults to 128
    kinds = set(hf.get("layer_types") or ())  # per-layer attention kinds (configs written by transformers >= 4.54)
    if len(kinds) > 1:
        raise ValueError(f"{base_dir / 'config.json'}: layer_types mixes {sorted(kinds)}; a random model cannot "
                         "choose which of its layers get which")
    if kinds:
        hf["layer_types"] = [kinds.pop()] * hf["num_hidden_layers"]  # one per layer of the new depth
    hf.pop("quantization_config", None)
    hf["torch_dtype"] = "float32"
    return hf


def random_model_dir(base: str, architecture, seed: int, revision: str | None = None) -> Path:
    """The Hugging Face directory of a random model shaped by ``architecture`` over ``base``; built on first call.

    Args:
        base: ``model.path`` of the recipe (a Hugging Face directory or ``builtin:<name>``): architecture class,
            vocabulary and tokenizer.
        architecture: a :class:`~megatron_gigpo.models.config.ArchitectureConfig`.
        seed: seed of ``torch.manual_seed`` before the weights are drawn.
        revision: ``model.revision`` of a hub id ``base``.

    Returns:
        the directory (config.json, model.safetensors in float32, generation_config.json, tokenizer files).

    Raises:
        FileNotFoundError / ValueError: ``base`` does not resolve (see ``resolve_model_path``).
    """
    base_dir = resolve_model_path(base, revision)
    hf = _random_config(base_dir, architecture)
    digest = hashlib.sha256(json.dumps([hf, int(seed)], sort_keys=True).encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"random-{digest}"
    if (out / "config.json").is_file():
        return out

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**hf)
        with torch.random.fork_rng():
            torch.manual_seed(int(seed))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # save_pretrained writes the checkpoint names (transformers >= 5 keeps Qwen3-MoE's experts fused in memory,
        # mlp.experts.gate_up_proj, and writes them per expert, mlp.experts.{e}.gate_proj) and leaves out a tied
        # lm_head; only its weight files are kept.
        weights = tmp / "weights"
        model.save_pretrained(str(weights))
        for item in weights.iterdir():
            if item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json":
                item.rename(tmp / item.name)
        shutil.rmtree(weights)
        for item in base_dir.iterdir():
            if item.is_file() and item.name not in _NOT_TOKENIZER and not item.name.endswith(".safetensors") \
                    and not item.name.endswith(".bin") and item.name != "model.safetensors.index.json":
                shutil.copy2(item, tmp / item.name)
        if architecture.vocab_size is not None:
            source = base_dir / "tokenizer.json"
            small = truncate_tokenizer(json.loads(source.read_text()), architecture.vocab_size, source=str(source))
            (tmp / "tokenizer.json").write_text(json.dumps(small, ensure_ascii=False))
            for slow in ("vocab.json", "merges.txt"):  # the full vocabulary's files of the slow tokenizer
                (tmp / slow).unlink(missing_ok=True)
        if (base_dir / "generation_config.json").is_file():
            shutil.copy2(base_dir / "generation_config.json", tmp / "generation_config.json")
        hf_out = dict(hf, _name_or_path=f"random:{base}:seed{seed}")
        (tmp / "config.json").write_text(json.dumps(hf_out, indent=2))

    write_hf_dir_atomic(out, write)
    return out


def resolve_model(model_cfg) -> Path:
    """The local Hugging Face directory of a recipe's ``model`` section (pretrained or random).

    Raises:
        FileNotFoundError / ValueError: the path does not resolve (see ``resolve_model_path``).
    """
    if model_cfg.init == "random":
        return random_model_dir(model_cfg.path, model_cfg.architecture, model_cfg.seed, model_cfg.revision)
    return resolve_model_path(model_cfg.path, model_cfg.revision)
