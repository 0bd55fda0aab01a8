"""It learns: from a fixed small cold start, a few GiGPO iterations move the policy the way the advantages say,
the engines sample from the updated weights, and held-out success does not fall.

The cold start is the README recipe's own (recipes/cpu/sokoban.yaml: a random 2-layer Llama, expert
demonstrations, the SFT stage), shrunk to fit a test. Everything is seeded, so each run is repeatable. What is
asserted, per RL iteration (``trainer.update_effect_metrics``: the batch's log-probs recomputed after the
update):

- rows with positive advantage gain log-probability relative to rows with negative advantage
  (``actor/update_effect_pos > actor/update_effect_neg``, means over the iterations) and the change correlates
  with the advantage (``actor/update_effect_corr`` above 0.05 in every iteration and 0.1 on average; measured
  0.20, 0.10, 0.37 when correct). A flipped advantage sign turns both around; advantages scattered onto the
  wrong rows (shifted by one position in each micro-batch) leave the correlation near 0 (measured 0.01, 0.04,
  then 0.32: once many invalid replies, which the entropy bonus and KL move apart, dominate, the correlation
  no longer needs the policy gradient, hence the per-iteration bound);
- vLLM's sampling log-probs equal the actor's on the same tokens (``rollout/actor_logprob_diff_max < 1e-3``,
  fp32): a weight sync that does not reach the engines leaves them sampling from the old weights;
- held-out greedy success (64 validation rooms, in neither the demonstrations nor the RL tasks) after RL is at
  least its value before RL.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gigpo.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/cpu/sokoban.yaml"
# The README recipe, shrunk: fewer demonstrations and SFT epochs, three RL iterations.
SMALL = ["sft.demos.num_episodes=400", "sft.epochs=3", "logging.progress_bars=false", "checkpoint.save_every=0"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args[:2])} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="module")
def cold_start(tmp_path_factory) -> Path:
    """The SFT export of the shrunk README recipe (demonstrations + SFT on the random model)."""
    out = tmp_path_factory.mktemp("learning")
    _cli("sft", str(RECIPE), f"trainer.output_dir={out}", "trainer.experiment_name=cold", *SMALL)
    model = out / "cold" / "sft" / "hf"
    assert (model / "config.json").is_file()
    return model


def test_gigpo_moves_the_policy_by_its_advantages(cold_start, tmp_path):
    _cli("train", str(RECIPE), f"trainer.output_dir={tmp_path}", "trainer.experiment_name=rl", *SMALL,
         f"model.path={cold_start}", "model.init=pretrained", "sft.enabled=false", "trainer.total_iterations=3",
         "trainer.val_every=3", "trainer.update_effect_metrics=true")
    check_learning(read_metrics(tmp_path / "rl"), iterations=3)


def check_learning(records: list[dict], iterations: int) -> None:
    """The assertions of the module docstring on a run's metrics records (validation at 0 and at the end)."""
    assert [r["step"] for r in records] == list(range(iterations + 1))
    before, *its = records
    val = "val/episode/sokoban/success_rate"
    for rec in its:
        it = rec["step"]
        assert rec["rollout/actor_logprob_diff_max"] < 1e-3, (it, rec["rollout/actor_logprob_diff_max"])
        assert rec["action/invalid_rate"] < 0.25, (it, rec["action/invalid_rate"])  # the cold start holds
    # Means over the iterations: one batch of ~500 rows gives a correlation within ~0.05 of its expectation.
    pos, neg, corr = ([rec[f"actor/update_effect_{k}"] for rec in its] for k in ("pos", "neg", "corr"))
    assert sum(pos) / len(pos) > sum(neg) / len(neg), (pos, neg)
    assert min(corr) > 0.05 and sum(corr) / len(corr) > 0.1, corr
    assert its[-1][val] >= before[val], (before[val], its[-1][val])
