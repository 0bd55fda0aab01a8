"""The communication of :func:`megatron_gigpo.models.weights.export_hf_weights`: one bucket of HF tensors at a time.

Dense parameters come from data-parallel replica 0: each pipeline stage's tensor-parallel ranks send their shards
to the stage's TP-rank-0, which merges them into HF tensors. Routed experts come from expert-data-parallel rank 0
(megatron-core's expert groups, ``parallel_state.get_expert_*``): an expert lives on one expert-parallel (EP) rank;
its expert-tensor-parallel (ETP) ranks send their shards to ETP-rank-0 of that EP rank, which merges them and sends
the HF tensors to EP-rank-0 of the stage over the expert-parallel group. In megatron-core's rank order the stage's
dense TP-rank-0 of DP-rank-0 is also its ETP-0 / EP-0 / expert-DP-0 rank (checked), so that rank ends up with every
tensor of its stage in the bucket and, unless it receives them itself, sends them on over the pipeline group.
Every message is a ``torch.distributed.batch_isend_irecv`` batch (gloo or NCCL); no rank holds more than one
bucket of HF tensors (plus its own stage's staging buffer) at a time.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_gigpo.models.mapping import ShardLayout, TensorRule

__all__ = ["ExportEntry", "BucketGather", "buckets_of", "broadcast_bucket", "export_device"]

_ALIGN_BYTES = 64  # every shard view in a flat buffer starts aligned for any dtype


class ExportEntry(NamedTuple):
    """One exported parameter: its owner pipeline stage, shard shape, export dtype, HF tensors and, for a routed
    expert, the expert-parallel rank that holds it (``-1`` for a dense parameter)."""

    name: str
    stage: int
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    hf_parts: list[tuple[str, tuple[int, ...]]]
    ep_owner: int = -1

    @property
    def local_nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


def buckets_of(plan: list[ExportEntry], bucket_size_bytes: int) -> list[list[ExportEntry]]:
    """``plan`` cut in order into buckets of at most ``bucket_size_bytes`` of HF tensors (one oversized entry alone)."""
    buckets, current, size = [], [], 0
    for entry in plan:
        nbytes = sum(torch.Size(shape).numel() for _, shape in entry.hf_parts) * entry.dtype.itemsize
        if current and size + nbytes > bucket_size_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def export_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def broadcast_bucket(
    entries: list[ExportEntry], tensors: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """Global rank 0's HF tensors of one bucket (``tensors``, ignored elsewhere) on every rank of the default
    group, as one broadcast of a flat byte buffer; elsewhere the tensors are views of a fresh buffer per bucket."""
    parts = [(hf_name, shape, entry.dtype) for entry in entries for hf_name, shape in entry.hf_parts]
    offsets, cursor = [], 0
    for _, shape, dtype in parts:
        offsets.append(cursor)
        cursor += -(-math.prod(shape) * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
    flat = torch.empty(cursor, dtype=torch.uint8, device=export_device())

    def view(index: int) -> torch.Tensor:
        _, shape, dtype = parts[index]
        return flat[offsets[index] : offsets[index] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    sender = dist.get_rank() == 0
    if sender:
        if [name for name, _ in tensors] != [name for name, _, _ in parts]:
            raise RuntimeError("export_hf_weights(destination='all'): rank 0's bucket differs from the plan")
        for index, (_, tensor) in enumerate(tensors):
            view(index).copy_(tensor)
    if cursor:
        dist.broadcast(flat, src=0)
    return tensors if sender else [(name, view(index)) for index, (name, _, _) in enumerate(parts)]


class _Part(NamedTuple):
    """Entries gathered over one group in a flat byte buffer: group rank t's shards at ``t * nbytes``."""

    entries: list[ExportEntry]
    offsets: list[int]  # byte offset of each entry's shard within a rank's slot
    nbytes: int  # one rank's slot

    @classmethod
    def of(cls, entries: list[ExportEntry]) -> "_Part":
        offsets, cursor = [], 0
        for entry in entries:
            offsets.append(cursor)
            cursor += -(-entry.local_nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        return cls(entries, offsets, cursor)


def _shard_view(flat: torch.Tensor, offset: int, entry: ExportEntry) -> torch.Tensor:
    return flat[offset : offset + entry.local_nbytes].view(entry.dtype).view(entry.local_shape)


def _p2p(op, tensors: list[torch.Tensor], group, peers: list[int]) -> None:
    """``op`` (dist.isend / dist.irecv) of each tensor with its group-rank peer, as one batch; waits for all."""
    if tensors:
        ops = [dist.P2POp(op, tensor, group=group, group_peer=peer) for tensor, peer in zip(tensors, peers)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


HFTensors = dict[str, list[tuple[str, torch.Tensor]]]  # entry name -> its HF (name, tensor) pairs


class BucketGather:
    """One rank's part of ``export_hf_weights``, one bucket at a time (see the module docstring).

    Args:
        params: ``{canonical global name: parameter}`` of this rank (``weights.global_parameters``).
        rules: the mapping's rules by Megatron name.
        layout: this rank's shard layout (dense and expert tensor parallelism).
        destination: ``"rank0"`` or ``"pp_stage"`` (``"all"`` gathers as ``"rank0"``).
        value: the tensor exported for a parameter (``weights.export_value``: LoRA-merged or the parameter).
    """

    def __init__(self, params: dict, rules: dict[str, TensorRule], layout: ShardLayout, destination: str,
                 value: Callable[[torch.nn.Parameter], torch.Tensor]):
        self.params, self.rules, self.layout, self.value = params, rules, layout, value
        ps = parallel_state
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dense_source = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.expert_source = ps.get_expert_data_parallel_rank() == 0
        self.ep_rank, self.ep_group = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group()
        self.root = self.dense_source and layout.tp_rank == 0  # the stage's rank that assembles its tensors
        expert_root = self.expert_source and self.ep_rank == 0 and layout.expert_tp_rank == 0
        if self.root != expert_root:
            raise RuntimeError(
                f"export_hf_weights: rank {dist.get_rank()} is {'' if self.root else 'not '}the stage's dense "
                f"TP-0/DP-0 rank but {'' if expert_root else 'not '}its expert TP-0/EP-0/expert-DP-0 rank; the "
                "export expects megatron-core's default rank order, where they are the same rank")
        self.per_stage = destination == "pp_stage"
        self.device = export_device()
        # Staging buffers, reused across buckets: writing into fresh pages costs ~3x a warm copy on CPU.
        self.scratch: dict[Any, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether this rank sends or receives anything (else every bucket is ``[]`` without communication)."""
        return self.dense_source or self.expert_source

    def _receiver(self, stage: int) -> int:
        """Pipeline stage whose root receives the tensors of ``stage``."""
        return stage if self.per_stage else 0

    def _buffer(self, key: Any, nbytes: int) -> torch.Tensor:
        buffer = self.scratch.get(key)
        if buffer is None or buffer.numel() < nbytes:
            self.scratch.pop(key, None)
            buffer = self.scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]

    def bucket(self, entries: list[ExportEntry]) -> list[tuple[str, torch.Tensor]]:
        """This rank's part of one bucket: the HF tensors (in ``entries`` order) on the receiving rank, else ``[]``."""
        received: HFTensors = {}
        if self.root:
            for entry in entries:
                if entry.stage != self.stage and self._receiver(entry.stage) == self.stage:
                    received[entry.name] = [
                        (hf_name, torch.empty(shape, dtype=entry.dtype, device=self.device))
                        for hf_name, shape in entry.hf_parts
                    ]
        # Post the pipeline receives before this stage's own work, which the other stages' sends overlap.
        ops = [
            dist.P2POp(dist.irecv, tensor, group=self.pp_group, group_peer=entry.stage)
            for entry in entries
            for _, tensor in received.get(entry.name, ())
        ]
        works = dist.batch_isend_irecv(ops) if ops else []
        mine = [entry for entry in entries if entry.stage == self.stage]
        local: HFTensors = {}
        dense = [entry for entry in mine if entry.ep_owner < 0]
        if self.dense_source and dense:
            local.update(self._gathered(dense, parallel_state.get_tensor_model_parallel_group(),
                                        self.layout.tp_rank, self.layout.tp_size, "dense"))
        experts = [entry for entry in mine if entry.ep_owner >= 0]
        if self.expert_source and experts:
            local.update(self._experts(experts))
        if self.root and mine and self._receiver(self.stage) != self.stage:
            # HF tensors, not shards, in bucket order: the receiving rank gets them straight into its outputs.
            outgoing = [tensor for entry in mine for _, tensor in local[entry.name]]
            _p2p(dist.isend, outgoing, self.pp_group, [self._receiver(self.stage)] * len(outgoing))
            local = {}
        for work in works:
            work.wait()
        if not self.root:
            return []
        return [pair for entry in entries for pair in local.get(entry.name, received.get(entry.name, ()))]

    def _experts(self, entries: list[ExportEntry]) -> HFTensors:
        """This stage's experts of the bucket, as HF tensors on its EP-0 / ETP-0 rank (``{}`` elsewhere): each
        expert merged on ETP-rank-0 of its owner EP rank, then sent over the expert-parallel group."""
        own = [entry for entry in entries if entry.ep_owner == self.ep_rank]
        tensors = {}
        if own:
            tensors = self._gathered(own, parallel_state.get_expert_tensor_parallel_group(),
                                     self.layout.expert_tp_rank, self.layout.expert_tp_size, "experts")
        if self.layout.expert_tp_rank != 0:
            return {}
        if self.ep_rank != 0:
            outgoing = [tensor for entry in own for _, tensor in tensors[entry.name]]
            _p2p(dist.isend, outgoing, self.ep_group, [0] * len(outgoing))
            return {}
        peers, incoming = [], []
        for entry in entries:
            if entry.ep_owner != 0:
                tensors[entry.name] = [(hf_name, torch.empty(shape, dtype=entry.dtype, device=self.device))
                                       for hf_name, shape in entry.hf_parts]
                incoming += [tensor for _, tensor in tensors[entry.name]]
                peers += [entry.ep_owner] * len(entry.hf_parts)
        _p2p(dist.irecv, incoming, self.ep_group, peers)
        return tensors

    def _gathered(self, entries: list[ExportEntry], group, rank: int, size: int, key: str) -> HFTensors:
        """Gather the shards of ``entries`` over ``group`` (this rank is ``rank`` of ``size``) on its rank 0, one
        message per rank, and make the HF tensors there; ``{}`` on the other ranks."""
        part = _Part.of(entries)
        shards: dict[str, list[torch.Tensor]] = {}
        packed = []
        for entry, offset in zip(part.entries, part.offsets):
            param = self.value(self.params[entry.name])
            if size == 1 and param.dtype == entry.dtype:
                shards[entry.name] = [param]  # no cast, no message: merged straight from the parameter
            else:
                packed.append((entry, offset, param))
        if packed:
            flat = self._buffer(key, (size if rank == 0 else 1) * part.nbytes)
            for entry, offset, param in packed:
                _shard_view(flat, offset, entry).copy_(param)  # the cast to the export dtype happens in the copy
            if rank != 0:
                _p2p(dist.isend, [flat], group, [0])
                return {}
            slots = [flat[t * part.nbytes : (t + 1) * part.nbytes] for t in range(1, size)]
            _p2p(dist.irecv, slots, group, list(range(1, size)))
            for entry, offset, _ in packed:
                shards[entry.name] = [_shard_view(flat[t * part.nbytes :], offset, entry) for t in range(size)]
        return self._merge(entries, shards)

    def _merge(self, entries: list[ExportEntry], shards: dict[str, list[torch.Tensor]]) -> HFTensors:
        """HF tensors of each entry, none of them a view of a staging buffer."""
        staging = {buffer.untyped_storage().data_ptr() for buffer in self.scratch.values()}
        out = {}
        for entry in entries:
            out[entry.name] = []
            for hf_name, tensor in self.rules[entry.name].merge_shards(shards[entry.name], self.layout):
                tensor = tensor.contiguous()
                if tensor.untyped_storage().data_ptr() in staging:
                    tensor = tensor.clone()  # the buffer is rewritten by the next bucket
                out[entry.name].append((hf_name, tensor))
        return out
