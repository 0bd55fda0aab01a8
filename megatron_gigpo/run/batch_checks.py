"""Checks of one training batch around the update, read by the driver through
:class:`~megatron_gigpo.builders.RunContext`: the engines' log-probs against the actor's before the update
(:func:`engine_check`, :func:`rollout_actor_gap`, the stale-engine alarm of :mod:`.stale_engine`; under
asynchronous rollout :func:`engine_probe` after the sync) and how the update moved the batch's own log-probs
(:func:`update_effect`)."""

from __future__ import annotations

__all__ = ["engine_check", "engine_probe", "rollout_actor_gap", "update_effect"]


def engine_check(cfg, actors, batch, weights_version: int, actor_log_probs=None, *, lagged: bool = False
                 ) -> dict[str, float]:
    """The engines' log-probs of ``batch`` against the actor's, before the update: the gap and mismatch metrics
    (:func:`rollout_actor_gap`, :func:`~megatron_gigpo.algo.rollout_correction.mismatch_metrics`) and the
    stale-engine alarm (:mod:`megatron_gigpo.run.stale_engine`).

    Args:
        cfg: the run's :class:`~megatron_gigpo.config.Config`.
        actors: the :class:`~megatron_gigpo.actor.group.ActorGroup` (asked for log-probs only when
            ``actor_log_probs`` is None).
        batch: the training batch; its ``engine`` and ``weight_version`` extras name each row's engine and version.
        weights_version: the policy version the engines were last synced to.
        actor_log_probs: the actor's log-probs of every row (the recomputed old log-probs), or None: then the
            actor computes those of a probe of each engine's first rows (:func:`~megatron_gigpo.run.
            stale_engine.probe_rows`, one small forward pass).
        lagged: the batch was sampled by older policy versions (asynchronous rollout): only the mismatch metrics,
            which then measure behaviour against proximal policy (mismatch plus policy lag); the engines are
            checked after the sync instead (:func:`engine_probe`).
    Raises:
        StaleEngineError: an engine's gap is above ``trainer.stale_engine_gap`` (without top-k / top-p).
    """
    from megatron_gigpo.algo.rollout_correction import mismatch_metrics
    from megatron_gigpo.run import stale_engine

    n = batch.num_rows
    engine_of, versions_of = batch.extras.get("engine", [0] * n), batch.extras.get("weight_version", [0] * n)
    rows = list(range(n))
    if actor_log_probs is None:
        rows = stale_engine.probe_rows(engine_of)
        actor_log_probs = actors.compute_log_probs(batch.select(rows))
    engine_lp = [batch.rollout_log_probs[i] for i in rows]
    rc = cfg.algorithm.rollout_correction
    metrics = mismatch_metrics(actor_log_probs, engine_lp, mode=rc.mode, level=rc.level, low=rc.low, high=rc.high)
    if lagged:
        return metrics
    metrics |= rollout_actor_gap(batch.select(rows), actor_log_probs)
    _alarm(cfg, engine_lp, actor_log_probs, [engine_of[i] for i in rows], [versions_of[i] for i in rows],
           weights_version)
    return metrics


def engine_probe(cfg, actors, engines, sampling, batch, weights_version: int) -> dict[str, float]:
    """Asynchronous rollout, right after the sync to ``weights_version`` (docs/async-rollout-design.md D6): the
    prompts of ``batch``'s probe rows (:func:`~megatron_gigpo.run.stale_engine.probe_rows`) generated again by
    the engines (:func:`~megatron_gigpo.run.stale_engine.probe_sampling` of the training ``sampling``), scored by
    the actor (at the same version), then :func:`rollout_actor_gap` and the stale-engine alarm on those.

    Returns:
        ``rollout/actor_logprob_diff_max`` and ``_mean`` of the probe.
    Raises:
        StaleEngineError: an engine's gap is above ``trainer.stale_engine_gap`` (without top-k / top-p).
    """
    from megatron_gigpo.run import stale_engine

    rows = stale_engine.probe_rows(batch.extras.get("engine", [0] * batch.num_rows))
    results = engines.generate([batch.prompt_ids[i].tolist() for i in rows],
                               stale_engine.probe_sampling(sampling, cfg.trainer.seed))
    probe = stale_engine.probe_batch(batch, rows, results)
    actor_log_probs = actors.compute_log_probs(probe)
    _alarm(cfg, probe.rollout_log_probs, actor_log_probs, probe.extras["engine"], probe.extras["weight_version"],
           weights_version, probe=True)
    return rollout_actor_gap(probe, actor_log_probs)


def _alarm(cfg, engine_lp, actor_lp, engine_of, versions_of, weights_version: int, *, probe: bool = False) -> None:
    """The stale-engine alarm on rows of per-row engine indices ``engine_of`` and weight versions ``versions_of``
    (armed without top-k / top-p only)."""
    from megatron_gigpo.run import stale_engine

    if not stale_engine.armed(cfg.rollout.top_p, cfg.rollout.top_k):
        return
    versions: dict[int, set[int]] = {}
    for e, v in zip(engine_of, versions_of, strict=True):
        versions.setdefault(int(e), set()).add(int(v))
    threshold = stale_engine.gap_threshold(cfg.trainer.stale_engine_gap, cfg.model.params_dtype(cfg.trainer.device))
    stale_engine.check_engines(stale_engine.engine_gaps(engine_lp, actor_lp, engine_of), versions, weights_version,
                               threshold, probe=probe)


def rollout_actor_gap(batch, actor_log_probs) -> dict[str, float]:
    """How far vLLM's sampling log-probs are from the actor's on the same tokens and weights.

    A sync that failed to reach the engines shows up here at once (the engines would sample from
    stale weights); otherwise the gap is numerical noise (fp32 ~1e-4, bf16 ~1e-2).
    """
    import torch

    diffs = [(r.float() - a.float()).abs() for r, a in zip(batch.rollout_log_probs, actor_log_probs) if r.numel()]
    if not diffs:
        return {}
    d = torch.cat(diffs)
    return {"rollout/actor_logprob_diff_max": float(d.max()), "rollout/actor_logprob_diff_mean": float(d.mean())}


def update_effect(actors, batch, row_advantages, old_log_probs) -> dict[str, float]:
    """How the update moved the batch's own log-probs, by the sign of each row's advantage.

    Recomputes the policy's log-probs of the batch (one forward pass of ``actors``) and compares them with the
    log-probs it had before the update (``old_log_probs``), per row as the mean over response tokens.

    Returns:
        ``actor/update_effect_pos`` and ``actor/update_effect_neg``: mean log-prob change (nats per token)
        of rows with positive / negative advantage (absent when there is no such row), and
        ``actor/update_effect_corr``: Pearson correlation of row advantage and row change (0 when either
        is constant). A correct policy-gradient update gives pos > 0 > neg and a positive correlation.
    """
    import torch

    new_log_probs = actors.compute_log_probs(batch)
    rows = [i for i, lp in enumerate(old_log_probs) if lp.numel()]
    delta = torch.tensor([float((new_log_probs[i] - old_log_probs[i]).double().mean()) for i in rows],
                         dtype=torch.float64)
    adv = row_advantages.double().cpu()[rows]
    out: dict[str, float] = {}
    for name, sel in (("pos", adv > 0), ("neg", adv < 0)):
        if bool(sel.any()):
            out[f"actor/update_effect_{name}"] = float(delta[sel].mean())
    corr = 0.0
    if len(rows) > 1 and float(adv.std()) > 0 and float(delta.std()) > 0:
        corr = float(torch.corrcoef(torch.stack([adv, delta]))[0, 1])
    out["actor/update_effect_corr"] = corr
    return out
