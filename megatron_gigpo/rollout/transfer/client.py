"""The trainer's control plane to K rollout engines: vLLM's ``VLLMWeightSyncClient`` over RolloutEngine Ray actors.

vLLM 0.32's trainer engines (``vllm.distributed.weight_transfer.base.TrainerWeightTransferEngine``) drive an update
through four calls on a client: ``init_weight_transfer_engine(init_info)``, ``start_weight_update()``,
``update_weights(update_info)``, ``finish_weight_update(weight_version=None)``. vLLM's own
``RayVLLMWeightSyncClient`` waits forever, sends one init info to every engine and passes no version; this client
(:class:`EngineGroupClient`) fans every call out to the engines of one sync with a deadline
(:func:`megatron_gigpo.deadlines.get_with_deadline`, late engines named ``"engine k"``), rewrites the init info per
engine (``rank_offset`` of a broadcast group, ``node_key`` of a shared-memory node), holds the sync's version, and
turns ``finish_weight_update()`` into commit + finish: before the engines load, it sends the commit chunk with the
source's checksum (or, if the source recorded an error, aborts) and checks what every engine then serves.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.errors import WeightSyncError

__all__ = ["EngineGroupClient", "ABORT_TIMEOUT_S", "remote_error"]

log = logging.getLogger(__name__)

# Each abort call gets this long, from its own start (the sync's deadline may already be spent).
ABORT_TIMEOUT_S = 60.0


def remote_error(exc: BaseException) -> BaseException:
    """The engine-side exception inside a Ray error (``RayTaskError.cause``), else ``exc``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class EngineGroupClient:
    """``VLLMWeightSyncClient`` (vLLM 0.32, structural protocol) over :class:`~megatron_gigpo.rollout.engine.RolloutEngine`
    handles.

    Args:
        engines: Ray handles of the engines, in the sync plan's order (index k = label ``"engine k"``).
        engine_workers: vLLM workers (TP size) of each engine, same order (for the per-engine ``rank_offset``).
        timeout_s: deadline of one sync in seconds; every wait of a sync counts from :meth:`begin`.

    Per sync, the caller first calls :meth:`begin` (version, the source whose checksum the commit carries).
    Errors of the engines arrive as :class:`WeightSyncError` (the engine's message), a time-out as
    :class:`megatron_gigpo.deadlines.DeadlineError` naming the late engines.
    """

    def __init__(self, engines: Sequence[Any], engine_workers: Sequence[int], timeout_s: float) -> None:
        self.engines = tuple(engines)
        self.engine_workers = tuple(int(n) for n in engine_workers)
        if len(self.engine_workers) != len(self.engines):
            raise ValueError(f"{len(self.engines)} engines but {len(self.engine_workers)} worker counts")
        self.timeout_s = float(timeout_s)
        self.labels = [f"engine {k}" for k in range(len(self.engines))]
        self.version: int | None = None
        self.source: Any = None
        self.aborted = False
        self.served: list[tuple[int, str | None]] = []
        self.commit_s = 0.0
        self._started = time.monotonic()

    # ------------------------------------------------------------------------------------------- per sync
    def begin(self, version: int, source: Any = None) -> None:
        """Start the clock of a sync of ``version``; ``source`` (``.checksum()``, ``.error``) feeds the commit."""
        self.version, self.source, self.aborted, self.served = int(version), source, False, []
        self.commit_s = 0.0
        self._started = time.monotonic()

    def _wait(self, refs: list, what: str, *, timeout_s: float | None = None, fresh: bool = False) -> list:
        import ray

        try:
            return get_with_deadline(refs, timeout_s or self.timeout_s, f"{what} on the rollout engines",
                                     labels=self.labels[: len(refs)], started_at=None if fresh else self._started)
        except ray.exceptions.RayTaskError as exc:
            cause = remote_error(exc)
            raise WeightSyncError(f"{self._failed(refs)}{what} failed: {cause}") from exc

    def _failed(self, refs: list) -> str:
        """``"engine k: "`` for the first engine among ``refs`` whose call raised, else ``""``."""
        import ray

        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for k, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    return f"{self.labels[k]}: "
        return ""

    def wait(self, refs: list, what: str) -> list:
        """Wait for refs from one of the ``*_async`` calls, within the sync's deadline."""
        return self._wait(refs, what)

    # ------------------------------------------------------------------------------ the protocol (4 calls)
    def per_engine_init_info(self, init_info: dict[str, Any] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """One init info per engine: a list is taken as is; a dict with ``rank_offset`` (vLLM's NCCL trainer sends 1
        to every engine, so K engines would collide) gets ``rank_offset + workers of the engines before k``."""
        if not isinstance(init_info, dict):
            infos = [dict(info) for info in init_info]
            if len(infos) != len(self.engines):
                raise ValueError(f"{len(infos)} init infos for {len(self.engines)} engines")
            return infos
        if "rank_offset" not in init_info:
            return [dict(init_info) for _ in self.engines]
        base = int(init_info["rank_offset"])
        return [{**init_info, "rank_offset": base + sum(self.engine_workers[:k])} for k in range(len(self.engines))]

    def init_weight_transfer_engine_async(self, init_info: dict[str, Any] | Sequence[dict[str, Any]]) -> list:
        """Issue ``RolloutEngine.init_weight_transfer_engine`` on every engine (see :meth:`per_engine_init_info`);
        returns the refs (a broadcast group's members block in it until the trainer joins)."""
        infos = self.per_engine_init_info(init_info)
        return [e.init_weight_transfer_engine.remote(info) for e, info in zip(self.engines, infos)]

    def init_weight_transfer_engine(self, init_info: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """vLLM protocol: create each engine's transfer engine from its init info (``{"dtype", ...}``)."""
        self._wait(self.init_weight_transfer_engine_async(init_info), "init_weight_transfer_engine", fresh=True)

    def start_weight_update(self) -> None:
        """vLLM protocol: ``RolloutEngine.start_weight_update(version)`` on every engine (refused unless the version
        exceeds what it serves)."""
        if self.version is None:
            raise WeightSyncError("start_weight_update before EngineGroupClient.begin(version)")
        self._wait([e.start_weight_update.remote(self.version) for e in self.engines],
                   f"start_weight_update (version {self.version})")

    def update_weights_async(self, update_info: dict[str, Any] | Sequence[dict[str, Any]]) -> list:
        """Issue one ``update_weights`` chunk on every engine (a list: one chunk per engine); returns the refs."""
        infos = update_info if isinstance(update_info, (list, tuple)) else [update_info] * len(self.engines)
        if isinstance(update_info, dict) and "abort" in update_info:
            self.aborted = True
        return [e.update_weights.remote(info) for e, info in zip(self.engines, infos, strict=True)]

    def update_weights(self, update_info: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """vLLM protocol: one chunk (bucket, ``{"commit": hex}`` or ``{"abort": reason}``) on every engine."""
        self._wait(self.update_weights_async(update_info), f"update_weights (version {self.version})")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM protocol, completed with what it lacks: after an abort, end the engines' session without loading;
        otherwise commit (the source's checksum, checked by every engine against what it staged) and finish as
        ``str(version)``, then check that every engine serves ``(version, checksum)``.

        Raises:
            WeightSyncError: the source recorded an error, an engine refused the commit or finish, or serves something
                else afterwards; the caller then aborts the update (:meth:`abort`).
        """
        if self.aborted:
            self._wait([e.finish_weight_update.remote(None) for e in self.engines], "finish_weight_update(None)",
                       timeout_s=ABORT_TIMEOUT_S, fresh=True)
            return
        version = str(self.version) if weight_version is None else str(weight_version)
        checksum = None
        tick = time.perf_counter()
        if self.source is not None:
            error = getattr(self.source, "error", None)
            if error is not None:  # the caller aborts the engines (push_weights)
                raise WeightSyncError(str(error))
            checksum = self.source.checksum()
            self.update_weights({"commit": checksum})
        self.served = self._wait([e.finish_weight_update.remote(version) for e in self.engines],
                                 f"finish_weight_update (version {version})")
        self.commit_s = time.perf_counter() - tick
        for k, served in enumerate(self.served):
            if checksum is not None and tuple(served) != (int(version), checksum):
                raise WeightSyncError(f"engine {k} reports weights (version {served[0]}, checksum {served[1]}) after "
                                      f"the sync of (version {version}, checksum {checksum})")

    # ------------------------------------------------------------------------------------------ abort
    def abort(self, reason: str) -> None:
        """Every engine drops the update and keeps serving its weights: the abort chunk, ``finish(None)`` (each may be
        refused by an engine whose update already ended: logged), then ``RolloutEngine.abort_weight_update`` (ends
        vLLM's session on every worker; idempotent). Never raises: the sync's own error is what the caller raises."""
        import ray

        self.aborted = True
        steps = (("update_weights(abort)", lambda e: e.update_weights.remote({"abort": reason})),
                 ("finish_weight_update(None)", lambda e: e.finish_weight_update.remote(None)),
                 ("abort_weight_update", lambda e: e.abort_weight_update.remote()))
        for what, call in steps:
            try:
                refs = [call(e) for e in self.engines]
                get_with_deadline(refs, ABORT_TIMEOUT_S, f"{what} on the rollout engines", labels=self.labels)
            except (ray.exceptions.RayError, TimeoutError, WeightSyncError) as exc:
                log.warning("weight sync abort (version %s), %s: %s", self.version, what, remote_error(exc))
