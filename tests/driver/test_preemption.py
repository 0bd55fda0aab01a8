"""megatron_gigpo.run.preemption: a stop signal only sets a flag, a second one aborts, the handlers survive a
library that replaces them (ray.init) and come back afterwards; the demonstrations stop at once. The whole path
(driver, checkpoint, exit code, sbatch requeue, resume) runs in tests/slurm/test_sbatch.py."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from megatron_gigpo.run import preemption
from megatron_gigpo.run.preemption import RESUME_EXIT_CODE, StoppedBySignal, requested, stop_at_once, stop_on_signals

pytestmark = pytest.mark.unit


def _send(signum: int) -> None:
    """Deliver ``signum`` to this process; its Python handler runs before os.kill returns to the caller's next
    bytecode (main thread)."""
    os.kill(os.getpid(), signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_first_signal_only_requests_a_stop_and_a_second_aborts(signum):
    before = signal.getsignal(signum)
    with stop_on_signals():
        assert requested() is None
        _send(signum)
        assert requested() == signal.Signals(signum).name  # the process lives on: only a flag
        with pytest.raises(SystemExit) as exc:
            _send(signum)
        assert exc.value.code == 128 + signum  # 143 for SIGTERM
    assert signal.getsignal(signum) is before and requested() is None


def test_handlers_come_back_after_a_library_replaced_them():
    """``ray.init`` installs its own SIGTERM handler (sys.exit) in the driver; start_ray calls reinstall()."""
    with stop_on_signals():
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # as ray.init does with its handler
        preemption.reinstall()
        _send(signal.SIGTERM)
        assert requested() == "SIGTERM"
    replaced = signal.getsignal(signal.SIGTERM)
    preemption.reinstall()  # outside stop_on_signals: nothing changes
    assert signal.getsignal(signal.SIGTERM) is replaced


def test_demonstrations_stop_at_once_and_only_inside_stop_on_signals():
    with stop_at_once("demos"):  # not inside stop_on_signals: a no-op
        pass
    with stop_on_signals():
        with pytest.raises(StoppedBySignal) as exc:
            with stop_at_once("demos"):
                _send(signal.SIGTERM)
        assert (exc.value.signal_name, exc.value.stage, exc.value.checkpoint) == ("SIGTERM", "demos", None)
        with pytest.raises(StoppedBySignal):  # a signal received before: raised on entry
            with stop_at_once("demos"):
                pass


def test_stopped_by_signal_names_the_checkpoint_and_the_exit_code(tmp_path):
    exc = StoppedBySignal("SIGUSR1", "train", 7, tmp_path / "iter_00000007")
    assert str(exc) == (f"stopped by SIGUSR1 (train) after iteration 7: checkpoint {tmp_path}/iter_00000007; "
                        f"run the same command again to resume (exit code {RESUME_EXIT_CODE})")
    assert "nothing to checkpoint yet" in str(StoppedBySignal("SIGTERM", "train", 0, None))
    assert "the finished episodes are kept" in str(StoppedBySignal("SIGTERM", "demos", 0, None))


def test_the_sbatch_script_requeues_on_the_same_exit_code():
    script = (Path(__file__).resolve().parents[2] / "slurm/train.sbatch").read_text()
    assert re.findall(r"^RESUME_RC=(\d+)", script, re.MULTILINE) == [str(RESUME_EXIT_CODE)]
