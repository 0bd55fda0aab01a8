"""The cold start in front of RL: expert demonstrations, then supervised fine-tuning, then GiGPO from its result.

With ``sft.enabled: true``, ``megatron-gigpo train`` calls :func:`cold_start` first:

1. demonstrations: when ``sft.train_file`` is null, the environment's expert plays ``sft.demos.num_episodes``
   training tasks through the RL step prompts (:func:`megatron_gigpo.demos.writer.write_demos`) into
   ``<run dir>/sft/demos.jsonl`` (kept, and reused by a re-run);
2. the SFT stage (:func:`megatron_gigpo.sft.trainer.run_sft`) trains the recipe's model on them and exports
   ``<run dir>/sft/hf`` (skipped when that exists: a finished stage);
3. RL starts from that export: the returned config's ``model.path`` is it (``model.init: pretrained``).

Each step is skipped once its output exists, so an interrupted ``train`` resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron_gigpo.config import Config

__all__ = ["cold_start", "demos_path", "from_cold_start", "with_sft_data"]

log = logging.getLogger(__name__)


def demos_path(cfg: Config) -> Path:
    """``<run dir>/sft/demos.jsonl``: where generated demonstrations go."""
    from megatron_gigpo.sft.trainer import sft_dir

    return sft_dir(cfg) / "demos.jsonl"


def with_sft_data(cfg: Config) -> Config:
    """``cfg`` with ``sft.train_file`` set: the recipe's own file, or expert demonstrations written on first use.

    Raises:
        ConfigError: no expert exists for ``env.name`` (and no ``sft.train_file`` was given).
    """
    if cfg.sft.train_file:
        return cfg
    path = demos_path(cfg)
    if path.is_file():
        log.info("cold start: reusing the demonstrations in %s", path)
    else:
        from megatron_gigpo.demos.writer import write_demos
        from megatron_gigpo.run.preemption import stop_at_once

        d = cfg.sft.demos
        with stop_at_once("demos"):  # a stop signal: finished episodes stay in the partial file for a re-run
            stats = write_demos(cfg, path, d.num_episodes, d.epsilon, d.seed, reasoning=d.reasoning)
        log.info("cold start: %d demonstration rows of %d %s episodes (expert success %.3f, random share %.3f) "
                 "in %s", stats.rows, stats.episodes, cfg.env.name, stats.success_rate, stats.random_share, path)
    return dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, train_file=str(path)))


def cold_start(cfg: Config) -> Config:
    """Run the cold start of ``cfg`` if ``sft.enabled`` (see the module docstring); return the RL config.

    Returns:
        ``cfg`` unchanged when ``sft.enabled`` is false; else ``cfg`` whose ``model.path`` is the SFT export
        (absolute) and ``model.init`` is ``pretrained``.

    Raises:
        ConfigError, SFTDataError, PreflightError: as :func:`with_sft_data` and ``run_sft``.
    """
    if not cfg.sft.enabled:
        return cfg
    from megatron_gigpo.sft.trainer import finished_model, run_sft

    model = finished_model(cfg)
    if model is None:
        run_sft(with_sft_data(cfg))
        model = finished_model(cfg)
        if model is None:  # run_sft exports atomically at its end; anything else is a bug
            raise RuntimeError(f"the SFT stage ended without its export in {cfg.run_dir / 'sft'}")
    else:
        log.info("cold start: SFT finished earlier; RL starts from %s", model)
    return from_cold_start(cfg)


def from_cold_start(cfg: Config) -> Config:
    """The RL config of a run whose cold start has finished: what ``train`` trained and ``eval`` must load.

    A checkpoint of an RL run that used adapters (``model.lora``) holds its frozen base only as the model it
    started from, so evaluating it on the recipe's ``model.init: random`` would score adapters on random weights.

    Returns:
        ``cfg`` unchanged when ``sft.enabled`` is false; else ``cfg`` whose ``model.path`` is the SFT export
        ``<run dir>/sft/hf`` (absolute) and ``model.init`` is ``pretrained``.

    Raises:
        FileNotFoundError: ``sft.enabled`` and the run has no finished SFT export (names the folder).
    """
    if not cfg.sft.enabled:
        return cfg
    from megatron_gigpo.sft.trainer import HF_SUBDIR, finished_model, sft_dir

    model = finished_model(cfg)
    if model is None:
        raise FileNotFoundError(
            f"sft.enabled: the run's cold start export {sft_dir(cfg) / HF_SUBDIR} is missing (no config.json); "
            "run `megatron-gigpo train` (or `sft`) for this trainer.experiment_name first, or set sft.enabled=false "
            "and model.path to the model the run started from"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model.resolve()), init="pretrained"))
