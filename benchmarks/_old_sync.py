"""The weight sync as it was before #39 (main's ``rollout/sender.py``, ``weight_sync.py``, ``engine.py`` and
``worker_extension.py``), trimmed to its CPU colocated path (``shm``), for ``benchmarks/resharding.py`` only.

What it keeps of the old path, step for step: the source rank casts and packs each export bucket into a pooled
shared-memory file, hashes every tensor (BLAKE3), and sends the file's path to the engine with two buckets in
flight; the engine actor checks names and shapes, its worker (a vLLM worker extension) maps the file, hashes the
views and stages them; the commit compares the checksums, loads everything in place
(``model_runner.reload_weights``, checkpoint format), refreshes a tied lm_head and resets the prefix cache. Left
out: relays, the broadcast and CUDA IPC transports, deadlines and the abort paths (no error happens here).

The engine is a bare ``vllm.LLM`` in a Ray actor (:class:`OldEngine`), built like ``RolloutEngine`` builds a TP-1
CPU engine (everything in the actor's process); ``benchmarks/`` must be on the actor's ``PYTHONPATH`` (vLLM
imports the worker extension by name).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    SharedMemoryPool,
    dtype_from_name,
    open_shared_memory_bucket,
    pack_bucket,
    plan_layout,
    unpack_bucket,
)

_POOL: list[SharedMemoryPool] = []  # the source rank's shm files, kept between syncs (main's reuse_shm=True)


class OldWorkerExtension:
    """main's ``WeightSyncWorkerExtension``, ``shm`` path (mixed into the vLLM worker by vLLM)."""

    def weight_sync_begin(self) -> None:
        self._wsync_buckets = []

    def weight_sync_receive_shm(self, path: str, layout_wire: dict[str, Any]) -> list[str]:
        flat = open_shared_memory_bucket(path, int(layout_wire["nbytes"]))
        views = unpack_bucket(flat, BucketLayout.from_wire(layout_wire))
        digests = [tensor_digest(name, view).hex() for name, view in views]
        self._wsync_buckets.append((views, flat))
        return digests

    @torch.no_grad()
    def weight_sync_apply(self) -> int:
        weights = [pair for views, _ in self._wsync_buckets for pair in views]
        try:
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            model = self.model_runner.model
            lm_head = getattr(model, "lm_head", None)
            if lm_head is not None and getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
                lm_head.quant_method.process_weights_after_loading(lm_head)
        finally:
            self._wsync_buckets = []
        return len(weights)


class OldEngine:
    """main's ``RolloutEngine`` weight-sync methods over a bare TP-1 CPU ``vllm.LLM`` (wrap with ``ray.remote``)."""

    def __init__(self, model_path: str, dtype: str, kv_cache_bytes: int, max_model_len: int = 512):
        from vllm import LLM

        from megatron_gigpo.rollout.spec import read_checkpoint_spec

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as RolloutEngine's "uni" CPU engine
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=0, enforce_eager=True,
                       enable_prefix_caching=True, kv_cache_memory_bytes=kv_cache_bytes, enable_chunked_prefill=False,
                       max_num_batched_tokens=8192, distributed_executor_backend="uni",
                       worker_extension_cls="_old_sync.OldWorkerExtension")
        self.spec = read_checkpoint_spec(model_path, dtype)
        self.version, self._seen, self._digests = 0, set(), {}

    def ready(self) -> bool:
        return True

    def begin_weight_update(self, version: int) -> None:
        assert version > self.version
        self.llm.collective_rpc("weight_sync_begin")
        self._seen, self._digests = set(), {}

    def receive_bucket(self, desc: dict[str, Any]) -> int:
        layout = BucketLayout.from_wire(desc["layout"])
        for name, shape in zip(layout.names, layout.shapes):
            self.spec.check_tensor(name, shape, self._seen)
        (digests,) = self.llm.collective_rpc("weight_sync_receive_shm", args=(desc["path"], desc["layout"]))
        self._digests.update(zip(layout.names, (bytes.fromhex(h) for h in digests)))
        return len(layout.names)

    def commit_weight_update(self, version: int, checksum: str) -> tuple[int, str]:
        self.spec.check_complete(self._seen)
        staged = combine_digests(self._digests)
        if staged != checksum:
            raise RuntimeError(f"checksum mismatch: trainer {checksum}, engine {staged}")
        self.llm.collective_rpc("weight_sync_apply")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache")
        self.version = version
        return version, staged

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def old_push(buckets, engine, version: int, dtype: str, timeout_s: float, max_inflight: int = 2) -> dict[str, float]:
    """main's source-rank push over ``shm`` into one :class:`OldEngine`; returns its time split (seconds).
    Non-source ranks pass ``engine=None`` and only iterate their (empty) buckets."""
    import time

    from megatron_gigpo.deadlines import get_with_deadline

    if engine is None:
        for _ in buckets:
            pass
        return {}
    start = time.perf_counter()
    wire_dtype = dtype_from_name(dtype)
    if not _POOL:
        _POOL.append(SharedMemoryPool())
    pool = _POOL[0]
    get_with_deadline(engine.begin_weight_update.remote(version), timeout_s, "old begin_weight_update")
    digests: dict[str, bytes] = {}
    inflight: deque = deque()
    pack_s = hash_s = 0.0
    for bucket in buckets:
        if not bucket:
            continue
        tick = time.perf_counter()
        shm = pool.acquire(plan_layout(bucket, wire_dtype).nbytes)
        flat, layout = pack_bucket(bucket, wire_dtype, out=shm.buffer)
        pack_s += time.perf_counter() - tick
        tick = time.perf_counter()
        digests.update((name, tensor_digest(name, view)) for name, view in unpack_bucket(flat, layout))
        hash_s += time.perf_counter() - tick
        inflight.append(engine.receive_bucket.remote({"path": shm.path, "layout": layout.to_wire()}))
        if len(inflight) >= max_inflight:
            get_with_deadline(inflight.popleft(), timeout_s, "old receive_bucket")
    get_with_deadline(list(inflight), timeout_s, "old receive_bucket")
    tick = time.perf_counter()
    get_with_deadline(engine.commit_weight_update.remote(version, combine_digests(digests)), timeout_s,
                      "old commit_weight_update")
    commit_s = time.perf_counter() - tick
    pool.release_all()
    return {"pack_s": pack_s, "hash_s": hash_s, "commit_s": commit_s, "total_s": time.perf_counter() - start}
