"""Metric sinks for a run: ``metrics.jsonl`` (always; ``megatron-gigpo plot`` reads it), TensorBoard
(default) and Weights & Biases (optional, offline mode works without a network)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import dataclasses
from typing import Protocol

from megatron_gigpo.run.config import LoggingConfig, TrainerConfig

METRICS_FILE = "metrics.jsonl"


class LoggedRecipe(Protocol):
    """What the sinks read of a recipe (:class:`megatron_gigpo.config.Config` is one): ``logging`` (which sinks),
    ``trainer`` (the W&B project and run names); W&B also records the whole recipe."""

    logging: LoggingConfig
    trainer: TrainerConfig


class MetricsLogger:
    """Writes one record per iteration to every enabled sink.

    Values are ``float``-convertible scalars (non-finite values go to the jsonl file only).
    """

    def __init__(self, cfg: LoggedRecipe, run_dir: Path, *, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / METRICS_FILE).open("a")
        self._tb = None
        self._wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step or None)
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


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Records of ``run_dir/metrics.jsonl``; a resumed run's repeated steps keep the latest record.

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
