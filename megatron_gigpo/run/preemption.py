"""Stopping a run on a signal: Slurm's time limit (``sbatch --signal=B:TERM@300``), preemption, ``kill``.

``megatron-gigpo train`` and ``sft`` run inside :func:`stop_on_signals`. There the first SIGTERM or SIGUSR1 only
records the request (:func:`requested`): no exception enters a collective, a Ray call or a checkpoint write. The
loops act on it at their next safe point (:mod:`megatron_gigpo.driver`, :mod:`megatron_gigpo.sft.trainer`):

- RL, a signal during an iteration's rollout: the rollout is abandoned at its next environment step (it is not
  awaited: a long rollout would outlast the time left) and the iteration's tasks are drawn again on resume; a
  signal after the rollout (log-probs, update, weight sync, validation, checkpoint): the iteration finishes;
- SFT: the current optimizer step finishes;
- the cold start's expert demonstrations (:func:`stop_at_once`): they stop at once, their finished episodes kept.

Then the loop writes a checkpoint of the last completed iteration (or step), unless one exists, stops Ray and the
ranks, and raises :class:`StoppedBySignal`; the command line turns it into exit code :data:`RESUME_EXIT_CODE`.
The same command run again resumes from that checkpoint (``checkpoint.resume``, on by default);
``slurm/train.sbatch`` requeues the job. A second signal aborts at once (``SystemExit(128 + signal)``: 143 for
SIGTERM), keeping only the checkpoints already written.

Ray's ``ray.init`` installs its own SIGTERM handler in the driver; :func:`start_ray
<megatron_gigpo.builders.start_ray>` calls :func:`reinstall` after it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RESUME_EXIT_CODE", "STOP_SIGNALS", "StoppedBySignal", "requested", "reinstall", "stop_at_once",
           "stop_on_signals"]

#: Exit code of a run that a signal stopped after it checkpointed: run the same command again to resume.
#: EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry"); not 143, which is also what a
#: shell reports for a process killed by SIGTERM without any checkpoint.
RESUME_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StoppedBySignal(Exception):
    """A loop stopped on a signal after its checkpoint (or before any progress worth one).

    Attributes:
        signal_name: ``"SIGTERM"`` or ``"SIGUSR1"``.
        stage: ``"train"``, ``"sft"`` or ``"demos"``.
        done: iterations (RL) or optimizer steps (SFT) completed, resumed ones included; 0 for ``demos``.
        checkpoint: the checkpoint folder holding ``done``, or None (nothing completed yet, or demos).
    """

    def __init__(self, signal_name: str, stage: str, done: int, checkpoint: Path | None) -> None:
        self.signal_name, self.stage, self.done, self.checkpoint = signal_name, stage, done, checkpoint
        where = (f"checkpoint {checkpoint}" if checkpoint is not None else
                 "the finished episodes are kept" if stage == "demos" else "nothing to checkpoint yet")
        unit = {"train": "iteration", "sft": "SFT step"}.get(stage)
        after = f" after {unit} {done}" if unit else ""
        super().__init__(f"stopped by {signal_name} ({stage}){after}: {where}; run the same command again to "
                         f"resume (exit code {RESUME_EXIT_CODE})")


class _State:
    """The process's stop request (signal handlers are process-wide, so is this)."""

    enabled = False  # inside stop_on_signals
    signum: int | None = None  # the first stop signal received
    at_once: str | None = None  # inside stop_at_once: the stage to name


def requested() -> str | None:
    """The name of the stop signal received inside :func:`stop_on_signals` (``"SIGTERM"``), or None."""
    return None if _State.signum is None else signal.Signals(_State.signum).name


def _handler(signum: int, frame: object) -> None:
    if _State.signum is not None:  # a second signal: abort now
        raise SystemExit(128 + signum)
    _State.signum = signum
    if _State.at_once is not None:
        raise StoppedBySignal(signal.Signals(signum).name, _State.at_once, 0, None)


def reinstall() -> None:
    """Inside :func:`stop_on_signals`: install its handlers again (after a library replaced them, as ``ray.init``
    does with SIGTERM); a no-op outside."""
    if _State.enabled:
        for signum in STOP_SIGNALS:
            signal.signal(signum, _handler)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside (main thread only): SIGTERM and SIGUSR1 request a stop (:func:`requested`) instead of ending
    the process; a second one raises ``SystemExit(128 + signal)``. The previous handlers come back on exit."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    _State.enabled, _State.signum, _State.at_once = True, None, None
    reinstall()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _State.enabled, _State.signum, _State.at_once = False, None, None


@contextlib.contextmanager
def stop_at_once(stage: str) -> Iterator[None]:
    """Inside :func:`stop_on_signals`, for work that keeps its progress as it goes (the demonstration writer's
    partial file): a stop signal, or one received before, raises :class:`StoppedBySignal` for ``stage`` at once."""
    if not _State.enabled:
        yield
        return
    if _State.signum is not None:
        raise StoppedBySignal(signal.Signals(_State.signum).name, stage, 0, None)
    _State.at_once = stage
    try:
        yield
    finally:
        _State.at_once = None
