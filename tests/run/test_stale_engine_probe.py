"""The asynchronous rollout's probe of the stale-engine alarm (docs/async-rollout-design.md D6): what is
generated again after a sync, and the batch the actor scores."""

import pytest
import torch

from megatron_gigpo.episodes.batch import TrainingBatch
from megatron_gigpo.rollout.sampling import GenerationResult, SamplingConfig
from megatron_gigpo.run.stale_engine import (PROBE_MAX_TOKENS, StaleEngineError, check_engines, engine_gaps, probe_batch,
                                             probe_rows, probe_sampling)

pytestmark = pytest.mark.unit


def _batch(n: int) -> TrainingBatch:
    return TrainingBatch(
        prompt_ids=[torch.arange(i, i + 4) for i in range(n)], response_ids=[torch.arange(3) for _ in range(n)],
        rollout_log_probs=[torch.full((3,), -0.5) for _ in range(n)], uid=[f"g{i // 2}" for i in range(n)],
        traj_id=[f"t{i}" for i in range(n)], step_index=torch.zeros(n, dtype=torch.int64), anchor=["s"] * n,
        env_reward=torch.zeros(n, dtype=torch.float64), action_valid=torch.ones(n, dtype=torch.bool),
        extras={"engine": [i % 2 for i in range(n)], "weight_version": [3] * n, "actions": [f"a{i}" for i in range(n)],
                "env_name": "sokoban"})


def test_probe_sampling_is_the_training_sampling_shortened_with_a_fixed_seed():
    train = SamplingConfig(temperature=0.7, top_p=1.0, top_k=-1, max_tokens=256, stop=["</action>"], seed=None)
    probe = probe_sampling(train, seed=5)
    assert (probe.temperature, probe.stop, probe.seed, probe.max_tokens) == (0.7, ["</action>"], 5, PROBE_MAX_TOKENS)
    assert probe_sampling(SamplingConfig(max_tokens=4), seed=5).max_tokens == 4


def test_probe_batch_holds_the_probe_responses_of_the_probe_rows():
    batch = _batch(6)
    rows = probe_rows(batch.extras["engine"], per_engine=2)
    assert rows == [0, 1, 2, 3]
    results = [GenerationResult([7] * (i + 1), [-0.1 * (i + 1)] * (i + 1), "length", "", weight_version=4, engine=e)
               for i, e in enumerate([0, 0, 1, 1])]
    probe = probe_batch(batch, rows, results)
    assert [p.tolist() for p in probe.prompt_ids] == [batch.prompt_ids[i].tolist() for i in rows]
    assert [r.tolist() for r in probe.response_ids] == [[7], [7, 7], [7, 7, 7], [7, 7, 7, 7]]
    assert probe.rollout_log_probs[1].dtype == torch.float32 and probe.response_ids[1].dtype == torch.int64
    assert probe.extras["engine"] == [0, 0, 1, 1] and probe.extras["weight_version"] == [4] * 4
    assert probe.extras["actions"] == ["a0", "a1", "a2", "a3"] and batch.extras["weight_version"] == [3] * 6
    actor = [lp + 0.01 for lp in probe.rollout_log_probs]
    gaps = engine_gaps(probe.rollout_log_probs, actor, probe.extras["engine"])
    assert gaps.keys() == {0, 1} and all(abs(g - 0.01) < 1e-6 for g, _ in gaps.values())
    with pytest.raises(ValueError, match="3 probe results for 4 rows"):
        probe_batch(batch, rows, results[:3])


def test_the_probe_alarm_says_the_update_was_applied():
    gaps = {0: (0.004, 161)}
    with pytest.raises(StaleEngineError, match="found by the probe after the sync: the run stops before the next "
                                               "update"):
        check_engines(gaps, {0: {0}}, 1, 2e-4, probe=True)
    with pytest.raises(StaleEngineError, match="the update was not applied"):
        check_engines(gaps, {0: {0}}, 1, 2e-4)
