"""In-memory weight resharding: Megatron actor ranks -> vLLM rollout engines, versioned and checksummed.

One sync, driven by :func:`sync_weights` on the controller:

1. ``prepare_sync`` asks the engines for their :class:`WeightSpec` (HF names and shapes of the checkpoint
   the engines were started from, and the transfer dtype = the engines' model dtype) and builds a
   :class:`SyncPlan`.
2. Every actor rank runs :func:`push_weights` with its ``export_hf_weights`` bucket iterator (a collective:
   the TP and PP gathers happen inside it). The source rank (``plan.source_rank``, the export's
   destination) validates each bucket against the spec, casts and packs it into one flat buffer, hashes
   it, and sends it through the transport (shared-memory file, gloo/NCCL broadcast, CUDA IPC handle; see
   :mod:`megatron_gigpo.rollout.transport` and :mod:`megatron_gigpo.rollout.sender`). The same-node transports
   reach engines on other nodes through each node's leader rank (:attr:`SyncPlan.relays`,
   :mod:`megatron_gigpo.rollout.relay`). Engines validate again, hash what they received and stage it.
3. The source commits with its checksum (:mod:`megatron_gigpo.rollout.checksum`). Each engine compares it
   with the checksum of what it staged, loads the weights in place only if they match, resets its prefix
   cache (stale KV blocks), and reports ``(version, checksum)``; the source checks the reports.

Any failure (bad name or shape, missing tensor, checksum mismatch, transport error, an engine that does not
answer within the sync's deadline ``timeout_s``) aborts the update on every engine, which keep serving their
previous weights, and raises :class:`WeightSyncError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest, weights_checksum
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.relay import RelaySource, relay_group, serve_node
from megatron_gigpo.rollout.sender import (
    SAME_NODE_TRANSPORTS,
    EngineSender,
    engine_labels,
    release_sender_resources,
)
from megatron_gigpo.rollout.transport import dtype_from_name, unpack_bucket

__all__ = [
    "WeightSyncError",
    "WeightSpec",
    "read_checkpoint_spec",
    "SyncPlan",
    "SyncReport",
    "prepare_sync",
    "push_weights",
    "sync_weights",
    "release_sender_resources",
    "weights_checksum",
    "TRANSPORTS",
]

TRANSPORTS = ("shm", "broadcast", "cuda_ipc")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# The contract: which tensors an engine expects
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightSpec:
    """HF tensors an engine loads, read from the safetensors headers of its checkpoint.

    Attributes:
        shapes: HF name -> shape of every tensor a sync must carry.
        optional: names a sync may carry but need not (``lm_head.weight`` of a tied-embedding model).
        dtype: transfer dtype name (the engine's model dtype).
    """

    shapes: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]]
    dtype: str

    def check_tensor(self, name: str, shape: Sequence[int], seen: set[str]) -> None:
        """Raises WeightSyncError for an unknown or repeated name or a wrong shape; adds ``name`` to ``seen``."""
        expected = self.shapes.get(name, self.optional.get(name))
        if expected is None:
            close = sorted(n for n in self.shapes if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:3]
            raise WeightSyncError(
                f"tensor {name!r} is not a weight of the engine's model (checkpoint names like {close})"
            )
        if tuple(shape) != tuple(expected):
            raise WeightSyncError(f"tensor {name!r} has shape {tuple(shape)}, the engine expects {tuple(expected)}")
        if name in seen:
            raise WeightSyncError(f"tensor {name!r} was sent twice in one sync")
        seen.add(name)

    def check_complete(self, seen: set[str]) -> None:
        """Raises WeightSyncError naming the tensors a sync did not carry."""
        missing = sorted(set(self.shapes) - seen)
        if missing:
            raise WeightSyncError(
                f"{len(missing)} of {len(self.shapes)} weights were not sent, e.g. {missing[:5]}"
            )


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def read_checkpoint_spec(model_dir: str | Path, dtype: str) -> WeightSpec:
    """The :class:`WeightSpec` of an HF checkpoint directory (headers only; no tensor is read).

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors``.
        dtype: the engine's model dtype (``"bfloat16"``, ``"float32"``, ``"float16"``).

    Raises:
        FileNotFoundError: no config.json or no safetensors file in ``model_dir``.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    config = json.loads(config_path.read_text())
    optional: dict[str, tuple[int, ...]] = {}
    # A tied lm_head is the embedding: exporters may send it or not, vLLM ignores it either way.
    if config.get("tie_word_embeddings", False) and "model.embed_tokens.weight" in shapes:
        shapes.pop("lm_head.weight", None)
        optional["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    dtype_from_name(dtype)
    return WeightSpec(shapes=shapes, optional=optional, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# Plan and report
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncPlan:
    """Everything an actor rank needs to push one weight version (picklable; travels to Ray actors).

    Attributes:
        engines: Ray handles of the :class:`~megatron_gigpo.rollout.engine.RolloutEngine` actors.
        engine_workers: number of vLLM workers (TP size) of each engine, same order.
        engine_nodes: Ray node id of each engine (the same-node transports check it against their sender's).
        version: the new weights version; must exceed every engine's current version.
        bucket_size_bytes: export bucket size (``export_hf_weights(bucket_size_bytes=...)``).
        transport: ``"shm"`` | ``"broadcast"`` | ``"cuda_ipc"``.
        spec: what the engines expect.
        source_rank: torch.distributed rank that receives the full HF tensors from the export.
        backend: ``"gloo"`` or ``"nccl"``: the torch.distributed backend of the sync's groups (the broadcast
            transport's, the node relays').
        max_inflight_buckets: buckets sent but not yet acknowledged by the engines (bounds memory).
        reuse_shm: keep the ``shm`` bucket files for the next sync (faster; holds the model's bytes of
            shared memory on the source node between syncs), else close them after each bucket is staged.
        timeout_s: deadline of the whole sync on the source rank (every wait on an engine and the broadcast
            group's timeout), seconds.
        relays: ``(leader rank, engine indices)`` per node reached through a node leader
            (:mod:`megatron_gigpo.rollout.relay`; the placement plan's
            :func:`~megatron_gigpo.cluster.placement.weight_relays`); the source serves the other engines itself.
    """

    engines: tuple[Any, ...]
    engine_workers: tuple[int, ...]
    engine_nodes: tuple[str, ...]
    version: int
    bucket_size_bytes: int
    transport: str
    spec: WeightSpec
    source_rank: int = 0
    backend: str = "gloo"
    max_inflight_buckets: int = 2
    reuse_shm: bool = True
    timeout_s: float = 600.0
    relays: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def relay_leaders(self) -> tuple[int, ...]:
        """The node leaders' ranks, in relay order."""
        return tuple(leader for leader, _ in self.relays)

    def relay_engines(self, rank: int) -> tuple[int, ...]:
        """Indices of the engines ``rank`` relays to (() when it is no leader)."""
        return next((tuple(engines) for leader, engines in self.relays if leader == rank), ())

    @property
    def direct_engines(self) -> tuple[int, ...]:
        """Indices of the engines the source rank serves itself (those no leader relays to)."""
        relayed = {i for _, engines in self.relays for i in engines}
        return tuple(i for i in range(len(self.engines)) if i not in relayed)

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype to export in (``export_hf_weights(..., dtype=plan.export_dtype)``): the engines' dtype,
        so the TP/PP gathers already move the bytes that travel."""
        return dtype_from_name(self.spec.dtype)

    @property
    def group_key(self) -> str:
        """Identity of the broadcast group (engines and their worker counts)."""
        ids = ",".join(str(getattr(e, "_actor_id", id(e))) for e in self.engines)
        return f"{ids}|{self.engine_workers}|{self.backend}"


@dataclass
class SyncReport:
    """What the source rank measured for one sync (seconds, bytes)."""

    version: int
    checksum: str
    num_tensors: int
    num_buckets: int
    bytes: int
    export_s: float = 0.0  # waiting for the export iterator (TP/PP gathers)
    pack_s: float = 0.0  # cast + copy into the transport buffer
    hash_s: float = 0.0
    send_s: float = 0.0  # waiting for engines to receive and stage
    commit_s: float = 0.0  # engines' checksum check + in-place load + prefix-cache reset
    total_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Flat float metrics under ``weight_sync/``."""
        out = {f"weight_sync/{k}": float(v) for k, v in dataclasses.asdict(self).items() if k != "checksum"}
        out["weight_sync/gb_per_s"] = self.bytes / max(self.total_s, 1e-9) / 1e9
        return out


# The controller waits this much longer than the sync's own deadline, so that the source rank's error (which
# names the engine that did not answer) arrives before the controller's own time-out.
DRIVER_GRACE_S = 120.0
ABORT_TIMEOUT_S = 60.0


def _engine_labels(plan: SyncPlan) -> list[str]:
    return engine_labels(range(len(plan.engines)))


def _remote_error(exc: BaseException) -> BaseException:
    """The engine-side exception inside a Ray error, when there is one."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def prepare_sync(
    engines: Any,
    *,
    version: int,
    bucket_size_bytes: int,
    transport: str,
    backend: str,
    source_rank: int = 0,
    max_inflight_buckets: int = 2,
    timeout_s: float = 600.0,
    relays: Sequence[Sequence[Any]] = (),
) -> SyncPlan:
    """Build the :class:`SyncPlan` (asks every engine for its spec, worker count and node).

    Args:
        engines: a :class:`~megatron_gigpo.rollout.engine.RolloutEngineGroup` or a list of engine handles.
        version: new weights version (int > every engine's current version).
        bucket_size_bytes: export bucket size in bytes (>= 1).
        transport: one of :data:`TRANSPORTS`; a run's is its placement plan's
            (:attr:`megatron_gigpo.cluster.placement.PlacementPlan.transport`, the one place it is decided).
        backend: ``"gloo"`` or ``"nccl"``: the torch.distributed backend of the ``broadcast`` transport and of
            the node relays (:attr:`~megatron_gigpo.cluster.placement.PlacementPlan.collective_backend`: NCCL on
            GPUs).
        source_rank: the export's destination rank.
        max_inflight_buckets: >= 1.
        timeout_s: the sync's deadline in seconds (:attr:`SyncPlan.timeout_s`); also this call's.
        relays: ``(leader rank, engine indices)`` pairs (:func:`megatron_gigpo.cluster.placement.weight_relays` gives them
            for a run's placement plan): engines on other nodes than the source's, reached through a rank on
            their node. Ignored by the ``broadcast`` transport, which reaches every node itself.

    Raises:
        ValueError: bad argument value (also a relay naming the source, an engine twice or an unknown engine).
        WeightSyncError: the engines disagree on their spec.
        megatron_gigpo.deadlines.DeadlineError: an engine did not answer within ``timeout_s``.
    """
    handles = tuple(getattr(engines, "engines", engines))
    if not handles:
        raise ValueError("sync_weights needs at least one engine")
    if bucket_size_bytes < 1 or max_inflight_buckets < 1:
        raise ValueError(f"bucket_size_bytes={bucket_size_bytes} and max_inflight_buckets="
                         f"{max_inflight_buckets} must be >= 1")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; expected one of {TRANSPORTS}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; expected 'gloo' or 'nccl'")
    relays = _check_relays(relays, len(handles), source_rank) if transport in SAME_NODE_TRANSPORTS else ()
    infos = get_with_deadline([e.sync_info.remote() for e in handles], timeout_s, "sync_info of the rollout engines",
                              labels=[f"engine {i}" for i in range(len(handles))])
    spec = infos[0]["spec"]
    for i, info in enumerate(infos[1:], start=1):
        if info["spec"] != spec:
            raise WeightSyncError(f"engine {i} expects other weights than engine 0 (different checkpoints or dtype)")
    return SyncPlan(
        engines=handles,
        engine_workers=tuple(int(info["num_workers"]) for info in infos),
        engine_nodes=tuple(str(info["node_id"]) for info in infos),
        version=int(version),
        bucket_size_bytes=int(bucket_size_bytes),
        transport=transport,
        spec=spec,
        source_rank=source_rank,
        backend=backend,
        max_inflight_buckets=max_inflight_buckets,
        timeout_s=float(timeout_s),
        relays=relays,
    )


def _check_relays(relays: Sequence[Sequence[Any]], num_engines: int, source_rank: int):
    out = tuple((int(r[0]), tuple(int(i) for i in r[1])) for r in relays)
    engines = [i for _, indices in out for i in indices]
    leaders = [leader for leader, _ in out]
    if (len(set(leaders)) != len(leaders) or source_rank in leaders or len(set(engines)) != len(engines)
            or any(not 0 <= i < num_engines for i in engines)):
        raise ValueError(f"relays={out}: each leader rank once and not the source rank {source_rank}, each of the "
                         f"{num_engines} engines at most once")
    return out


def sync_weights(
    actors: Any,
    engines: Any,
    *,
    version: int,
    bucket_size_bytes: int,
    transport: str,
    backend: str,
    method: str = "push_weights",
    timeout_s: float = 600.0,
    relays: Sequence[Sequence[Any]] = (),
) -> dict[str, float]:
    """Push the actor's current weights into every engine as ``version``; returns ``weight_sync/*`` metrics.

    Args:
        actors: an :class:`~megatron_gigpo.actor.group.ActorGroup` (its ``call_all(method, plan)`` runs
            ``PolicyActor.<method>(plan)`` on every rank) or a list of Ray actor handles each with a
            ``<method>(plan)`` remote method. That method must call :func:`push_weights` with the rank's
            ``export_hf_weights(model, bucket_size_bytes=plan.bucket_size_bytes)`` iterator.
        engines: a :class:`~megatron_gigpo.rollout.engine.RolloutEngineGroup` or engine handles.
        version, bucket_size_bytes, transport, backend: see :func:`prepare_sync`.
        method: name of the per-rank method.
        timeout_s: deadline of the sync on the source rank, seconds (the ranks' call gets ``DRIVER_GRACE_S``
            more, so that the source rank's error naming the engine arrives first).
        relays: per-node relays for engines on other nodes than the source rank's (see :func:`prepare_sync`).

    Raises:
        WeightSyncError: the sync failed (an engine that did not answer in time included); every engine still
            serves its previous weights.
        megatron_gigpo.deadlines.DeadlineError: an engine or an actor rank did not answer at all.
    """
    import ray

    plan = prepare_sync(engines, version=version, bucket_size_bytes=bucket_size_bytes, transport=transport,
                        backend=backend, timeout_s=timeout_s, relays=relays)
    try:
        if hasattr(actors, "call_all"):
            results = actors.call_all(method, plan, timeout_s=timeout_s + DRIVER_GRACE_S)
        else:
            results = get_with_deadline([getattr(a, method).remote(plan) for a in actors],
                                        timeout_s + DRIVER_GRACE_S, f"{method} on the actor ranks",
                                        labels=[f"rank {i}" for i in range(len(actors))])
    except ray.exceptions.RayTaskError as exc:
        cause = _remote_error(exc)
        if isinstance(cause, WeightSyncError):
            raise WeightSyncError(str(cause)) from exc
        raise
    reports = [r for r in results if r is not None]
    if len(reports) != 1:
        raise WeightSyncError(
            f"expected exactly one source rank to report, got {len(reports)}: the export's destination must "
            f"be rank {plan.source_rank}"
        )
    return reports[0].metrics()


# ---------------------------------------------------------------------------------------------------------
# Source side
# ---------------------------------------------------------------------------------------------------------


def _digests(flat: torch.Tensor, layout) -> dict[str, bytes]:
    host = flat if flat.device.type == "cpu" else flat[: layout.nbytes].cpu()
    return {name: tensor_digest(name, view) for name, view in unpack_bucket(host, layout)}


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def push_weights(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], plan: SyncPlan) -> SyncReport | None:
    """Run on every actor rank with its export iterator: the source rank sends, node leaders relay
    (:mod:`megatron_gigpo.rollout.relay`), the others only iterate.

    Args:
        buckets: ``export_hf_weights(model, bucket_size_bytes=plan.bucket_size_bytes)`` of this rank:
            lists of ``(hf_name, tensor)``, full (unsharded) tensors on the source rank.
        plan: from :func:`prepare_sync`.

    Returns:
        The :class:`SyncReport` on the source rank, None on the others.

    Raises:
        WeightSyncError: on the source rank, after the iterator is exhausted (so the other ranks' collectives
            complete) and every engine has aborted the update; a node leader's failure is raised here too.
    """
    rank = _rank()
    if plan.relays:
        relay_group(plan)  # a collective of every actor rank, the first time
    if rank == plan.source_rank:
        return _push_from_source(buckets, plan)
    if plan.relay_engines(rank):
        serve_node(buckets, plan, rank)
        return None
    for _ in buckets:
        pass
    return None


def _push_from_source(buckets, plan: SyncPlan) -> SyncReport:
    import ray

    start = time.perf_counter()
    started = time.monotonic()  # every wait below ends plan.timeout_s after this
    labels = _engine_labels(plan)
    report = SyncReport(plan.version, "", 0, 0, 0)
    error: BaseException | None = None
    sender: EngineSender | None = None
    relay = RelaySource(plan)
    try:
        get_with_deadline([e.begin_weight_update.remote(plan.version) for e in plan.engines], plan.timeout_s,
                          f"begin_weight_update (version {plan.version}) on the rollout engines", labels=labels,
                          started_at=started)
        sender = EngineSender(plan, plan.direct_engines, f"the source rank {plan.source_rank}")
        digests = _send_all(buckets, plan, sender, relay, report, started)
        _raise_relay_errors(relay.close())
        plan.spec.check_complete(set(digests))
        report.checksum = combine_digests(digests)
        _commit(plan, report, started)
    except ray.exceptions.RayTaskError as exc:
        error = WeightSyncError(str(_remote_error(exc)))
        error.__cause__ = exc
    except BaseException as exc:  # noqa: BLE001 - every failure must abort the engines' staged update
        error = exc
    if error is not None:
        _abort(buckets, plan, relay)
    if sender is not None:
        sender.finish()
    if error is not None:
        if isinstance(error, WeightSyncError):
            raise error
        raise WeightSyncError(
            f"weight sync of version {plan.version} failed: {type(error).__name__}: {error}") from error
    report.total_s = time.perf_counter() - start
    return report


def _raise_relay_errors(failures: dict[int, str]) -> None:
    if failures:
        raise WeightSyncError("relay to the engines of another node failed: " + "; ".join(failures.values()))


def _commit(plan: SyncPlan, report: SyncReport, started: float) -> None:
    """Every engine checks the checksum of what it staged against the source's and loads; check the reports."""
    tick = time.perf_counter()
    results = get_with_deadline(
        [e.commit_weight_update.remote(plan.version, report.checksum) for e in plan.engines],
        plan.timeout_s, f"commit_weight_update (version {plan.version}) on the rollout engines",
        labels=_engine_labels(plan), started_at=started)
    report.commit_s = time.perf_counter() - tick
    for i, (version, checksum) in enumerate(results):
        if (version, checksum) != (plan.version, report.checksum):
            raise WeightSyncError(
                f"engine {i} reports weights (version {version}, checksum {checksum}) after the sync of "
                f"(version {plan.version}, checksum {report.checksum})"
            )


def _abort(buckets, plan: SyncPlan, relay: RelaySource) -> None:
    """Finish the export (the other ranks may be inside its collectives; the leaders learn of the abort at the
    next bucket), collect the leaders' statuses, and drop every engine's staging."""
    import ray

    for _ in buckets:
        relay.abort()
    try:
        for text in relay.close().values():
            log.warning("weight sync aborted; %s", text)
    except Exception as exc:  # noqa: BLE001 - an out-of-step relay must not hide the sync's error
        log.warning("the relay's status exchange failed: %s", exc)
    try:
        get_with_deadline([e.abort_weight_update.remote() for e in plan.engines], ABORT_TIMEOUT_S,
                          "abort_weight_update on the rollout engines", labels=_engine_labels(plan))
    except (ray.exceptions.RayError, TimeoutError) as exc:  # a dead or hung engine must not hide the sync's error
        log.warning("abort_weight_update failed on an engine: %s", exc)


def _send_all(buckets, plan: SyncPlan, sender: EngineSender, relay: RelaySource, report: SyncReport,
              started: float) -> dict[str, bytes]:
    """Validate, pack, hash and send every bucket: to the source's own engines and to the node leaders."""
    digests: dict[str, bytes] = {}
    seen: set[str] = set()
    inflight: deque = deque()  # (refs, keepalive, flat)

    def settle(limit: int) -> None:
        while len(inflight) > limit:
            refs, keepalive, _ = inflight.popleft()
            tick = time.perf_counter()
            try:
                get_with_deadline(refs, plan.timeout_s, f"receive_bucket (version {plan.version}) on the "
                                  "rollout engines", labels=sender.labels, started_at=started)
            finally:
                sender.done(keepalive)
            report.send_s += time.perf_counter() - tick

    try:
        tick = time.perf_counter()
        for bucket in buckets:
            report.export_s += time.perf_counter() - tick
            try:
                _send_one(list(bucket), plan, sender, relay, report, digests, seen, settle, inflight)
            except BaseException:
                relay.abort()  # in this bucket's turn: the leaders wait for its header before their next bucket
                raise
            tick = time.perf_counter()
        settle(0)
    finally:
        for _, keepalive, _ in inflight:
            sender.done(keepalive)
    return digests


def _send_one(bucket, plan: SyncPlan, sender: EngineSender, relay: RelaySource, report: SyncReport,
              digests: dict[str, bytes], seen: set[str], settle, inflight: deque) -> None:
    if not bucket:
        relay.skip()
        return
    for name, tensor in bucket:
        plan.spec.check_tensor(name, tensor.shape, seen)
    t0 = time.perf_counter()
    flat, layout, keepalive = sender.pack(bucket)
    t1 = time.perf_counter()
    digests.update(_digests(flat, layout))
    t2 = time.perf_counter()
    report.pack_s += t1 - t0
    report.hash_s += t2 - t1
    settle(plan.max_inflight_buckets - 1)
    refs = sender.send(flat, layout, keepalive)
    inflight.append((refs, keepalive, flat))
    t3 = time.perf_counter()
    relay.send(flat, layout)  # the leaders hand it to their engines while this rank exports the next bucket
    report.send_s += time.perf_counter() - t3
    report.num_buckets += 1
    report.num_tensors += len(bucket)
    report.bytes += layout.nbytes
