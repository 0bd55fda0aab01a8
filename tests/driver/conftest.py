"""Fixtures shared by the driver tests."""

import os
from pathlib import Path

import pytest
from cli_runs import run_cli

ROOT = Path(__file__).resolve().parents[2]
COLD_START_RECIPE = ROOT / "recipes/cpu/sokoban.yaml"
# The README recipe's cold start, shrunk: 400 demonstration episodes (3 epochs) instead of 8,000 (1 epoch).
COLD_START_OVERRIDES = ["sft.demos.num_episodes=400", "sft.epochs=3", "logging.progress_bars=false",
                        "checkpoint.save_every=0"]


@pytest.fixture(scope="session")
def small_cold_start(tmp_path_factory) -> Path:
    """The SFT export (``<run>/sft/hf``) of the shrunk README recipe: demonstrations + SFT on its random model.

    Built once per test session and shared by test_learning.py and test_dynamic_sampling_e2e.py (about two
    minutes on 2 cores). Under pytest-xdist (scripts/test.sh runs two workers) the first worker that needs it
    builds it in the session's shared temp folder while holding a file lock; the other waits for it."""
    from filelock import FileLock

    # xdist: every worker's basetemp lies in one session folder; without xdist basetemp is that folder.
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    model = root / "cold-start" / "cold" / "sft" / "hf"
    with FileLock(str(root / "cold-start.lock"), timeout=1800):
        if not (model / "config.json").is_file():
            run_cli("sft", str(COLD_START_RECIPE), f"trainer.output_dir={root / 'cold-start'}",
                    "trainer.experiment_name=cold", *COLD_START_OVERRIDES)
    assert (model / "config.json").is_file()
    return model
