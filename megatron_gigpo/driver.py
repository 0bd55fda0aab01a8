"""The GiGPO training loop: a Ray single controller that reads top to bottom.

One iteration: collect grouped episodes (vLLM engines x environment workers) -> old and reference
log-probs (Megatron actor; no old log-prob pass when the update is one optimizer step, which then computes
them itself, or with ``trainer.old_log_probs: rollout``, which takes the engines') -> stale-engine check ->
advantages (GiGPO registry) -> clipped updates -> resharding of the new weights into the
engines -> periodic validation and checkpoint. Construction of the parts lives in
:mod:`megatron_gigpo.builders`; this file only orders them.

With ``rollout.asynchronous.enabled`` the rollout is a producer thread (:mod:`megatron_gigpo.run.async_rollout`)
that collects the next iterations' batches, at most ``max_staleness`` policy versions behind, while the actor
trains: the collection step takes its item, the engines never sleep, and the sync, a probe of the engines on
the new version (the stale-engine alarm) and validation run inside ``run.engines_paused()``.
"""

from __future__ import annotations

import logging
import time

from megatron_gigpo.config import Config

log = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, float]:
    """Train ``cfg`` to ``trainer.total_iterations``, resuming from the latest checkpoint if any.

    Returns the metrics of the last iteration. An iteration without training rows (its episodes all failed,
    or dynamic sampling found no informative group within its round limit) logs its rollout metrics and skips
    its update and weight sync; it still validates and saves when due, so every validation point exists.

    Inside :func:`megatron_gigpo.run.preemption.stop_on_signals` (``megatron-gigpo train``), a stop signal ends
    the loop at the next safe point (an iteration whose rollout it interrupts is abandoned, one past its rollout
    finishes), after a checkpoint of the last completed iteration.

    Raises:
        PreflightError: before starting anything, when the machine lacks what the recipe needs.
        StoppedBySignal: a stop signal ended the run early, after its checkpoint; Ray and the ranks are stopped.
    """
    from megatron_gigpo.builders import RunContext
    from megatron_gigpo.run.preemption import StoppedBySignal, requested

    with RunContext(cfg) as run:  # preflight, Ray, actor ranks, engines, environment workers, logger
        metrics: dict[str, float] = {}
        for it in range(run.start_iteration, cfg.trainer.total_iterations):
            step_metrics = None if requested() else _iteration(run, it)
            if step_metrics is None:  # a stop signal: `it` iterations are complete
                checkpoint = run.stop_checkpoint(it)
                break
            metrics = step_metrics
        else:
            return metrics
    raise StoppedBySignal(requested(), "train", it, checkpoint)


def _iteration(run, it: int) -> dict[str, float] | None:
    """Iteration ``it`` (0-based): rollout, log-probs, advantages, update, weight sync, validation and checkpoint
    when due, its metrics logged as step ``it + 1``. None (nothing logged) when a stop signal came during the
    rollout."""
    from megatron_gigpo.actor.batching import update_is_on_policy
    from megatron_gigpo.algo.advantages import compute_advantages

    cfg = run.cfg
    timer = run.timer()
    with timer("rollout"):
        collected = run.collect_train_batch(it)
    if collected is None:
        return None
    batch, metrics = collected
    if batch.num_rows == 0:  # every episode failed (worker crashes, prompts that cannot fit) or was filtered
        log.warning("iteration %d: no training rows (%d episodes failed, %d groups filtered by dynamic "
                    "sampling); no update", it + 1, int(metrics["episode/failed"]),
                    round(metrics.get("dynamic_sampling/filtered_group_frac", 0.0)
                          * cfg.env.num_groups * metrics.get("dynamic_sampling/rounds", 0.0)))
        metrics |= _sync_validate_save(run, timer, it, None)
        metrics |= timer.metrics(num_tokens=0)
        run.log(metrics, it + 1)
        return metrics
    if run.producer is None:  # asynchronous rollout: the engines generate the next batches meanwhile
        run.engines.sleep()  # GPU: free the KV cache while the actor computes (no-op on CPU)
    old_log_probs = None  # on-policy (one optimizer step): the update computes them itself, as verl does
    recompute = cfg.trainer.old_log_probs == "recompute"
    if not recompute:  # the PPO ratio's denominator is the engines' sampling log-probs: no pass
        old_log_probs = list(batch.rollout_log_probs)
    elif not update_is_on_policy(batch.num_rows, cfg.trainer):
        with timer("old_log_prob"):
            old_log_probs = run.actors.compute_log_probs(batch)
    with timer("engine_check"):  # stale-engine alarm and mismatch metrics, before the update
        metrics |= run.engine_check(batch, old_log_probs if recompute else None)
    ref_log_probs = None
    if cfg.algorithm.use_kl_loss:
        with timer("ref_log_prob"):
            ref_log_probs = run.actors.compute_log_probs(batch, reference=True)
    with timer("advantage"):
        adv = compute_advantages(cfg.algorithm.adv_estimator, batch.advantage_inputs(), cfg.algorithm)
    with timer("update"):
        update_metrics, old_log_probs = run.actors.update(batch, adv.advantage, old_log_probs, ref_log_probs)
        metrics |= update_metrics
    if cfg.trainer.update_effect_metrics:
        with timer("update_effect"):
            metrics |= run.update_effect(batch, adv.advantage, old_log_probs)
    metrics |= _sync_validate_save(run, timer, it, batch)
    metrics |= run.advantage_metrics(adv)
    metrics |= timer.metrics(num_tokens=run.num_tokens(batch))
    run.log(metrics, it + 1)
    return metrics


def _sync_validate_save(run, timer, it: int, batch) -> dict[str, float]:
    """The end of iteration ``it``: weight sync to version ``it + 1`` when it trained on ``batch`` (under
    asynchronous rollout always, so that policy versions count iterations), then the engines' wake-up, or under
    asynchronous rollout the post-sync probe of the stale-engine alarm, and validation when ``trainer.val_every``
    says so, all inside ``run.engines_paused()`` (no rollout round runs there); then the checkpoint when
    ``checkpoint.save_every`` says so. Returns the sync, probe and validation metrics."""
    iteration, metrics = it + 1, {}
    with run.engines_paused():
        if batch is not None or run.producer is not None:
            with timer("resharding"):
                metrics |= run.sync_weights(version=iteration)
        if run.producer is None and batch is not None:
            run.engines.wake_up()
        elif batch is not None:
            with timer("engine_probe"):
                metrics |= run.probe_engines(batch)
        if run.should_validate(iteration):
            with timer("validation"):
                metrics |= run.validate(iteration)
    if run.should_save(iteration):
        with timer("checkpoint"):
            run.save_checkpoint(iteration)
    return metrics


def evaluate(cfg: Config, checkpoint: str) -> dict[str, float]:
    """Greedy validation of a checkpoint on the recipe's validation tasks.

    Args:
        checkpoint: a checkpoint directory written by ``train`` (``.../checkpoints/iter_0000010``) or the
            ``checkpoints`` root (the latest complete one is used).
    """
    from megatron_gigpo.builders import RunContext

    start = time.perf_counter()
    with RunContext(cfg, load_checkpoint=checkpoint, training=False) as run:  # loads and syncs the weights
        metrics = run.validate(run.start_iteration)
    metrics["timing/eval_s"] = time.perf_counter() - start
    return metrics
