"""Read a TensorBoard log folder back with TensorBoard's own reader (imported by module name from tests/)."""

from __future__ import annotations

from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of every scalar in the event files of ``log_dir``, in step order, as
    TensorBoard shows them (a resumed writer's ``purge_step`` drops the earlier file's later steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
