"""Metric sinks for a run: ``metrics.jsonl`` (always; ``megatron-gigpo plot`` reads it), TensorBoard
(default) and Weights & Biases (optional, offline mode works without a network)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from megatron_gigpo.files import write_text_atomic
from megatron_gigpo.run.config import LoggingConfig, TrainerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
ATTEMPTS_DIR = "previous_attempts"  # <run dir>/previous_attempts/<start time>/: records an earlier attempt left
VALIDATION_DIR = "validation"  # <run dir>/validation/step_<N>.jsonl: one record per validation episode


class LoggedRecipe(Protocol):
    """What the sinks read of a recipe (:class:`megatron_gigpo.config.Config` is one): ``logging`` (which sinks),
    ``trainer`` (the W&B project and run names); W&B also records the whole recipe."""

    logging: LoggingConfig
    trainer: TrainerConfig


class MetricsLogger:
    """Writes one record per iteration to every enabled sink; each step appears once in a run directory.

    Values are ``float``-convertible scalars (non-finite values go to the jsonl file only). ``resume_step``: the
    step of the checkpoint the run resumed from (0: none). Records of an earlier attempt that this run will
    write again are set aside first (:func:`set_aside_earlier_attempt`); TensorBoard hides the earlier event
    files' steps after ``resume_step`` (``purge_step``).
    """

    def __init__(self, cfg: LoggedRecipe, run_dir: Path, *, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        set_aside_earlier_attempt(self.run_dir, resume_step)
        self._jsonl = (self.run_dir / METRICS_FILE).open("a")
        self._tb = None
        self._wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step > 0 else None  # the checkpoint's own step stays
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)
        if cfg.logging.wandb:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'megatron-gigpo[wandb]'") from exc
            self._wandb = wandb.init(
                project=cfg.trainer.project_name, name=cfg.trainer.experiment_name, dir=str(self.run_dir),
                mode=cfg.logging.wandb_mode, config=dataclasses.asdict(cfg), resume="allow",
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step} | {key: float(value) for key, value in metrics.items()}
        self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _record_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a torn line (a process killed while writing it)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def set_aside_earlier_attempt(run_dir: Path, resume_step: int) -> Path | None:
    """Move what an earlier attempt in ``run_dir`` logged past ``resume_step`` to
    ``run_dir/previous_attempts/<time>/``, so that a re-run logs each step once; says so on the console.

    ``resume_step`` 0 (no checkpoint to resume from: the run starts over): all of ``metrics.jsonl`` and the
    ``tensorboard/`` folder move. ``resume_step`` N > 0: the records of steps after N (and torn lines) move,
    those up to N stay (``metrics.jsonl`` is rewritten atomically); TensorBoard's own ``purge_step`` hides the
    later steps of the earlier event files. Nothing is deleted.

    Returns:
        The folder the records went to, or None when there was nothing to set aside.
    """
    path = run_dir / METRICS_FILE
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [_record_step(line) for line in lines]
    # One rule for both sides: a record stays iff the run resumes (N > 0) and it is a readable step <= N.
    stays = [resume_step > 0 and step is not None and step <= resume_step for step in steps]
    keep = [line for line, stay in zip(lines, stays) if stay]
    later = [step for step, stay in zip(steps, stays) if not stay]
    tensorboard = run_dir / TENSORBOARD_DIR
    move_tb = resume_step == 0 and tensorboard.is_dir() and any(tensorboard.iterdir())
    if not later and not move_tb:
        return None
    dest = run_dir / ATTEMPTS_DIR / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    dest.mkdir(parents=True)
    if later:
        (dest / METRICS_FILE).write_text("".join(line + "\n" for line in lines))  # the whole file as it was
        write_text_atomic(path, "".join(line + "\n" for line in keep))
    if move_tb:
        shutil.move(str(tensorboard), str(dest / TENSORBOARD_DIR))
    shown = sorted({s for s in later if s is not None})
    which = f"steps {shown[0]}-{shown[-1]}" if shown else "a torn line"
    why = "no checkpoint to resume from" if resume_step == 0 else f"this run resumes after step {resume_step}"
    log.warning("%s: an earlier attempt logged %s (%s); its records moved to %s, so that each step is logged "
                "once", run_dir, which, why, dest)
    return dest


def write_validation_episodes(run_dir: Path, step: int, episodes: list[Any]) -> Path:
    """Write one JSON line per validation episode to ``run_dir/validation/step_<step>.jsonl`` (replaced atomically;
    a resumed run that validates step N again replaces that file): ``task_id``, ``won``, ``length`` (steps),
    ``episode_return`` (environment units), ``failed``. Per-task outcomes are what a paired comparison of two
    runs on the same held-out tasks needs (``benchmarks/learning.py``).

    Args:
        episodes: :class:`~megatron_gigpo.episodes.metrics.EpisodeSummary` objects, one per validation episode.

    Returns:
        The file written.
    """
    path = Path(run_dir) / VALIDATION_DIR / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"task_id": e.task_id, "won": bool(e.won), "length": int(e.length),
                         "episode_return": float(e.episode_return), "failed": bool(e.failed)}) for e in episodes]
    return write_text_atomic(path, "".join(line + "\n" for line in lines))


def read_validation_episodes(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The records :func:`write_validation_episodes` wrote for ``step``.

    Raises:
        FileNotFoundError: the run has no such file (names the path).
    """
    path = Path(run_dir) / VALIDATION_DIR / f"step_{step}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no per-episode validation records {path} (written by runs since 2026-12-06)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Records of ``run_dir/metrics.jsonl``; a step found twice (a run directory written before
    :func:`set_aside_earlier_attempt` existed) keeps the latest record.

    Raises:
        FileNotFoundError: the run has no metrics file (names the path).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: is this a megatron-gigpo run directory?")
    by_step: dict[int, dict[str, Any]] = {}
    with path.open() as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


# (label, metric key pattern, format) of the console line; {env} is the environment name.
_CONSOLE_FIELDS = (
    ("success", "episode/{env}/success_rate", "{:.3f}"),
    ("val", "val/episode/{env}/success_rate", "{:.3f}"),
    ("invalid", "action/invalid_rate", "{:.3f}"),
    ("return", "episode/return_mean", "{:.2f}"),
    ("kl", "actor/kl_loss", "{:.4f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
)
# (label, timing key) of the phases shown, in loop order.
_CONSOLE_PHASES = (("rollout", "rollout"), ("logp", "old_log_prob"), ("ref", "ref_log_prob"), ("update", "update"),
                   ("sync", "resharding"), ("val", "validation"), ("ckpt", "checkpoint"))


def console_line(metrics: dict[str, Any], iteration: int, total: int, env: str) -> str:
    """The one terminal line of an iteration: success, validation success, invalid-action rate, mean return, KL,
    entropy, then seconds per phase and in all; metrics the iteration lacks are left out.

    Example: ``iter 3/20 | success 0.422 | invalid 0.031 | return 4.12 | kl 0.0021 | entropy 0.612 | rollout 9.1s
    logp 3.2s ref 3.0s update 8.7s sync 0.1s | 24.3s``
    """
    parts = [f"iter {iteration}/{total}"]
    for label, key, fmt in _CONSOLE_FIELDS:
        key = key.format(env=env)
        if key in metrics:
            parts.append(f"{label} {fmt.format(float(metrics[key]))}")
    phases = [f"{label} {float(metrics[f'timing/{key}_s']):.1f}s" for label, key in _CONSOLE_PHASES
              if f"timing/{key}_s" in metrics]
    if phases:
        parts.append(" ".join(phases))
    if "timing/iteration_s" in metrics:
        parts.append(f"{float(metrics['timing/iteration_s']):.1f}s")
    return " | ".join(parts)
