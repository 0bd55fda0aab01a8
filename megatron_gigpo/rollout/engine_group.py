"""K vLLM rollout engines (:class:`~megatron_gigpo.rollout.engine.RolloutEngine` Ray actors) behind one
``generate``: each batch is split over them in contiguous chunks (data parallel), preserving order; start, calls
and shutdown under the recipe's deadlines (``trainer.timeouts``).

Sampling seeds are per prompt (``seed + global prompt index``), so results do not depend on how a batch is split
over engines. Upstream API: Ray actor handles and ``ray.wait`` / ``ray.kill`` (Ray 2.60).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.config import RolloutConfig
from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine
from megatron_gigpo.rollout.sampling import GenerationResult, SamplingConfig, TokenizerInfo
from megatron_gigpo.run.config import TimeoutsConfig

__all__ = ["RolloutEngineGroup"]

log = logging.getLogger(__name__)


class RolloutEngineGroup:
    """K rollout engines (data parallel) behind one ``generate``.

    Args:
        model_path: HF checkpoint directory.
        rollout: the recipe's ``rollout`` section (K = ``num_engines``, TP, context, KV cache; see
            :class:`EngineConfig`).
        dtype: model and weight-transfer dtype (the actor's).
        ray_options: extra ``.options()`` for every engine actor (e.g. a placement-group strategy), or a list
            with one dict per engine (the placement plan's :func:`megatron_gigpo.cluster.placement.engine_options`).
        timeouts: the recipe's ``trainer.timeouts``: ``engine_start_s`` (placement, weight load, KV-cache
            allocation), ``generate_s`` (one :meth:`generate` / :meth:`compute_log_probs` batch) and
            ``engine_call_s`` (sleep, wake-up, version and tokenizer queries), seconds.
        wait: wait for the start here (:meth:`wait_started`); False returns once the engine actors are
            launched, so the caller can do other work while they start, then call :meth:`wait_started`.
        **engine_kwargs: the other :class:`EngineConfig` fields (seed, num_cpus, max_num_seqs, ...).

    Raises:
        ValueError: a ``ray_options`` list of another length than ``rollout.num_engines``, or a bad
            :class:`EngineConfig` field.
        megatron_gigpo.deadlines.DeadlineError: (``wait``) an engine did not start in time (the message names
            it, its node, or that no node had its resources); every engine is stopped.
    """

    def __init__(self, model_path: str, rollout: RolloutConfig, *, dtype: str,
                 ray_options: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 timeouts: TimeoutsConfig | None = None, wait: bool = True, **engine_kwargs: Any):
        timeouts = timeouts or TimeoutsConfig()
        self.config = EngineConfig(model_path=str(model_path), dtype=dtype, rollout=rollout, **engine_kwargs)
        num_engines = rollout.num_engines
        per_engine = [ray_options or {}] * num_engines if not isinstance(ray_options, Sequence) else list(ray_options)
        if len(per_engine) != num_engines:
            raise ValueError(f"ray_options has {len(per_engine)} entries for num_engines={num_engines}")
        self.generate_timeout_s, self.call_timeout_s = timeouts.generate_s, timeouts.engine_call_s
        self.engines = [RolloutEngine.launch(self.config, **options) for options in per_engine]
        self._ray_options = per_engine
        self._start_clock = (time.monotonic(), timeouts.engine_start_s)  # the start deadline runs from here
        self._starting = [e.ready.remote() for e in self.engines]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every engine has started (the constructor launched them), at most until the start deadline
        (``engine_start_s`` after construction); at once when they already have.

        Raises:
            megatron_gigpo.deadlines.DeadlineError: an engine did not start in time (the message names it, its
                node, or that no node had its resources); every engine is stopped.
            ray.exceptions.RayError: an engine failed to start; every engine is stopped.
        """
        import ray

        if not self._starting:
            return

        def resources() -> str:
            return (f"engine .options(): {self._ray_options}, num_cpus={self.config.num_cpus}; cluster resources "
                    f"available: {ray.available_resources()}")

        try:
            started_at, timeout_s = self._start_clock
            get_with_deadline(self._starting, timeout_s, "vLLM rollout engine start", labels=self._labels(),
                              context=resources, started_at=started_at)
        except BaseException:
            self.shutdown()
            raise
        self._starting = []

    def _labels(self, suffix: str = "") -> list[str]:
        return [f"engine {k}{suffix}" for k in range(len(self.engines))]

    def _get(self, refs: list, what: str, timeout_s: float, labels: list[str] | None = None) -> list:
        return get_with_deadline(refs, timeout_s, what, labels=labels or self._labels())

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[GenerationResult]:
        """Split the batch into K contiguous chunks (sizes differ by at most one), generate, concatenate.

        Raises:
            megatron_gigpo.deadlines.DeadlineError: an engine did not answer within ``generate_timeout_s``.
        """
        chunks = zip(self.engines, self._chunks(len(prompt_token_ids)))
        parts = [(k, e, lo, hi) for k, (e, (lo, hi)) in enumerate(chunks) if hi > lo]
        refs = [e.generate.remote(prompt_token_ids[lo:hi], sampling, index_offset=lo) for _, e, lo, hi in parts]
        labels = [f"engine {k} ({hi - lo} prompts)" for k, _, lo, hi in parts]
        chunks = self._get(refs, "generate on the rollout engines", self.generate_timeout_s, labels)
        return [dataclasses.replace(result, engine=k) for (k, *_), chunk in zip(parts, chunks) for result in chunk]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """K contiguous [lo, hi) ranges covering n items, sizes differing by at most one."""
        k = len(self.engines)
        bounds = [i * n // k for i in range(k + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def compute_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """:meth:`RolloutEngine.compute_log_probs`, split over the engines like :meth:`generate`."""
        parts = [(k, e, lo, hi) for k, (e, (lo, hi)) in enumerate(zip(self.engines, self._chunks(len(sequences))))
                 if hi > lo]
        refs = [e.compute_log_probs.remote(sequences[lo:hi]) for _, e, lo, hi in parts]
        labels = [f"engine {k} ({hi - lo} sequences)" for k, _, lo, hi in parts]
        return [row for chunk in self._get(refs, "log-probs on the rollout engines", self.generate_timeout_s, labels)
                for row in chunk]

    def tokenizer_info(self) -> TokenizerInfo:
        return self._get([self.engines[0].tokenizer_info.remote()], "tokenizer_info of a rollout engine",
                         self.call_timeout_s, self._labels()[:1])[0]

    def weights_version(self) -> list[tuple[int, str | None]]:
        """``(version, checksum)`` per engine."""
        return self._get([e.weights_version.remote() for e in self.engines], "weights_version of the rollout engines",
                         self.call_timeout_s)

    def sleep(self) -> None:
        self._get([e.sleep.remote() for e in self.engines], "sleep of the rollout engines", self.call_timeout_s)

    def wake_up(self) -> None:
        self._get([e.wake_up.remote() for e in self.engines], "wake_up of the rollout engines", self.call_timeout_s)

    def shutdown(self) -> None:
        """Stop vLLM in every engine that has started, then kill the engine actors (one still starting, unplaced
        or hung is killed at once)."""
        import ray

        flags = [True] * len(self.engines)
        if self._starting:
            ready = set(ray.wait(self._starting, num_returns=len(self._starting), timeout=0)[0])
            flags = [ref in ready for ref in self._starting]
            self._starting = []
        refs = [e.shutdown.remote() for e, up in zip(self.engines, flags) if up]
        try:
            ray.get(refs, timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck engine must not stop the others' shutdown
            log.warning("rollout engine shutdown: %r", exc)
        for engine in self.engines:
            ray.kill(engine)
        self.engines = []
