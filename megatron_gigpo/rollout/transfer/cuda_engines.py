"""GPU backends ``mgigpo_ipc`` / ``mgigpo_nccl``: vLLM 0.32's CUDA transports with our staging.

Engine side (one per vLLM worker, created by vLLM's ``WeightTransferEngineFactory`` from the name
:func:`megatron_gigpo.rollout.vllm_plugin.register` gave it):

- :class:`StagedIPCWeightTransferEngine` (``mgigpo_ipc``, colocated): vLLM's
  ``IPCWeightTransferEngine`` transport, packed mode only. Each chunk is vLLM's ``packed_ipc_consumer`` (rebuild
  the CUDA IPC buffer of the trainer rank on this GPU, unpack, clone) and is staged instead of
  ``model.load_weights``. Chunk dict: vLLM's ``IPCWeightTransferUpdateInfo`` fields plus an optional
  ``digests`` (hex ``checksum.tensor_digest`` per tensor, ``names`` order), compared when present.
- :class:`StagedNCCLWeightTransferEngine` (``mgigpo_nccl``, disaggregated): vLLM's ``NCCLWeightTransferEngine``
  transport, packed mode only: one ``update_weights`` for the whole model (names / dtypes / shapes), received by
  vLLM's ``packed_nccl_broadcast_consumer`` whose post-unpack hook stages each chunk. A staging error is raised
  only after the whole broadcast was received, so the trainer's broadcast never hangs on it (and the mixin then
  keeps it as the update's error).

Staging (:class:`~.staged.StagedWeightTransfer`): nothing reaches the model before the trainer's
``{"commit": checksum}`` chunk has matched; ``finish_weight_update`` then loads the set in place (vLLM's layerwise
reload), an ``{"abort"}`` or any error keeps the served weights. The per-tensor BLAKE3 digests behind that checksum
are computed on CPU bytes, so every received tensor is copied to host memory once (D2H) and **staged there**: the
load at finish is the same CPU -> GPU ``weight_loader`` copy as vLLM's checkpoint load, and a sync holds no extra
model copy in GPU memory (only one packed chunk, ``rollout.bucket_size_mb``), but one full HF copy of the
weights in host memory per engine worker. Cost per sync and worker: one D2H of the model plus single-threaded
BLAKE3 (about 3 GB/s here) of it.

Trainer side: vLLM's own ``ipc`` / ``nccl`` trainer engines; :func:`ipc_trainer_init_info` and
:func:`nccl_trainer_init_info` build their init infos (packed) for a sync plan. vLLM's ``nccl`` trainer sends
every engine the same worker init info with ``rank_offset=1``, and each engine's workers count their ranks from 0,
so two engines would both claim group rank 1: the client
(:meth:`megatron_gigpo.rollout.transfer.client.EngineGroupClient.per_engine_init_info`) gives engine k
``rank_offset = 1 + workers of the engines before k``.

Importing this module needs vLLM >= 0.32 but no GPU (vLLM's CUDA modules import on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_NUM_BUFFERS,
    packed_ipc_consumer,
    packed_nccl_broadcast_consumer,
)

from megatron_gigpo.rollout.transfer.staged import StagedWeightTransfer
from megatron_gigpo.rollout.transport import dtype_from_name

__all__ = [
    "StagedIPCUpdateInfo",
    "StagedIPCWeightTransferEngine",
    "StagedNCCLWeightTransferEngine",
    "ipc_trainer_init_info",
    "nccl_trainer_init_info",
    "packed_buffer_bytes",
]


def _to_host(pairs: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Host copies of ``(name, tensor)`` pairs (synchronous D2H on the current stream, so it follows the copy or
    broadcast that filled the tensors)."""
    return [(name, tensor.to("cpu")) for name, tensor in pairs]


@dataclass
class StagedIPCUpdateInfo(IPCWeightTransferUpdateInfo):
    """vLLM's ``IPCWeightTransferUpdateInfo`` (``names``, ``dtype_names``, ``shapes``, ``ipc_handles``,
    ``tensor_sizes``) plus ``digests``: hex ``checksum.tensor_digest`` per tensor in ``names`` order, or None
    (the commit's whole-set checksum still checks every byte)."""

    digests: list[str] | None = None


class StagedIPCWeightTransferEngine(StagedWeightTransfer, IPCWeightTransferEngine):
    """``mgigpo_ipc``: vLLM's CUDA IPC transport (packed), our staging (see the module docstring).

    Init info: vLLM's ``IPCWeightTransferInitInfo`` (``{"packed": true}``); update info:
    :class:`StagedIPCUpdateInfo`; plus the staging's ``{"commit"}`` / ``{"abort"}`` chunks.
    """

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = StagedIPCUpdateInfo

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        """Raises ValueError unless ``packed`` (one reused IPC buffer per trainer rank; see
        :func:`ipc_trainer_init_info`)."""
        if not init_info.packed:
            raise ValueError("mgigpo_ipc receives packed chunks only: the trainer's IPCTrainerInitInfo needs "
                             "packed=True (cuda_engines.ipc_trainer_init_info sets it)")
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info: StagedIPCUpdateInfo) -> None:
        """Unpack one chunk from this GPU's CUDA IPC buffer (vLLM's ``packed_ipc_consumer``: GPU clones), copy it to
        host memory and stage it.

        Raises:
            ValueError: no ``tensor_sizes``, or no handle for this GPU's UUID (no trainer rank on this GPU).
            WeightSyncError: a staging check failed (name, shape, dtype, digest).
        """
        if update_info.tensor_sizes is None or not isinstance(update_info.ipc_handles, dict):
            raise ValueError("mgigpo_ipc chunk: expected one packed buffer handle dict and tensor_sizes")
        pairs = packed_ipc_consumer(
            ipc_handle=update_info.ipc_handles, names=update_info.names, shapes=update_info.shapes,
            dtype_names=update_info.dtype_names, tensor_sizes=update_info.tensor_sizes,
            device_index=self.device.index, importer=self._packed_importer)
        self._stage(_to_host(pairs), update_info.digests, copy=False)

    def finish_weight_update(self) -> None:
        """Load a committed update (else keep the weights), then release the trainer's IPC buffer mapping (as
        vLLM's ``IPCWeightTransferEngine.finish_weight_update`` does)."""
        try:
            super().finish_weight_update()
        finally:
            self._packed_importer.close()

    def shutdown(self) -> None:
        super().shutdown()
        self._packed_importer.close()


class StagedNCCLWeightTransferEngine(StagedWeightTransfer, NCCLWeightTransferEngine):
    """``mgigpo_nccl``: vLLM's NCCL broadcast transport (packed), our staging (see the module docstring).

    Init info: vLLM's ``NCCLWeightTransferInitInfo`` (``master_address``, ``master_port``, ``rank_offset``,
    ``world_size``, ``packed``, buffer sizes; the worker joins as ``rank_offset + its TP rank``); update info:
    vLLM's ``NCCLWeightTransferUpdateInfo`` (the whole model's names / dtype names / shapes, one chunk per update);
    plus the staging's ``{"commit"}`` / ``{"abort"}`` chunks.
    """

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        """Join the trainer's NCCL group (vLLM's ``worker_init_process_group``; blocks until every member joined).

        Raises:
            ValueError: ``packed`` is false (:func:`nccl_trainer_init_info` sets it).
        """
        if not init_info.packed:
            raise ValueError("mgigpo_nccl receives packed broadcasts only: the trainer's NCCLTrainerInitInfo needs "
                             "packed=True (cuda_engines.nccl_trainer_init_info sets it)")
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive the whole model by vLLM's packed broadcast consumer; each unpacked chunk is copied to host memory
        and staged. The first staging error is raised after the last chunk was received (the trainer broadcasts
        every chunk regardless).

        Raises:
            RuntimeError: the group was not joined (``init_transfer_engine``).
            AttributeError: a dtype name torch does not have (before anything is received).
            WeightSyncError: a staging check failed (name, shape, dtype, repeated name).
        """
        if self.model_update_group is None:
            raise RuntimeError("mgigpo_nccl: init_weight_transfer_engine was not called")
        meta = [(name, (list(shape), getattr(torch, dtype)))
                for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        failures: list[Exception] = []

        def stage_chunk(pairs: list[tuple[str, torch.Tensor]]) -> None:
            if failures:
                return
            try:
                self._stage(_to_host(pairs), None, copy=False)
            except Exception as exc:  # noqa: BLE001 - raised below, once the broadcast is drained
                failures.append(exc)

        packed_nccl_broadcast_consumer(
            iterator=iter(meta), group=self.model_update_group, src=0, post_unpack_func=stage_chunk,
            buffer_size_bytes=self.packed_buffer_size_bytes, num_buffers=self.packed_num_buffers,
            device=self.device)
        if failures:
            raise failures[0]

    def shutdown(self) -> None:
        """Drop the staging and leave the NCCL group (vLLM's ``NCCLWeightTransferEngine.shutdown``)."""
        StagedWeightTransfer.shutdown(self)
        NCCLWeightTransferEngine.shutdown(self)


# --------------------------------------------------------------------------------------------- trainer side
def packed_buffer_bytes(plan: Any) -> int:
    """Packed chunk size of a sync: ``plan.bucket_size_bytes``, raised to the largest tensor of ``plan.spec``
    (vLLM's ``packed_ipc_producer`` refuses a tensor larger than its buffer).

    Args:
        plan: the sync plan (:class:`megatron_gigpo.rollout.weight_sync.SyncPlan`): reads ``bucket_size_bytes``
            and ``spec`` (``shapes``, ``optional``, ``dtype``).
    """
    spec = plan.spec
    itemsize = dtype_from_name(spec.dtype).itemsize
    largest = max((itemsize * _numel(s) for s in (*spec.shapes.values(), *spec.optional.values())), default=0)
    return max(int(plan.bucket_size_bytes), largest)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def ipc_trainer_init_info(plan: Any, rank: int) -> IPCTrainerInitInfo:
    """vLLM's ``ipc`` trainer init info of actor rank ``rank`` (rank 0 sends): packed, one reused CUDA IPC buffer
    of :func:`packed_buffer_bytes` per rank. Every actor rank must iterate the full weights (vLLM's ``ipc``
    all-gathers each rank's buffer handle over the default process group, keyed by GPU UUID).

    Args:
        plan: the sync plan (see :func:`packed_buffer_bytes`).
        rank: this process's torch.distributed rank among the actor ranks.
    """
    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=packed_buffer_bytes(plan))


def nccl_trainer_init_info(plan: Any, rank: int, *, master_address: str | None = None,
                           master_port: int | None = None) -> NCCLTrainerInitInfo:
    """vLLM's ``nccl`` trainer init info of actor rank ``rank``: one NCCL group of the sender (group rank 0) and
    every worker of every engine (``world_size = 1 + sum(plan.engine_workers)``), packed chunks of
    :func:`packed_buffer_bytes`, vLLM's default double buffering. Only rank 0's address and port are used (it
    hosts the rendezvous); the client makes the engines' ``rank_offset`` per engine (module docstring).

    Args:
        plan: the sync plan: reads ``engine_workers`` (vLLM workers per engine) and :func:`packed_buffer_bytes`'s.
        rank: this process's rank among the actor ranks.
        master_address, master_port: the rendezvous; default this host's IP (vLLM's ``get_ip``) and a free port.
    """
    from vllm.utils.network_utils import get_ip, get_open_port

    return NCCLTrainerInitInfo(
        rank=rank, master_address=master_address or get_ip(), master_port=master_port or get_open_port(),
        world_size=1 + sum(int(w) for w in plan.engine_workers), packed=True,
        packed_buffer_size_bytes=packed_buffer_bytes(plan), packed_num_buffers=DEFAULT_PACKED_NUM_BUFFERS)
