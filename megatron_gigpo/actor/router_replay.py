"""Routing replay (``algorithm.router_replay: rollout``): the actor's MoE layers route every token to the experts
the rollout engine chose for it, through megatron-core's own router replay
(``megatron.core.transformer.moe.router_replay.RouterReplay``, on with ``TransformerConfig.moe_enable_routing_replay``:
each ``TopKRouter`` owns one instance; in ``REPLAY_FORWARD`` its top-k step takes the target indices and gathers
the router's scores at them, so the gates stay differentiable and Qwen3-MoE's renormalised softmax runs over the
replayed experts).

Layout of the replay targets: the engine returns, per row, the top-k expert ids of every token it ran through the
model, uint8 ``(T_i, L, K)`` (T_i = prompt + response - 1: the last response token is sampled, never fed back;
vLLM ``CompletionOutput.routed_experts``). :func:`micro_batch_targets` scatters them into the decoder's flat token
order of one micro-batch, int64 ``(L, S * B, K)``; tokens without an engine routing (each row's last token, padding)
get experts ``0 .. K-1``: they are causally after every position whose log-prob is read, so their routing changes
no log-prob. :class:`ReplayedRouters` sets a micro-batch's targets on this stage's routers before its forward and
counts, per layer, the tokens where the actor's own router would have chosen another expert set (the drift metric).

Limits: activation recomputation of full layers under pipeline parallelism would re-run a router after a later
micro-batch's targets were set; :func:`megatron_gigpo.algo.config.router_replay_errors` refuses it (and
dense models).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

__all__ = ["ROUTED_EXPERTS", "micro_batch_targets", "ReplayedRouters"]

#: The per-row extra of :class:`~megatron_gigpo.episodes.batch.TrainingBatch` holding the engine's routed experts.
ROUTED_EXPERTS = "routed_experts"


def micro_batch_targets(rows: Sequence[int], routed: Sequence[torch.Tensor], seq_lens: Sequence[int],
                        *, seq: int, packed_starts: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The replay targets of one micro-batch in the decoder's flat token order.

    Args:
        rows: the micro-batch's row ids (indices into ``routed`` / ``seq_lens``), in layout order.
        routed: per row of the batch, integer ``(T_i, L, K)`` expert ids of its first T_i tokens (T_i <= its length).
        seq_lens: per row, prompt + response tokens.
        seq: padded layout: the padded sequence length S; packed: the packed length T.
        packed_starts: packed (thd) layout: each row's first position in the packed sequence; None: padded.

    Returns:
        ``(targets, replayed)``: int64 ``(L, S * B, K)`` (padded, flat index ``position * B + b``) or ``(L, T, K)``
        (packed), and bool ``(S * B,)`` / ``(T,)``: the tokens whose experts came from the engine.

    Raises:
        ValueError: a row with more routed tokens than tokens, or rows with different (L, K).
    """
    shapes = {tuple(routed[r].shape[1:]) for r in rows}
    if len(shapes) != 1:
        raise ValueError(f"routed experts of rows {list(rows)} have different (layers, top-k): {sorted(shapes)}")
    (layers, topk), = shapes
    batch = 1 if packed_starts is not None else len(rows)
    tokens = seq * batch
    targets = torch.arange(topk, dtype=torch.int64).expand(layers, tokens, topk).clone()
    replayed = torch.zeros(tokens, dtype=torch.bool)
    for b, r in enumerate(rows):
        t = int(routed[r].shape[0])
        if t > seq_lens[r]:
            raise ValueError(f"row {r}: {t} routed tokens for a sequence of {seq_lens[r]} tokens")
        pos = torch.arange(t)
        flat = pos + packed_starts[b] if packed_starts is not None else pos * batch + b
        targets[:, flat] = routed[r].to(torch.int64).permute(1, 0, 2)
        replayed[flat] = True
    return targets, replayed


class ReplayedRouters:
    """This pipeline stage's MoE routers of one model chunk list, replaying the engine's experts.

    Args:
        model_chunks: the (DDP-wrapped) model chunks whose ``TopKRouter`` s were built with
            ``moe_enable_routing_replay=True``.
        num_layers: decoder layers of the whole model (the metric's per-layer length).

    Raises:
        ValueError: a router without megatron-core's replay (the model was built without
            ``moe_enable_routing_replay``), or no router at all.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], num_layers: int) -> None:
        self.routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("router replay: the model has no MoE router")
        if any(r.router_replay is None for r in self.routers):
            raise ValueError("router replay: routers built without TransformerConfig.moe_enable_routing_replay")
        self.num_layers = num_layers
        self._replayed: torch.Tensor | None = None
        self.counts = torch.zeros(2, num_layers, dtype=torch.float64)  # (differs, tokens) per layer

    def set_micro_batch(self, targets: torch.Tensor, replayed: torch.Tensor) -> None:
        """Replay ``targets`` (int64 (L, N, K), the micro-batch's whole flat token order) in the next forward; with
        sequence parallelism each router gets its tensor-parallel rank's contiguous slice of the N tokens."""
        if parallel_state.get_tensor_model_parallel_world_size() > 1 and self.routers[0].config.sequence_parallel:
            tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_rank())
            n = targets.shape[1] // tp
            targets, replayed = targets[:, rank * n:(rank + 1) * n], replayed[rank * n:(rank + 1) * n]
        for router in self.routers:
            router.router_replay.set_target_indices(targets[router.layer_number - 1])
        self._replayed = replayed

    def _count(self, router: TopKRouter, args: tuple, output: tuple) -> None:
        """Forward hook: tokens whose own top-k (the router's logits, as megatron-core ranks them) differs from the
        replayed experts, among the tokens the engine routed."""
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
            own = torch.zeros_like(output[1]).scatter_(1, logits.topk(router.topk, dim=1).indices, True)
            differs = (own != output[1]).any(dim=1)
            mask = self._replayed.to(differs.device) if self._replayed is not None else torch.ones_like(differs)
            self.counts[0, router.layer_number - 1] += float((differs & mask).sum())
            self.counts[1, router.layer_number - 1] += float(mask.sum())

    @contextlib.contextmanager
    def active(self) -> Iterator["ReplayedRouters"]:
        """Replay (and count) during one Megatron schedule over micro-batches; clears the targets afterwards."""
        hooks = [r.register_forward_hook(self._count) for r in self.routers]
        for r in self.routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
            for r in self.routers:
                r.router_replay.clear_router_replay_action()
                r.router_replay.clear_indices()
            self._replayed = None

    def metrics(self, device: torch.device, prefix: str = "actor/router_replay_mismatch") -> dict[str, float]:
        """Share of engine-routed tokens where the actor's own router, on the replayed pass's inputs, would choose
        another expert set: overall and per layer (``<prefix>``, ``<prefix>/layer_<i>``, i 0-based), and the number
        of engine-routed tokens counted (``actor/router_replay_tokens``), summed over data-parallel ranks, pipeline stages
        and (sequence parallelism) tensor-parallel ranks since the last call, which resets the counts. Collective
        over those groups."""
        counts = self.counts.clone().to(device)  # a copy: the reduction must not alias the running counts
        groups = [parallel_state.get_data_parallel_group()]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            groups.append(parallel_state.get_pipeline_model_parallel_group())
        if parallel_state.get_tensor_model_parallel_world_size() > 1 and self.routers[0].config.sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        for group in groups:
            dist.all_reduce(counts, group=group)
        counts = counts.cpu()
        self.counts.zero_()
        out = {prefix: float(counts[0].sum() / counts[1].sum()) if counts[1].sum() > 0 else 0.0,
               "actor/router_replay_tokens": float(counts[1].max())}
        for i in range(self.num_layers):
            out[f"{prefix}/layer_{i}"] = float(counts[0, i] / counts[1, i]) if counts[1, i] > 0 else 0.0
        return out
