"""Engine sides (vLLM workers) of the CPU backends ``mgigpo_shm`` and ``mgigpo_gloo``.

Both are vLLM 0.32 ``WeightTransferEngine`` subclasses with our staging (:class:`~.staged.StagedWeightTransfer`):
each bucket chunk is received, checked against the engine's checkpoint and the trainer's per-tensor digests, and
staged; the ``{"commit": ...}`` chunk checks completeness and the whole-set checksum; ``finish_weight_update``
loads the committed set in place. Wire format of one bucket: a flat byte buffer described by
``transport.BucketLayout.to_wire()`` (names, shapes, 64-byte aligned offsets, dtype, nbytes) plus
``digests``: hex ``checksum.tensor_digest`` per tensor in layout order.

- ``mgigpo_shm`` (colocated): the trainer writes each bucket into an anonymous shared-memory file of the engine's
  node; the worker maps it (no copy) and stages views of it. The trainer keeps the files until the update has
  finished.
- ``mgigpo_gloo`` (disaggregated): the trainer's rank 0 and every worker of the engines form one gloo group
  (``transport._GlooBroadcast``); each bucket is broadcast from rank 0 into a fresh buffer per worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transfer.staged import StagedWeightTransfer
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    _GlooBroadcast,
    open_shared_memory_bucket,
    unpack_bucket,
)

__all__ = [
    "SharedMemoryInitInfo",
    "SharedMemoryUpdateInfo",
    "SharedMemoryWeightTransferEngine",
    "GlooInitInfo",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
]


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """``mgigpo_shm`` init info of one engine: the transfer dtype name (the engine's model dtype) and the key
    of the engine's node in each bucket chunk's ``paths`` (the Ray node id; stand-in nodes share a hostname)."""

    dtype: str
    node_key: str


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """``mgigpo_shm`` bucket chunk: ``paths`` {node_key: ``/proc/<pid>/fd/<fd>`` of that node's file},
    ``layout`` (``BucketLayout.to_wire()``), ``digests`` (hex, layout order)."""

    paths: dict[str, str]
    layout: dict[str, Any]
    digests: list[str]


class SharedMemoryWeightTransferEngine(StagedWeightTransfer, WeightTransferEngine):
    """``mgigpo_shm`` in one vLLM worker (vLLM 0.32 ``WeightTransferEngine``): maps the bucket file of its node
    and stages views into it (no copy).

    ``update_weights`` refuses a chunk (kept in :attr:`StagedWeightTransfer.error`, not raised): WeightSyncError
    before ``init_weight_transfer_engine``, no file for this engine's node, or any check of
    :meth:`StagedWeightTransfer._stage` (name, shape, dtype, digest); FileNotFoundError / ValueError when the
    file is gone or shorter than the layout.
    """

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.node_key: str | None = None

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        """Keep the node key (vLLM ``init_weight_transfer_engine``). Raises WeightSyncError for another dtype."""
        self._check_dtype(init_info.dtype, "mgigpo_shm init_info")
        self.node_key = init_info.node_key

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        """Map this node's bucket file and stage its tensors (vLLM ``receive_weights``)."""
        if self.node_key is None:
            raise WeightSyncError("mgigpo_shm bucket before init_weight_transfer_engine")
        path = update_info.paths.get(self.node_key)
        if path is None:
            raise WeightSyncError(f"mgigpo_shm bucket has files for nodes {sorted(update_info.paths)}, none for "
                                  f"this engine's node {self.node_key!r}")
        layout = BucketLayout.from_wire(update_info.layout)
        flat = open_shared_memory_bucket(path, layout.nbytes)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        self._stage(unpack_bucket(flat, layout), update_info.digests, copy=False)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """``mgigpo_gloo`` init info: the group's TCP store (hosted by trainer rank 0), this engine's first rank
    (its worker of TP rank r joins as ``rank_offset + r``), the group size (1 + every engine's workers) and
    the store / collective timeout in seconds."""

    dtype: str
    host: str
    port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """``mgigpo_gloo`` bucket chunk: ``layout`` (``BucketLayout.to_wire()``) and ``digests`` (hex, layout order);
    the ``layout.nbytes`` bytes come by broadcast from rank 0."""

    layout: dict[str, Any]
    digests: list[str]


class GlooWeightTransferEngine(StagedWeightTransfer, WeightTransferEngine):
    """``mgigpo_gloo`` in one vLLM worker (vLLM 0.32 ``WeightTransferEngine``): joins the trainer's gloo group at
    ``init_transfer_engine`` (blocks until every member has joined, at most ``timeout_s``), receives each bucket
    by broadcast from rank 0 into a fresh buffer and stages it.

    ``update_weights`` refuses a chunk (kept in :attr:`StagedWeightTransfer.error`, not raised): WeightSyncError
    before ``init_weight_transfer_engine`` or any check of :meth:`StagedWeightTransfer._stage` (name, shape,
    dtype, digest); ValueError for an inconsistent layout; gloo's RuntimeError on a broken or timed-out group.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: _GlooBroadcast | None = None
        self.rank: int | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the group as ``rank_offset + <this worker's rank in its engine>`` (vLLM
        ``init_weight_transfer_engine``). Raises WeightSyncError for another dtype or a rank outside the group."""
        self._check_dtype(init_info.dtype, "mgigpo_gloo init_info")
        rank = init_info.rank_offset + self.parallel_config.rank
        if not 0 < rank < init_info.world_size:
            raise WeightSyncError(f"mgigpo_gloo: worker rank {rank} (rank_offset {init_info.rank_offset}) is outside "
                                  f"the group of {init_info.world_size} (rank 0 is the trainer)")
        self.shutdown()
        self.group = _GlooBroadcast(init_info.host, init_info.port, rank, init_info.world_size, init_info.timeout_s)
        self.rank = rank

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive one bucket from rank 0's broadcast and stage it (vLLM ``receive_weights``)."""
        if self.group is None:
            raise WeightSyncError("mgigpo_gloo bucket before init_weight_transfer_engine")
        layout = BucketLayout.from_wire(update_info.layout)
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        self.group.broadcast(flat)  # before any check: rank 0 sends either way, the group must stay in step
        self._stage(unpack_bucket(flat, layout), update_info.digests, copy=False)  # flat is this bucket's own

    def shutdown(self) -> None:
        """Drop the staging and leave the group (vLLM ``shutdown_weight_transfer_engine``)."""
        super().shutdown()
        self.group, self.rank = None, None
