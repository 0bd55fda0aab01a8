"""LoRA adapters (Hu et al. 2021, arXiv 2106.09685) on the linear layers of a Megatron ``GPTModel``.

``y = W x + (alpha / r) * B (A dropout(x))`` with ``A`` (r, in) and ``B`` (out, r); ``B`` starts at zero, so a
fresh adapter leaves the model unchanged. Adapters attach to the Megatron layers named in
:data:`LORA_TARGETS` (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) of every decoder layer
of this pipeline stage, so pipeline parallelism needs nothing more. Tensor parallelism:

* column-parallel layers (``linear_qkv``, ``linear_fc1``; output split over TP): ``A`` replicated, ``B``
  split along its output dim like ``W``. ``A x`` is the same on every TP rank; its gradient is all-reduced over
  TP (``copy_to_tensor_model_parallel_region``), so ``A``'s gradient and the input gradient are complete.
* row-parallel layers (``linear_proj``, ``linear_fc2``; input split over TP): ``A`` split along its input dim
  like ``W``, ``B`` replicated. ``A x`` is all-reduced over TP (``reduce_from_tensor_model_parallel_region``,
  the reduction the base layer does on its output) before ``B``.

The adapter is a child module ``lora`` of the adapted layer (parameters ``<layer>.lora.A`` and
``<layer>.lora.B``) and runs in a forward hook, so base parameter names, the HF weight mapping and Megatron's
checkpoint keys of the base stay unchanged. Base parameters are frozen (``requires_grad=False``): Megatron's
DDP and optimizers skip them, so gradient buffers and optimizer state exist only for the adapters.

Why our own module: Megatron-Bridge's PEFT (``megatron.bridge.peft``) is the maintained Megatron LoRA, but
its newest releases need Python >= 3.12, and the Python 3.11 release (0.3.1, for megatron-core < 0.17)
imports Transformer-Engine unconditionally in ``peft/lora.py`` (TE does not install without CUDA) and
requires TE, mamba-ssm and nvidia-resiliency-ext as dependencies. megatron-core 0.16.1 has no PEFT module of
its own (only ``ColumnParallelLinear(disable_grad_reduce=...)``, a hook NeMo's adapters used). Hugging Face
PEFT wraps ``torch.nn.Linear`` and knows nothing of TP shards. We use HF PEFT's file format for export
(:func:`megatron_gigpo.actor.lora_export.write_peft_adapter`).

Transformer-Engine layers that fuse the input norm into ``linear_qkv`` / ``linear_fc1``
(``TELayerNormColumnParallelLinear``) get the norm recomputed on the adapter's input (:func:`_adapter_input`);
sequence parallelism is not supported.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_gigpo.models.builder import unwrap_gpt_model
from megatron_gigpo.models.config import LORA_TARGETS  # Megatron layer name -> column / row (TP split)

__all__ = [
    "LORA_TARGETS",
    "LoraAdapter",
    "apply_lora",
    "lora_adapters",
    "adapters_disabled",
    "set_full_adapter_weights",
    "full_adapter_weights",
    "adapter_state_keys",
    "count_parameters",
]



class LoraAdapter(torch.nn.Module):
    """The adapter of one TP-sharded linear layer: this rank's ``A`` and ``B`` shards.

    Args:
        weight: the base layer's weight shard (out_local, in_local); gives shapes, dtype and device.
        style: ``column`` (output split over TP) or ``row`` (input split over TP).
        rank, alpha, dropout: LoRA r, alpha (scale ``alpha / r``) and input dropout probability.
        tp_size: tensor-parallel world size.

    Shapes: column: ``A`` (r, in), ``B`` (out_local, r); row: ``A`` (r, in_local), ``B`` (out, r).
    ``A`` and ``B`` carry Megatron's ``tensor_model_parallel`` attributes (for gradient-norm accounting).
    """

    def __init__(self, weight: torch.Tensor, style: str, *, rank: int, alpha: float, dropout: float,
                 tp_size: int) -> None:
        super().__init__()
        if style not in ("column", "row"):
            raise ValueError(f"style={style!r} must be 'column' or 'row'")
        out_local, in_local = weight.shape
        self.style, self.rank, self.scaling = style, rank, alpha / rank
        self.tp_size = tp_size
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.A = torch.nn.Parameter(torch.zeros(rank, in_local, **kw))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, **kw))
        set_tensor_model_parallel_attributes(self.A, style == "row", 1, 1)
        set_tensor_model_parallel_attributes(self.B, style == "column", 0, 1)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.active = True
        # SwiGLU linear_fc1: each TP shard of the output is [gate_t; up_t], the full matrix [gate; up]
        self.gated = False

    @property
    def split_dims(self) -> dict[str, int | None]:
        """Dim of each parameter split over TP (None: replicated)."""
        return {"A": 1, "B": None} if self.style == "row" else {"A": None, "B": 0}

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        """Global (all-TP) shapes of ``A`` and ``B``."""
        out = {}
        for name, dim in self.split_dims.items():
            shape = list(getattr(self, name).shape)
            if dim is not None:
                shape[dim] *= self.tp_size
            out[name] = tuple(shape)
        return out

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.style == "row":  # each TP rank holds different input columns: its own mask stream
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)  # the same input on every TP rank: the default generator, equal on all of them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output shard for input ``x`` (..., in or in_local): (..., out_local or out)."""
        z = F.linear(self._dropout(x), self.A)
        if self.style == "column":
            z = copy_to_tensor_model_parallel_region(z)  # backward: sum of every TP rank's part of dL/dz
        else:
            z = reduce_from_tensor_model_parallel_region(z)  # forward: sum of the input shards' parts
        return F.linear(z, self.B) * self.scaling

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """This rank's shard of ``(alpha / r) * B @ A`` in float32, shaped like the base weight shard."""
        return (self.B.float() @ self.A.float()) * self.scaling


def _adapter_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of the layer's matmul: ``x``, or the fused norm of ``x`` for a Transformer-Engine
    ``LayerNormColumnParallelLinear`` (``layer_norm_weight``), recomputed as TE does (RMSNorm / LayerNorm,
    ``zero_centered_gamma``)."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    gamma = weight + 1 if getattr(module, "zero_centered_gamma", False) else weight
    eps = float(getattr(module, "eps", 1e-5))
    if getattr(module, "normalization", "RMSNorm") == "RMSNorm":
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, getattr(module, "layer_norm_bias", None), eps)


def _hook(module: torch.nn.Module, args: tuple, output):
    adapter: LoraAdapter = module.lora
    if not adapter.active:
        return output
    out, bias = output
    return out + adapter(_adapter_input(module, args[0])).to(out.dtype), bias


def _sharded_state_dict_with_adapter(module: torch.nn.Module, base_fn: Callable):
    """``module.sharded_state_dict`` that also shards the adapter's split parameter over TP."""

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        out = base_fn(prefix, sharded_offsets, metadata)
        adapter: LoraAdapter = module.lora
        tensors = {f"lora.{n}": getattr(adapter, n) for n in ("A", "B")}
        axis = {f"lora.{n}": d for n, d in adapter.split_dims.items() if d is not None}
        adapter_sd = make_sharded_tensors_for_checkpoint(tensors, prefix, axis, sharded_offsets)
        if adapter.gated:  # store B as [gate; up] like Megatron's MLP does for fc1's weight: TP-reshardable
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora.B"
            adapter_sd[key] = apply_swiglu_sharded_factory(
                adapter_sd[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        out.update(adapter_sd)
        return out

    return sharded_state_dict


def _merged_export(module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    def merged() -> torch.Tensor:
        weight = module.weight.detach()
        return (weight.float() + module.lora.delta()).to(weight.dtype)

    return merged


def _targets(model: torch.nn.Module, names: Sequence[str]) -> Iterator[tuple[str, torch.nn.Module, str]]:
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in names and name.startswith("decoder.layers."):
            yield name, module, LORA_TARGETS[leaf]


def apply_lora(model: torch.nn.Module, lora, *, seed: int = 0) -> list[str]:
    """Freeze ``model`` and attach adapters to its ``lora.target_modules`` layers; in place.

    Args:
        model: this rank's ``GPTModel`` (or a wrapper), weights already loaded.
        lora: a :class:`megatron_gigpo.models.config.LoraConfig` (``rank``, ``alpha``, ``dropout``,
            ``target_modules``).
        seed: ``A`` is drawn (Kaiming-uniform, as HF PEFT) from a generator seeded by ``seed`` and the layer's
            global name, as the full matrix then sliced, so initial adapters do not depend on TP / PP.

    Returns:
        the adapted layers' global names (``decoder.layers.<global i>.self_attention.linear_qkv`` ...).

    Raises:
        ValueError: an unknown target name, no layer matched, or sequence parallelism.
    """
    unknown = sorted(set(lora.target_modules) - set(LORA_TARGETS))
    if unknown or not lora.target_modules:
        raise ValueError(f"lora.target_modules={list(lora.target_modules)!r}: use names from {list(LORA_TARGETS)}")
    gpt = unwrap_gpt_model(model)
    if getattr(gpt.config, "sequence_parallel", False):
        raise ValueError("LoRA adapters do not support sequence_parallel=True")
    gpt.requires_grad_(False)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    adapted = []
    for name, module, style in _targets(gpt, lora.target_modules):
        adapter = LoraAdapter(module.weight, style, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                              tp_size=tp_size)
        adapter.gated = name.endswith("linear_fc1") and bool(gpt.config.gated_linear_unit)
        module.add_module("lora", adapter)
        module.register_forward_hook(_hook)
        module.sharded_state_dict = _sharded_state_dict_with_adapter(module, module.sharded_state_dict)
        module.weight.merged_export = _merged_export(module)
        adapted.append(_global_name(gpt, name))
    if not adapted:
        raise ValueError(f"lora.target_modules={list(lora.target_modules)!r} matched no layer of this stage")
    set_full_adapter_weights(gpt, lambda name, part, shape: _kaiming_a(name, shape, seed) if part == "A" else None)
    return adapted


def _global_name(gpt: torch.nn.Module, local_name: str) -> str:
    """``decoder.layers.<local>.rest`` with the layer's global index (as :func:`megatron_gigpo.models.weights.global_parameters`)."""
    _, _, index, rest = local_name.split(".", 3)
    return f"decoder.layers.{gpt.decoder.layers[int(index)].layer_number - 1}.{rest}"


def _kaiming_a(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def lora_adapters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[tuple[str, LoraAdapter]]:
    """``(global layer name, adapter)`` of every adapted layer of this rank, in module order."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        gpt = unwrap_gpt_model(chunk)
        for name, module in gpt.named_modules():
            if isinstance(getattr(module, "lora", None), LoraAdapter) and name.startswith("decoder.layers."):
                out.append((_global_name(gpt, name), module.lora))
    return out


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run ``model`` as its frozen base inside the block (the KL reference policy); no copy is made."""
    adapters = [adapter for _, adapter in lora_adapters(model)]
    states = [adapter.active for adapter in adapters]
    for adapter in adapters:
        adapter.active = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.active = state


@torch.no_grad()
def set_full_adapter_weights(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    make: Callable[[str, str, tuple[int, int]], torch.Tensor | None],
) -> None:
    """Set adapters from full (all-TP) matrices: ``make(layer_name, "A" | "B", full_shape)`` returns the full
    float tensor (or None to leave the parameter); this rank copies its TP slice. Layout-independent weights
    (tests, initialisation). Once an optimizer with fp32 main copies exists (bf16), use
    :meth:`megatron_gigpo.actor.policy.PolicyActor.set_adapter_weights`, which refreshes them."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, adapter in lora_adapters(model):
        for part, full_shape in adapter.full_shapes().items():
            full = make(name, part, full_shape)
            if full is None:
                continue
            if tuple(full.shape) != full_shape:
                raise ValueError(f"{name}.lora.{part}: got shape {list(full.shape)}, expected {list(full_shape)}")
            param = getattr(adapter, part)
            param.copy_(_tp_slice(adapter, part, full, tp_rank).to(param.dtype))


def _tp_slice(adapter: LoraAdapter, part: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of a full adapter matrix (the TP1 layout)."""
    dim = adapter.split_dims[part]
    if dim is None:
        return full
    size = getattr(adapter, part).shape[dim]
    if adapter.gated and part == "B":  # [gate; up] -> [gate_t; up_t]
        half = size // 2
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.narrow(0, tp_rank * half, half), up.narrow(0, tp_rank * half, half)])
    return full.narrow(dim, tp_rank * size, size)


def _tp_merge(adapter: LoraAdapter, part: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full adapter matrix (TP1 layout) from every TP rank's shard, in TP-rank order."""
    dim = adapter.split_dims[part]
    if dim is None:
        return shards[0]
    if adapter.gated and part == "B":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=dim)


@torch.no_grad()
def full_adapter_weights(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter matrix of the whole model in the TP1 layout, on every rank; collective over the
    tensor- and pipeline-parallel groups (adapters are small: one all-gather per TP-split matrix).

    Returns:
        ``{"decoder.layers.<global i>.<path>.lora.A" | ".lora.B": float tensor on the CPU}``; ``A`` (r, in),
        ``B`` (out, r) with the fused Megatron row order of ``linear_qkv`` / ``linear_fc1`` (per-KV-group
        ``[q|k|v]``, ``[gate; up]``).
    """
    import torch.distributed as dist

    tp_group = parallel_state.get_tensor_model_parallel_group()
    mine = {}
    for name, adapter in lora_adapters(model):
        for part, dim in adapter.split_dims.items():
            param = getattr(adapter, part).detach().contiguous()
            shards = [param]
            if dim is not None and adapter.tp_size > 1:
                shards = [torch.empty_like(param) for _ in range(adapter.tp_size)]
                dist.all_gather(shards, param, group=tp_group)
            mine[f"{name}.lora.{part}"] = _tp_merge(adapter, part, shards).cpu().clone()
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return {key: value for stage in stages for key, value in stage.items()}


def adapter_state_keys(model: torch.nn.Module) -> set[str]:
    """Keys of ``model.state_dict()`` that belong to adapters (``...lora.A`` / ``...lora.B``)."""
    return {key for key in unwrap_gpt_model(model).state_dict() if key.endswith((".lora.A", ".lora.B"))}


def count_parameters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[str, int]:
    """This rank's parameter counts: ``{"total", "trainable"}`` (elements, shards as stored here)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    params = [p for chunk in chunks for p in chunk.parameters()]
    return {"total": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad)}
