"""Load HF safetensors into any TP/PP layout, and export HF-named tensors from any layout in buckets.

Both directions use the per-architecture rules of ``megatron_gigpo.models.mapping``.

* :func:`load_hf_weights`: each rank reads only the slices of the HF tensors its own shards need
  (``safetensors.safe_open(...).get_slice``); no communication.
* :func:`export_hf_weights`: a collective over each model-parallel group that yields, on every rank and in
  lockstep, one bucket of complete HF-named tensors at a time on the destination rank(s) (an empty list
  elsewhere). Used by ``tools/convert_megatron_to_hf.py`` and the live weight sync into vLLM.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_gigpo.models.builder import hf_config_of, load_hf_config, unwrap_gpt_model
from megatron_gigpo.models.export_gather import BucketGather, ExportEntry, broadcast_bucket, buckets_of
from megatron_gigpo.models.mapping import (
    ModelMapping,
    ShardLayout,
    TensorRule,
    WeightShapeError,
    canonical_name,
    get_model_mapping,
)

__all__ = [
    "HFCheckpointReader",
    "MissingTensorError",
    "load_hf_weights",
    "export_hf_weights",
    "export_metadata",
    "shard_layout",
    "global_parameters",
]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
}
_DEFAULT_BUCKET_BYTES = 512 * 2**20


class MissingTensorError(ValueError):
    """A tensor the mapping needs is absent from the HF checkpoint, or the checkpoint has unknown tensors."""


class HFCheckpointReader:
    """Lazy, slice-wise access to the safetensors files of an HF model directory.

    Reads ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file's header.
    Only the requested slices are read from disk.
    """

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: self.hf_dir / file for name, file in weight_map.items()}
        else:
            files = sorted(self.hf_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.hf_dir}")
            self._files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    self._files.update({name: file for name in handle.keys()})
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._files)

    def where(self, name: str) -> str:
        """The file holding ``name`` (for error messages)."""
        return str(self._files[name]) if name in self._files else str(self.hf_dir)

    def _slice(self, name: str):
        if name not in self._files:
            raise MissingTensorError(f"tensor {name!r} is missing from the HF checkpoint {self.hf_dir}")
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = self._safe_open(str(file), framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.where(name)} has unsupported dtype {code}")
        return _SAFETENSORS_DTYPES[code]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or its rows/columns ``[start, stop)`` along ``dim`` (0 or 1)."""
        part = self._slice(name)
        if dim is None:
            return part[:]
        if dim == 0:
            return part[start:stop]
        if dim == 1:
            return part[:, start:stop]
        raise ValueError(f"slicing along dim {dim} is not supported")

    def close(self) -> None:
        self._handles.clear()


def _chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[GPTModel]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    return [unwrap_gpt_model(m) for m in models]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def global_parameters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """``(canonical Megatron name with global layer index, parameter)`` for this rank's shards.

    ``model`` is a GPTModel, a DDP/Float16Module wrapper of one, or a list of virtual-pipeline chunks.
    LoRA adapter parameters (``<layer>.lora.A`` / ``.B``, :mod:`megatron_gigpo.actor.lora`) are not HF
    tensors and are left out; their base weight exports merged (see :func:`export_value`).
    """
    out = []
    for chunk in _chunks(model):
        for name, param in chunk.named_parameters():
            if name.endswith((".lora.A", ".lora.B")):
                continue
            match = _LAYER.match(name)
            if match:
                layer = chunk.decoder.layers[int(match.group(1))].layer_number - 1
                name = f"decoder.layers.{layer}.{match.group(2)}"
            out.append((_global_expert(canonical_name(name), chunk.config), param))
    return out


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _global_expert(name: str, config: Any) -> str:
    """``name`` with a local expert index (megatron-core numbers each expert-parallel rank's experts from 0)
    replaced by the global one, ``ep_rank * num_local_experts + local``."""
    match = _LOCAL_EXPERT.match(name)
    if not match:
        return name
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * (config.num_moe_experts // ep_size)
    return f"{match.group(1)}{first + int(match.group(2))}{match.group(3)}"


def export_value(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor exported for ``param``: ``param.merged_export()`` when the parameter carries that hook (a
    LoRA-adapted weight: ``W + (alpha / r) B A`` of this shard, in the weight's dtype), else the parameter."""
    merged = getattr(param, "merged_export", None)
    return merged() if merged is not None else param.detach()


def shard_layout(model: torch.nn.Module | Sequence[torch.nn.Module], hf_config: Any) -> ShardLayout:
    """This rank's :class:`ShardLayout` from the model's TransformerConfig and the HF vocab size."""
    config = _chunks(model)[0].config
    return ShardLayout(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        num_query_groups=config.num_query_groups,
        heads_per_group=config.num_attention_heads // config.num_query_groups,
        head_dim=config.kv_channels,
        vocab_size=int(hf_config.vocab_size),
        expert_tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        expert_tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


_MATCHED_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
_MATCHED_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")  # MoE configs only


def _check_same_model(model_config: Any, checkpoint_config: Any, hf_dir: Path) -> None:
    for field in _MATCHED_FIELDS + _MATCHED_MOE_FIELDS:
        if field in _MATCHED_MOE_FIELDS and not hasattr(model_config, field):
            continue
        mine, theirs = getattr(model_config, field), getattr(checkpoint_config, field, None)
        if mine != theirs:
            raise WeightShapeError(
                f"HF checkpoint {hf_dir} has {field}={theirs!r} but the model was built with {field}={mine!r}"
            )


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    hf_dir: str | os.PathLike,
    *,
    hf_config: Any | None = None,
    strict: bool = True,
) -> None:
    """Copy HF safetensors weights into this rank's Megatron shards (any TP/PP/VPP layout).

    Each rank reads only the slices it needs. Call on every rank; no communication happens.

    Args:
        model: GPTModel (or DDP/Float16Module wrapper, or list of VPP chunks) from ``build_gpt_model``.
        hf_dir: HF model directory (``config.json`` + ``*.safetensors``).
        hf_config: the config the model was built from (default: ``model.hf_config``).
        strict: also fail on checkpoint tensors that no parameter uses.

    Raises:
        UnsupportedModelError: the checkpoint's architecture has no mapping.
        WeightShapeError: config fields or a tensor's shape differ (message names the tensor and both shapes).
        MissingTensorError: a needed tensor is absent, or (strict) the checkpoint has unknown tensors.
    """
    hf_dir = Path(hf_dir)
    hf_config = hf_config_of(model if not isinstance(model, (list, tuple)) else model[0], hf_config)
    _check_same_model(hf_config, load_hf_config(hf_dir), hf_dir)
    mapping = get_model_mapping(hf_config)
    rules = mapping.rules(hf_config)
    layout = shard_layout(model, hf_config)
    reader = HFCheckpointReader(hf_dir)
    try:
        if strict:
            _check_no_unknown_tensors(reader, rules, mapping, hf_config)
        for name, param in global_parameters(model):
            if name not in rules:
                raise MissingTensorError(f"Megatron parameter {name!r} has no {mapping.model_type} HF mapping")
            shard = rules[name].load_shard(reader, layout, tuple(param.shape))
            if tuple(shard.shape) != tuple(param.shape):
                raise WeightShapeError(f"{name}: loaded shard {list(shard.shape)} != parameter {list(param.shape)}")
            param.data.copy_(shard.to(param.dtype))
    finally:
        reader.close()


def _check_no_unknown_tensors(
    reader: HFCheckpointReader, rules: dict[str, TensorRule], mapping: ModelMapping, hf_config: Any
) -> None:
    known = {name for rule in rules.values() for name in rule.hf_names}
    unknown = [n for n in reader.names() if n not in known and not mapping.ignorable_hf_tensor(n, hf_config)]
    if unknown:
        raise MissingTensorError(
            f"HF checkpoint {reader.hf_dir} has tensors the {mapping.model_type} mapping does not use "
            f"(another architecture?): {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )


def _export_plan(
    model, rules: dict[str, TensorRule], mapping: ModelMapping, hf_config: Any, dtype
) -> list[ExportEntry]:
    """Every exported parameter of the whole model (every expert of every layer), in rule order. Identical on all
    ranks: a collective over the expert-parallel group (each EP rank lists its experts) and the pipeline group."""
    local = {}
    for name, param in global_parameters(model):
        if name not in rules:
            raise MissingTensorError(f"Megatron parameter {name!r} has no {mapping.model_type} HF mapping")
        if mapping.exported(rules[name], hf_config):
            local[name] = (tuple(param.shape), dtype or param.dtype, 0 if _LOCAL_EXPERT.match(name) else -1)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size > 1:  # each EP rank holds num_experts / EP experts: list them all, each with its owner EP rank
        per_ep: list[dict] = [None] * ep_size
        dist.all_gather_object(per_ep, local, group=parallel_state.get_expert_model_parallel_group())
        local = {name: item for name, item in local.items() if item[2] < 0}
        for owner, entries in enumerate(per_ep):
            for name, (shape, out_dtype, expert) in entries.items():
                if expert >= 0:
                    if name in local:
                        raise RuntimeError(f"export_hf_weights: expert parameter {name!r} is on EP ranks "
                                           f"{local[name][2]} and {owner}")
                    local[name] = (shape, out_dtype, owner)
    stages: list[dict] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, local, group=parallel_state.get_pipeline_model_parallel_group())
    layout = shard_layout(model, hf_config)
    plan = []
    for name, rule in rules.items():
        for stage, entries in enumerate(stages):
            if name in entries:
                shape, out_dtype, owner = entries[name]
                hf_parts = list(zip(rule.hf_names, rule.hf_shapes(shape, layout)))
                plan.append(ExportEntry(name, stage, shape, out_dtype, hf_parts, owner))
                break
    return plan


def _model_plan(model, dtype, hf_config) -> tuple[list[ExportEntry], dict[str, TensorRule], Any]:
    """``(export plan, mapping rules, hf_config)`` of ``model`` (a collective over the EP and pipeline groups)."""
    first = model[0] if isinstance(model, (list, tuple)) else model
    hf_config = hf_config_of(first, hf_config)
    mapping = get_model_mapping(hf_config)
    rules = mapping.rules(hf_config)
    return _export_plan(model, rules, mapping, hf_config, dtype), rules, hf_config


def export_metadata(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    dtype: torch.dtype | None = None,
    hf_config: Any | None = None,
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(hf_name, dtype, full HF shape)`` of every tensor :func:`export_hf_weights` yields, in the order it yields
    them (the receiving rank's concatenated buckets; independent of the bucket size).

    Identical on every rank; no tensor moves. With expert or pipeline parallelism it is a collective of the
    expert-parallel and pipeline groups (one ``all_gather_object`` each of the ranks' parameter shapes, as the
    export itself does), so every rank of the model must call it, in the same order relative to other collectives.

    Args:
        model: as for :func:`export_hf_weights`.
        dtype: the export dtype (default: each parameter's own dtype).
        hf_config: default ``model.hf_config``.
    """
    plan, _, _ = _model_plan(model, dtype, hf_config)
    return [(hf_name, entry.dtype, tuple(shape)) for entry in plan for hf_name, shape in entry.hf_parts]


@torch.no_grad()
def export_hf_weights(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    bucket_size_bytes: int = _DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    destination: str = "rank0",
    hf_config: Any | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the model's weights as buckets of full, HF-named tensors (a collective, see below).

    Every rank of every model-parallel group must call this and consume the whole iterator: all ranks
    yield the same number of buckets, in lockstep. Within the data-parallel replica 0, for each bucket,
    every TP rank of a pipeline stage casts its shards of the stage's parameters into one flat buffer and
    sends it to the stage's TP-rank-0 (one message per TP rank, in the tensor-parallel group), which
    converts the shards to HF tensors (q/k/v split, gate/up split, vocab padding dropped). For
    ``destination="rank0"`` the TP-rank-0 of every other stage then sends its HF tensors, as one batch,
    straight into the output tensors of the TP-rank-0 of pipeline stage 0 (global rank 0 in Megatron's
    default rank order). Routed experts (mixture-of-experts layers) come from expert-data-parallel rank 0
    instead: each expert is merged on expert-TP-rank-0 of the expert-parallel rank that holds it and sent over the
    expert-parallel group to the stage's TP-rank-0 (:mod:`megatron_gigpo.models.export_gather`), one bucket at a
    time. Messages are ``torch.distributed.batch_isend_irecv`` batches (gloo or NCCL). Ranks that are neither
    data-parallel rank 0 nor expert-data-parallel rank 0 yield empty buckets without communicating.

    Args:
        model: GPTModel (or DDP/Float16Module wrapper, or list of VPP chunks) from ``build_gpt_model``.
        bucket_size_bytes: bucket budget in bytes of exported tensors; a bucket closes before the parameter
            that would overflow it (one parameter larger than the budget gets a bucket of its own). A
            rank holds at most about twice ``bucket_size_bytes`` at a time (its stage's gathered shards and
            the HF tensors made from them); the staging buffer is reused from bucket to bucket and freed
            when the iterator ends. The tensors yielded do not depend on the bucket size.
        dtype: export dtype (default: each parameter's own dtype).
        destination: ``"rank0"`` (all tensors to stage-0 TP-rank-0), ``"pp_stage"`` (each stage's
            TP-rank-0 receives the tensors of its own stage; no pipeline traffic) or ``"all"`` (as ``"rank0"``,
            then global rank 0 broadcasts each bucket, one flat message, over the default process group: every
            rank of every replica gets every tensor, e.g. for CUDA IPC from each GPU).
        hf_config: default ``model.hf_config``.

    Yields:
        ``[(hf_name, tensor), ...]`` on the receiving rank(s), ``[]`` elsewhere (:func:`export_metadata` lists
        them in order). Names are exactly HF's
        (``model.layers.3.self_attn.q_proj.weight``); with tied embeddings ``lm_head.weight`` is not
        emitted. Tensors are contiguous, on this rank's device (CUDA or CPU), in ``dtype``; each owns its
        memory, except that with TP=1 a tensor exported unchanged (same dtype, no split) may be the
        parameter itself.

    Raises:
        ValueError: unknown ``destination`` or non-positive ``bucket_size_bytes``.
    """
    if destination not in ("rank0", "pp_stage", "all"):
        raise ValueError(f"destination must be 'rank0', 'pp_stage' or 'all', got {destination!r}")
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    plan, rules, hf_config = _model_plan(model, dtype, hf_config)
    gather = BucketGather(dict(global_parameters(model)), rules, shard_layout(model, hf_config), destination,
                          export_value)
    for bucket in buckets_of(plan, bucket_size_bytes):
        tensors = gather.bucket(bucket) if gather.active else []
        yield broadcast_bucket(bucket, tensors) if destination == "all" else tensors
