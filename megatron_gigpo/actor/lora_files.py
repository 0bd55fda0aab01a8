"""LoRA files: the base-model reference of an adapter-only checkpoint, loading adapters from one, and export as a
Hugging Face PEFT adapter folder.

An actor checkpoint of a LoRA run (:mod:`megatron_gigpo.actor.checkpoint`) stores only the adapters (and their
optimizer state); ``lora.json`` in its folder names the frozen base::

    {"format": "megatron_gigpo.lora/1", "base_model_path": "/abs/hf/dir", "base_fingerprint": "<sha256>",
     "rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["linear_qkv", ...]}

The fingerprint covers the base's ``config.json`` and the names and sizes of its safetensors files, so a resume
or export against another base is refused. A PEFT folder (:func:`write_peft_adapter`) holds
``adapter_config.json`` and ``adapter_model.safetensors`` in the layout HF PEFT's ``LoraConfig`` /
``PeftModel.from_pretrained`` read (peft 0.21): fused Megatron adapters split exactly into per-projection
ones that share ``A`` (``q_proj``/``k_proj``/``v_proj`` from ``linear_qkv``, ``gate_proj``/``up_proj`` from
``linear_fc1``), each of rank ``r`` with the same ``lora_alpha``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "LORA_FILE",
    "base_fingerprint",
    "write_lora_reference",
    "read_lora_reference",
    "check_lora_reference",
    "adapter_sharded_state_dict",
    "load_lora_adapters",
    "load_adapter_state",
    "peft_tensors",
    "write_peft_adapter",
]

LORA_FILE = "lora.json"
FORMAT = "megatron_gigpo.lora/1"
_SETTINGS = ("rank", "alpha", "dropout", "target_modules")


def base_fingerprint(hf_dir: str | os.PathLike) -> str:
    """sha256 of ``config.json`` and the (name, size) of every ``*.safetensors`` file of ``hf_dir``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``hf_dir``.
    """
    hf_dir = Path(hf_dir)
    digest = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for path in sorted(hf_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()


def write_lora_reference(folder: str | os.PathLike, lora, base_dir: str | os.PathLike) -> None:
    """Write ``lora.json`` (base path + fingerprint + LoRA settings) into a checkpoint ``folder``."""
    doc = {"format": FORMAT, "base_model_path": str(Path(base_dir).resolve()),
           "base_fingerprint": base_fingerprint(base_dir)}
    doc.update({k: getattr(lora, k) for k in _SETTINGS})
    doc["target_modules"] = list(doc["target_modules"])
    (Path(folder) / LORA_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def read_lora_reference(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The ``lora.json`` of a checkpoint folder, or None when it has none (a full-weight checkpoint).

    Raises:
        ValueError: unknown format.
    """
    path = Path(folder) / LORA_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return doc


def check_lora_reference(folder: str | os.PathLike, lora, base_dir: str | os.PathLike) -> None:
    """Refuse to load ``folder`` into an actor whose LoRA settings or base differ from the checkpoint's.

    Raises:
        ValueError: naming the difference (adapter-only checkpoint into a full-weight actor or the reverse,
            another rank / targets, another base model).
    """
    doc = read_lora_reference(folder)
    if doc is None:
        if lora.enabled:
            raise ValueError(f"checkpoint {folder} holds full weights, not LoRA adapters (model.lora.enabled=true)")
        return
    if not lora.enabled:
        raise ValueError(f"checkpoint {folder} holds only LoRA adapters; set model.lora.enabled=true to resume it")
    for key in ("rank", "target_modules"):
        mine = list(getattr(lora, key)) if key == "target_modules" else getattr(lora, key)
        if doc[key] != mine:
            raise ValueError(f"checkpoint {folder} has LoRA {key}={doc[key]!r}, the actor {key}={mine!r}")
    if doc["base_fingerprint"] != base_fingerprint(base_dir):
        raise ValueError(f"checkpoint {folder} adapts the base {doc['base_model_path']}, which differs from "
                         f"model.path {base_dir} (config.json or weight files)")


def adapter_sharded_state_dict(gpt) -> dict[str, Any]:
    """The adapter entries of ``GPTModel.sharded_state_dict()`` (keys ending ``.lora.A`` / ``.lora.B``)."""
    return {k: v for k, v in gpt.sharded_state_dict().items() if k.endswith((".lora.A", ".lora.B"))}


def load_lora_adapters(model, folder: str | os.PathLike, *, key: str = "model") -> None:
    """Load the adapters of a LoRA actor checkpoint ``folder`` into ``model`` (adapters attached, any TP/PP);
    collective. ``key``: the section of the checkpoint's sharded dict that holds the model."""
    from megatron.core import dist_checkpointing

    from megatron_gigpo.models.builder import unwrap_gpt_model

    gpt = unwrap_gpt_model(model[0] if isinstance(model, (list, tuple)) else model)
    loaded = dist_checkpointing.load({key: adapter_sharded_state_dict(gpt)}, str(folder))
    load_adapter_state(gpt, loaded[key])


def load_adapter_state(gpt, state: dict[str, torch.Tensor]) -> None:
    """``gpt.load_state_dict`` of adapter tensors only; every adapter must be present.

    Raises:
        ValueError: an adapter is missing from ``state`` or ``state`` holds non-adapter keys.
    """
    from megatron_gigpo.actor.lora import adapter_state_keys

    expected = adapter_state_keys(gpt)
    if set(state) != expected:
        raise ValueError(f"adapter state mismatch: missing {sorted(expected - set(state))[:4]}, "
                         f"unexpected {sorted(set(state) - expected)[:4]}")
    result = gpt.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"unexpected adapter keys {result.unexpected_keys[:4]}")


def peft_tensors(full: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF PEFT tensors (``base_model.model.<hf module>.lora_A.weight`` (r, in) / ``lora_B.weight`` (out, r))
    from :func:`megatron_gigpo.actor.lora.full_adapter_weights`'s Megatron adapters (TP1 layout)."""
    from megatron_gigpo.models.builder import head_dim
    from megatron_gigpo.models.mapping import ShardLayout, get_model_mapping

    rules = get_model_mapping(hf_config).rules(hf_config)
    heads, groups = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    layout = ShardLayout(tp_rank=0, tp_size=1, num_query_groups=groups, heads_per_group=heads // groups,
                         head_dim=head_dim(hf_config), vocab_size=int(hf_config.vocab_size))
    out = {}
    for key in sorted(k for k in full if k.endswith(".lora.B")):
        layer = key[: -len(".lora.B")]
        a, parts = full[layer + ".lora.A"], rules[layer + ".weight"].merge_shards([full[key]], layout)
        for hf_name, b in parts:
            module = "base_model.model." + hf_name.removesuffix(".weight")
            out[module + ".lora_A.weight"] = a.contiguous().clone()
            out[module + ".lora_B.weight"] = b.contiguous().clone()
    return out


def write_peft_adapter(model, out_dir: str | os.PathLike, lora, *, base_model: str,
                       dtype: torch.dtype | None = None) -> None:
    """Write the adapters of ``model`` as an HF PEFT LoRA folder (``adapter_config.json`` +
    ``adapter_model.safetensors``); collective over all ranks, rank 0 writes, atomically.

    Args:
        model: the LoRA-adapted model (any TP/PP layout; every rank calls).
        out_dir: output folder; must not exist or be empty.
        lora: the :class:`~megatron_gigpo.models.config.LoraConfig` the adapters were trained with.
        base_model: written as ``base_model_name_or_path``.
        dtype: tensor dtype in the file (default: the adapters' own).

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    from safetensors.torch import save_file

    from megatron_gigpo.actor.lora import full_adapter_weights
    from megatron_gigpo.models.builder import hf_config_of

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} exists and is not empty")
    full = full_adapter_weights(model)
    if dist.get_rank() == 0:
        tensors = peft_tensors(full, hf_config_of(model[0] if isinstance(model, (list, tuple)) else model))
        tensors = {k: v.to(dtype) if dtype else v for k, v in tensors.items()}
        staging = out_dir.with_name(out_dir.name + ".incomplete")
        staging.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        targets = sorted({k.split(".")[-3] for k in tensors})
        (staging / "adapter_config.json").write_text(json.dumps(_peft_config(lora, base_model, targets), indent=2))
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    dist.barrier()


def _peft_config(lora, base_model: str, targets: Sequence[str]) -> dict[str, Any]:
    """``adapter_config.json`` fields of HF PEFT's ``LoraConfig`` (others keep PEFT's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
