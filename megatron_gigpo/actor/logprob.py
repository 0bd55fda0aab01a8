"""Per-token log-probabilities and entropy of response tokens under Megatron TP / PP.

Three layers:

- :func:`vocab_parallel_log_probs`: log-softmax of the target token and the entropy from vocabulary-parallel
  logits (each TP rank holds V / TP columns); the full-vocabulary row never exists on one rank. The softmax
  normaliser and the target logit are summed over TP with Megatron's
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward, because every TP
  rank computes the same loss from the reduced values). Megatron's own ``vocab_parallel_cross_entropy``
  gives the same log-prob but overwrites its input logits in place and has no entropy, so we compose the
  differentiable version here and test it against Megatron's.
- :func:`response_log_probs`: applies ``GPTModel.output_layer`` to the decoder's final hidden states at
  response positions only, ``chunk_size`` tokens at a time; with autograd on, every chunk is recomputed in
  backward (``torch.utils.checkpoint``) so at most one (chunk, V / TP) logits block is alive. With sequence
  parallelism the decoder's output is split along the sequence over the TP ranks: it is gathered first
  (Megatron's ``gather_from_sequence_parallel_region``, whose backward hands each rank its slice of the
  gradient) and the output layer runs as without sequence parallelism (its input gradient all-reduced over TP),
  as ``GPTModel`` itself does for its last-token inference logits.
- :func:`forward_step_func` / :func:`run_forward_only`: the ``forward_step_func`` for Megatron's pipeline
  schedules (``get_forward_backward_func``) and the forward-only pass over token-budget micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import unwrap_model
from torch.utils.checkpoint import checkpoint

from megatron_gigpo.actor.batching import MicroBatch

if TYPE_CHECKING:
    from megatron_gigpo.actor.router_replay import ReplayedRouters

__all__ = [
    "vocab_parallel_log_probs",
    "response_log_probs",
    "final_hidden_states",
    "forward_step_func",
    "run_forward_only",
    "HeadSettings",
]


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and entropy of the softmax over a vocabulary split across TP ranks.

    Args:
        logits: float (N, V_local): this rank's columns ``[vocab_start, vocab_start + V_local)``.
        labels: int64 (N,): global token ids.
        tp_group: tensor-parallel group, or None when the logits hold the whole vocabulary.
        vocab_start: global id of this rank's first column.
        vocab_size: number of real tokens; columns at or beyond it (Megatron pads the embedding to a
            multiple of TP x 128) get probability 0.
        with_entropy: also return the entropy ``H = logZ - sum_v p_v z_v`` (nats).

    Returns:
        ``(log_probs, entropy)``, float32 (N,) each (entropy None unless requested), differentiable
        w.r.t. ``logits``.
    """
    logits = logits.float()
    local_vocab = logits.shape[-1]
    invalid = None
    if vocab_start + local_vocab > vocab_size:
        invalid = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) >= vocab_size
    with torch.no_grad():
        row_max = logits if invalid is None else logits.masked_fill(invalid, float("-inf"))
        row_max = row_max.max(dim=-1).values  # (N,)
        if tp_group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)  # (N, V_local), <= 0 on real columns
    exp = shifted.exp()
    if invalid is not None:
        exp = exp.masked_fill(invalid, 0.0)
    sum_exp = exp.sum(dim=-1)
    local_label = labels - vocab_start
    owned = (local_label >= 0) & (local_label < local_vocab)
    picked = shifted.gather(-1, local_label.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    if tp_group is not None:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)
        picked = reduce_from_tensor_model_parallel_region(picked, group=tp_group)
    log_z = sum_exp.log()  # (N,) log-partition relative to row_max
    log_probs = picked - log_z
    entropy = None
    if with_entropy:
        weighted = (exp * shifted).sum(dim=-1)  # sum_v exp(z_v - max) * (z_v - max), this rank's columns
        if tp_group is not None:
            weighted = reduce_from_tensor_model_parallel_region(weighted, group=tp_group)
        entropy = log_z - weighted / sum_exp
    return log_probs, entropy


def _tp_vocab_range(local_vocab: int) -> tuple[dist.ProcessGroup | None, int]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return None, 0
    rank = parallel_state.get_tensor_model_parallel_rank()
    return parallel_state.get_tensor_model_parallel_group(), rank * local_vocab


@dataclass(frozen=True)
class HeadSettings:
    """How :func:`response_log_probs` evaluates the output layer.

    Attributes:
        chunk_size: response tokens per output-layer chunk.
        temperature: logits are divided by it (the rollout's sampling temperature).
        vocab_size: real vocabulary size (HF ``config.vocab_size``); padded columns are masked.
        with_entropy: compute entropy.
        entropy_grad: keep entropy in the autograd graph (entropy bonus); otherwise it is detached.
    """

    chunk_size: int
    temperature: float
    vocab_size: int
    with_entropy: bool
    entropy_grad: bool


def response_log_probs(
    gpt: torch.nn.Module, hidden: torch.Tensor, mb: MicroBatch, head: HeadSettings
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``mb``'s response tokens from the last stage's final hidden states.

    Args:
        gpt: the (unwrapped) last-stage ``GPTModel``.
        hidden: (S, B, H) decoder output after the final norm (see :func:`final_hidden_states`); (S / TP, B, H),
            this rank's slice of the sequence, with ``gpt.config.sequence_parallel``.
        mb: the micro-batch that produced ``hidden``.
        head: chunking / temperature / entropy settings.

    Returns:
        float32 (N,) log-probs and (N,) entropy or None, N = ``mb.num_response_tokens``, in row-major order.
    """
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    if gpt.config.sequence_parallel:  # the whole sequence on every TP rank; backward: each rank's slice
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (S * B, H)
    selected = flat.index_select(0, mb.hidden_index)  # (N, H)

    def chunk_fn(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _whole_sequence(gpt.output_layer):  # inside: also while torch.utils.checkpoint recomputes it
            logits, _ = gpt.output_layer(h.unsqueeze(1), weight=weight, runtime_gather_output=False)
        logits = logits.squeeze(1).float()  # (c, V / TP)
        if head.temperature != 1.0:
            logits = logits / head.temperature
        tp_group, vocab_start = _tp_vocab_range(logits.shape[-1])
        log_probs, entropy = vocab_parallel_log_probs(
            logits, labels, tp_group=tp_group, vocab_start=vocab_start, vocab_size=head.vocab_size,
            with_entropy=head.with_entropy,
        )
        if entropy is not None and not head.entropy_grad:
            entropy = entropy.detach()
        return log_probs, entropy

    recompute = torch.is_grad_enabled() and selected.requires_grad
    log_prob_chunks, entropy_chunks = [], []
    for start in range(0, selected.shape[0], head.chunk_size):
        h = selected[start : start + head.chunk_size]
        labels = mb.labels[start : start + head.chunk_size]
        if recompute:
            lp, ent = checkpoint(chunk_fn, h, labels, use_reentrant=False)
        else:
            lp, ent = chunk_fn(h, labels)
        log_prob_chunks.append(lp)
        entropy_chunks.append(ent)
    if not log_prob_chunks:  # rows with empty responses only
        empty = selected.new_zeros(0, dtype=torch.float32)
        return empty, (empty if head.with_entropy else None)
    log_probs = torch.cat(log_prob_chunks)
    entropy = torch.cat(entropy_chunks) if head.with_entropy else None
    return log_probs, entropy


@contextlib.contextmanager
def _whole_sequence(output_layer: torch.nn.Module) -> Iterator[None]:
    """Run Megatron's ``ColumnParallelLinear`` on an input that every TP rank holds whole (its sequence-parallel
    mode would all-gather the input along the sequence): the input gradient is then all-reduced over TP."""
    saved = output_layer.sequence_parallel
    output_layer.sequence_parallel = False
    try:
        yield
    finally:
        output_layer.sequence_parallel = saved


@contextlib.contextmanager
def final_hidden_states(gpt: torch.nn.Module) -> Iterator[None]:
    """Make ``GPTModel.forward`` return the final-norm hidden states (S, B, H) instead of logits.

    ``GPTModel._postprocess`` applies the output layer only when ``post_process`` is set (the final norm
    belongs to the decoder block and still runs); clearing the flag for the duration of one forward lets
    :func:`response_log_probs` apply the output layer itself, to response positions only and in chunks.
    """
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


# (mb, gpt, hidden) -> (loss, reduced dict), called on the last pipeline stage only
LossHead = Callable[[MicroBatch, torch.nn.Module, torch.Tensor], tuple[torch.Tensor, dict]]


def forward_step_func(loss_head: LossHead, device: torch.device, replay: "ReplayedRouters | None" = None) -> Callable:
    """A Megatron ``forward_step_func(data_iterator, model)`` over :class:`MicroBatch` items.

    Every stage runs the model; on the last stage the returned loss function is ``loss_head(mb, gpt,
    hidden)`` (Megatron calls it only there). With ``replay`` (routing replay, inside ``replay.active()``) each
    micro-batch's :attr:`MicroBatch.routed_experts` are set on the routers before its forward.

    Raises (in the step): ValueError: ``replay`` given and a micro-batch without routed experts.
    """

    def step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator).to(device)
        if replay is not None:
            if mb.routed_experts is None:
                raise ValueError(f"router replay: micro-batch of rows {mb.rows} has no routed experts")
            replay.set_micro_batch(*mb.routed_experts)
        gpt = unwrap_model(model)
        context = final_hidden_states(gpt) if gpt.post_process else contextlib.nullcontext()
        with context:
            output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        return output, functools.partial(loss_head, mb, gpt)

    return step


def _forward_only_head(head: HeadSettings, mb: MicroBatch, gpt: torch.nn.Module, hidden: torch.Tensor):
    log_probs, entropy = response_log_probs(gpt, hidden, mb, head)
    out = {"log_probs": log_probs.float().cpu()}
    if entropy is not None:
        out["entropy"] = entropy.float().cpu()
    return torch.zeros((), device=hidden.device), out


def run_forward_only(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    head: HeadSettings,
    device: torch.device,
    replay: "ReplayedRouters | None" = None,
) -> list[dict[str, torch.Tensor]]:
    """One forward-only pass (Megatron schedule) over ``micro_batches``; with ``replay``, the MoE layers route
    every token to the micro-batch's :attr:`MicroBatch.routed_experts` (routing replay).

    Returns:
        On the last pipeline stage, per micro-batch ``{"log_probs": (N_mb,), "entropy": (N_mb,)}`` float32
        on the CPU (entropy only if ``head.with_entropy``); an empty list on other stages.

    Raises:
        ValueError: no micro-batches (Megatron's schedules need at least one).
    """
    if not micro_batches:
        raise ValueError("run_forward_only needs at least one micro-batch")
    for chunk in model_chunks:
        chunk.eval()
    fb = get_forward_backward_func()
    with torch.no_grad(), (replay.active() if replay is not None else contextlib.nullcontext()):
        outputs = fb(
            forward_step_func=forward_step_func(functools.partial(_forward_only_head, head), device, replay),
            data_iterator=iter(micro_batches),
            model=list(model_chunks),
            num_microbatches=len(micro_batches),
            seq_length=max(int(mb.input_ids.shape[1]) for mb in micro_batches),
            micro_batch_size=max(int(mb.input_ids.shape[0]) for mb in micro_batches),
            forward_only=True,
        )
    return list(outputs) if parallel_state.is_pipeline_last_stage() else []
