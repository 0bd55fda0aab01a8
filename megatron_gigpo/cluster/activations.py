"""Activation memory of one actor rank during the update: the tensors autograd keeps for backward.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198),
count per transformer layer and micro-batch of s tokens x b rows ``sbh(34 + 5as/h)`` bytes for GPT-3 (16-bit,
dropout, LayerNorm, a 4h GeLU MLP): ``sbh(10 + 24/t + 5as/(ht))`` at tensor-parallel size t,
``sbh/t (34 + 5as/h)`` with sequence parallelism, ``34 sbh/t`` with selective recomputation and ``2sbh`` (the
layer's input) with full recomputation. The first pipeline stage of 1F1B holds p micro-batches in flight, so
its L/p layers cost as much as all L layers of one micro-batch. :func:`activation_bytes` redoes that count term
by term for the model the actor builds (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP, no dropout) in
megatron-core 0.16's code, and ``benchmarks/activation_memory.py`` measures it (docs/recipes-and-placement.md).

Notation: T tokens of one micro-batch (rows x the longest row: ``trainer.micro_batch_tokens``), s its longest row
(at most ``rollout.prompt_length + rollout.response_length``), h hidden size, f FFN size, a attention heads, g KV
heads, d head size, t TP size, e bytes of an activation (2 in bf16, 4 in fp32), r = t with
``parallel.sequence_parallel`` (the norms, residuals and the linear layers' kept inputs are split along the
sequence) else 1. Per layer and micro-batch, bytes:

==================  ===========================================================================================
norms, linear in    local: ``T x (6h e + 8) / r``: each RMSNorm keeps its input, its normalised output and an fp32
                    inverse RMS (2 x (2h e + 4)), the q/k/v and fc1 linears their inputs (2h e); TE (norm fused
                    into the linear): ``T x (4h e + 8) / r``
attention           local (Megatron's ``DotProductAttention``): ``T x (4ad e + as (4 + e'))/t``: q, k and v (k and
                    v repeated to a heads; with a = g v is a view of the fused q/k/v output, which then stays:
                    (a + 2g)d instead of ad), the softmax probabilities (fp32, plus an e-byte copy for the product
                    with v when e < 4: e' = e if e < 4 else 0), the output projection's input; plus ``s^2`` bytes
                    (the causal mask). TE (fused attention, the GPU install): ``T x ((2a + 3g)d e + 4a + ad e)/t``:
                    the fused q/k/v output (v is a view of it), q and k after RoPE, fp32 softmax statistics, the
                    output (the projection's input); no s x s term
MLP                 ``T x 5f e / t``: fc1's output 2f (SiLU keeps a view), the up half plus Megatron's GLU offset f,
                    SiLU's output f, their product (fc2's input) f
RoPE                ``4 s d e``: cos and sin for q and for k
MoE MLP             (instead of MLP; E experts, top-k, expert FFN size f_e, expert TP size t_e) the router's fp32
                    scores and probabilities ``T x 8E / r``, and per routed token copy the experts' permuted input
                    and output (kept for the probability-weighted sum) and its probability ``h e + h e + 4`` plus
                    the expert MLP ``5 f_e e / t_e``; a rank holds ``R = T x k x t_e / t`` routed copies (its T / t
                    tokens sent to k experts each, over the EP ranks, then gathered over the t_e expert-TP ranks;
                    megatron-core's MoE layer trains with TP > 1 only under sequence parallelism, r = t), assuming
                    balanced routing: a rank whose experts are chosen more often keeps more
==================  ===========================================================================================

``recompute_granularity: selective`` (Megatron's ``core_attn``) keeps the core attention's inputs instead of its
insides: local attention becomes TE's term without the statistics (``T x ((2a + 3g)d + ad) e / t``, no mask);
TE is unchanged. ``full`` keeps each recomputed group's input (``T x h e / r``, plus the RoPE frequencies
``4 s d`` once) and, during backward, the whole layers of the one group being recomputed (less the group's input,
which its first norm keeps again, and the last stage's final norm, released before the first recomputation):
``uniform`` with n = ``recompute_num_layers`` keeps ceil(L_s / n) inputs and recomputes n layers at a time;
``block`` keeps n inputs and L_s - n whole layers and recomputes one layer at a time (which adds to the peak only
when n = L_s: otherwise the whole layers above are released first). L_s = layers of the stage.

Per micro-batch besides the layers: the first stage's token ids (8 B per token, the embedding's backward), the
last stage's final norm (local ``T x (2h e + 4) / r``, TE ``T x (h e + 4) / r``). A stage holds ``pp - stage``
micro-batches in flight (1F1B; fewer when a mini-batch has fewer micro-batches): the estimate is

    ``(pp - stage) x kept(one micro-batch) + recomputed layers``.

Not counted: the output layer's log-prob chunk (:data:`megatron_gigpo.cluster.memory.LOGPROB_CHUNK_BLOCKS`, its
own term), the per-token log-probs, entropies and losses (a few floats per response token), activation
gradients in flight during backward (a few T x h tensors), LoRA adapters' inputs, the padding of the sequence
to a multiple of t under sequence parallelism; the TE terms follow TE's documented kernels and are not measured
here (no GPU on CI).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from megatron_gigpo.models.specs import moe_shape

__all__ = ["ActivationEstimate", "RecomputeSettings", "activation_bytes"]

_FP32 = 4
_TOKEN_ID = 8  # int64


class RecomputeSettings(Protocol):
    """Megatron's recompute settings (:class:`megatron_gigpo.actor.config.RecomputeConfig` is one)."""

    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one actor rank (see the module docstring).

    Attributes:
        layer: one whole layer, one micro-batch, without recomputation.
        kept: what one micro-batch keeps on this stage between its forward and its backward (its layers as the
            recompute settings keep them, token ids on the first stage, the final norm on the last).
        micro_batches: micro-batches in flight on the stage (1F1B: ``pp - stage``).
        recomputed: what the layers being recomputed during backward (full granularity) add to ``kept`` at
            their peak.
    """

    layer: int
    kept: int
    micro_batches: int
    recomputed: int

    @property
    def total(self) -> int:
        """Peak activation bytes of the rank: ``micro_batches x kept + recomputed``."""
        return self.micro_batches * self.kept + self.recomputed


def _mlp(hf: dict[str, Any], tokens: int, e: int, t: int, r: int, expert_tp: int) -> int:
    """Bytes the layer's MLP keeps for one micro-batch: dense SwiGLU, or a MoE layer's router and routed copies."""
    experts, top_k, expert_ffn = moe_shape(hf)
    if not experts:
        return tokens * 5 * hf["intermediate_size"] * e // t
    h = hf["hidden_size"]
    routed = tokens * top_k * expert_tp // t
    return tokens * 2 * _FP32 * experts // r + routed * (2 * h * e + _FP32) + routed * 5 * expert_ffn * e // expert_tp


def _layer(hf: dict[str, Any], tokens: int, row: int, e: int, t: int, r: int, *, fused: bool, selective: bool,
           expert_tp: int) -> int:
    """Bytes one layer keeps for one micro-batch (``selective``: core attention recomputed)."""
    h, a = hf["hidden_size"], hf["num_attention_heads"]
    g = hf.get("num_key_value_heads") or a
    d = hf.get("head_dim") or h // a
    norms = (4 if fused else 6) * h * e + 2 * _FP32
    qkv_kept = (2 * a + 3 * g) * d * e  # fused q/k/v output (v a view of it), q and k after RoPE
    if fused:
        attention = qkv_kept + a * _FP32 + a * d * e
    elif selective:
        attention = qkv_kept + a * d * e
    else:
        v = a * d if a != g else (a + 2 * g) * d
        attention = (2 * a * d + v + a * d) * e + a * row * (_FP32 + (e if e < _FP32 else 0))
    per_micro_batch = 4 * row * d * e + (row * row if not (fused or selective) else 0)
    return tokens * norms // r + tokens * attention // t + _mlp(hf, tokens, e, t, r, expert_tp) + per_micro_batch


def activation_bytes(hf: dict[str, Any], *, tokens: int, row_tokens: int, element_bytes: int, tp: int = 1,
                     pp: int = 1, stage: int = 0, sequence_parallel: bool = False,
                     recompute: RecomputeSettings | None = None, fused_attention: bool = False,
                     expert_tp: int | None = None) -> ActivationEstimate:
    """Activation bytes of the actor rank at pipeline stage ``stage`` during the update (formula: module docstring).

    Args:
        hf: the policy's config.json (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim``).
        tokens: T, tokens of one micro-batch as the actor pads them (``trainer.micro_batch_tokens`` bounds it).
        row_tokens: s, the longest row (capped at ``tokens``).
        element_bytes: e, bytes of an activation element (the params dtype's: 2 or 4).
        tp, pp, stage: tensor- and pipeline-parallel sizes and this rank's stage (0-based).
        sequence_parallel: ``parallel.sequence_parallel``.
        recompute: the ``actor`` section's recompute settings (None: no recomputation).
        fused_attention: Transformer-Engine's layer spec (fused norm + linear, fused attention: GPUs with the
            ``gpu`` extra) instead of Megatron's local spec (CPU).
        expert_tp: a MoE model's expert tensor-parallel size (``parallel.expert_tensor_parallel_size``; None:
            ``tp``). A MoE config.json also needs ``num_experts``, ``num_experts_per_tok`` and
            ``moe_intermediate_size``; a dense one ``intermediate_size``.

    Raises:
        ValueError: ``recompute_granularity: full`` without method or layer count, or a count below 1.
    """
    e, t, s = element_bytes, tp, min(row_tokens, tokens)
    r = tp if sequence_parallel else 1
    layers = hf["num_hidden_layers"] // pp
    granularity = recompute.recompute_granularity if recompute is not None else None
    expert_tp = expert_tp or tp
    whole = _layer(hf, tokens, s, e, t, r, fused=fused_attention, selective=False, expert_tp=expert_tp)
    final_norm = tokens * ((1 if fused_attention else 2) * hf["hidden_size"] * e + _FP32) // r if stage == pp - 1 else 0
    extra = (tokens * _TOKEN_ID if stage == 0 else 0) + final_norm
    recomputed = 0
    if granularity == "full":
        n, method = recompute.recompute_num_layers, recompute.recompute_method
        if n is None or n < 1 or method not in ("uniform", "block"):
            raise ValueError(f"recompute_granularity=full needs recompute_method uniform|block and "
                             f"recompute_num_layers >= 1 (got {method!r}, {n!r})")
        n = min(n, layers)
        group_input = tokens * hf["hidden_size"] * e // r
        rope_freqs = 4 * s * (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        if method == "uniform":
            kept = -(-layers // n) * group_input + rope_freqs
            during = n * whole - group_input
        else:
            kept = n * group_input + (layers - n) * whole + rope_freqs
            during = whole - group_input if n == layers else 0
        recomputed = max(during - final_norm, 0)
    else:
        kept = layers * _layer(hf, tokens, s, e, t, r, fused=fused_attention, selective=granularity == "selective",
                               expert_tp=expert_tp)
    return ActivationEstimate(layer=whole, kept=kept + extra, micro_batches=pp - stage, recomputed=recomputed)
