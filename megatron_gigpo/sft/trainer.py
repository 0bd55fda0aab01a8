"""The supervised cold-start stage (``megatron-gigpo sft RECIPE``): NLL on demonstrations, on the RL actor.

The same Megatron actor ranks as RL training (:func:`megatron_gigpo.builders.start_actor_group`, any TP / PP /
DP layout the actor supports) train with the registered ``nll`` policy loss (no KL, no reference model, no
entropy bonus). One optimizer step per mini-batch of ``sft.batch_size`` rows: each epoch is a fresh seeded
permutation of the training rows cut into ``ceil(rows / batch_size)`` near-equal mini-batches
(:func:`megatron_gigpo.actor.batching.split_mini_batches`), so a resumed run sees exactly the rows an
uninterrupted one would. The LR schedule (``sft.lr``, warmup, decay) runs over all optimizer steps.

Everything goes under ``<run dir>/sft/``::

    config.yaml, metrics.jsonl, tensorboard/   the resolved recipe and per-step metrics
    checkpoints/iter_<step>/                   actor checkpoints (atomic; a re-run resumes from the newest)
    hf/                                        the trained model (safetensors, config, tokenizer) for RL:
                                               ``model.path: runs/<experiment>/sft/hf``

Metrics per optimizer step: ``actor/loss`` (= ``actor/nll``, the mini-batch NLL by ``sft.loss_agg_mode``),
``actor/entropy``, ``actor/grad_norm``, ``actor/lr``, ``sft/epoch``, ``timing/step_s``, ``perf/tokens_per_s``
(prompt + response tokens per second). Held-out, before training and after every epoch: ``val/loss``, the
mean NLL per response token under the actor (:meth:`PolicyActor.compute_log_probs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path

import torch

from megatron_gigpo.builders import StartedStack, start_progress
from megatron_gigpo.config import Config
from megatron_gigpo.fields import ConfigError

__all__ = ["SFTTrainer", "run_sft", "sft_dir", "finished_model", "sft_actor_config", "epoch_batches"]

log = logging.getLogger(__name__)

PROGRESS_LINES = 20  # without a terminal: a line per 1/20 of the stage's steps ...
PROGRESS_LINE_S = 60.0  # ... or per minute, whichever comes first

HF_SUBDIR = "hf"


def sft_dir(cfg: Config) -> Path:
    """``<run dir>/sft``: where the stage writes everything."""
    return cfg.run_dir / "sft"


def finished_model(cfg: Config) -> Path | None:
    """The exported model of a finished SFT run (``<run dir>/sft/hf``), or None. The export appears
    atomically, so a present ``config.json`` means the run is complete."""
    hf = sft_dir(cfg) / HF_SUBDIR
    return hf if (hf / "config.json").is_file() else None


def sft_actor_config(cfg: Config, model_dir: Path, total_steps: int):
    """The RL actor of the recipe (:func:`megatron_gigpo.builders.actor_config`: model, layout,
    dtype, token budgets, Adam settings) with the ``sft`` section's loss, LR schedule, batch size and adapters
    (``sft.lora``, not the RL actor's ``model.lora``).

    Temperature is 1: demonstrations are scored under the model's own distribution.
    """
    from megatron_gigpo.builders import actor_config

    s = cfg.sft
    return actor_config(cfg, model_dir).replace(
        optim={"lr": s.lr, "min_lr": s.min_lr, "lr_warmup_steps": s.lr_warmup_steps, "lr_decay_style": s.lr_decay_style},
        loss={"policy_loss": "nll", "loss_agg_mode": s.loss_agg_mode, "use_kl_loss": False, "kl_loss_coef": 0.0,
              "entropy_coeff": 0.0},
        trainer={"ppo_mini_batch_size": s.batch_size, "ppo_epochs": 1, "shuffle": False, "seed": s.seed},
        temperature=1.0, lr_decay_steps=max(1, total_steps), lora=s.lora,
    )


def epoch_batches(num_rows: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Row indices of the optimizer steps of ``epoch``: a permutation seeded by ``(seed, epoch)`` cut into
    ``ceil(num_rows / batch_size)`` near-equal mini-batches. A pure function, so resuming is exact."""
    from megatron_gigpo.actor.batching import split_mini_batches

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return split_mini_batches(num_rows, batch_size, generator)


def _digest(rows) -> str:
    h = hashlib.sha256()
    for p, r in zip(rows.prompt_ids, rows.response_ids):
        h.update(p.numpy().tobytes() + b"|" + r.numpy().tobytes() + b";")
    return h.hexdigest()[:16]


def _held_out_loss(actors, rows) -> dict[str, float]:
    """``val/loss``: mean NLL per response token of ``rows`` under the actor."""
    log_probs = actors.compute_log_probs(rows)
    total = torch.cat([lp.double() for lp in log_probs])
    return {"val/loss": float(-total.mean()), "val/num_tokens": float(total.numel())}


class SFTTrainer(StartedStack):
    """One SFT run. Use as a context manager (Ray, the actor ranks and the metric sinks stop on exit), then
    :meth:`fit`. ``trainer.actors`` (an :class:`~megatron_gigpo.actor.group.ActorGroup`) and
    ``trainer.train_rows`` / ``trainer.val_rows`` stay usable inside the ``with`` block.

    Raises (on entry):
        ConfigError: ``sft.train_file`` is not set.
        SFTDataError: a demonstration file is missing or has an invalid row (see :mod:`.data`).
        ValueError: fewer training or held-out rows than data-parallel ranks, or a checkpoint in
            ``<run dir>/sft/checkpoints`` from other data or other ``sft`` batch settings.
    """

    def __init__(self, cfg: Config) -> None:
        if not cfg.sft.train_file:
            raise ConfigError("sft.train_file is not set: the JSONL demonstrations to train on")
        self.cfg = cfg
        self.out = sft_dir(cfg)
        self.ckpt_root = self.out / "checkpoints"
        self.start_step = 0
        self.saved_step = 0  # the newest checkpoint's step (0: none)
        self.progress = self.bar = None
        self._last_line = time.monotonic()
        self.skipped_rows = 0
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- start
    def _load_data(self, tokenizer) -> None:
        from megatron_gigpo.sft.data import load_sft_rows, split_held_out

        s, dp = self.cfg.sft, self.cfg.parallel.data_parallel_size
        kwargs = dict(max_length=s.max_length, skip_invalid_rows=s.skip_invalid_rows)
        rows, report = load_sft_rows(s.train_file, tokenizer, **kwargs)
        self.skipped_rows = report.skipped
        if s.val_file:
            self.train_rows, (self.val_rows, val_report) = rows, load_sft_rows(s.val_file, tokenizer, **kwargs)
            self.skipped_rows += val_report.skipped
        else:
            self.train_rows, self.val_rows = split_held_out(rows, s.val_fraction, s.seed)
        if self.val_rows.num_rows == 0:
            self.val_rows = None
        for name, part in (("training", self.train_rows), ("held-out", self.val_rows)):
            if part is not None and part.num_rows < dp:
                raise ValueError(f"sft: {part.num_rows} {name} rows cannot be split over DP={dp} ranks")
        self.steps_per_epoch = len(epoch_batches(self.train_rows.num_rows, s.batch_size, s.seed, 0))
        self.total_steps = s.epochs * self.steps_per_epoch
        self.plan = {"train_rows": self.train_rows.num_rows, "train_digest": _digest(self.train_rows),
                     "batch_size": s.batch_size, "seed": s.seed, "epochs": s.epochs}
        log.info("sft: %d training rows (%d tokens), %d held-out rows, %d invalid rows skipped; %d epochs x %d "
                 "steps", self.train_rows.num_rows, self.train_rows.num_tokens(),
                 0 if self.val_rows is None else self.val_rows.num_rows, self.skipped_rows, s.epochs,
                 self.steps_per_epoch)

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from megatron_gigpo.builders import start_actor_group, start_ray
        from megatron_gigpo.config import save_config
        from megatron_gigpo.run.lock import hold_run_dir
        from megatron_gigpo.run.metrics import MetricsLogger
        from megatron_gigpo.models.random_init import resolve_model

        cfg = self.cfg
        self._stack.enter_context(hold_run_dir(cfg.run_dir))  # one run per directory (megatron_gigpo.run.lock)
        start_ray(cfg, self._stack, check_env=False)
        self.model_dir = resolve_model(cfg.model)
        self._load_data(AutoTokenizer.from_pretrained(str(self.model_dir)))
        actor_cfg = sft_actor_config(cfg, self.model_dir, self.total_steps)
        _, _, self.actors = start_actor_group(cfg, actor_cfg, self._stack)
        if cfg.checkpoint.resume:
            self._resume()
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml")
        self.logger = MetricsLogger(cfg, self.out, resume_step=self.start_step)
        self._stack.callback(self.logger.close)
        if cfg.logging.progress_bars:
            self._start_progress()

    def _resume(self) -> None:
        state = self.actors.load_checkpoint(str(self.ckpt_root))
        if state is None:
            return
        saved = state.get("plan", {})
        differ = {k: (saved.get(k), v) for k, v in self.plan.items() if saved.get(k) != v}
        if differ:
            raise ValueError(
                f"sft: the checkpoint in {self.ckpt_root} was made with other data or settings "
                f"({', '.join(f'{k}: {a} then, {b} now' for k, (a, b) in differ.items())}); use another "
                "trainer.experiment_name or remove that folder"
            )
        self.start_step = self.saved_step = int(state["step"])
        log.info("sft: resumed from %s at step %d of %d", self.ckpt_root, self.start_step, self.total_steps)

    def _start_progress(self) -> None:
        self.progress, self.bar = start_progress(self._stack, "SFT", self.total_steps, self.start_step, "status", "")

    # ---------------------------------------------------------------- loop
    def validate(self) -> dict[str, float]:
        """Held-out metrics (``val/loss``: mean NLL per response token); {} without held-out rows."""
        return {} if self.val_rows is None else _held_out_loss(self.actors, self.val_rows)

    def _train_step(self, rows) -> dict[str, float]:
        t0 = time.perf_counter()
        zeros = [torch.zeros(r.numel(), dtype=torch.float32) for r in rows.response_ids]
        metrics, _ = self.actors.update(rows, torch.zeros(rows.num_rows), zeros, None)
        seconds = time.perf_counter() - t0
        return metrics | {"timing/step_s": seconds, "perf/tokens_per_s": rows.num_tokens() / seconds}

    def fit(self) -> dict[str, float]:
        """Train from the resume point to the end, checkpoint, and export ``<run dir>/sft/hf``.

        Returns:
            The last step's metrics, with the last held-out metrics, ``sft/steps`` and
            ``sft/skipped_rows``.

        Raises:
            StoppedBySignal: a stop signal (:mod:`megatron_gigpo.run.preemption`) came; the current step
                finished and was checkpointed.
        """
        from megatron_gigpo.run.preemption import requested

        s = self.cfg.sft
        last: dict[str, float] = {}
        if self.start_step == 0:
            last = self.validate()
            if last:
                self._log(last, 0)
        for step in range(self.start_step, self.total_steps):
            if requested():
                self._stop(step)
            epoch, index = divmod(step, self.steps_per_epoch)
            batch = epoch_batches(self.train_rows.num_rows, s.batch_size, s.seed, epoch)[index]
            metrics = self._train_step(self.train_rows.select(batch)) | {"sft/epoch": float(epoch + 1)}
            end_of_epoch = index == self.steps_per_epoch - 1
            if end_of_epoch:
                metrics |= self.validate()
            last = {k: v for k, v in last.items() if k.startswith("val/")} | metrics
            self._log(metrics, step + 1)
            if end_of_epoch or (s.save_every and (step + 1) % s.save_every == 0):
                self._save(step + 1)
        hf = self.out / HF_SUBDIR
        self.actors.call_all("save_hf_model", str(hf))
        self._print(f"sft: done, {self.total_steps} steps; model for RL: model.path={hf}")
        return last | {"sft/steps": float(self.total_steps), "sft/skipped_rows": float(self.skipped_rows)}

    def _save(self, step: int) -> None:
        self.actors.save_checkpoint(str(self.ckpt_root), step, {"step": step, "plan": self.plan},
                                    keep_last=self.cfg.checkpoint.keep_last)
        self.saved_step = step

    def _stop(self, done: int) -> None:
        """After a stop signal: checkpoint ``done`` steps (unless saved) and raise StoppedBySignal."""
        from megatron_gigpo.actor.checkpoint_layout import checkpoint_name
        from megatron_gigpo.run.preemption import StoppedBySignal, requested

        if done and self.saved_step != done:
            self._save(done)
        self._print(f"sft: {requested()}: stopping after step {done} of {self.total_steps}")
        raise StoppedBySignal(requested(), "sft", done, self.ckpt_root / checkpoint_name(done) if done else None)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log(metrics | {"sft/skipped_rows": float(self.skipped_rows)}, step)
        keys = [k for k in ("actor/loss", "val/loss", "perf/tokens_per_s") if k in metrics]
        line = f"step {step}: " + ", ".join(f"{k}={metrics[k]:.4g}" for k in keys)
        if self.progress is not None:
            loss = f"loss {metrics['actor/loss']:.4g}" if "actor/loss" in metrics else ""
            self.progress.update(self.bar, completed=step, status=loss)
        terminal = self.progress is not None and self.progress.console.is_terminal
        if self.progress is None or "val/loss" in metrics or progress_line_due(
                step, self.total_steps, terminal=terminal, seconds_since_last=time.monotonic() - self._last_line):
            self._print(line)

    def _print(self, line: str) -> None:
        self._last_line = time.monotonic()
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.console.print(line, soft_wrap=True)


def progress_line_due(step: int, total: int, *, terminal: bool, seconds_since_last: float) -> bool:
    """Whether the SFT stage prints a ``step N: ...`` line beside its progress bar: never on a terminal (the bar
    shows the step); in a log file (no terminal: the bar does not draw) every ``total // PROGRESS_LINES`` steps,
    at the last step, and whenever ``PROGRESS_LINE_S`` seconds passed since the last line."""
    if terminal:
        return False
    return step == total or step % max(1, total // PROGRESS_LINES) == 0 or seconds_since_last >= PROGRESS_LINE_S


def run_sft(cfg: Config) -> dict[str, float]:
    """Run (or resume) the SFT stage of ``cfg`` and export the model; see the module docstring.

    A finished stage (``<run dir>/sft/hf`` exists) returns at once, saying where the model is, with the last
    metrics recorded.

    Returns:
        Final metrics (:meth:`SFTTrainer.fit`).
    """
    done = finished_model(cfg)
    if done is not None:
        from megatron_gigpo.run.metrics import read_metrics

        print(f"megatron-gigpo: SFT already finished: the model is {done} (model.path={done}); remove "
              f"{sft_dir(cfg)} or use another trainer.experiment_name to train again", flush=True)
        try:
            records = read_metrics(sft_dir(cfg))
        except FileNotFoundError:
            return {}
        final: dict[str, float] = {}
        for record in records:
            final |= {k: v for k, v in record.items() if k != "step"}
        return final
    with SFTTrainer(cfg) as trainer:
        return trainer.fit()
