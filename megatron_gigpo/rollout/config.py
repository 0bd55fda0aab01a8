"""The recipe's ``rollout`` section (:class:`RolloutConfig`): the vLLM engines, their sampling, the per-step
prompt budget and how the weights reach them. Passed whole to the engines
(:class:`megatron_gigpo.rollout.engine.EngineConfig`); the placement plan reads the engine count, tensor-parallel
size and ``weight_sync_mode`` (:mod:`megatron_gigpo.cluster.placement`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.fields import choice, num

__all__ = ["WEIGHT_SYNC_MODES", "RolloutConfig"]

#: ``colocated``: engines share the actor ranks' GPUs and sleep while they train (verl's hybrid engine);
#: ``disaggregated``: engines on GPUs of their own.
WEIGHT_SYNC_MODES = ("colocated", "disaggregated")


@dataclass
class RolloutConfig:
    """vLLM rollout engines and sampling, passed whole to :class:`megatron_gigpo.rollout.engine.EngineConfig`.
    ``n`` is the GiGPO group size (rollouts per task); an engine's context is ``prompt_length +
    response_length`` tokens."""

    n: int = num(8, ge=1)
    # auto (or null): one engine per tensor_parallel_size devices of the recipe (colocated: engines on every GPU;
    # disaggregated GPU: on the GPUs the actor leaves), decided when the recipe is loaded
    num_engines: int | None = num(1, ge=1, auto=True)
    tensor_parallel_size: int = num(1, ge=1)
    temperature: float = num(1.0, gt=0)  # > 0: the actor divides its logits by it
    top_p: float = num(1.0, gt=0, le=1)
    top_k: int = num(-1, ge=-1)  # -1 or 0: all tokens
    prompt_length: int = num(2048, ge=1)  # tokens; longer prompts are truncated by the documented policy
    # end_episode | error: when even the fully truncated prompt (rules, task, admissible actions) exceeds
    # prompt_length, end only that trajectory at that step, or stop the run (megatron_gigpo.episodes.prompts)
    prompt_overflow: str = choice("end_episode", "megatron_gigpo.episodes.prompts:PROMPT_OVERFLOW_POLICIES")
    response_length: int = num(512, ge=1)  # max new tokens per step
    stop: list[str] = field(default_factory=list)
    val_temperature: float = num(0.0, ge=0)  # 0: greedy
    gpu_memory_utilization: float = num(0.6, gt=0, le=1)  # CUDA: share of GPU memory for weights + KV cache
    cpu_kvcache_space_gib: float = num(2.0, gt=0)  # CPU: KV cache per engine, GiB (vLLM kv_cache_memory_bytes)
    enforce_eager: bool = False  # CUDA: no CUDA graphs (always eager on CPU)
    weight_sync_mode: str = choice("colocated", WEIGHT_SYNC_MODES)
    bucket_size_mb: int = num(512, ge=1)
