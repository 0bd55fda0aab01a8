"""Submit slurm/train.sbatch, wait for the job without sacct, and look for Ray processes it left behind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

# Ray settings a test process may carry that a submitted job must not inherit.
RAY_SESSION_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")

REPO = Path(__file__).resolve().parents[2]
TERMINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
}  # fmt: skip


@dataclass(frozen=True)
class JobResult:
    job_id: str
    state: str
    exit_code: int  # the batch script's exit status (ExitCode=N:signal)
    output: str  # the job's stdout and stderr (--output)

    def describe(self) -> str:
        return f"job {self.job_id}: {self.state}, exit {self.exit_code}; output:\n{self.output}"


def _job_fields(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o`` as a dict; None once Slurm no longer knows the job; ``{}`` when slurmctld did
    not answer this time (busy on a loaded 2-core machine: ask again rather than give the job up)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {}
    if out.returncode != 0:
        return None if "invalid job id" in out.stderr.lower() else {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def submit(sbatch_args: list[str], script_args: list[str], out_dir: Path, env: dict[str, str]) -> str:
    """sbatch slurm/train.sbatch from the repository root; returns the job id. Output: out_dir/<id>.out."""
    cmd = ["sbatch", "--parsable", f"--output={out_dir}/%j.out", *sbatch_args, "slurm/train.sbatch", *script_args]
    # The job decides its own Ray settings: nothing from this test process (an earlier in-process run leaves
    # RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH set for the process's lifetime) reaches it unless `env` says so.
    inherited = {k: v for k, v in os.environ.items() if k not in RAY_SESSION_VARS}
    # The job's own join deadline ends before a test's wait (300 s), so that a failure shows the job's reason.
    inherited["MEGATRON_GIGPO_RAY_WAIT_S"] = "180"
    out = subprocess.run(cmd, cwd=REPO, env={**inherited, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def wait_job(job_id: str, out_dir: Path, timeout_s: float) -> JobResult:
    """Poll scontrol every second until the job ends (no sacct: there is no slurmdbd); scancel on timeout."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] | None = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id)
        if fields is None or ("JobState" in fields and fields["JobState"] in TERMINAL_STATES):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        output_file = out_dir / f"{job_id}.out"
        output = output_file.read_text() if output_file.exists() else "(no output file)"
        state = fields["JobState"] if fields and "JobState" in fields else "unanswered"
        pytest.fail(f"job {job_id} still {state} after {timeout_s:.0f}s; cancelled. Output:\n{output}")
    output_file = out_dir / f"{job_id}.out"
    output = output_file.read_text() if output_file.exists() else "(no output file)"
    if fields is None:
        return JobResult(job_id, "UNKNOWN", -1, output)
    return JobResult(job_id, fields["JobState"], int(fields["ExitCode"].split(":")[0]), output)


def wait_output_line(job_id: str, out_dir: Path, prefix: str, timeout_s: float) -> str:
    """The first line of the running job's output that starts with ``prefix``; fails the test (and cancels
    the job) when the job ends or ``timeout_s`` passes first."""
    output_file = out_dir / f"{job_id}.out"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        output = output_file.read_text() if output_file.exists() else ""
        for line in output.splitlines():
            if line.startswith(prefix):
                return line
        fields = _job_fields(job_id)
        if fields is None or fields.get("JobState") in TERMINAL_STATES:
            pytest.fail(f"job {job_id} ended before printing {prefix!r}; output:\n{output}")
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=30, check=False)
    pytest.fail(f"job {job_id} printed no {prefix!r} within {timeout_s:.0f}s; cancelled")


def wait_metrics_step(job_id: str, out_dir: Path, run_dir: Path, step: int, timeout_s: float) -> None:
    """Until ``run_dir/metrics.jsonl`` holds a record of ``step``; fails the test (and cancels the job) when the
    job ends or ``timeout_s`` passes first."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and f'{{"step": {step},' in metrics.read_text():
            return
        fields = _job_fields(job_id)
        if fields is None or fields.get("JobState") in TERMINAL_STATES:
            output_file = out_dir / f"{job_id}.out"
            pytest.fail(f"job {job_id} ended before logging step {step}; output:\n"
                        f"{output_file.read_text() if output_file.exists() else '(no output file)'}")
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=30, check=False)
    pytest.fail(f"job {job_id} logged no step {step} within {timeout_s:.0f}s; cancelled")


def start_requeued_now(job_id: str, timeout_s: float) -> None:
    """Once the job was requeued (pending again, Restarts >= 1), let it start at once: Slurm holds a requeued job
    back for its credential lifetime + 1 s (cred_expire: 121 s by default), and `scontrol update StartTime=now`
    lifts that. Fails the test when the job is not requeued within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] | None = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id)
        if fields is None or fields.get("JobState") in TERMINAL_STATES:
            break
        if int(fields.get("Restarts", "0")) >= 1 and fields.get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30, check=True)
            return
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=30, check=False)
    state = (fields or {}).get("JobState", "unknown to Slurm")
    pytest.fail(f"job {job_id} was not requeued (state {state}, exit code {(fields or {}).get('ExitCode')}; waited up "
                f"to {timeout_s:.0f}s)")


def job_paths(job_id: str) -> list[Path]:
    """What train.sbatch keeps under /tmp for the job: the node dirs, the log dir and the token dir."""
    return sorted(Path("/tmp").glob(f"ray-j{job_id}[nla]*"))


def ray_processes_of_job(job_id: str) -> list[str]:
    """Command lines of processes that still use the job's Ray temp dirs (/tmp/ray-j<id>n<i>): raylet, GCS,
    workers, `ray start`."""
    marker = f"/ray-j{job_id}n"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline:
            found.append(cmdline[:200])
    return found


def wait_no_ray_processes(job_id: str, timeout_s: float = 30) -> list[str]:
    """Leftover Ray processes of the job after up to ``timeout_s`` (slurmstepd may still be reaping)."""
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes_of_job(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def remove_ray_dirs(job_id: str) -> None:
    """The job's Ray dirs under /tmp, which train.sbatch keeps after a failure (and a token dir, which it
    never should)."""
    for path in job_paths(job_id):
        shutil.rmtree(path, ignore_errors=True)
