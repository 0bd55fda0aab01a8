"""Fixtures shared by the driver tests."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLD_START_RECIPE = ROOT / "recipes/cpu/sokoban.yaml"
# The README recipe's cold start, shrunk: 400 demonstration episodes (3 epochs) instead of 8,000 (1 epoch).
COLD_START_OVERRIDES = ["sft.demos.num_episodes=400", "sft.epochs=3", "logging.progress_bars=false",
                        "checkpoint.save_every=0"]


@pytest.fixture(scope="session")
def small_cold_start(tmp_path_factory) -> Path:
    """The SFT export (``<run>/sft/hf``) of the shrunk README recipe: demonstrations + SFT on its random model.

    Built once per test session and shared by test_learning.py and test_dynamic_sampling_e2e.py (about two
    minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("cold-start")
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", "sft", str(COLD_START_RECIPE), f"trainer.output_dir={out}",
           "trainer.experiment_name=cold", *COLD_START_OVERRIDES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"sft exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    model = out / "cold" / "sft" / "hf"
    assert (model / "config.json").is_file()
    return model
