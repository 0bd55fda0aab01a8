"""One run per run directory (megatron_gigpo.run.lock), with real processes: a second holder is refused naming the
first (host, PID, Slurm job id), and the lock of a holder that died is taken over (a requeued job)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gigpo.run.lock import LOCK_FILE, RunDirInUse, hold_run_dir

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from megatron_gigpo.run.lock import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("HELD", flush=True)
    time.sleep(600)
"""


def start_holder(run_dir: Path, job_id: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": job_id}
    env.pop("SLURM_ARRAY_JOB_ID", None)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "HELD"
    return holder


def test_a_second_run_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "runs" / "exp"
    holder = start_holder(run_dir, "4242")
    try:
        with pytest.raises(RunDirInUse) as refused:
            with hold_run_dir(run_dir):
                pytest.fail("a second holder got the run directory")
        message = str(refused.value)
        assert f"run directory {run_dir} is in use by another run (host {socket.gethostname()}, pid {holder.pid}, " \
               f"Slurm job 4242, since " in message
        assert "Give each job its own trainer.experiment_name" in message
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel drops the lock
        holder.wait(timeout=30)
    with hold_run_dir(run_dir) as lock_file:  # what a requeued job does
        assert lock_file == (run_dir / LOCK_FILE).resolve()
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
        with hold_run_dir(run_dir):  # the same process again (the SFT stage inside `train`)
            pass
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    # Released at the end: another process gets it.
    last = start_holder(run_dir, "4243")
    last.kill()
    last.wait(timeout=30)


def test_train_is_refused_before_ray_starts_while_another_run_holds_the_directory(tmp_path, capsys):
    import ray

    from megatron_gigpo.cli import main

    holder = start_holder(tmp_path / "smoke-cpu", "77")
    try:
        rc = main(["train", str(REPO / "recipes/smoke/cpu.yaml"), f"trainer.output_dir={tmp_path}"])
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert rc == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'smoke-cpu'} is in use by another run (host " in err
    assert f"pid {holder.pid}, Slurm job 77" in err
    assert not ray.is_initialized()
