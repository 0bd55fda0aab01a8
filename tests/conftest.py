"""Shared pytest configuration: GPU tests are skipped unless CUDA is present; the ../shared data folder.

Tests that read ../shared skip when it (or a file they need in it) is missing, so that a checkout without it
still runs the rest; with ``CI=true`` (as on CI, and as the Slurm tests read it) they fail instead, so a CI
run without its data cannot pass. ``scripts/test.sh`` refuses to start without the folder.
"""

import os
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# scripts/test.sh runs two pytest-xdist workers that take one file at a time in collection order: the files of
# several minutes go first, so that the short ones fill the gaps at the end. Seconds on 2 cores (2026-12-04,
# serial): dynamic sampling 526 (it builds the shared small cold start), sbatch 312, train_e2e 291, learning 355
# (after the cold start is built: placed later, so that its worker does not wait on the other's build), SFT
# 111, boundary values 108. The remaining `slow` files follow, then the rest, each group in collection order.
LONG_FILES = ("driver/test_dynamic_sampling_e2e.py", "slurm/test_sbatch.py", "driver/test_train_e2e.py",
              "driver/test_learning.py", "sft/test_sft_e2e.py", "driver/test_boundary_values_e2e.py")


def _schedule_rank(item, slow_files: set[str]) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    if path in LONG_FILES:
        return LONG_FILES.index(path)
    return len(LONG_FILES) + (0 if path in slow_files else 1)


def pytest_collection_modifyitems(config, items):
    slow_files = {item.nodeid.split("::", 1)[0].removeprefix("tests/") for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _schedule_rank(item, slow_files))  # stable: collection order within a rank
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def shared_missing(message: str) -> None:
    """Skip the test, or fail it under ``CI=true``, because shared data is missing."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: the shared data is required)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ../shared folder beside the checkout (data and fixtures for tests)."""
    if not SHARED.is_dir():
        shared_missing(f"shared data folder not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def shared_path(shared_dir):
    """``shared_path("data/alfworld/...")``: that path inside ../shared; skips (fails under CI=true) when it
    does not exist."""

    def get(relative: str) -> Path:
        path = shared_dir / relative
        if not path.exists():
            shared_missing(f"shared file {path} not found")
        return path

    return get
