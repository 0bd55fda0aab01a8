"""The run's own sections: ``trainer`` (:class:`TrainerConfig`: the training loop, mini-batches and token
budgets of every actor rank, devices and nodes, validation cadence, output folder; with ``trainer.timeouts``,
:class:`TimeoutsConfig`), ``logging`` (:class:`LoggingConfig`, the metric sinks of :mod:`megatron_gigpo.run.metrics`)
and ``checkpoint`` (:class:`CheckpointConfig`).

``trainer`` is read by the driver and :class:`~megatron_gigpo.builders.RunContext`, the actor ranks
(:class:`megatron_gigpo.actor.config.ActorConfig` holds it whole) and the placement plan (nodes, devices);
``trainer.timeouts`` by every blocking wait (:mod:`megatron_gigpo.deadlines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.fields import MAX_SEED, choice, num

__all__ = ["MAX_TIMEOUT_S", "TimeoutsConfig", "TrainerConfig", "LoggingConfig", "CheckpointConfig"]

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: any deadline must be finite


@dataclass
class TimeoutsConfig:
    """Deadlines in seconds of every blocking wait of the driver (``trainer.timeouts``). A wait that passes its
    deadline raises :class:`megatron_gigpo.deadlines.DeadlineError` naming what did not answer, on which node and
    after how long, except an environment call: that ends only its episode, as failed, and the run goes on."""

    placement_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # the actor ranks' placement group is reserved
    actor_start_s: float = num(1800.0, gt=0, le=MAX_TIMEOUT_S)  # ranks start, join, build and load the model
    engine_start_s: float = num(900.0, gt=0, le=MAX_TIMEOUT_S)  # vLLM engines start (weights, KV cache)
    rank_call_s: float = num(10800.0, gt=0, le=MAX_TIMEOUT_S)  # one log-prob, update or checkpoint call
    generate_s: float = num(3600.0, gt=0, le=MAX_TIMEOUT_S)  # one generate batch (a step of every episode)
    engine_call_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # engine sleep / wake-up / version queries
    env_call_s: float = num(300.0, gt=0, le=MAX_TIMEOUT_S)  # one environment reset or step
    weight_sync_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # one weight sync into every engine


@dataclass
class TrainerConfig:
    """The training loop; its mini-batch, micro-batch and seed settings are read by every actor rank
    (:class:`megatron_gigpo.actor.config.ActorConfig` holds this section)."""

    total_iterations: int = num(150, ge=1)
    ppo_mini_batch_size: int = num(256, ge=1)  # step rows per optimizer step
    ppo_epochs: int = num(1, ge=1)  # passes over the iteration's rows
    # Token budget of one update micro-batch, counted as rows x longest row (micro-batches are padded to it)
    micro_batch_tokens: int = num(16384, ge=1)
    log_prob_micro_batch_tokens: int = num(32768, ge=1)  # the same budget for forward-only log-prob passes
    # Response tokens per output-layer chunk: its (chunk, vocab / TP) fp32 logits are the head's largest
    # activation (1024 x 151,936 x 4 B = 594 MB at Qwen2.5's vocabulary and TP1; recomputed in backward)
    logprob_chunk_size: int = num(1024, ge=1)
    # Shuffle the rows before cutting mini-batches (seeded by seed, the update count and the epoch: a resumed
    # run shuffles identically)
    shuffle: bool = True
    # Pack rows into one THD sequence (PackedSeqParams) instead of padding; needs Transformer-Engine attention
    # (GPU): Megatron's local DotProductAttention refuses it at actor start
    sequence_packing: bool = False
    device: str = choice("cuda", ("cuda", "cpu"))
    nnodes: int = num(1, ge=1)
    devices_per_node: int = num(8, ge=1)  # GPUs per node; on CPU, actor processes
    seed: int = num(1, ge=0, le=MAX_SEED)
    val_every: int = num(5, ge=0)  # 0: never
    val_before_train: bool = True
    # Recompute the batch's log-probs after each update and report how they moved for rows of positive and of
    # negative advantage (actor/update_effect_*): one extra forward pass per iteration; for learning checks.
    update_effect_metrics: bool = False
    # recompute: the PPO ratio's denominator is the actor's log-probs of the batch before the update (one
    # forward pass) | rollout: the engines' sampling log-probs, no pass (megatron_gigpo.algo.rollout_correction)
    old_log_probs: str = choice("recompute", ("recompute", "rollout"))
    # Stale-engine alarm: after each weight sync, the mean |engine - actor| log-prob of the next batch's tokens
    # above this stops the run before the update (megatron_gigpo.run.stale_engine); null: the default of
    # model.dtype measured on healthy runs (stale_engine.DEFAULT_GAPS)
    stale_engine_gap: float | None = num(None, gt=0)
    output_dir: str = "runs"
    project_name: str = "megatron-gigpo"
    experiment_name: str = "default"
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_mode: str = choice("offline", ("online", "offline", "disabled"))
    progress_bars: bool = True


@dataclass
class CheckpointConfig:
    save_every: int = num(10, ge=0)  # 0: never
    keep_last: int = num(3, ge=1)
    dir: str | None = None  # default: <run dir>/checkpoints
    resume: bool = True  # resume from the latest complete checkpoint in dir
