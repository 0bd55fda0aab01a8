"""Per-GPU memory estimate of a placement plan (``megatron-gigpo validate RECIPE --plan``).

Bytes on one GPU, for the actor rank there (tensor-parallel size T, pipeline stage s of S, data-parallel size D;
``P_s`` = parameters of stage s that one TP rank holds, :func:`rank_parameter_count`) and the engine there
(tensor-parallel size k, ``P`` = the model's parameters, :func:`hf_parameter_count`; a MoE rank's ``P_s`` holds
its E / EP experts of every layer of the stage, each split over the expert TP size, :func:`rank_parameters`):

=================  ================================================================================================
weights            ``P_s x b``; b = 2 (bfloat16 / float16) or 4 (float32; the CPU path always trains in float32)
reference          ``P_s x b`` when ``algorithm.use_kl_loss`` (the frozen copy for the KL loss), else 0
gradients          ``P_s x 4``: Megatron DDP's fp32 ``main_grad`` buffer (``grad_reduce_in_fp32``), full size on
                   every rank with or without the distributed optimizer
optimizer          ``P_s x (8 + m) / Z``: Adam's two fp32 moments (8 B) plus the fp32 master copy (m = 4) when
                   b = 2 (m = 0 for float32 params); Z = D with ``parallel.use_distributed_optimizer`` (ZeRO-1
                   shards the state over data-parallel ranks), else 1 — both variants are printed. A MoE model's
                   expert parameters ``X_s`` (in ``P_s``) are sharded over the expert-data-parallel group instead:
                   ``(P_s - X_s) x (8 + m) / D + X_s x (8 + m) / (T x D / (EP x T_e))`` (EP the expert-parallel,
                   T_e the expert tensor-parallel size; megatron-core's expert-DP group)
activations        what autograd keeps for backward during the update, per micro-batch of
                   ``trainer.micro_batch_tokens`` tokens, times the micro-batches in flight on the stage (1F1B:
                   S - s), with ``actor.recompute_*`` and ``parallel.sequence_parallel`` (their formula:
                   :mod:`megatron_gigpo.cluster.activations`; Transformer-Engine's fused attention, the GPU install)
log-prob chunk     ``4 x C x V_pad / T x 4`` on the last stage: the fp32 (C, V_pad / T) logits of
                   C = ``logprob_chunk_size`` response tokens, and the shifted, exp and exp * shifted temporaries of
                   :func:`megatron_gigpo.actor.logprob.vocab_parallel_log_probs`; V_pad = vocabulary padded to a
                   multiple of lcm(128, T)
vLLM               ``u x G`` while the engine is awake: vLLM takes ``u = rollout.gpu_memory_utilization`` of the
                   GPU's memory G for its weights ``P / k x b`` and its KV cache (the rest)
KV cache           ``u x G - P / k x b``
=================  ================================================================================================

With ``model.lora.enabled`` the base is frozen: the reference is the base with adapters off (0 bytes), and
gradients and optimizer state are those of the adapters only (``A_s`` = adapter parameters of the rank,
:func:`lora_rank_parameter_count`; weights ``(P_s + A_s) x b``).

Peak of a colocated GPU = weights + reference + gradients + optimizer + max(activations + log-prob chunk, vLLM):
the actor's state stays resident while the engines generate, and the engines sleep (weights offloaded, KV cache
freed) while the actor computes log-probs and updates. Disaggregated: actor GPUs hold the first six terms,
engine GPUs ``u x G``. Not counted: the CUDA context and allocator slack (1-3 GiB), vLLM's CUDA graphs and
sampler buffers, the forward-only log-prob passes' transient tensors (one layer at a time, no graph kept).
:func:`memory_refusal` names the GPU that does not fit; ``validate --plan`` refuses such a plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

from megatron_gigpo.actor.config import RecomputeConfig
from megatron_gigpo.algo.config import AlgorithmConfig
from megatron_gigpo.cluster.activations import activation_bytes
from megatron_gigpo.cluster.placement import PlacementPlan, RecipeLayout
from megatron_gigpo.models.config import ModelConfig
from megatron_gigpo.models.mapping import mapping_for
from megatron_gigpo.models.specs import hf_config_for, moe_shape, padded_vocab_size

__all__ = [
    "GPUMemory", "RankParameters", "hf_parameter_count", "moe_shape", "rank_parameters", "rank_parameter_count",
    "lora_rank_parameter_count",
    "optimizer_bytes_per_param", "expert_data_parallel_size",
    "estimate_memory", "format_experts", "format_memory", "memory_refusal", "policy_hf_config", "LOGPROB_CHUNK_BLOCKS",
]

GIB = 1 << 30
#: fp32 (chunk, V / TP) blocks alive at once in vocab_parallel_log_probs: logits, shifted, exp, exp * shifted.
LOGPROB_CHUNK_BLOCKS = 4
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _layer_params(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(TP-split, TP-replicated, routed-expert) parameters of one decoder layer: attention with the Q/K/V biases
    and the per-head query/key norm gains its family's mapping declares
    (:meth:`megatron_gigpo.models.mapping.ModelMapping.qkv_bias` and ``qk_layernorm``), two RMSNorm gains, and a
    gated MLP of ``3 h f`` (dense, TP-split) or, for a MoE model, the router ``E x h`` (replicated on every TP
    rank) and E experts of ``3 h f_e`` each (split over EP x expert TP).

    Raises:
        megatron_gigpo.models.mapping.UnsupportedModelError: a ``model_type`` with no mapping.
    """
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    attention = h * heads * d + 2 * h * kv_heads * d + heads * d * h
    mapping, family = mapping_for(hf.get("model_type"), hf.get("architectures")), SimpleNamespace(**hf)
    if mapping.qkv_bias(family):  # the family says
        attention += heads * d + 2 * kv_heads * d
    qk_norms = 2 * d if mapping.qk_layernorm(family) else 0  # one gain of head_dim each, on every TP rank
    experts, _, expert_ffn = moe_shape(hf)
    if experts:
        return attention, 2 * h + qk_norms + experts * h, experts * 3 * h * expert_ffn
    return attention + 3 * h * hf["intermediate_size"], 2 * h + qk_norms, 0


def hf_parameter_count(hf: dict[str, Any]) -> int:
    """Parameters of the Hugging Face model described by config.json ``hf`` (a tied head counted once; every
    expert of a MoE model)."""
    split, replicated, experts = _layer_params(hf)
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    head = 0 if hf.get("tie_word_embeddings", False) else vocab * h
    return hf["num_hidden_layers"] * (split + replicated + experts) + vocab * h + head + h


@dataclass(frozen=True)
class RankParameters:
    """Parameters one Megatron rank holds: ``dense`` (reduced and sharded over the data-parallel group) and
    ``expert`` (its EP rank's experts; reduced and sharded over the expert-data-parallel group)."""

    dense: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_parameters(hf: dict[str, Any], tp: int, pp: int, stage: int, ep: int = 1,
                    etp: int | None = None) -> RankParameters:
    """Parameters one Megatron rank holds at tensor-parallel size ``tp``, pipeline stage ``stage`` of ``pp``,
    expert-parallel size ``ep`` and expert tensor-parallel size ``etp`` (None: ``tp``, megatron-core's default).

    Dense: ``L/pp x (split / tp + replicated)``; vocabulary padded as the actor pads it; the first stage holds the
    embedding, the last the final norm and the output layer (with tied embeddings and PP > 1 the last stage keeps
    its own copy of the embedding). Experts: ``L/pp x E x 3 h f_e / (ep x etp)`` (E / ep experts, each linear split
    over etp).
    """
    split, replicated, experts = _layer_params(hf)
    h = hf["hidden_size"]
    vocab = padded_vocab_size(SimpleNamespace(vocab_size=hf["vocab_size"]), tp)
    layers = hf["num_hidden_layers"] // pp
    dense = layers * (split // tp + replicated)
    if stage == 0:
        dense += vocab * h // tp
    if stage == pp - 1:
        dense += h
        if not hf.get("tie_word_embeddings", False) or pp > 1:
            dense += vocab * h // tp
    return RankParameters(dense, layers * experts // (ep * (etp or tp)))


def rank_parameter_count(hf: dict[str, Any], tp: int, pp: int, stage: int, ep: int = 1,
                         etp: int | None = None) -> int:
    """All parameters of the rank (:func:`rank_parameters`, dense plus expert)."""
    return rank_parameters(hf, tp, pp, stage, ep, etp).total


def lora_rank_parameter_count(hf: dict[str, Any], tp: int, pp: int, lora) -> int:
    """LoRA adapter parameters one Megatron rank holds (:mod:`megatron_gigpo.actor.lora`): per adapted layer
    ``A`` (r, in) and ``B`` (out, r); column-parallel layers (``linear_qkv``, ``linear_fc1``) split ``B`` over
    TP, row-parallel ones (``linear_proj``, ``linear_fc2``) split ``A``."""
    h, heads, r = hf["hidden_size"], hf["num_attention_heads"], lora.rank
    kv_heads = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    ffn = hf["intermediate_size"]
    per_target = {
        "linear_qkv": r * h + (heads + 2 * kv_heads) * d // tp * r,
        "linear_proj": r * heads * d // tp + h * r,
        "linear_fc1": r * h + 2 * ffn // tp * r,
        "linear_fc2": r * ffn // tp + h * r,
    }
    return hf["num_hidden_layers"] // pp * sum(per_target[t] for t in lora.target_modules)


def expert_data_parallel_size(parallel) -> int:
    """megatron-core's expert-data-parallel size, the ranks that reduce and (distributed optimizer) shard one
    expert's gradients and Adam state: world / (expert TP x EP x PP) = TP x DP / (expert TP x EP), at least 1
    (``parallel``: a :class:`megatron_gigpo.actor.config.ParallelConfig`; validation refuses layouts where the
    division is not exact)."""
    p = parallel
    return max(p.tensor_model_parallel_size * p.data_parallel_size
               // (p.expert_tensor_parallel * p.expert_model_parallel_size), 1)


def optimizer_bytes_per_param(params_dtype: str) -> int:
    """Adam state bytes per parameter before sharding: two fp32 moments, plus an fp32 master copy for 16-bit params."""
    return 8 + (4 if _BYTES[params_dtype] == 2 else 0)


class PlannedRecipe(RecipeLayout, Protocol):
    """What the estimate reads of a recipe (:class:`megatron_gigpo.config.Config` is one): the placement plan's
    sections, ``model`` (dtype, LoRA, ``init: random`` shape), ``algorithm`` (``use_kl_loss``: a reference
    copy or not) and ``actor`` (activation recomputation)."""

    model: ModelConfig
    algorithm: AlgorithmConfig
    actor: RecomputeConfig


@dataclass(frozen=True)
class GPUMemory:
    """Estimated bytes on one GPU of a plan (see the module docstring for each term)."""

    node: int
    gpu: int
    rank: int | None  # actor rank on this GPU, or None
    weights: int = 0
    reference: int = 0
    gradients: int = 0
    optimizer_distributed: int = 0
    optimizer_replicated: int = 0
    activations: int = 0
    logprob_chunk: int = 0
    vllm: int = 0  # u x G, when an engine (or a vLLM worker of one) uses this GPU
    engine_weights: int = 0
    kv_cache: int = 0
    distributed_optimizer: bool = False

    @property
    def actor(self) -> int:
        """The actor's resident bytes (weights, reference, gradients, the recipe's optimizer variant)."""
        optim = self.optimizer_distributed if self.distributed_optimizer else self.optimizer_replicated
        return self.weights + self.reference + self.gradients + optim

    @property
    def update(self) -> int:
        """The actor's bytes while it updates: resident state, activations and the log-prob chunk."""
        return self.actor + self.activations + self.logprob_chunk

    @property
    def peak(self) -> int:
        return max(self.update, self.actor + self.vllm)


def policy_hf_config(cfg: PlannedRecipe) -> dict[str, Any] | None:
    """config.json of the policy (``model.architecture`` applied for ``init: random``); None if unknown."""
    hf = hf_config_for(cfg.model.path, cfg.model.revision)
    if hf is None:
        return None
    if cfg.model.init == "random":
        keep_base = ("vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")  # null: the base's
        hf.update({k: v for k, v in dataclasses.asdict(cfg.model.architecture).items()
                   if k != "initializer_range" and not (k in keep_base and v is None)})
    return hf


def estimate_memory(cfg: PlannedRecipe, plan: PlacementPlan, hf: dict[str, Any],
                    gpu_memory_gib: float = 80.0) -> list[GPUMemory]:
    """One :class:`GPUMemory` per GPU of ``plan`` (a GPU plan), in node / GPU order.

    Args:
        cfg: the recipe; plan: its :func:`~megatron_gigpo.cluster.placement.plan_placement`; hf: the policy's
            config.json (:func:`policy_hf_config`); gpu_memory_gib: memory G of one GPU (vLLM's share is u x G).
    """
    p, r = cfg.parallel, cfg.rollout
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel
    expert_dp = expert_data_parallel_size(p)
    dtype = cfg.model.params_dtype(plan.cluster.device)
    b = _BYTES[dtype]
    vocab = padded_vocab_size(SimpleNamespace(vocab_size=hf["vocab_size"]), tp)
    chunk = LOGPROB_CHUNK_BLOCKS * cfg.trainer.logprob_chunk_size * vocab // tp * 4
    tokens = cfg.trainer.micro_batch_tokens
    row = r.prompt_length + r.response_length
    vllm = int(r.gpu_memory_utilization * gpu_memory_gib * GIB)
    engine_weights = hf_parameter_count(hf) * b // r.tensor_parallel_size
    engine_gpus = {(w.node, g) for e in plan.engines for w in (e.workers or (e.host,)) for g in w.gpus}
    out = []
    for n, node in enumerate(plan.bundles):
        for g in range(len(node)):
            fields: dict[str, Any] = {"distributed_optimizer": p.use_distributed_optimizer}
            rank = next((s.index for s in plan.ranks if (s.node, s.gpus) == (n, (g,))), None)
            if rank is not None:
                stage = rank // (tp * dp)  # Megatron's default order tp-cp-ep-dp-pp: PP varies slowest
                split = rank_parameters(hf, tp, pp, stage, ep, etp)
                params = split.total
                trained, weights, reference = params, params, params if cfg.algorithm.use_kl_loss else 0
                per_param = optimizer_bytes_per_param(dtype)
                # ZeRO-1: dense state over the DP group, expert state over the expert-DP group
                opt = params * per_param
                opt_dist = split.dense * per_param // dp + split.expert * per_param // expert_dp
                if cfg.model.lora.enabled:  # frozen base; the reference is the base itself
                    trained = lora_rank_parameter_count(hf, tp, pp, cfg.model.lora)
                    weights, reference = params + trained, 0
                    opt = trained * per_param
                    opt_dist = opt // dp
                act = activation_bytes(hf, tokens=tokens, row_tokens=row, element_bytes=b, tp=tp, pp=pp, stage=stage,
                                       sequence_parallel=p.sequence_parallel, recompute=cfg.actor,
                                       fused_attention=True,  # the GPU install's Transformer-Engine layers
                                       expert_tp=etp)
                fields.update(weights=weights * b, reference=reference * b, gradients=trained * 4,
                              optimizer_distributed=opt_dist, optimizer_replicated=opt, activations=act.total,
                              logprob_chunk=chunk if stage == pp - 1 else 0)
            if (n, g) in engine_gpus:
                fields.update(vllm=vllm, engine_weights=engine_weights, kv_cache=max(vllm - engine_weights, 0))
            out.append(GPUMemory(n, g, rank, **fields))
    return out


def format_experts(cfg: PlannedRecipe, hf: dict[str, Any]) -> str | None:
    """One line on how a mixture-of-experts policy's experts are split (None for a dense model): experts per GPU
    of the actor (E / EP, each linear over expert TP), the groups its optimizer state is sharded over, the nodes
    the first expert-parallel group spans (megatron-core's expert rank order: expert TP fastest, then EP, then
    expert DP, then PP) and the engines' split over their k GPUs: by default vLLM's tensor parallelism shards every
    expert's linear layers; with ``rollout.enable_expert_parallel`` each GPU holds E / k whole experts (vLLM's
    EP size = engine TP x DP, DP 1 here). Either way an engine GPU holds ``P / k`` of the weights, the ``vLLM-w``
    column of :func:`estimate_memory`."""
    experts, top_k, _ = moe_shape(hf)
    if not experts:
        return None
    p, t = cfg.parallel, cfg.trainer
    dp, ep, etp = p.data_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel
    nodes = sorted({r // t.devices_per_node for r in range(etp * ep)})
    return (f"experts: {experts} per layer, top-{top_k}; actor EP{ep} x expert TP{etp}: {experts // ep} experts per "
            f"GPU; optimizer state: experts over expert-DP {expert_data_parallel_size(p)}, the rest over DP{dp}; "
            f"an EP group spans node(s) {','.join(map(str, nodes))}; {_engine_experts(cfg.rollout, experts)}")


def _engine_experts(r, experts: int) -> str:
    """The engines' part of :func:`format_experts`."""
    k = r.tensor_parallel_size
    if r.enable_expert_parallel:
        split = f"vLLM EP{k} (rollout.enable_expert_parallel): {experts // k} whole experts per engine GPU"
    else:
        split = f"every expert split over TP{k}"
    return f"engines: {split}, attention over TP{k}; engine weights per GPU = all weights / {k} either way"


def format_memory(rows: list[GPUMemory], gpu_memory_gib: float) -> str:
    """The estimate as a table in GiB, one line per GPU, with each GPU's peak against ``gpu_memory_gib``."""
    head = (f"{'node':>4} {'GPU':>3} {'rank':>4} {'weights':>7} {'ref':>6} {'grads':>6} {'optim':>6} "
            f"{'optim':>6} {'activ':>6} {'lp-chunk':>8} {'vLLM':>6} {'vLLM-w':>6} {'KV':>6} {'peak':>6}  verdict")
    sub = f"{'':>4} {'':>3} {'':>4} {'':>7} {'':>6} {'':>6} {'dist':>6} {'repl':>6}"
    lines = [f"memory per GPU (GiB, estimate; megatron_gigpo/cluster/memory.py), against {gpu_memory_gib:g} GiB:", head, sub]
    over = 0
    for m in rows:
        def gib(x: int) -> str:
            return f"{x / GIB:.1f}"

        star = ("*", "") if m.distributed_optimizer else ("", "*")
        fits = m.peak <= gpu_memory_gib * GIB
        over += not fits
        verdict = "fits" if fits else f"OVER by {(m.peak - gpu_memory_gib * GIB) / GIB:.1f}"
        lines.append(
            f"{m.node:>4} {m.gpu:>3} {'-' if m.rank is None else m.rank:>4} {gib(m.weights):>7} {gib(m.reference):>6} "
            f"{gib(m.gradients):>6} {gib(m.optimizer_distributed) + star[0]:>6} "
            f"{gib(m.optimizer_replicated) + star[1]:>6} {gib(m.activations):>6} {gib(m.logprob_chunk):>8} "
            f"{gib(m.vllm):>6} {gib(m.engine_weights):>6} {gib(m.kv_cache):>6} {gib(m.peak):>6}  {verdict}")
    lines.append("* = the recipe's optimizer (parallel.use_distributed_optimizer); peak = weights + ref + grads + "
                 "optim* + max(activ + lp-chunk, vLLM); activ: the update's activations (actor.recompute_*, "
                 "parallel.sequence_parallel, trainer.micro_batch_tokens)")
    if over:
        lines.append(f"{over} GPU(s) over {gpu_memory_gib:g} GiB")
    return "\n".join(lines)


def memory_refusal(rows: list[GPUMemory], gpu_memory_gib: float) -> str | None:
    """None when every GPU's peak fits in ``gpu_memory_gib``; else one line naming the GPU most over, what runs
    there, by how much, and the settings that lower its larger part (the actor's update or vLLM)::

        2 of 8 GPU(s) over 80 GiB; OVER by 35.4 GiB on node 0 GPU 0 (actor rank 0 and a vLLM engine: the
        update needs 115.4 GiB); lower trainer.micro_batch_tokens, ...
    """
    limit = gpu_memory_gib * GIB
    over = [m for m in rows if m.peak > limit]
    if not over:
        return None
    worst = max(over, key=lambda m: m.peak)
    roles = [f"actor rank {worst.rank}"] if worst.rank is not None else []
    roles += ["a vLLM engine"] if worst.vllm else []
    if worst.rank is not None and worst.update >= worst.actor + worst.vllm:
        part = f"the update needs {worst.update / GIB:.1f} GiB"
        advice = ("lower trainer.micro_batch_tokens, set actor.recompute_granularity=full (with recompute_method and "
                  "recompute_num_layers) or parallel.sequence_parallel=true (TP > 1), raise "
                  "parallel.tensor_model_parallel_size / pipeline_model_parallel_size"
                  + ("" if worst.distributed_optimizer else " or set parallel.use_distributed_optimizer=true"))
    else:
        part = f"the actor's state and vLLM need {(worst.actor + worst.vllm) / GIB:.1f} GiB"
        advice = "lower rollout.gpu_memory_utilization (or the actor's state: raise TP / PP)"
    return (f"{len(over)} of {len(rows)} GPU(s) over {gpu_memory_gib:g} GiB; OVER by {(worst.peak - limit) / GIB:.1f} "
            f"GiB on node {worst.node} GPU {worst.gpu} ({' and '.join(roles)}: {part}); {advice}")
