"""Real Sokoban environments with injected faults, for the worker and collector tests.

They run inside Ray worker processes, which import this module by name: the tests' Ray fixture puts this
folder on the workers' PYTHONPATH. A fault fires once per marker file (created atomically with O_EXCL),
so exactly one environment across all workers and processes trips it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from megatron_gigpo.envs.base import ResetResult, StepResult, Task
from megatron_gigpo.envs.sokoban import SokobanEnv


def _claim(marker: str) -> bool:
    """True for the first caller (across processes) that creates ``marker``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class FaultySokoban(SokobanEnv):
    """Sokoban whose first step, in exactly one environment, raises, kills its process, or hangs.

    Args:
        marker: path of the marker file that decides which environment trips (the first to create it).
        mode: ``raise`` (RuntimeError), ``exit`` (``os._exit``: the worker process dies) or ``hang``.
    """

    def __init__(self, marker: str, mode: str) -> None:
        super().__init__(dim_room=(6, 6), num_boxes=1, max_steps=10)
        if mode not in ("raise", "exit", "hang"):
            raise ValueError(f"unknown fault mode {mode!r}")
        self.marker = marker
        self.mode = mode

    def step(self, action_text: str) -> StepResult:
        if _claim(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            if self.mode == "raise":
                raise RuntimeError("injected environment fault")
            if self.mode == "exit":
                os._exit(17)
            time.sleep(3600)
        return super().step(action_text)


class UnseededSokoban(SokobanEnv):
    """A broken environment: its first observation depends on the hosting process, not only (task, seed).

    This is the bug class the collector's group check exists for (members seeded differently).
    """

    def __init__(self) -> None:
        super().__init__(dim_room=(6, 6), num_boxes=1, max_steps=10)

    def reset(self, task: Task, seed: int) -> ResetResult:
        result = super().reset(task, seed)
        result.observation += f"\n(process {os.getpid()})"
        return result


class SeededSokoban(SokobanEnv):
    """Sokoban whose room comes from the reset seed, not the task: an environment with a randomised start.

    The shipped environments fix the first state by the task alone, so members reset with different seeds
    would still agree there; here they only agree if the collector gives every member its group's seed.
    """

    def __init__(self) -> None:
        super().__init__(dim_room=(6, 6), num_boxes=1, max_steps=10)

    def reset(self, task: Task, seed: int) -> ResetResult:
        return super().reset(dataclasses.replace(task, payload={**task.payload, "room_seed": seed}), seed)
