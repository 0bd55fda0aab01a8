"""One Hugging Face <-> Megatron tensor mapping per architecture family.

A :class:`ModelMapping` lists, for a given HF config, one :class:`TensorRule` per Megatron parameter
(canonical local-spec name, *global* layer index): which HF tensors it is made of, along which dimension
Megatron splits it over tensor-parallel ranks, and how to cut one rank's shard out of the HF tensors
(:meth:`TensorRule.load_shard`) or rebuild the HF tensors from all ranks' shards
(:meth:`TensorRule.merge_shards`). The same rules serve model loading, the offline converters and the
live resharding into vLLM (``megatron_gigpo.models.weights``).

Megatron local-spec layouts (megatron-core 0.16 ``get_gpt_layer_local_spec``):

- ``self_attention.linear_qkv`` (ColumnParallel, dim 0): rows grouped per KV head,
  ``[q (heads_per_group * head_dim) | k (head_dim) | v (head_dim)] x num_query_groups``; bias likewise.
  A TP rank holds ``num_query_groups / TP`` whole groups, so its shard is a contiguous row range of each
  of q_proj, k_proj and v_proj.
- ``mlp.linear_fc1`` (ColumnParallel, dim 0): each TP shard is ``[gate_r ; up_r]`` (SwiGLU), so the
  concatenation of shards is *not* ``[gate ; up]``.
- ``linear_proj`` / ``linear_fc2`` (RowParallel, dim 1); ``word_embeddings`` / ``output_layer``
  (vocab-parallel, dim 0, vocabulary padded to a multiple of TP; padding rows are zero and dropped on export).
- ``self_attention.q_layernorm`` / ``k_layernorm`` (Qwen3's ``q_norm`` / ``k_norm``, with megatron-core's
  ``qk_layernorm``): one RMSNorm gain of ``head_dim`` shared by every head, replicated over TP ranks (each rank
  normalises its own heads; ``finalize_model_grads`` sums their gradients over TP).
- Mixture-of-experts layers (Qwen3-MoE; megatron-core ``MoELayer`` with the local spec's ``SequentialMLP``):
  ``mlp.router.weight`` (HF ``mlp.gate.weight``, ``[num_experts, hidden]``, replicated) and, per expert,
  ``mlp.experts.local_experts.{e}.linear_fc1`` (``[gate_e ; up_e]``, split over the *expert*-tensor-parallel
  ranks like the dense ``linear_fc1``) and ``.linear_fc2`` (HF ``mlp.experts.{e}.down_proj``, dim 1). An
  expert-parallel rank holds ``num_experts / EP`` experts; megatron-core numbers them locally from 0, and
  :func:`megatron_gigpo.models.weights.global_parameters` renames them to the global index
  ``ep_rank * (num_experts / EP) + local`` (as it does with layer numbers), so the rules here know global
  experts only. Grouped-GEMM experts (``TEGroupedMLP``: ``mlp.experts.linear_fc1.weight{e}``) get the same
  canonical names (:func:`canonical_name`).
- Transformer-Engine spec names the two norms ``self_attention.linear_qkv.layer_norm_weight`` and
  ``mlp.linear_fc1.layer_norm_weight`` (fused into the following linear); :func:`canonical_name` maps them
  to the local-spec names.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

__all__ = [
    "ShardLayout",
    "TensorRule",
    "CopyRule",
    "VocabRule",
    "QKVRule",
    "GateUpRule",
    "ExpertGateUpRule",
    "ExpertCopyRule",
    "ModelMapping",
    "Qwen2Mapping",
    "LlamaMapping",
    "Qwen3Mapping",
    "Qwen3MoeMapping",
    "get_model_mapping",
    "supported_architectures",
    "canonical_name",
    "UnsupportedModelError",
    "WeightShapeError",
]


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or feature this package cannot map."""


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not match the model; the message names the tensor and both shapes."""


class TensorSource(Protocol):
    """Read access to HF tensors (``megatron_gigpo.models.weights.HFCheckpointReader`` implements it)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...

    def where(self, name: str) -> str: ...


@dataclass(frozen=True)
class ShardLayout:
    """What a rule needs to know about the model and this rank's tensor-parallel position."""

    tp_rank: int
    tp_size: int
    num_query_groups: int
    heads_per_group: int
    head_dim: int
    vocab_size: int  # HF vocabulary size (Megatron's may be padded up to a multiple of TP)
    expert_tp_rank: int = 0  # position in the expert-tensor-parallel group (splits the experts' linear layers)
    expert_tp_size: int = 1

    def for_experts(self) -> "ShardLayout":
        """This layout with the expert-tensor-parallel rank and size in place of the tensor-parallel ones."""
        return dataclasses.replace(self, tp_rank=self.expert_tp_rank, tp_size=self.expert_tp_size)


_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_name(name: str) -> str:
    """Local-spec name for a Megatron parameter name (maps the Transformer-Engine fused-norm names and the
    grouped-GEMM experts' ``mlp.experts.linear_fc1.weight{e}`` to ``mlp.experts.local_experts.{e}.linear_fc1.weight``)."""
    match = re.match(r"^(decoder\.layers\.\d+\.)(.+)$", name)
    if match and match.group(2) in _TE_ALIASES:
        return match.group(1) + _TE_ALIASES[match.group(2)]
    grouped = _GROUPED_EXPERT.match(match.group(2)) if match else None
    if grouped:
        return f"{match.group(1)}mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return name


def _check_shape(source: TensorSource, name: str, expected: tuple[int, ...], megatron_name: str) -> None:
    actual = tuple(source.shape(name))
    if actual != tuple(expected):
        raise WeightShapeError(
            f"tensor {name!r} in {source.where(name)} has shape {list(actual)}, but the model "
            f"(Megatron {megatron_name!r}) expects {list(expected)}"
        )


@dataclass(frozen=True)
class TensorRule:
    """How one Megatron parameter (full, TP-merged view) relates to HF tensors.

    Attributes:
        megatron_name: canonical Megatron name with the global layer index.
        hf_names: the HF tensors it is built from, in the order the rule documents.
        tp_dim: dimension Megatron splits over TP ranks, or None when replicated.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    tp_dim: int | None

    def hf_shapes(self, local_shape: tuple[int, ...], layout: ShardLayout) -> list[tuple[int, ...]]:
        """Full HF shapes implied by one rank's Megatron shard shape."""
        raise NotImplementedError

    def load_shard(self, source: TensorSource, layout: ShardLayout, local_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's Megatron shard, read slice by slice from ``source`` (shapes checked first)."""
        raise NotImplementedError

    def merge_shards(self, shards: list[torch.Tensor], layout: ShardLayout) -> list[tuple[str, torch.Tensor]]:
        """Full HF tensors from the shards of every TP rank (in TP-rank order)."""
        raise NotImplementedError

    def _check_all(self, source: TensorSource, layout: ShardLayout, local_shape: tuple[int, ...]) -> None:
        for name, shape in zip(self.hf_names, self.hf_shapes(local_shape, layout)):
            _check_shape(source, name, shape, self.megatron_name)


@dataclass(frozen=True)
class CopyRule(TensorRule):
    """One HF tensor, identical up to TP slicing along ``tp_dim``."""

    def hf_shapes(self, local_shape, layout):
        shape = list(local_shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= layout.tp_size
        return [tuple(shape)]

    def load_shard(self, source, layout, local_shape):
        self._check_all(source, layout, local_shape)
        if self.tp_dim is None:
            return source.read(self.hf_names[0])
        size = local_shape[self.tp_dim]
        start = layout.tp_rank * size
        return source.read(self.hf_names[0], self.tp_dim, start, start + size)

    def merge_shards(self, shards, layout):
        full = shards[0] if self.tp_dim is None else torch.cat(shards, dim=self.tp_dim)
        return [(self.hf_names[0], full)]


@dataclass(frozen=True)
class VocabRule(CopyRule):
    """Embedding / LM head: vocab-parallel rows; Megatron's padding rows beyond the HF vocab are zero."""

    def hf_shapes(self, local_shape, layout):
        return [(layout.vocab_size, *local_shape[1:])]

    def load_shard(self, source, layout, local_shape):
        self._check_all(source, layout, local_shape)
        rows = local_shape[0]
        start = layout.tp_rank * rows
        stop = min(start + rows, layout.vocab_size)
        shard = torch.zeros(local_shape, dtype=source.dtype(self.hf_names[0]))
        if stop > start:
            shard[: stop - start] = source.read(self.hf_names[0], 0, start, stop)
        return shard

    def merge_shards(self, shards, layout):
        return [(self.hf_names[0], torch.cat(shards, dim=0)[: layout.vocab_size])]


@dataclass(frozen=True)
class QKVRule(TensorRule):
    """``linear_qkv`` (weight or bias) from ``(q_proj, k_proj, v_proj)``, grouped per KV head."""

    def hf_shapes(self, local_shape, layout):
        rest = tuple(local_shape[1:])
        groups, qpg, hd = layout.num_query_groups, layout.heads_per_group, layout.head_dim
        return [(groups * qpg * hd, *rest), (groups * hd, *rest), (groups * hd, *rest)]

    def load_shard(self, source, layout, local_shape):
        self._check_all(source, layout, local_shape)
        groups = layout.num_query_groups // layout.tp_size  # whole KV groups on this rank
        qpg, hd, first = layout.heads_per_group, layout.head_dim, layout.tp_rank * groups
        q = source.read(self.hf_names[0], 0, first * qpg * hd, (first + groups) * qpg * hd)
        k = source.read(self.hf_names[1], 0, first * hd, (first + groups) * hd)
        v = source.read(self.hf_names[2], 0, first * hd, (first + groups) * hd)
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, qpg * hd, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)], dim=1
        )  # (groups, (qpg + 2) * hd, *rest)
        return fused.reshape(-1, *rest)

    def merge_shards(self, shards, layout):
        full = torch.cat(shards, dim=0)  # shards hold whole groups in order, so this is the fused tensor
        rest = full.shape[1:]
        qpg, hd = layout.heads_per_group, layout.head_dim
        grouped = full.reshape(layout.num_query_groups, (qpg + 2) * hd, *rest)
        q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
        return [(name, part.reshape(-1, *rest).contiguous()) for name, part in zip(self.hf_names, (q, k, v))]


@dataclass(frozen=True)
class GateUpRule(TensorRule):
    """SwiGLU ``linear_fc1`` from ``(gate_proj, up_proj)``; each TP shard is ``[gate_r ; up_r]``."""

    def hf_shapes(self, local_shape, layout):
        full = (local_shape[0] // 2 * layout.tp_size, *local_shape[1:])
        return [full, full]

    def load_shard(self, source, layout, local_shape):
        self._check_all(source, layout, local_shape)
        rows = local_shape[0] // 2
        start = layout.tp_rank * rows
        gate = source.read(self.hf_names[0], 0, start, start + rows)
        up = source.read(self.hf_names[1], 0, start, start + rows)
        return torch.cat([gate, up], dim=0)

    def merge_shards(self, shards, layout):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(self.hf_names[0], gate), (self.hf_names[1], up)]


class _ExpertTensorParallel:
    """Mixin before a rule: its shard arithmetic runs on the expert-tensor-parallel layout
    (``layout.for_experts()``) instead of the dense tensor-parallel one."""

    def hf_shapes(self, local_shape, layout):
        return super().hf_shapes(local_shape, layout.for_experts())

    def load_shard(self, source, layout, local_shape):
        return super().load_shard(source, layout.for_experts(), local_shape)

    def merge_shards(self, shards, layout):
        return super().merge_shards(shards, layout.for_experts())


@dataclass(frozen=True)
class ExpertGateUpRule(_ExpertTensorParallel, GateUpRule):
    """One expert's ``linear_fc1`` from its ``(gate_proj, up_proj)``, split over the expert-tensor-parallel ranks."""


@dataclass(frozen=True)
class ExpertCopyRule(_ExpertTensorParallel, CopyRule):
    """One expert's ``linear_fc2`` (``down_proj``), split over the expert-tensor-parallel ranks."""


def _require(hf_config: Any, name: str) -> Any:
    if not hasattr(hf_config, name):
        raise UnsupportedModelError(f"HF config of model_type {hf_config.model_type!r} has no field {name!r}")
    return getattr(hf_config, name)


class ModelMapping:
    """HF <-> Megatron mapping of one decoder-only architecture family (override the hooks per family)."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()

    def qkv_bias(self, hf_config: Any) -> bool:
        """Whether q/k/v projections carry biases (Megatron ``add_qkv_bias``)."""
        raise NotImplementedError

    def qk_layernorm(self, hf_config: Any) -> bool:
        """Whether queries and keys get a per-head RMSNorm before RoPE (Megatron ``qk_layernorm``; Qwen3)."""
        return False

    def num_experts(self, hf_config: Any) -> int | None:
        """Routed experts per MoE layer (Megatron ``num_moe_experts``), None for a dense model."""
        return None

    def mlp_rules(self, hf_config: Any, m: str, h: str) -> list[TensorRule]:
        """Rules of one layer's MLP (``m`` / ``h``: the Megatron / HF prefix of the layer): the dense SwiGLU."""
        return [
            GateUpRule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), 0),
            CopyRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), 1),
        ]

    def check_supported(self, hf_config: Any) -> None:
        """Raise :class:`UnsupportedModelError` for features Megatron's GPTModel cannot reproduce."""
        act = _require(hf_config, "hidden_act")
        if act != "silu":
            raise UnsupportedModelError(f"{self.model_type}: hidden_act={act!r} is not supported (only 'silu', SwiGLU)")
        layer_types = getattr(hf_config, "layer_types", None)  # transformers>=4.54 only; absent means all full
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            raise UnsupportedModelError(f"{self.model_type}: layer_types {sorted(set(layer_types))} (sliding window)")

    def layer_rules(self, hf_config: Any, layer: int) -> list[TensorRule]:
        """Rules of one decoder layer (global index ``layer``), in Megatron parameter order."""
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        attn = [h + f"self_attn.{p}_proj" for p in "qkv"]
        rules: list[TensorRule] = [
            CopyRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), None),
            QKVRule(m + "self_attention.linear_qkv.weight", tuple(n + ".weight" for n in attn), 0),
        ]
        if self.qkv_bias(hf_config):
            rules.append(QKVRule(m + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in attn), 0))
        if self.qk_layernorm(hf_config):
            rules += [
                CopyRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), None),
                CopyRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), None),
            ]
        rules += [
            CopyRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), 1),
            CopyRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), None),
        ]
        return rules + self.mlp_rules(hf_config, m, h)

    def rules(self, hf_config: Any) -> dict[str, TensorRule]:
        """Every parameter's rule, keyed by canonical Megatron name, in HF export order.

        With tied embeddings the Megatron ``output_layer.weight`` (which exists only on the last pipeline
        stage when PP > 1) is read from ``model.embed_tokens.weight`` and never exported.
        """
        tied = bool(_require(hf_config, "tie_word_embeddings"))
        ordered: list[TensorRule] = [
            VocabRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0)
        ]
        for layer in range(_require(hf_config, "num_hidden_layers")):
            ordered += self.layer_rules(hf_config, layer)
        ordered.append(CopyRule("decoder.final_layernorm.weight", ("model.norm.weight",), None))
        lm_head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        ordered.append(VocabRule("output_layer.weight", (lm_head,), 0))
        return {rule.megatron_name: rule for rule in ordered}

    def exported(self, rule: TensorRule, hf_config: Any) -> bool:
        """False for parameters that are copies of another HF tensor (tied LM head)."""
        return not (rule.megatron_name == "output_layer.weight" and bool(hf_config.tie_word_embeddings))

    def ignorable_hf_tensor(self, name: str, hf_config: Any) -> bool:
        """HF tensors that may be present but are not model parameters (old RoPE buffers, a tied lm_head)."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return name == "lm_head.weight" and bool(hf_config.tie_word_embeddings)


class Qwen2Mapping(ModelMapping):
    """Qwen2 / Qwen2.5: GQA with q/k/v biases, RMSNorm, SwiGLU, RoPE, tied or untied embeddings."""

    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)

    def qkv_bias(self, hf_config):
        return True

    def check_supported(self, hf_config):
        super().check_supported(hf_config)
        if bool(_require(hf_config, "use_sliding_window")):
            raise UnsupportedModelError("qwen2: use_sliding_window=True is not supported")


class LlamaMapping(ModelMapping):
    """Llama 2/3 and SmolLM/SmolLM2: GQA without biases, RMSNorm, SwiGLU, RoPE (default or llama3 scaling)."""

    model_type = "llama"
    architectures = ("LlamaForCausalLM",)

    def qkv_bias(self, hf_config):
        return False

    def check_supported(self, hf_config):
        super().check_supported(hf_config)
        for flag in ("attention_bias", "mlp_bias"):
            if bool(_require(hf_config, flag)):
                raise UnsupportedModelError(
                    f"llama: {flag}=True is not supported (Megatron has no o_proj/MLP-only bias)"
                )


class Qwen3Mapping(ModelMapping):
    """Qwen3 dense: GQA without biases, a per-head RMSNorm on queries and keys (``q_norm`` / ``k_norm``) before
    RoPE, ``head_dim`` independent of hidden_size / num_attention_heads, SwiGLU, tied or untied embeddings."""

    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)

    def qkv_bias(self, hf_config):
        return False

    def qk_layernorm(self, hf_config):
        return True

    def check_supported(self, hf_config):
        super().check_supported(hf_config)
        if bool(_require(hf_config, "attention_bias")):
            raise UnsupportedModelError("qwen3: attention_bias=True is not supported (Megatron has no o_proj bias)")
        if bool(_require(hf_config, "use_sliding_window")):
            raise UnsupportedModelError("qwen3: use_sliding_window=True is not supported")


class Qwen3MoeMapping(Qwen3Mapping):
    """Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention; every layer's MLP is ``num_experts`` SwiGLU experts
    of ``moe_intermediate_size`` behind a linear router (``mlp.gate``) that picks ``num_experts_per_tok`` per token
    (softmax over all experts, top-k, renormalised over the k when ``norm_topk_prob``); no shared expert."""

    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)

    def num_experts(self, hf_config):
        return int(_require(hf_config, "num_experts"))

    def mlp_rules(self, hf_config, m, h):
        rules: list[TensorRule] = [CopyRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), None)]
        for e in range(self.num_experts(hf_config)):
            me, he = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
            rules += [
                ExpertGateUpRule(me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), 0),
                ExpertCopyRule(me + "linear_fc2.weight", (he + "down_proj.weight",), 1),
            ]
        return rules

    def check_supported(self, hf_config):
        super().check_supported(hf_config)
        dense = list(_require(hf_config, "mlp_only_layers") or [])
        step = int(_require(hf_config, "decoder_sparse_step"))
        if dense or step != 1:
            raise UnsupportedModelError(
                f"qwen3_moe: dense MLP layers (mlp_only_layers={dense}, decoder_sparse_step={step}) are not "
                "supported; every layer must be a MoE layer (mlp_only_layers=[], decoder_sparse_step=1)"
            )
        if int(_require(hf_config, "num_experts_per_tok")) > self.num_experts(hf_config):
            raise UnsupportedModelError(f"qwen3_moe: num_experts_per_tok={hf_config.num_experts_per_tok} exceeds "
                                        f"num_experts={hf_config.num_experts}")


_REGISTRY: dict[str, Callable[[], ModelMapping]] = {
    Qwen2Mapping.model_type: Qwen2Mapping,
    LlamaMapping.model_type: LlamaMapping,
    Qwen3Mapping.model_type: Qwen3Mapping,
    Qwen3MoeMapping.model_type: Qwen3MoeMapping,
}


def supported_architectures() -> list[str]:
    """HF ``architectures`` names with a mapping, sorted, e.g. ``['LlamaForCausalLM', 'Qwen2ForCausalLM', ...]``."""
    return sorted(arch for factory in _REGISTRY.values() for arch in factory.architectures)


def mapping_for(model_type: str | None, architectures: Any = None) -> ModelMapping:
    """The mapping registered for ``model_type`` (a config.json ``model_type``), without checking a config's
    features: what the memory plan asks of a model known only by a config.json subset (q/k/v biases).

    Raises:
        UnsupportedModelError: unknown ``model_type`` (the message lists the supported architectures).
    """
    if model_type not in _REGISTRY:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or model_type!r} (model_type {model_type!r}); "
            f"supported: {', '.join(supported_architectures())}"
        )
    return _REGISTRY[model_type]()


def get_model_mapping(hf_config: Any) -> ModelMapping:
    """The mapping for ``hf_config`` (a ``transformers.PretrainedConfig``), after checking its features.

    Raises:
        UnsupportedModelError: unknown ``model_type`` (the message lists the supported architectures) or an
            unsupported feature of a known family.
    """
    mapping = mapping_for(getattr(hf_config, "model_type", None), getattr(hf_config, "architectures", None))
    mapping.check_supported(hf_config)
    return mapping
