"""benchmarks/learning.py's paired bootstrap: exact where it must be, paired where pairing matters, and fed by
the per-episode validation records a run writes (run/metrics.write_validation_episodes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_gigpo.run.metrics import write_validation_episodes

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("learning_benchmark", ROOT / "benchmarks" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_bootstrap_is_exact_on_constant_data_and_narrow_when_paired():
    boot = _script().paired_bootstrap
    ones, zeros = np.ones((3, 50)), np.zeros((3, 50))
    r = boot(ones, zeros, draws=200)
    assert r["a"] == [1.0, 1.0, 1.0] and r["b"] == [0.0, 0.0, 0.0] and r["a_minus_b"] == [1.0, 1.0, 1.0]
    # b wins every task a wins, plus 10% more: the tasks vary a lot, the difference does not. Paired on tasks,
    # the difference's interval is far narrower than either method's own.
    rng = np.random.default_rng(1)
    a = (rng.random((3, 1000)) < 0.5).astype(float)
    b = np.maximum(a, (rng.random((3, 1000)) < 0.1).astype(float))
    r = boot(a, b, draws=2000)
    d, m = r["a_minus_b"], r["a"]
    assert d[1] <= d[0] <= d[2] < 0 and m[1] <= m[0] <= m[2]
    assert (d[2] - d[1]) < 0.6 * (m[2] - m[1]), r
    with pytest.raises(ValueError, match="equal"):
        boot(a, b[:, :10])


def test_outcomes_read_the_records_a_run_writes(tmp_path):
    script = _script()
    for seed, wins in ((1, [1, 0]), (2, [0, 0])):
        episodes = [SimpleNamespace(task_id=t, won=w, length=3, episode_return=1.0, failed=False)
                    for t, w in zip(("b-task", "a-task"), wins)]
        write_validation_episodes(tmp_path / f"grpo-seed{seed}", 20, episodes)
    # Tasks in id order, so that two methods' columns are the same tasks.
    assert script._outcomes(tmp_path, "grpo", 2, 20).tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert script._outcomes(tmp_path, "grpo", 3, 20) is None  # a run without records: no interval


def test_each_method_is_compared_with_its_reference(tmp_path):
    script = _script()
    wins = {"grpo": [0, 0, 1, 0], "gigpo": [1, 0, 1, 0], "gigpo_rollout_logp": [1, 1, 1, 0]}
    for method, outcome in wins.items():
        episodes = [SimpleNamespace(task_id=f"t{k}", won=w, length=3, episode_return=1.0, failed=False)
                    for k, w in enumerate(outcome)]
        write_validation_episodes(tmp_path / f"{method}-seed1", 20, episodes)
    result = {"out": str(tmp_path), "curves": {method: [{20: 0.0}] for method in wins}}
    found = script._intervals(result, 20)
    # GiGPO against GRPO; the rollout-log-prob arm against GiGPO (issue #41 item 2), not against GRPO.
    assert set(found) == {"gigpo", "gigpo_rollout_logp_vs_gigpo"}
    assert found["gigpo"]["a_minus_b"][0] == pytest.approx(0.25)
    assert found["gigpo_rollout_logp_vs_gigpo"]["a_minus_b"][0] == pytest.approx(0.25)
