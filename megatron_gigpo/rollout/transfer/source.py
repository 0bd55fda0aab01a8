"""The actor's weights as a vLLM ``WeightSource``: one pass of a rank's ``export_hf_weights`` bucket iterator.

:class:`MegatronExportSource` implements ``vllm.distributed.weight_transfer.base.WeightSource`` (vLLM 0.32) over the
bucket iterator of :func:`megatron_gigpo.models.weights.export_hf_weights` (a collective: every actor rank iterates
it in lockstep; the export's destination, the sender rank 0, gets full HF tensors, the others empty buckets). On the
sender it checks every tensor against the engines' :class:`~megatron_gigpo.rollout.spec.WeightSpec` and
hashes the bytes that travel (the tensor cast to the transfer dtype, :func:`~megatron_gigpo.rollout.checksum.
tensor_digest`), so the commit chunk can carry the whole set's checksum.

It never raises in the middle of an iteration (the other ranks are inside the export's collectives, and vLLM's NCCL
stream cannot stop half-way): the first bad tensor is recorded in :attr:`MegatronExportSource.error` and the rest of
the export is drained (no more tensors are yielded); the client reads ``error`` before it commits.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Sequence

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import dtype_from_name

__all__ = ["MegatronExportSource"]


class MegatronExportSource(WeightSource):
    """One sync's pass over a rank's export (iterate it once).

    Args:
        buckets: this rank's ``export_hf_weights(model, bucket_size_bytes=..., dtype=...)`` iterator: lists of
            ``(hf_name, tensor)``; full (unsharded) tensors of any float dtype and device on the sender, empty
            lists elsewhere.
        spec: the engines' :class:`~megatron_gigpo.rollout.spec.WeightSpec` (names, shapes, transfer dtype).
        is_sender: this rank is the export's destination (trainer rank 0): it checks and hashes.
        metadata: the whole model's ``ParamMeta`` (or ``(name, dtype, shape)`` tuples:
            :func:`~megatron_gigpo.models.weights.export_metadata`) in export order, when known (vLLM's NCCL trainer
            needs it); default: not available (:meth:`metadata` raises).
        yield_all: every rank yields its buckets (an export with ``destination="all"``: vLLM's IPC trainer shares
            each rank's own copy); checks and digests stay on the sender. Default: only the sender yields.

    Attributes:
        error: the first :class:`WeightSyncError` of the sender's checks, else None.
        digests: 32-byte BLAKE3 digest per HF name of what was yielded (sender only).
        num_tensors, nbytes: tensors yielded and their bytes in the transfer dtype (sender only).
        export_s, hash_s: seconds spent waiting for the export (TP/PP gathers) and hashing.
    """

    def __init__(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], spec: Any, *, is_sender: bool,
                 metadata: Sequence[ParamMeta | tuple[str, torch.dtype, tuple[int, ...]]] | None = None,
                 yield_all: bool = False) -> None:
        self._buckets = iter(buckets)
        self.spec, self.is_sender, self.yield_all = spec, is_sender, yield_all
        self.dtype = dtype_from_name(spec.dtype)
        self._metadata = None if metadata is None else [
            meta if isinstance(meta, ParamMeta) else ParamMeta(meta[0], meta[1], tuple(meta[2])) for meta in metadata
        ]
        self.error: WeightSyncError | None = None
        self.digests: dict[str, bytes] = {}
        self._seen: set[str] = set()
        self.num_tensors = self.nbytes = 0
        self.export_s = self.hash_s = 0.0

    # ------------------------------------------------------------------------------------ WeightSource
    def metadata(self) -> list[ParamMeta]:
        """``ParamMeta(name, transfer dtype, full shape)`` of every tensor, in export order.

        Raises:
            NotImplementedError: built without ``metadata`` (the export plan's names are needed in export order).
        """
        if self._metadata is None:
            raise NotImplementedError("MegatronExportSource needs metadata= (export order) for this backend")
        return list(self._metadata)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs of every bucket, in export order (none on non-senders unless ``yield_all``)."""
        for bucket in self.iter_buckets():
            yield from bucket

    # ------------------------------------------------------------------------------------ buckets
    def iter_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The export's buckets, one per export step on every rank (so ranks stay in lockstep): the checked,
        hashed tensors on the sender; ``[]`` on other ranks (their unchecked buckets with ``yield_all``) and, after
        :attr:`error`, on the sender."""
        tick = time.perf_counter()
        for bucket in self._buckets:
            self.export_s += time.perf_counter() - tick
            bucket = list(bucket)
            if not self.is_sender:
                yield bucket if self.yield_all else []
                tick = time.perf_counter()
                continue
            if self.error is not None:
                bucket = []
            try:
                self._check(bucket)
            except WeightSyncError as exc:
                self.error, bucket = exc, []
            yield bucket
            tick = time.perf_counter()

    def _check(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            self.spec.check_tensor(name, tensor.shape, self._seen)
        tick = time.perf_counter()
        for name, tensor in bucket:
            wire = tensor.detach().to(self.dtype)
            self.digests[name] = tensor_digest(name, wire if wire.device.type == "cpu" else wire.cpu())
            self.num_tensors += 1
            self.nbytes += wire.numel() * wire.element_size()
        self.hash_s += time.perf_counter() - tick

    def drain(self) -> None:
        """Iterate the rest of the export (the other ranks may wait in its collectives); never raises a check."""
        for _ in self.iter_buckets():
            pass

    def checksum(self) -> str:
        """Hex checksum of everything yielded (:func:`~megatron_gigpo.rollout.checksum.combine_digests`).

        Raises:
            WeightSyncError: :attr:`error`, or tensors of the spec that were not yielded.
        """
        if self.error is not None:
            raise self.error
        self.spec.check_complete(set(self.digests))
        return combine_digests(self.digests)
