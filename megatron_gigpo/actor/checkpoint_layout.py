"""Where actor checkpoints live on disk: folder names, completeness and atomic small writes (no torch).

Layout under a checkpoint root (written by :mod:`megatron_gigpo.actor.checkpoint`)::

    root/iter_00000010/        complete checkpoint of iteration 10 (dist_checkpointing files + meta.json)
    root/iter_00000020.tmp/    being written (or left by a crash): never loaded, removed on the next save

A folder is complete when its name has no suffix and it holds ``meta.json``. These helpers import neither torch
nor megatron-core, so the driver process (``megatron-gigpo train``/``eval``, which only finds checkpoints) starts
without them; the ranks save and load through :mod:`megatron_gigpo.actor.checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from megatron_gigpo.files import write_text_atomic

__all__ = [
    "META_FILE",
    "checkpoint_name",
    "complete_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "write_json_atomic",
    "fsync_dir",
]

_NAME = re.compile(r"^iter_(\d{8})$")
META_FILE = "meta.json"


def checkpoint_name(iteration: int) -> str:
    """Folder name of the checkpoint of ``iteration`` (>= 0), e.g. ``iter_00000010``."""
    if iteration < 0:
        raise ValueError(f"iteration={iteration} must be >= 0")
    return f"iter_{iteration:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(iteration, folder)`` of the complete checkpoints under ``root``, oldest first ([] if none)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> tuple[int, Path] | None:
    """``(iteration, folder)`` of ``path`` itself when it is a complete checkpoint (``iter_N`` with its
    ``meta.json``), else of the newest complete checkpoint under it; None when there is neither."""
    path = Path(path)
    match = _NAME.match(path.name)
    if match and path.is_dir() and (path / META_FILE).is_file():
        return int(match.group(1)), path
    return latest_checkpoint(path)


def checkpoint_from_cli(path: str | Path, flag: str, *, other_folders: bool = False) -> tuple[int | None, Path]:
    """The checkpoint a command-line ``flag`` names: ``path`` itself (``iter_N`` with its ``meta.json``) or the
    newest complete one under it (a run's ``checkpoints/``), as :func:`resolve_checkpoint`. With
    ``other_folders``, an existing folder that is neither comes back as is, iteration None (a distributed
    checkpoint that ``convert hf-to-megatron`` or another tool wrote).

    Raises:
        FileNotFoundError: none of these; the message says whether ``path`` exists and lists the complete
            checkpoints beside it (its parent), e.g. for ``iter_20`` where the folder is ``iter_00000020``.
    """
    path = Path(path)
    found = resolve_checkpoint(path)
    if found is not None:
        return found
    if other_folders and path.is_dir():
        return None, path
    what = "is not a complete checkpoint (iter_N with meta.json) nor a folder holding one" if path.is_dir() else \
        "does not exist"
    beside = complete_checkpoints(path.parent)
    hint = (f"; complete checkpoints in {path.parent}: {', '.join(p.name for _, p in beside)} (or pass "
            f"{path.parent} for the newest)") if beside else ""
    raise FileNotFoundError(f"{flag} {path} {what}{hint}")


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` through ``<path>.tmp``, fsync and rename: readers see the old file
    or the whole new one."""
    write_text_atomic(path, json.dumps(payload, indent=1, sort_keys=True), fsync=True)


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``, so that renames inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
