"""HF safetensors <-> Megatron distributed checkpoint conversion, in any TP/PP layout on either side.

Run through ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``::

    torchrun --nproc-per-node 2 tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-0.5B --out ckpt --tp 2 --pp 1
    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py --megatron-dir ckpt --out hf_out --tp 1 --pp 2
    python tools/convert_megatron_to_hf.py --megatron-dir ckpt --out hf_out        # one process, TP1 PP1

The number of processes must be a multiple of TP x PP (extra processes are data-parallel replicas that
load the same shards). Without torchrun's environment the tools run as a single process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_gigpo.models.builder import build_gpt_model, load_hf_config, unwrap_gpt_model
from megatron_gigpo.models.checkpoint import (
    HF_SUBDIR,
    copy_hf_sidecar_files,
    load_megatron_checkpoint,
    read_checkpoint_metadata,
    save_megatron_checkpoint,
)
from megatron_gigpo.models.weights import export_hf_weights, load_hf_weights

__all__ = [
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "write_hf_model",
    "main_hf_to_megatron",
    "main_megatron_to_hf",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_params_dtype(hf_config: Any) -> torch.dtype:
    """The dtype the HF checkpoint declares (``dtype``, formerly ``torch_dtype``), float32 if none."""
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if declared is None:
        return torch.float32
    declared = declared if isinstance(declared, torch.dtype) else _DTYPES[str(declared)]
    return declared


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, params_dtype: torch.dtype | None = None
) -> None:
    """Build the model for the current TP/PP/EP layout, load HF weights, save a Megatron dist checkpoint.

    Collective: call on every rank after ``megatron_gigpo.actor.distributed.initialize``.
    ``params_dtype`` defaults to the dtype the HF config declares (float32 if none).
    """
    hf_config = load_hf_config(hf_dir)
    model = build_gpt_model(hf_config, params_dtype=params_dtype or _hf_params_dtype(hf_config))
    load_hf_weights(model, hf_dir)
    save_megatron_checkpoint(model, out_dir, hf_dir=hf_dir)


def _write_shards(buckets, staging: Path) -> None:
    """Write each bucket as one safetensors shard (HF naming), plus the index when there are several."""
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str]]] = []
    total_bytes = 0
    for bucket in buckets:
        if not bucket:
            continue
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        path = staging / f"shard-{len(written):05d}.safetensors.part"
        save_file(tensors, str(path), metadata={"format": "pt"})
        written.append((path, list(tensors)))
    if len(written) == 1:
        os.replace(written[0][0], staging / "model.safetensors")
        return
    weight_map = {}
    for index, (path, names) in enumerate(written, start=1):
        final = f"model-{index:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, staging / final)
        weight_map.update({name: final for name in names})
    index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")


def _declare_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Make ``config.json`` declare the dtype its weights were written in (left byte-identical when it does)."""
    name = str(dtype).removeprefix("torch.")
    doc = json.loads(config_file.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in doc] or ["dtype"]
    if all(doc.get(k) == name for k in keys):
        return
    doc.update({k: name for k in keys})
    config_file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def convert_megatron_to_hf(
    megatron_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    prefix: str = "",
    peft: bool = False,
    base_dir: str | os.PathLike | None = None,
) -> None:
    """Load a Megatron dist checkpoint into the current TP/PP/EP layout and write an HF model directory.

    A LoRA actor checkpoint (``lora.json``, :mod:`megatron_gigpo.actor.lora_files`) is its base model
    (``base_dir``, default the path in ``lora.json``) plus the saved adapters: written as merged weights
    ``W + (alpha / r) B A``, or with ``peft=True`` as a Hugging Face PEFT adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``) for that base.

    Collective. Tensors are gathered bucket by bucket (``max_shard_bytes``) to global rank 0, which writes
    ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + index) and copies the config and
    tokenizer files from ``hf_config_dir`` (default ``<megatron_dir>/hf``). The output appears atomically.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        FileNotFoundError: no HF config next to the checkpoint and no ``hf_config_dir``.
        ValueError: ``peft`` for a checkpoint without adapters, or a base that is not the checkpoint's.
    """
    megatron_dir, out_dir = Path(megatron_dir), Path(out_dir)
    hf_config_dir = Path(hf_config_dir) if hf_config_dir is not None else megatron_dir / HF_SUBDIR
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} exists and is not empty")
    hf_config = load_hf_config(hf_config_dir)
    metadata = read_checkpoint_metadata(megatron_dir) if not prefix else None
    params_dtype = _DTYPES[metadata["params_dtype"]] if metadata else _hf_params_dtype(hf_config)
    model = build_gpt_model(hf_config, params_dtype=params_dtype)
    from megatron_gigpo.actor.lora_files import read_lora_reference

    lora_doc = read_lora_reference(megatron_dir)
    if lora_doc is not None:
        lora = _load_lora_checkpoint(model, megatron_dir, lora_doc, base_dir)
        if peft:
            from megatron_gigpo.actor.lora_files import write_peft_adapter

            write_peft_adapter(model, out_dir, lora, base_model=str(base_dir or lora_doc["base_model_path"]),
                               dtype=dtype)
            return
    elif peft:
        raise ValueError(f"--peft: {megatron_dir} is not a LoRA checkpoint (no lora.json)")
    else:
        load_megatron_checkpoint(model, megatron_dir, prefix=prefix)
    write_hf_model(model, out_dir, hf_config_dir=hf_config_dir, max_shard_bytes=max_shard_bytes, dtype=dtype)


def _load_lora_checkpoint(model, megatron_dir: Path, lora_doc: dict, base_dir: str | os.PathLike | None):
    """Base weights from the checkpoint's base (``base_dir`` overrides ``lora.json``'s path; the fingerprint
    must match), adapters attached and loaded from ``megatron_dir``. Returns the LoraConfig."""
    from megatron_gigpo.actor.lora import apply_lora
    from megatron_gigpo.actor.lora_files import check_lora_reference, load_lora_adapters
    from megatron_gigpo.models.config import LoraConfig

    base_dir = Path(base_dir or lora_doc["base_model_path"])
    lora = LoraConfig(enabled=True, rank=lora_doc["rank"], alpha=lora_doc["alpha"], dropout=lora_doc["dropout"],
                      target_modules=list(lora_doc["target_modules"]))
    check_lora_reference(megatron_dir, lora, base_dir)
    load_hf_weights(model, base_dir)
    apply_lora(model, lora)
    load_lora_adapters(model, megatron_dir)
    return lora


def write_hf_model(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    out_dir: str | os.PathLike,
    *,
    hf_config_dir: str | os.PathLike,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a live Megatron model (any TP/PP layout) as an HF model directory; collective over all ranks.

    Tensors are gathered bucket by bucket (``max_shard_bytes``) to global rank 0
    (:func:`~megatron_gigpo.models.weights.export_hf_weights`), which writes ``model.safetensors`` (or
    ``model-0000k-of-0000n.safetensors`` + index) and copies the config, generation config and tokenizer
    files of ``hf_config_dir``. The directory appears atomically (staged as ``<out_dir>.incomplete``).

    Args:
        model: GPTModel (or wrapper, or VPP chunk list) of this rank.
        out_dir: output directory; must not exist or be empty.
        hf_config_dir: HF directory whose non-weight files describe the model (config, tokenizer).
        max_shard_bytes: safetensors shard budget in bytes.
        dtype: export dtype (default: the model's ``params_dtype``); ``config.json`` is made to declare it.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} exists and is not empty")
    staging = out_dir.with_name(out_dir.name + ".incomplete")
    first = model[0] if isinstance(model, (list, tuple)) else model
    dtype = dtype or unwrap_gpt_model(first).config.params_dtype
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    buckets = export_hf_weights(model, bucket_size_bytes=max_shard_bytes, dtype=dtype)
    if rank0:
        _write_shards(buckets, staging)
        copy_hf_sidecar_files(hf_config_dir, staging)
        _declare_dtype(staging / "config.json", dtype)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    else:
        for _ in buckets:  # every rank takes part in each bucket's collectives
            pass
    dist.barrier()


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes from a size like ``5GB``, ``500MiB``, ``100kB`` or ``1048576`` (HF ``max_shard_size`` style).

    Raises:
        argparse.ArgumentTypeError: not a positive size with a known unit.
    """
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].upper()
    try:
        value = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 5GB, 500MiB, 100kB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _parser(description: str, *, to_hf: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    if to_hf:
        parser.add_argument("--megatron-dir", required=True,
                            help="a checkpoint folder (runs/<exp>/checkpoints/iter_00000020) or a run's "
                                 "checkpoints/ folder (its newest)")
        parser.add_argument("--hf-config-dir", default=None, help="HF config/tokenizer dir (default <ckpt>/hf)")
        parser.add_argument(
            "--max-shard-size", type=parse_size, default="5GB", help="safetensors shard budget, e.g. 5GB, 500MiB"
        )
        parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="export dtype (default: params)")
        parser.add_argument("--key-prefix", default="", help="prefix of model tensors in the checkpoint")
        parser.add_argument("--peft", action="store_true",
                            help="LoRA checkpoint: write a Hugging Face PEFT adapter folder instead of merged weights")
        parser.add_argument("--base-dir", default=None,
                            help="LoRA checkpoint: the base HF model, a directory or a hub id in the Hugging Face "
                                 "cache (default: the path in its lora.json)")
    else:
        parser.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors), or a "
                            "hub id (Org/Name) in the Hugging Face cache (HF_HOME / HF_HUB_CACHE)")
        parser.add_argument("--revision", default=None, help="with a hub id as --hf-dir: branch, tag or commit")
        parser.add_argument("--params-dtype", choices=sorted(_DTYPES), default=None, help="default: HF config")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-model-parallel size (mixture-of-experts models: each rank holds experts / EP)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert-tensor-parallel size (mixture-of-experts models; default: --tp)")
    return parser


def _run(args: argparse.Namespace, work) -> int:
    """Run ``work`` with Megatron initialised for the layout in ``args`` (``tp``, ``pp``, ``ep``, ``etp``); a
    one-process group when not under torchrun."""
    from megatron_gigpo.actor import distributed

    single = "RANK" not in os.environ and not dist.is_initialized()
    if single:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(hours=1))
    try:
        distributed.initialize(args.tp, args.pp, expert_model_parallel_size=args.ep,
                               expert_tensor_parallel_size=args.etp)
        work()
    finally:
        distributed.destroy()
        if single and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _cached(path: str | None, revision: str | None = None) -> str | None:
    """A hub id (``Org/Name``) as its snapshot directory in the Hugging Face cache (never downloaded: each rank of a
    torchrun resolves it); a directory as given.

    Raises:
        ModelNotCachedError (a FileNotFoundError): a hub id not in the cache, with the command that fetches it.
    """
    from megatron_gigpo.models.hub import hub_snapshot, is_hub_id

    return str(hub_snapshot(path, revision, download=False)) if path and is_hub_id(path) else path


def main_hf_to_megatron(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tools/convert_hf_to_megatron.py``."""
    args = _parser("Convert an HF model to a Megatron distributed checkpoint.", to_hf=False).parse_args(argv)
    dtype = _DTYPES[args.params_dtype] if args.params_dtype else None
    hf_dir = _cached(args.hf_dir, args.revision)
    return _run(args, lambda: convert_hf_to_megatron(hf_dir, args.out, params_dtype=dtype))


def main_megatron_to_hf(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tools/convert_megatron_to_hf.py``."""
    args = _parser("Convert a Megatron distributed checkpoint to an HF model.", to_hf=True).parse_args(argv)
    from megatron_gigpo.actor.checkpoint_layout import checkpoint_from_cli

    iteration, megatron_dir = checkpoint_from_cli(args.megatron_dir, "--megatron-dir", other_folders=True)
    if iteration is not None:
        print(f"converting {megatron_dir} (iteration {iteration})", flush=True)
    base_dir = _cached(args.base_dir)
    return _run(
        args,
        lambda: convert_megatron_to_hf(
            megatron_dir,
            args.out,
            hf_config_dir=args.hf_config_dir,
            max_shard_bytes=args.max_shard_size,
            dtype=_DTYPES[args.dtype] if args.dtype else None,
            prefix=args.key_prefix,
            peft=args.peft,
            base_dir=base_dir,
        ),
    )
