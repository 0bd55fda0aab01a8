"""The ``sft`` section (:class:`SFTConfig`): the supervised cold start on the RL actor (``megatron-gigpo sft``,
and the first stage of ``megatron-gigpo train`` when ``sft.enabled``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.actor.config import LR_DECAY_STYLES
from megatron_gigpo.demos.config import DemosConfig
from megatron_gigpo.fields import MAX_SEED, choice, num
from megatron_gigpo.models.config import LoraConfig

__all__ = ["SFTConfig"]


@dataclass
class SFTConfig:
    """Supervised cold start (``megatron-gigpo sft``, :mod:`megatron_gigpo.sft`): NLL on the assistant targets
    of JSONL demonstrations, on the same Megatron actor as RL. Model, parallel layout, device, micro-batch
    budget and Adam settings (weight decay, betas, eps, clip_grad) come from ``model``, ``parallel``,
    ``trainer`` and ``optim``. Writes ``<run dir>/sft/``: metrics, ``checkpoints/`` and ``hf/`` (the trained
    model; an RL recipe reads it as ``model.path``)."""

    # true: `megatron-gigpo train` runs this stage first (skipped once <run dir>/sft/hf exists) and starts RL from
    # its result; false: the stage runs only through `megatron-gigpo sft`.
    enabled: bool = False
    # JSONL rows {"messages": [{"role", "content"}, ...]}, last = assistant target; null: expert demonstrations
    # (`demos` below) written to <run dir>/sft/demos.jsonl
    train_file: str | None = None
    demos: DemosConfig = field(default_factory=DemosConfig)
    val_file: str | None = None  # held-out rows (same format); null: val_fraction of train_file
    val_fraction: float = num(0.05, ge=0, lt=1)  # share of train_file held out (seeded) when val_file is null; 0: none
    epochs: int = num(3, ge=1)
    batch_size: int = num(64, ge=1)  # rows per optimizer step
    lr: float = num(1e-5, gt=0)
    min_lr: float = num(0.0, ge=0)  # <= lr
    lr_warmup_steps: int = num(0, ge=0)  # optimizer steps
    lr_decay_style: str = choice("cosine", LR_DECAY_STYLES)  # over all optimizer steps of the run
    loss_agg_mode: str = choice("token-mean", "megatron_gigpo.algo.losses:LOSS_AGG_MODES")
    max_length: int = num(4096, ge=2)  # tokens of prompt + response (end token included); longer rows are invalid
    skip_invalid_rows: bool = False  # count, report and skip invalid rows instead of stopping at the first
    save_every: int = num(0, ge=0)  # optimizer steps between checkpoints; 0: only at the end of each epoch (always saved)
    seed: int = num(1, ge=0, le=MAX_SEED)  # held-out split and per-epoch shuffle
    # Adapters of this stage; off (default): all weights train. model.lora is the RL actor's alone, so an RL
    # recipe with LoRA still cold-starts a randomly initialised model in full.
    lora: LoraConfig = field(default_factory=LoraConfig)
