"""One optimizer step per mini-batch on Megatron: policy-loss head (PPO, or supervised NLL, chosen by
``AlgorithmConfig.policy_loss``), gradient accumulation over token-budget micro-batches through Megatron's
schedules, DDP gradient reduction, clipping and the optimizer step.

Loss normalisation (why the scale factors): ``algo.losses.compute_actor_loss`` aggregates a micro-batch by
its ``loss_agg_mode`` (a mean over tokens or over sequences). The mini-batch objective is the same mean over
*all* its tokens / sequences, spread over micro-batches and data-parallel ranks, so a micro-batch's loss is
weighted by ``w = units(micro-batch) / units(mini-batch)`` (units = response tokens for ``token-mean``,
non-empty rows otherwise). Megatron's schedule divides each micro-batch loss by the local number of
micro-batches ``n`` and DDP averages gradients over the ``dp`` data-parallel ranks, so the loss handed to
the schedule is ``w * n * dp * loss``: the summed gradient is then exactly that of the mini-batch objective,
independent of how rows fall into micro-batches or ranks.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model
from torch.nn.utils.rnn import pad_sequence

from megatron_gigpo.actor.batching import MicroBatch
from megatron_gigpo.algo.config import AlgorithmConfig
from megatron_gigpo.actor.logprob import HeadSettings, forward_step_func, response_log_probs
from megatron_gigpo.actor.moe_metrics import moe_aux_loss_metrics
from megatron_gigpo.algo.losses import compute_actor_loss
from megatron_gigpo.algo.rollout_correction import correction_weights
from megatron_gigpo.algo.scatter import scatter_advantages_padded

if TYPE_CHECKING:
    from megatron_gigpo.actor.router_replay import ReplayedRouters

__all__ = ["RowData", "MiniBatchPlan", "train_mini_batch", "METRIC_KEYS"]

# metric -> how micro-batch values combine: "agg" (loss_agg_mode weight) or "token" (token weight)
_METRIC_WEIGHTS = {
    "loss": "agg",
    "pg_loss": "agg",
    "nll": "agg",
    "entropy": "agg",
    "kl_loss": "agg",
    "pg_clipfrac": "token",
    "pg_clipfrac_lower": "token",
    "ppo_kl": "token",
}
METRIC_KEYS = tuple(_METRIC_WEIGHTS)


@dataclass
class RowData:
    """Per-row training inputs of the whole batch (identical on every rank).

    Attributes:
        old_log_probs: per row float32 (R_i,): behaviour-policy log-probs; None for an on-policy update
            (:func:`megatron_gigpo.actor.batching.update_is_on_policy`): each micro-batch then uses its own
            detached log-probs, so the importance ratio is exactly 1.
        advantages: float32 (rows,): one advantage per row.
        ref_log_probs: per row float32 (R_i,) reference log-probs, or None without KL loss.
        rollout_log_probs: per row float32 (R_i,) engine sampling log-probs, or None; read when
            ``loss.rollout_correction.mode`` is not ``none``.
        old_is_rollout: ``old_log_probs`` are the engine's (``trainer.old_log_probs: rollout``).
    """

    old_log_probs: Sequence[torch.Tensor] | None
    advantages: torch.Tensor
    ref_log_probs: Sequence[torch.Tensor] | None
    rollout_log_probs: Sequence[torch.Tensor] | None = None
    old_is_rollout: bool = False


@dataclass
class MiniBatchPlan:
    """This rank's micro-batches of one mini-batch and the mini-batch totals the loss is normalised by.

    Attributes:
        micro_batches: this data-parallel rank's micro-batches (``rows`` index the whole batch).
        total_tokens: response tokens of the mini-batch over all data-parallel ranks.
        total_sequences: rows with at least one response token, over all data-parallel ranks.
        stand_in: this rank has no row of the mini-batch (fewer rows than data-parallel ranks); its one
            micro-batch is a row of another rank whose loss is multiplied by zero, so that this rank still runs
            the forward, backward, gradient reduction and optimizer collectives and contributes nothing.
    """

    micro_batches: list[MicroBatch]
    total_tokens: int
    total_sequences: int
    stand_in: bool = False


def _pad(values: Sequence[torch.Tensor]) -> torch.Tensor:
    return pad_sequence(list(values), batch_first=True)  # (B, R_max)


def _policy_loss_head(
    loss: AlgorithmConfig,
    head: HeadSettings,
    rows: RowData,
    plan: MiniBatchPlan,
    dp_size: int,
    mb: MicroBatch,
    gpt: torch.nn.Module,
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron loss function of one micro-batch (last pipeline stage).

    On-policy (``rows.old_log_probs is None``) its reported dict also holds ``"log_probs"``: the micro-batch's
    float32 (N,) response log-probs before the step, on the CPU (absent for a stand-in row)."""
    on_policy = rows.old_log_probs is None
    if mb.num_response_tokens == 0 or plan.stand_in or mb.stand_in:
        # only empty responses, or a stand-in row: nothing to learn, but Megatron's backward needs a loss
        # attached to the graph (a zero gradient, reduced with the other ranks' real ones)
        empty = {"log_probs": torch.zeros(0)} if on_policy and not plan.stand_in else {}
        return hidden.sum() * 0.0, empty
    device = hidden.device
    log_probs, entropy = response_log_probs(gpt, hidden, mb, head)  # (N,), (N,)
    lengths = mb.response_lengths
    log_prob = _pad(torch.split(log_probs, lengths))  # (B, R_max)
    mask = _pad([torch.ones(n, device=device) for n in lengths])  # (B, R_max)
    if on_policy:  # verl's on-policy shortcut: old = current, ratio 1, gradient that of the plain policy loss
        old = log_prob.detach()
    else:
        old = _pad([rows.old_log_probs[r].to(device, torch.float32) for r in mb.rows])
    ref = None
    if loss.use_kl_loss:
        ref = _pad([rows.ref_log_probs[r].to(device, torch.float32) for r in mb.rows])
    row_adv = rows.advantages[mb.rows].to(device, torch.float32)  # (B,)
    advantages = scatter_advantages_padded(row_adv, mask)  # (B, R_max)
    ent = _pad(torch.split(entropy, lengths)) if entropy is not None else None
    weights = _correction_weights(loss, rows, mb, log_prob, old, mask)
    value, metrics = compute_actor_loss(
        log_prob,
        old,
        advantages,
        mask,
        policy_loss=loss.policy_loss,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
        clip_ratio_c=loss.clip_ratio_c,
        loss_agg_mode=loss.loss_agg_mode,
        entropy=ent,
        entropy_coeff=loss.entropy_coeff,
        ref_log_prob=ref,
        kl_loss_type=loss.kl_loss_type,
        kl_loss_coef=loss.kl_loss_coef if loss.use_kl_loss else 0.0,
        token_weights=weights,
    )
    tokens = sum(lengths)
    sequences = sum(1 for n in lengths if n > 0)
    weights = {
        "token": tokens / max(plan.total_tokens, 1),
        "agg": (tokens / max(plan.total_tokens, 1))
        if loss.loss_agg_mode == "token-mean"
        else sequences / max(plan.total_sequences, 1),
    }
    metrics["loss"] = value.detach()
    reported = {
        k: (metrics[k].float() * weights[kind]).reshape(()) for k, kind in _METRIC_WEIGHTS.items() if k in metrics
    }
    if on_policy:
        reported["log_probs"] = log_probs.detach().float().cpu()
    scale = weights["agg"] * len(plan.micro_batches) * dp_size
    return value * scale, reported


def _correction_weights(loss: AlgorithmConfig, rows: RowData, mb: MicroBatch, log_prob: torch.Tensor,
                        old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """(B, R_max) mismatch-correction weights of micro-batch ``mb`` (:mod:`megatron_gigpo.algo.rollout_correction`),
    or None with ``rollout_correction.mode: none``. The actor's log-probs are ``old`` (recomputed, or on-policy the
    detached current ones), or with engine old log-probs the current policy's, detached."""
    rc = loss.rollout_correction
    if rc.mode == "none":
        return None
    if rows.rollout_log_probs is None:
        raise ValueError(f"algorithm.rollout_correction.mode={rc.mode} needs the engines' rollout_log_probs")
    engine = _pad([rows.rollout_log_probs[r].to(old.device, torch.float32) for r in mb.rows])
    prox = log_prob.detach() if rows.old_is_rollout else old
    weights, _ = correction_weights(prox, engine, mask, mode=rc.mode, level=rc.level, low=rc.low, high=rc.high,
                                    ratio_has_engine=rows.old_is_rollout)
    return weights


def _reduce_metrics(outputs: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, float]:
    """Sum the weighted micro-batch metrics over micro-batches, data-parallel ranks and pipeline stages."""
    local = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=device)
    present = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=device)
    for out in outputs:
        for i, key in enumerate(METRIC_KEYS):
            if key in out:
                local[i] += float(out[key])
                present[i] = 1.0
    stacked = torch.stack([local, present])  # (2, K)
    dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(stacked, group=parallel_state.get_pipeline_model_parallel_group())
    return {key: float(stacked[0, i]) for i, key in enumerate(METRIC_KEYS) if stacked[1, i] > 0}


def train_mini_batch(
    model_chunks: Sequence[torch.nn.Module],
    optimizer,
    plan: MiniBatchPlan,
    rows: RowData,
    loss: AlgorithmConfig,
    head: HeadSettings,
    device: torch.device,
    replay: "ReplayedRouters | None" = None,
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Gradient accumulation over ``plan``'s micro-batches, then exactly one optimizer step.

    The step uses the LR the scheduler set for the current update (:meth:`PolicyActor.update` advances it
    once per update, as verl does per training step).

    Args:
        model_chunks: DDP-wrapped model chunks of this rank.
        optimizer: Megatron optimizer (``get_megatron_optimizer``).
        plan: this rank's micro-batches and the mini-batch totals.
        rows: per-row old / reference log-probs and advantages of the whole batch.
        loss, head: loss and output-head settings.
        device: compute device of this rank.
        replay: routing replay: the policy's routers, replaying each micro-batch's routed experts (forward and the
            backward's recomputation); None: the routers choose.

    Returns:
        ``(metrics, log_probs)``. ``metrics``: ``{"loss", "entropy", "kl_loss", "grad_norm", "lr",
        "update_skipped"}`` plus the policy loss's metrics (``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl`` for ``vanilla``; ``nll`` for ``nll``) as floats, identical on every rank (mini-batch means);
        with a mixture-of-experts policy and ``moe_aux_loss_coeff > 0`` also ``moe_aux_loss``
        (:func:`~megatron_gigpo.actor.moe_metrics.moe_aux_loss_metrics`).
        ``log_probs``: on-policy (``rows.old_log_probs is None``) and on the last pipeline stage, per micro-batch
        of this rank, float32 (N_mb,) CPU response log-probs computed before the step, rows in micro-batch
        order; otherwise (and for a stand-in plan) an empty list.
    """
    if not plan.micro_batches:
        raise ValueError("train_mini_batch: this data-parallel rank has no micro-batch")
    for chunk in model_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    dp_size = parallel_state.get_data_parallel_world_size()
    loss_head = functools.partial(_policy_loss_head, loss, head, rows, plan, dp_size)
    fb = get_forward_backward_func()
    with replay.active() if replay is not None else contextlib.nullcontext():
        outputs = fb(
            forward_step_func=forward_step_func(loss_head, device, replay),
            data_iterator=iter(plan.micro_batches),
            model=list(model_chunks),
            num_microbatches=len(plan.micro_batches),
            seq_length=max(int(mb.input_ids.shape[1]) for mb in plan.micro_batches),
            micro_batch_size=max(int(mb.input_ids.shape[0]) for mb in plan.micro_batches),
            forward_only=False,
        )
    outputs = list(outputs) if parallel_state.is_pipeline_last_stage() else []
    metrics = _reduce_metrics(outputs, device)
    metrics.update(moe_aux_loss_metrics(unwrap_model(model_chunks[0]).config, len(plan.micro_batches)))
    log_probs = [out["log_probs"] for out in outputs if "log_probs" in out]
    update_successful, grad_norm, _ = optimizer.step()
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["update_skipped"] = 0.0 if update_successful else 1.0
    return metrics, log_probs
