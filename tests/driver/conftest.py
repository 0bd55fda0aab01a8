"""Fixtures shared by the driver tests."""

import os
import shutil
from pathlib import Path

import pytest
from cli_runs import run_cli

ROOT = Path(__file__).resolve().parents[2]
COLD_START_RECIPE = ROOT / "recipes/cpu/sokoban.yaml"
# The README recipe's cold start, shrunk: 400 demonstration episodes (3 epochs) instead of 5,000 (1 epoch).
COLD_START_OVERRIDES = ["sft.demos.num_episodes=400", "sft.epochs=3", "logging.progress_bars=false",
                        "checkpoint.save_every=0"]
# How long a pytest-xdist worker waits for another one's build of the cold start (~14 minutes at worst measured).
COLD_START_WAIT_S = 3600


@pytest.fixture(scope="session")
def small_cold_start(tmp_path_factory) -> Path:
    """The SFT export (``<run>/sft/hf``) of the shrunk README recipe: demonstrations + SFT on its random model.

    Built once per test session (about two minutes on 2 cores, up to ~14 under load) and shared by every driver
    test that learns from it (test_learning, test_dynamic_sampling_e2e, test_old_log_probs_e2e, test_async_e2e).
    Under pytest-xdist the workers share it through the session's common temporary folder: the first to need it
    builds it under a file lock, the others wait for it (at most ``COLD_START_WAIT_S``), so the files that use it
    run on both workers instead of one after another on one.

    Raises:
        filelock.Timeout: another worker held the lock longer than ``COLD_START_WAIT_S``.
    """
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker's basetemp sits in the session's folder
        root = root.parent
    out = root / "small-cold-start"
    model = out / "cold" / "sft" / "hf"
    with FileLock(str(root / "small-cold-start.lock"), timeout=COLD_START_WAIT_S):
        if not (model / "config.json").is_file():  # not built, or a worker's build failed: (re)build it
            shutil.rmtree(out, ignore_errors=True)
            run_cli("sft", str(COLD_START_RECIPE), f"trainer.output_dir={out}", "trainer.experiment_name=cold",
                    *COLD_START_OVERRIDES)
    assert (model / "config.json").is_file()
    return model
