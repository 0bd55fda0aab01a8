"""Fixtures shared by the driver tests."""

from pathlib import Path

import pytest
from cli_runs import run_cli

ROOT = Path(__file__).resolve().parents[2]
COLD_START_RECIPE = ROOT / "recipes/cpu/sokoban.yaml"
# The README recipe's cold start, shrunk: 400 demonstration episodes (3 epochs) instead of 5,000 (1 epoch).
COLD_START_OVERRIDES = ["sft.demos.num_episodes=400", "sft.epochs=3", "logging.progress_bars=false",
                        "checkpoint.save_every=0"]


@pytest.fixture(scope="session")
def small_cold_start(tmp_path_factory) -> Path:
    """The SFT export (``<run>/sft/hf``) of the shrunk README recipe: demonstrations + SFT on its random model.

    Built once per test session and shared by test_learning.py and test_dynamic_sampling_e2e.py (about two
    minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("cold-start")
    run_cli("sft", str(COLD_START_RECIPE), f"trainer.output_dir={out}", "trainer.experiment_name=cold",
            *COLD_START_OVERRIDES)
    model = out / "cold" / "sft" / "hf"
    assert (model / "config.json").is_file()
    return model
