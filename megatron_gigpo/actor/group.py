"""Megatron actor ranks hosted as Ray actors, driven as one object by the single controller.

Each :class:`ActorWorker` is one torch.distributed rank holding a
:class:`megatron_gigpo.actor.policy.PolicyActor`. :class:`ActorGroup` places the ranks where the run's
placement plan says (:mod:`megatron_gigpo.cluster.placement`: one bundle per rank, a GPU or a CPU slot on the CPU path),
wires the process group (``MASTER_ADDR``/``MASTER_PORT`` of rank 0) and broadcasts every call to all ranks,
since every Megatron operation is a collective. Results come from the rank the policy documents (the last pipeline stage's
first rank for log-probs and losses).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Sequence

import ray

from megatron_gigpo.actor.config import ActorConfig
from megatron_gigpo.deadlines import get_with_deadline


class ActorWorker:
    """One actor rank (wrapped with ``ray.remote`` by :class:`ActorGroup`)."""

    def __init__(self, rank: int, world_size: int, env_vars: dict[str, str]):
        self.rank, self.world_size = rank, world_size
        os.environ.update(env_vars)
        if "OMP_NUM_THREADS" in env_vars:
            # torch was imported (with this module) before the variable changed, and read Ray's default
            # OMP_NUM_THREADS (the actor's num_cpus, often 1) then: set its intra-op pool explicitly.
            import torch

            torch.set_num_threads(int(env_vars["OMP_NUM_THREADS"]))
        self.policy = None

    @staticmethod
    def address() -> tuple[str, int]:
        """This node's IP and a free TCP port, for rank 0 to serve as MASTER_ADDR/MASTER_PORT."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, master: tuple[str, int], cfg: ActorConfig) -> None:
        """Join the process group at ``master`` (rank 0's :meth:`address`) and build the policy (and reference)
        model from ``cfg.model_path``."""
        master_addr, master_port = master
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )
        from megatron_gigpo.actor.policy import PolicyActor

        self.policy = PolicyActor(cfg)

    def push_weights(self, plan) -> Any:
        """Export this rank's HF-named buckets into the engines (collective; see rollout.weight_sync)."""
        from megatron_gigpo.rollout.weight_sync import push_weights

        metadata = self.policy.export_metadata(dtype=plan.export_dtype) if plan.needs_metadata else None
        buckets = self.policy.export_weights(plan.bucket_size_bytes, dtype=plan.export_dtype,
                                             destination=plan.export_destination)
        return push_weights(buckets, plan, metadata=metadata)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``PolicyActor.<method>``, or one of this worker's own collectives (``push_weights``)."""
        target = self.push_weights if method == "push_weights" else getattr(self.policy, method)
        return target(*args, **kwargs)


class ActorGroup:
    """All actor ranks of one Megatron model, each in the bundle its placement plan gives it.

    Args:
        cfg: the per-rank actor settings (same on every rank).
        rank_options: one ``.options()`` dict per rank (index = rank; CPU / GPU request and placement-group
            scheduling: :func:`megatron_gigpo.cluster.placement.slot_options`); the world size is its length.
        env_vars: environment of the rank processes (e.g. thread counts).
        start_timeout_s: deadline of the start (placement of the rank actors, process group, model build and
            weight load), seconds.
        call_timeout_s: default deadline of one call on the ranks (log-probs, update, checkpoint), seconds.
        wait: wait for the start here (:meth:`wait_started`); False returns at once, so the caller can start
            other work (the CPU path's vLLM engines) while the ranks build their models, then call
            :meth:`wait_started` before any other call.

    Raises:
        megatron_gigpo.deadlines.DeadlineError: (``wait``) a rank did not start in time (the ranks are stopped).
    """

    def __init__(self, cfg: ActorConfig, rank_options: Sequence[dict[str, Any]], *, env_vars: dict[str, str],
                 start_timeout_s: float = 1800.0, call_timeout_s: float = 10800.0, wait: bool = True):
        remote_cls = ray.remote(ActorWorker)
        self.call_timeout_s = call_timeout_s
        world_size = len(rank_options)
        self.workers = [remote_cls.options(**options).remote(i, world_size, env_vars)
                        for i, options in enumerate(rank_options)]
        self._start_clock = (time.monotonic(), start_timeout_s)  # the start deadline runs from here
        master = self.workers[0].address.remote()  # Ray resolves it before any rank's init runs
        self._starting = [w.init.remote(master, cfg) for w in self.workers]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every rank has started (the constructor launched the start), at most until the start
        deadline (``start_timeout_s`` after construction); at once when they already have.

        Raises:
            megatron_gigpo.deadlines.DeadlineError: a rank did not start in time (the ranks are stopped).
            ray.exceptions.RayError: a rank failed to start (the ranks are stopped).
        """
        if not self._starting:
            return
        started_at, timeout_s = self._start_clock
        try:
            get_with_deadline(self._starting, timeout_s,
                              "actor ranks start (placement, process group, model build, weight load)",
                              labels=[f"rank {i}" for i in range(len(self._starting))], started_at=started_at)
        except BaseException:
            self.shutdown()
            raise
        self._starting = []

    def _all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        refs = [w.call.remote(method, *args, **kwargs) for w in self.workers]
        return get_with_deadline(refs, timeout_s or self.call_timeout_s, f"PolicyActor.{method} on the actor ranks",
                                 labels=[f"rank {i}" for i in range(len(refs))])

    @staticmethod
    def _first(results: list[Any]) -> Any:
        for result in results:
            if result is not None:
                return result
        return None

    def compute_log_probs(self, batch, *, reference: bool = False) -> list:
        """Per-row response log-probs, float32 (R_i,), from the policy (or the frozen reference)."""
        ref = ray.put(batch)
        return self._first(self._all("compute_log_probs", ref, reference=reference))

    def update(self, batch, row_advantages, old_log_probs, ref_log_probs) -> tuple[dict[str, float], list]:
        """One ``PolicyActor.update`` (ppo_epochs x mini-batches optimizer steps) on every rank.

        ``old_log_probs=None`` asks for an on-policy update (one optimizer step; ValueError otherwise, see
        :meth:`megatron_gigpo.actor.policy.PolicyActor.update`).

        Returns:
            ``(metrics, old_log_probs)`` of the first rank, as
            :meth:`megatron_gigpo.actor.policy.PolicyActor.update` returns it: the rank-reduced metrics, and the
            old log-probs the update used (per row float32 (R_i,): copies of the given ones, or on-policy those
            the update computed before its step).
        """
        refs = [ray.put(x) for x in (batch, row_advantages, old_log_probs, ref_log_probs)]
        return self._first(self._all("update", *refs))

    def save_checkpoint(self, root: str, iteration: int, trainer_state: dict, *, keep_last: int) -> None:
        """Atomic dist_checkpointing save of model, optimizer, RNG and ``trainer_state``; keeps the last k."""
        self._all("save_checkpoint", root, iteration, trainer_state, keep_last=keep_last)

    def load_checkpoint(self, root: str) -> dict | None:
        return self._first(self._all("load_checkpoint", root))

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``PolicyActor.<method>`` on every rank (a collective); returns the per-rank results.

        ``timeout_s``: this call's deadline (default: the group's ``call_timeout_s``).

        Raises:
            megatron_gigpo.deadlines.DeadlineError: some rank did not answer in time.
        """
        return self._all(method, *args, timeout_s=timeout_s, **kwargs)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
