"""In-memory weight resharding: Megatron actor ranks -> vLLM rollout engines, on vLLM's weight-transfer protocol.

One sync, driven by :func:`sync_weights` on the controller:

1. :func:`prepare_sync` asks the engines for their :class:`WeightSpec` (HF names and shapes of the checkpoint the
   engines were started from, and the transfer dtype = the engines' model dtype), worker counts, Ray nodes and
   weight-transfer backend (``RolloutEngine.sync_info()``; all engines must share one) and builds a :class:`SyncPlan`.
2. Every actor rank runs :func:`push_weights` with its ``export_hf_weights`` bucket iterator (a collective: the TP
   and PP gathers happen inside it) wrapped in a :class:`~megatron_gigpo.rollout.transfer.source.MegatronExportSource`
   (spec check and per-tensor digests on the sender, rank 0), and the backend's vLLM trainer engine
   (``vllm.distributed.weight_transfer.factory.WeightTransferTrainerFactory.trainer_init``, built once per set of
   engines and kept on the rank) runs ``send_weights()``: ``start_weight_update`` / ``update_weights`` per bucket /
   commit chunk with the checksum / ``finish_weight_update(str(version))`` through an
   :class:`~megatron_gigpo.rollout.transfer.client.EngineGroupClient` (deadlines, per-engine init info, version).
   Backends (chosen by the placement, :func:`megatron_gigpo.cluster.placement.weight_transfer_backend`, and started
   with the engines): ``mgigpo_shm`` / ``mgigpo_gloo`` (CPU; :mod:`megatron_gigpo.rollout.transfer.cpu_trainers`),
   ``mgigpo_ipc`` / ``mgigpo_nccl`` (GPU; vLLM's ``ipc`` / ``nccl`` trainer engines).
3. Each engine checks every tensor against the spec, compares digests of what it received, stages the update, checks
   the commit's checksum, loads in place, resets its prefix cache, and reports ``(version, checksum)``.

Any failure (bad name or shape, missing tensor, checksum mismatch, transport error, an engine that does not answer
within the sync's deadline ``timeout_s``) aborts the update on every engine (abort chunk, ``finish(None)``,
``RolloutEngine.abort_weight_update``), which keep serving their previous weights, and raises
:class:`WeightSyncError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.checksum import weights_checksum
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.spec import WeightSpec
from megatron_gigpo.rollout.transport import dtype_from_name, initialized_dist
from megatron_gigpo.rollout.vllm_plugin import BACKENDS, GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND, SHM_BACKEND

__all__ = [
    "WeightSyncError",
    "WeightSpec",
    "SyncPlan",
    "SyncReport",
    "prepare_sync",
    "push_weights",
    "sync_weights",
    "release_sender_resources",
    "weights_checksum",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# Plan and report
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncPlan:
    """Everything an actor rank needs to push one weight version (picklable; travels to Ray actors).

    Attributes:
        engines: Ray handles of the :class:`~megatron_gigpo.rollout.engine.RolloutEngine` actors.
        engine_workers: number of vLLM workers (TP size) of each engine, same order.
        engine_nodes: Ray node id of each engine (``mgigpo_shm``'s node key).
        version: the new weights version; must exceed every engine's current version.
        bucket_size_bytes: export bucket size (``export_hf_weights(bucket_size_bytes=...)``).
        spec: what the engines expect.
        backend: the engines' weight-transfer backend (``mgigpo_shm``, ``mgigpo_gloo``, ``mgigpo_ipc``,
            ``mgigpo_nccl``), from their ``sync_info``.
        reuse_shm: ``mgigpo_shm`` keeps its bucket files for the next sync (faster; holds the model's bytes of shared
            memory per engine node between syncs), else closes them when the next sync starts.
        timeout_s: deadline of the whole sync on the sender rank (every wait on an engine and the broadcast group's
            timeout), seconds.
    """

    engines: tuple[Any, ...]
    engine_workers: tuple[int, ...]
    engine_nodes: tuple[str, ...]
    version: int
    bucket_size_bytes: int
    spec: WeightSpec
    backend: str = SHM_BACKEND
    reuse_shm: bool = True
    timeout_s: float = 600.0

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype to export in (``export_hf_weights(..., dtype=plan.export_dtype)``): the engines' dtype, so the
        TP/PP gathers already move the bytes that travel."""
        return dtype_from_name(self.spec.dtype)

    @property
    def export_destination(self) -> str:
        """``export_hf_weights(destination=...)`` for this backend: ``"all"`` for ``mgigpo_ipc`` (vLLM's IPC trainer
        shares every rank's own full copy), else ``"rank0"`` (only the sender needs the tensors)."""
        return "all" if self.backend == IPC_BACKEND else "rank0"

    @property
    def needs_metadata(self) -> bool:
        """The backend's trainer asks the source for ``metadata()`` (vLLM's NCCL trainer, ``mgigpo_nccl``): pass
        ``push_weights(..., metadata=export_metadata(model, dtype=plan.export_dtype))``."""
        return self.backend == NCCL_BACKEND

    @property
    def group_key(self) -> str:
        """Identity of the trainer engine a rank keeps for these engines (engines, worker counts, backend)."""
        ids = ",".join(str(getattr(e, "_actor_id", id(e))) for e in self.engines)
        return f"{ids}|{self.engine_workers}|{self.backend}|{self.spec.dtype}|{self.reuse_shm}"


@dataclass
class SyncReport:
    """What the sender rank measured for one sync (seconds, bytes)."""

    version: int
    checksum: str
    num_tensors: int
    num_buckets: int
    bytes: int
    export_s: float = 0.0  # waiting for the export iterator (TP/PP gathers)
    pack_s: float = 0.0  # cast + copy into the transport buffer (and the copies to other nodes' writers)
    hash_s: float = 0.0
    send_s: float = 0.0  # waiting for engines to receive and stage
    commit_s: float = 0.0  # engines' checksum check + in-place load + prefix-cache reset
    total_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Flat float metrics under ``weight_sync/``."""
        out = {f"weight_sync/{k}": float(v) for k, v in dataclasses.asdict(self).items() if k != "checksum"}
        out["weight_sync/gb_per_s"] = self.bytes / max(self.total_s, 1e-9) / 1e9
        return out


# The controller waits this much longer than the sync's own deadline, so that the sender rank's error (which
# names the engine that did not answer) arrives before the controller's own time-out.
DRIVER_GRACE_S = 120.0


def prepare_sync(engines: Any, *, version: int, bucket_size_bytes: int, timeout_s: float = 600.0,
                 reuse_shm: bool = True) -> SyncPlan:
    """Build the :class:`SyncPlan` (asks every engine for its spec, worker count, node and backend).

    Args:
        engines: a :class:`~megatron_gigpo.rollout.engine_group.RolloutEngineGroup` or a list of engine handles.
        version: new weights version (int > every engine's current version).
        bucket_size_bytes: export bucket size in bytes (>= 1).
        timeout_s: the sync's deadline in seconds (:attr:`SyncPlan.timeout_s`); also this call's.
        reuse_shm: see :attr:`SyncPlan.reuse_shm`.

    Raises:
        ValueError: bad argument value.
        WeightSyncError: the engines disagree on their spec or backend, or the backend is not ours.
        megatron_gigpo.deadlines.DeadlineError: an engine did not answer within ``timeout_s``.
    """
    handles = tuple(getattr(engines, "engines", engines))
    if not handles:
        raise ValueError("sync_weights needs at least one engine")
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes={bucket_size_bytes} must be >= 1")
    infos = get_with_deadline([e.sync_info.remote() for e in handles], timeout_s, "sync_info of the rollout engines",
                              labels=[f"engine {i}" for i in range(len(handles))])
    spec, backend = infos[0]["spec"], infos[0]["backend"]
    for i, info in enumerate(infos[1:], start=1):
        if info["spec"] != spec:
            raise WeightSyncError(f"engine {i} expects other weights than engine 0 (different checkpoints or dtype)")
        if info["backend"] != backend:
            raise WeightSyncError(f"engine {i} was started with weight-transfer backend {info['backend']!r}, engine 0 "
                                  f"with {backend!r}: one sync needs one backend")
    if backend not in BACKENDS:
        raise WeightSyncError(f"engine 0 was started with weight-transfer backend {backend!r}; the sync drives "
                              f"{BACKENDS} (rollout.engine.EngineConfig.weight_transfer_backend)")
    return SyncPlan(engines=handles, engine_workers=tuple(int(info["num_workers"]) for info in infos),
                    engine_nodes=tuple(str(info["node_id"]) for info in infos), version=int(version),
                    bucket_size_bytes=int(bucket_size_bytes), spec=spec, backend=backend, reuse_shm=reuse_shm,
                    timeout_s=float(timeout_s))


def sync_weights(
    actors: Any,
    engines: Any,
    *,
    version: int,
    bucket_size_bytes: int,
    timeout_s: float = 600.0,
    method: str = "push_weights",
) -> dict[str, float]:
    """Push the actor's current weights into every engine as ``version``; returns ``weight_sync/*`` metrics.

    Args:
        actors: an :class:`~megatron_gigpo.actor.group.ActorGroup` (its ``call_all(method, plan)`` runs
            ``PolicyActor.<method>(plan)`` on every rank) or a list of Ray actor handles each with a
            ``<method>(plan)`` remote method. That method must call :func:`push_weights` with the rank's
            ``export_hf_weights(model, bucket_size_bytes=plan.bucket_size_bytes, dtype=plan.export_dtype)`` iterator.
        engines: a :class:`~megatron_gigpo.rollout.engine_group.RolloutEngineGroup` or engine handles (their backend is the
            sync's).
        version, bucket_size_bytes: see :func:`prepare_sync`.
        timeout_s: deadline of the sync on the sender rank, seconds (the ranks' call gets ``DRIVER_GRACE_S`` more,
            so that the sender's error naming the engine arrives first).
        method: name of the per-rank method.

    Raises:
        WeightSyncError: the sync failed (an engine that did not answer in time included); every engine still
            serves its previous weights.
        megatron_gigpo.deadlines.DeadlineError: an engine or an actor rank did not answer at all.
    """
    import ray

    from megatron_gigpo.rollout.transfer.client import remote_error

    plan = prepare_sync(engines, version=version, bucket_size_bytes=bucket_size_bytes, timeout_s=timeout_s)
    try:
        if hasattr(actors, "call_all"):
            results = actors.call_all(method, plan, timeout_s=timeout_s + DRIVER_GRACE_S)
        else:
            results = get_with_deadline([getattr(a, method).remote(plan) for a in actors],
                                        timeout_s + DRIVER_GRACE_S, f"{method} on the actor ranks",
                                        labels=[f"rank {i}" for i in range(len(actors))])
    except ray.exceptions.RayTaskError as exc:
        cause = remote_error(exc)
        if isinstance(cause, WeightSyncError):
            raise WeightSyncError(str(cause)) from exc
        raise
    reports = [r for r in results if r is not None]
    if len(reports) != 1:
        raise WeightSyncError(f"expected exactly one sender rank to report, got {len(reports)}: the export's "
                              "destination must be rank 0")
    return reports[0].metrics()


# ---------------------------------------------------------------------------------------------------------
# Every actor rank
# ---------------------------------------------------------------------------------------------------------

# The trainer engine of this process per set of engines (SyncPlan.group_key); built on first use.
_TRAINERS: dict[str, Any] = {}


def release_sender_resources() -> None:
    """Shut down the trainer engines this process kept (``mgigpo_shm`` bucket files, ``mgigpo_gloo`` group). Optional:
    process exit frees them too. The next sync builds new ones (the engines get a new init)."""
    for trainer in _TRAINERS.values():
        trainer.shutdown()
    _TRAINERS.clear()


def _rank() -> int:
    dist = initialized_dist()
    return 0 if dist is None else dist.get_rank()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _trainer_init_info(plan: SyncPlan, rank: int):
    """The backend's vLLM ``TrainerInitInfo`` for this rank (GPU ones from ``transfer.cuda_engines``)."""
    from megatron_gigpo.rollout.transfer import cpu_trainers

    if plan.backend == SHM_BACKEND:
        return cpu_trainers.SharedMemoryTrainerInitInfo(rank=rank, dtype=plan.spec.dtype,
                                                        engine_nodes=plan.engine_nodes, reuse_files=plan.reuse_shm)
    if plan.backend == GLOO_BACKEND:
        return cpu_trainers.GlooTrainerInitInfo(rank=rank, dtype=plan.spec.dtype, host=_node_ip(),
                                                world_size=1 + sum(plan.engine_workers), timeout_s=plan.timeout_s)
    from megatron_gigpo.rollout.transfer import cuda_engines  # vLLM's CUDA transports; imported on GPU runs only

    if plan.backend == IPC_BACKEND:
        return cuda_engines.ipc_trainer_init_info(plan, rank)
    return cuda_engines.nccl_trainer_init_info(plan, rank)


def _trainer(plan: SyncPlan, rank: int, source):
    """This rank's trainer engine for ``plan``'s engines: kept from an earlier sync, else
    ``WeightTransferTrainerFactory.trainer_init`` (every rank; the sender initialises the engines)."""
    trainer = _TRAINERS.get(plan.group_key)
    if trainer is not None and not getattr(trainer, "broken", False):
        return trainer
    if trainer is not None:
        trainer.shutdown()
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from megatron_gigpo.rollout import vllm_plugin
    from megatron_gigpo.rollout.transfer.client import EngineGroupClient

    vllm_plugin.register()  # this process may have started no vLLM engine (no plugin loading)
    client = EngineGroupClient(plan.engines, plan.engine_workers, plan.timeout_s)
    client.begin(plan.version)
    trainer = WeightTransferTrainerFactory.trainer_init(_trainer_init_info(plan, rank), client=client, source=source)
    _TRAINERS[plan.group_key] = trainer
    return trainer


def push_weights(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], plan: SyncPlan, *,
                 metadata: Sequence[tuple[str, torch.dtype, tuple[int, ...]]] | None = None) -> SyncReport | None:
    """Run on every actor rank with its export iterator: the backend's trainer engine sends (rank 0), or takes part
    in the transfer's collectives (``mgigpo_shm``'s node writers, ``mgigpo_ipc``'s handle gather), or only iterates.

    Args:
        buckets: ``export_hf_weights(model, bucket_size_bytes=plan.bucket_size_bytes, dtype=plan.export_dtype,
            destination=plan.export_destination)`` of this rank: lists of ``(hf_name, tensor)``, full (unsharded)
            tensors on rank 0 (on every rank for ``"all"``).
        plan: from :func:`prepare_sync`.
        metadata: ``export_metadata(model, dtype=plan.export_dtype)``, needed where ``plan.needs_metadata``
            (``mgigpo_nccl``); ignored otherwise.

    Returns:
        The :class:`SyncReport` on rank 0, None on the others.

    Raises:
        WeightSyncError: on rank 0, after the iterator is exhausted (so the other ranks' collectives complete) and
            every engine has dropped the update (it serves its previous weights).
    """
    from megatron_gigpo.rollout.transfer.source import MegatronExportSource

    start, rank = time.perf_counter(), _rank()
    source = MegatronExportSource(buckets, plan.spec, is_sender=rank == 0,
                                  metadata=metadata if plan.needs_metadata else None,
                                  yield_all=plan.export_destination == "all")
    trainer = None
    try:
        trainer = _trainer(plan, rank, source)
        trainer.source = source
        trainer.client.begin(plan.version, source if rank == 0 else None)
        trainer.send_weights()
    except BaseException as exc:  # noqa: BLE001 - every failure must leave the engines on their weights
        source.drain()  # the other ranks may wait inside the export's collectives
        if trainer is not None and hasattr(trainer, "broken"):
            trainer.broken = True  # a gloo group may be out of step: the next sync builds a new one
        if rank != 0:
            raise
        _abort(plan, trainer, source, exc)
    if rank != 0:
        return None
    return _report(plan, trainer, source, time.perf_counter() - start)


def _abort(plan: SyncPlan, trainer, source, exc: BaseException) -> None:
    """Rank 0 after a failed update: every engine drops it, then the sync's error is raised as WeightSyncError."""
    import ray

    from megatron_gigpo.rollout.transfer.client import EngineGroupClient, remote_error

    client = trainer.client if trainer is not None else EngineGroupClient(plan.engines, plan.engine_workers,
                                                                          plan.timeout_s)
    client.version = plan.version
    client.abort(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, WeightSyncError):
        raise exc
    cause = source.error or (remote_error(exc) if isinstance(exc, ray.exceptions.RayTaskError) else exc)
    if isinstance(cause, WeightSyncError):
        raise WeightSyncError(str(cause)) from exc
    raise WeightSyncError(f"weight sync of version {plan.version} failed: {type(cause).__name__}: {cause}") from exc


def _report(plan: SyncPlan, trainer, source, total_s: float) -> SyncReport:
    served = trainer.client.served
    return SyncReport(
        version=plan.version, checksum=served[0][1] if served else source.checksum(),
        num_tensors=source.num_tensors, num_buckets=getattr(trainer, "num_buckets", 0), bytes=source.nbytes,
        export_s=source.export_s, pack_s=getattr(trainer, "pack_s", 0.0), hash_s=source.hash_s,
        send_s=getattr(trainer, "send_s", 0.0), commit_s=trainer.client.commit_s, total_s=total_s)
