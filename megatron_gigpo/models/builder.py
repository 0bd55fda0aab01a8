"""Build a megatron-core ``GPTModel`` from a Hugging Face config (Qwen2/Qwen2.5, Qwen3 dense, Qwen3-MoE, Llama/SmolLM2).

Upstream APIs: ``transformers.AutoConfig``, ``megatron.core.transformer.TransformerConfig``,
``megatron.core.models.gpt.GPTModel`` and its layer specs (megatron-core 0.16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_gigpo.models.specs import padded_vocab_size
from megatron_gigpo.models.mapping import UnsupportedModelError, get_model_mapping

__all__ = [
    "load_hf_config",
    "RopeSettings",
    "rope_settings",
    "head_dim",
    "padded_vocab_size",
    "transformer_config_from_hf",
    "moe_settings",
    "layer_spec",
    "build_gpt_model",
    "unwrap_gpt_model",
    "hf_config_of",
]

# Megatron's ``_apply_scaling`` hard-codes these llama3 RoPE parameters; other values cannot be reproduced.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def load_hf_config(path: str | os.PathLike) -> Any:
    """``transformers.AutoConfig`` of the HF model directory ``path`` (its ``config.json``).

    Raises:
        FileNotFoundError: ``path/config.json`` does not exist.
        UnsupportedModelError: the architecture has no mapping (message lists the supported ones).
    """
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {config_file}")
    hf_config = AutoConfig.from_pretrained(str(path))
    get_model_mapping(hf_config)  # fail early with the list of supported architectures
    return hf_config


@dataclass(frozen=True)
class RopeSettings:
    """RoPE parameters in Megatron's terms (``GPTModel(rotary_base=..., rope_scaling=..., ...)``)."""

    theta: float
    llama3_scaling_factor: float | None  # None: plain RoPE


def rope_settings(hf_config: Any) -> RopeSettings:
    """RoPE base and scaling from an HF config (transformers>=5 ``rope_parameters`` or older ``rope_theta``).

    Raises:
        UnsupportedModelError: a RoPE type other than default or llama3 (with Megatron's fixed llama3
            parameters ``low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192``).
    """
    params = getattr(hf_config, "rope_parameters", None)  # transformers>=5 folds rope_theta in here
    if params is None:
        theta = hf_config.rope_theta
        params = dict(hf_config.rope_scaling or {"rope_type": "default"})
    else:
        theta = params["rope_theta"]
    rope_type = params["rope_type"] if "rope_type" in params else params["type"]
    if rope_type == "default":
        return RopeSettings(float(theta), None)
    if rope_type == "llama3":
        for key, value in _LLAMA3_FIXED.items():
            if float(params[key]) != value:
                raise UnsupportedModelError(
                    f"llama3 RoPE with {key}={params[key]} is not supported (Megatron fixes it to {value})"
                )
        return RopeSettings(float(theta), float(params["factor"]))
    raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (supported: default, llama3)")


def head_dim(hf_config: Any) -> int:
    """Attention head size: ``head_dim`` when the config sets it, else hidden_size / num_attention_heads
    (the rule HF's attention modules apply; Qwen3 sets it apart from hidden / heads, Megatron's ``kv_channels``)."""
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit) if explicit else hf_config.hidden_size // hf_config.num_attention_heads


def _params_dtype_flags(params_dtype: torch.dtype) -> dict[str, Any]:
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype {params_dtype} is not one of float32, bfloat16, float16")
    return {
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
    }


def transformer_config_from_hf(
    hf_config: Any,
    *,
    params_dtype: torch.dtype,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` equivalent to an HF Qwen2/Qwen3/Qwen3-MoE/Llama config.

    MoE models (:func:`moe_settings`) get megatron-core's MoE layer fields; ``expert_tensor_parallel_size`` None is
    megatron-core's default (the tensor-parallel size).

    Fusions that need Apex/Transformer-Engine kernels are off; ``use_cpu_initialization`` is on without CUDA
    (megatron otherwise allocates on the GPU). Any TransformerConfig field can be set through ``overrides``
    (e.g. ``recompute_granularity``, ``variable_seq_lengths``, ``calculate_per_token_loss``).

    Raises:
        UnsupportedModelError: unsupported architecture or feature.
        ValueError: heads, KV groups or layers not divisible by the TP / PP sizes, experts not by EP.
    """
    mapping = get_model_mapping(hf_config)
    num_heads, num_groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    num_layers = hf_config.num_hidden_layers
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if num_heads % num_groups:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_groups}")
    if num_groups % tp:
        raise ValueError(f"num_key_value_heads {num_groups} is not divisible by tensor_model_parallel_size {tp}")
    if num_layers % pp and "num_layers_in_first_pipeline_stage" not in overrides:
        raise ValueError(f"num_hidden_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp}")
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=mapping.qkv_bias(hf_config),
        qk_layernorm=mapping.qk_layernorm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=float(hf_config.attention_dropout),
        init_method_std=float(hf_config.initializer_range),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        **_params_dtype_flags(params_dtype),
        **moe_settings(hf_config, expert_model_parallel_size),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_settings(hf_config: Any, expert_model_parallel_size: int = 1) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` MoE fields of an HF MoE config (empty for a dense model).

    Routing as Qwen3-MoE's ``Qwen3MoeTopKRouter``: logits of a bias-free linear router, softmax over all experts,
    top ``num_experts_per_tok``, renormalised over those k when ``norm_topk_prob``. Softmax is monotone, so the
    top-k of the logits is the top-k of the probabilities, and softmax-then-renormalise over k equals a softmax over
    the k chosen logits: megatron-core's ``moe_router_score_function="softmax"`` with
    ``moe_router_pre_softmax=False``; without renormalisation, ``moe_router_pre_softmax=True`` (softmax over all
    experts, then top-k, weights unchanged). Tokens are never dropped (no capacity factor). The experts: grouped GEMM
    and the all-to-all token dispatcher with Transformer-Engine on CUDA, else megatron-core's ``SequentialMLP``,
    with the all-to-all dispatcher under expert parallelism (each rank's token count differs; on the CPU through
    ``cpu_compat``'s host-side splits) and the all-gather dispatcher without it. The auxiliary
    load-balancing loss (``moe_router_load_balancing_type="aux_loss"``) is off (``moe_aux_loss_coeff=0``) unless the
    caller overrides the coefficient.

    Raises:
        ValueError: ``num_experts`` not divisible by ``expert_model_parallel_size``.
    """
    experts = get_model_mapping(hf_config).num_experts(hf_config)
    if experts is None:
        if expert_model_parallel_size != 1:
            raise ValueError(f"expert_model_parallel_size {expert_model_parallel_size} needs a mixture-of-experts "
                             f"model; {hf_config.model_type!r} is dense")
        return {}
    if experts % expert_model_parallel_size:
        raise ValueError(f"num_experts {experts} is not divisible by expert_model_parallel_size "
                         f"{expert_model_parallel_size}")
    grouped = _transformer_engine_usable()
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=grouped,
        # all-gather needs as many tokens on every expert-parallel rank; the data-parallel ranks' micro-batches differ
        moe_token_dispatcher_type="alltoall" if grouped or expert_model_parallel_size > 1 else "allgather",
    )


def _transformer_engine_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch ``RMSNorm`` / ``LayerNorm``) for sequence parallelism, which the
    wrapper refuses: with the sequence split over the TP ranks each rank's norm gains get the gradient of its own
    tokens only, so they carry Megatron's ``sequence_parallel`` attribute and ``finalize_model_grads`` sums
    their gradients over TP (as Transformer-Engine's and Apex's norms do). Same constructor as the wrapper."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: Any) -> torch.nn.Module:
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """Transformer-Engine layer spec when TE and CUDA are present, Megatron's local spec otherwise (with per-head
    query/key norms when ``config.qk_layernorm``); with ``config.sequence_parallel`` and the local spec, a
    ``TransformerBlockSubmodules`` of this stage's layers whose norms (and the final norm) are
    :class:`SequenceParallelTorchNorm` (the q/k norms too: torch's wrapper refuses sequence parallelism, and their
    gradients are summed over TP either way, by ``finalize_model_grads``)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if _transformer_engine_usable():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **moe)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization,
                                                    qk_layernorm=config.qk_layernorm, **moe)
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    if config.qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


def build_gpt_model(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    **overrides: Any,
) -> GPTModel:
    """A ``GPTModel`` for this rank's pipeline stage (and virtual stage ``vp_stage``) of ``hf_config``.

    TP/PP sizes come from ``megatron.core.parallel_state`` (call ``megatron_gigpo.actor.distributed.initialize``
    first). Parameters are randomly initialised; load weights with ``load_hf_weights``. The HF config is kept
    on the model as ``model.hf_config`` for the weight mapping. ``overrides`` go to
    :func:`transformer_config_from_hf`; pass ``config`` instead to use a ready TransformerConfig.
    Logits have ``padded_vocab_size(hf_config, TP)`` columns, split over TP ranks.

    Raises:
        RuntimeError: model parallel state is not initialised.
        UnsupportedModelError / ValueError: see :func:`transformer_config_from_hf`.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron model parallel is not initialised; call megatron_gigpo.actor.distributed.initialize"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if config is None:
        config = transformer_config_from_hf(
            hf_config,
            params_dtype=params_dtype,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
            **overrides,
        )
    if config.num_moe_experts:
        from megatron_gigpo.actor.cpu_compat import define_missing_te_names

        define_missing_te_names()  # megatron-core's router needs it without Transformer-Engine
    rope = rope_settings(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage),
        vocab_size=padded_vocab_size(hf_config, tp),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope.theta,
        rope_scaling=rope.llama3_scaling_factor is not None,
        rope_scaling_factor=rope.llama3_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.hf_config = hf_config
    return model


def unwrap_gpt_model(model: torch.nn.Module) -> GPTModel:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (each exposes it as ``.module``)."""
    while not isinstance(model, GPTModel):
        if not hasattr(model, "module"):
            raise TypeError(f"expected a megatron GPTModel or a wrapper of one, got {type(model).__name__}")
        model = model.module
    return model


def hf_config_of(model: torch.nn.Module, hf_config: Any | None = None) -> Any:
    """``hf_config`` if given, else the one :func:`build_gpt_model` attached to the model."""
    if hf_config is not None:
        return hf_config
    inner = unwrap_gpt_model(model)
    if not hasattr(inner, "hf_config"):
        raise ValueError("model was not built by build_gpt_model; pass hf_config= explicitly")
    return inner.hf_config
