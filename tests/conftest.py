"""Shared pytest configuration: GPU tests are skipped unless CUDA is present; the ../shared data folder.

Tests that read ../shared skip when it (or a file they need in it) is missing, so that a checkout without it
still runs the rest; with ``CI=true`` (as on CI, and as the Slurm tests read it) they fail instead, so a CI
run without its data cannot pass. ``scripts/test.sh`` refuses to start without the folder.

Property tests (hypothesis) draw a fixed sequence of examples (profile ``ci``: ``derandomize=True``), so that a run
cannot fail on a case no earlier run drew; ``HYPOTHESIS_PROFILE=explore`` draws new random examples each run (to
look for cases; pin what it finds with ``@example``).
"""

import os
from pathlib import Path

import pytest
import torch

# ../shared beside the checkout; MEGATRON_GIGPO_SHARED_DIR for a copy of the tests elsewhere (mutmut's mutants/).
SHARED = Path(os.environ.get("MEGATRON_GIGPO_SHARED_DIR") or Path(__file__).resolve().parents[1].parent / "shared")


def pytest_configure(config):
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(config, items):
    # One xdist group per test file (module-scoped fixtures are built once); xdist hands the groups out in this
    # order (--no-loadscope-reorder), so the order decides whether a worker waits:
    #   0. the first file that uses the costly session fixture ``small_cold_start`` (its worker builds it, a few
    #      minutes, under a file lock shared by the workers: tests/driver/conftest.py);
    #   1. the other files with a `slow` test, so that the two workers do not end on one long file each;
    #   2. the other files that use ``small_cold_start``: by then it is built, so the other worker does not sit
    #      idle at the lock (in collection order they came 5th, 7th, 8th and 10th: the 7th's worker reached the
    #      lock a minute or two into the 5th's build, which takes 2-7 minutes);
    #   3. the rest (collection order within each rank). Without xdist the markers do nothing.
    group = {item.nodeid: item.nodeid.split("::", 1)[0] for item in items}
    slow_groups = {group[item.nodeid] for item in items if item.get_closest_marker("slow")}
    cold = [group[item.nodeid] for item in items if "small_cold_start" in item.fixturenames]
    builder, cold_groups = (cold[0] if cold else None), set(cold)

    def rank(item) -> int:
        name = group[item.nodeid]
        if name == builder:
            return 0
        if name in cold_groups:
            return 2
        return 1 if name in slow_groups else 3

    items.sort(key=rank)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item.nodeid]))
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
