"""Run ``megatron-gigpo`` in a subprocess the way a user does, for the end-to-end tests."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout_s: float = 1500) -> subprocess.CompletedProcess:
    """``python -m megatron_gigpo.cli *args`` from the repository root; fails the test (with the tails of
    stdout and stderr) when it exits non-zero. Raises subprocess.TimeoutExpired after ``timeout_s``."""
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args[:2])} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    return proc
