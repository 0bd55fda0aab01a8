"""slurm/train.sbatch on a real Slurm cluster (scripts/slurm_up.sh): Ray on Slurm, then the driver.

The Ray-on-Slurm tests replace the driver with tests/slurm/ray_probe.py (MEGATRON_GIGPO_DRIVER), which reports
the cluster it sees; the last test runs the real CPU smoke recipe, stops it with the time limit's signal and
checks that the requeued job resumes. Every job runs with Ray token authentication (one token per job) unless a
test opts out.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megatron_gigpo.actor.checkpoint_layout import complete_checkpoints
from megatron_gigpo.run.metrics import read_metrics
from slurm_jobs import (
    REPO, JobResult, job_paths, remove_ray_dirs, start_requeued_now, submit, wait_job, wait_metrics_step,
    wait_no_ray_processes, wait_output_line,
)

pytestmark = pytest.mark.integration

PROBE = "python3 tests/slurm/ray_probe.py"
RECIPE = "recipes/smoke/cpu.yaml"
JOB_TIMEOUT_S = 300  # Ray head start, join and probe take ~30 s on the 2-core CI machine


def probe_report(result: JobResult) -> dict:
    lines = [line for line in result.output.splitlines() if line.startswith("RAY_PROBE ")]
    assert len(lines) == 1, f"expected one RAY_PROBE line; {result.describe()}"
    return json.loads(lines[0].removeprefix("RAY_PROBE "))


def partition_cpus(partition: str) -> int:
    """CPUs of one node of the partition, as Slurm configures it."""
    out = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%c"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def run_job(tmp_path: Path, sbatch_args: list[str], script_args: list[str], env: dict[str, str]) -> JobResult:
    job_id = submit(sbatch_args, script_args, tmp_path, env)
    return wait_job(job_id, tmp_path, JOB_TIMEOUT_S)


def ephemeral_port_floor() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def token_auth(job_id: str, node_index: int) -> dict:
    """What the probe reports for a process that uses node ``node_index``'s copy of the job's token."""
    return {"auth_mode": "token", "token_path": f"/tmp/ray-j{job_id}n{node_index}/auth_token",
            "token_file_mode": "0o600", "token_in_env": False}


def test_ray_head_on_one_node_runs_the_driver_and_stops(slurm_cluster, tmp_path):
    args = [RECIPE, "trainer.total_iterations=1", "trainer.experiment_name=a b"]
    result = run_job(tmp_path, ["--partition=debug"], args, {"MEGATRON_GIGPO_DRIVER": PROBE})

    assert (result.state, result.exit_code) == ("COMPLETED", 0), result.describe()
    # The default validation: the plan and the preflight, against the allocation (1 node, no GPU).
    validation = f"validating: megatron-gigpo validate --plan --preflight --nodes=1 --gpus-per-node=0 {' '.join(args)}"
    assert validation in result.output, result.describe()
    report = probe_report(result)
    assert report["argv"] == args  # passed through word for word, the space included
    assert report["ray_address"].startswith("127.0.0.1:")  # one node stays on loopback
    port = int(report["ray_address"].rsplit(":", 1)[1])
    assert port == 6379 or 20000 <= port < ephemeral_port_floor()  # a port nothing else takes at random
    assert report["nodes"] == 1
    assert report["cpus"] == partition_cpus("debug")  # --num-cpus from SLURM_CPUS_ON_NODE
    assert report["gpus"] == 0
    assert report["task_slurm_job_ids"] == [result.job_id]  # Ray's workers run inside the job's step
    # Token auth: the driver reads the job's token file, the worker its node's copy; both 0600.
    assert report["driver_auth"] == {"auth_mode": "token", "token_path": f"/tmp/ray-j{result.job_id}auth/auth_token",
                                     "token_file_mode": "0o600", "token_in_env": False}
    assert report["task_auth"] == [token_auth(result.job_id, 0)]
    assert wait_no_ray_processes(result.job_id) == []
    assert not job_paths(result.job_id), "Ray dirs and the token are removed after success"


def test_ray_workers_join_from_every_node_with_their_gpus(slurm_cluster, tmp_path):
    if "multinode" not in slurm_cluster.partitions:
        pytest.skip("the test cluster has no multinode partition (MEGATRON_GIGPO_SLURM_EMULATED_NODES=0)")
    env = {"MEGATRON_GIGPO_DRIVER": PROBE, "MEGATRON_GIGPO_VALIDATE": ""}
    sbatch_args = ["--partition=multinode", "--nodes=2", "--gpus-per-node=1"]
    result = run_job(tmp_path, sbatch_args, [RECIPE], env)

    assert (result.state, result.exit_code) == ("COMPLETED", 0), result.describe()
    assert "validating" not in result.output  # MEGATRON_GIGPO_VALIDATE="" skips it
    report = probe_report(result)
    assert report["nodes"] == 2
    assert len(set(report["node_ips"])) == 2  # each worker joined with its own node's address
    assert report["cpus"] == 2 * partition_cpus("multinode")
    assert report["gpus"] == 2  # --num-gpus from SLURM_GPUS_ON_NODE on every node
    assert len(report["task_nodes"]) == 2  # work ran on both nodes
    # Each node's Ray got the job's token through its srun step and keeps its own 0600 copy.
    assert report["task_auth"] == [token_auth(result.job_id, 0), token_auth(result.job_id, 1)]
    assert wait_no_ray_processes(result.job_id) == []
    assert not job_paths(result.job_id)


def test_invalid_override_fails_before_ray_starts(slurm_cluster, tmp_path):
    result = run_job(tmp_path, ["--partition=debug"], [RECIPE, "trainer.no_such_key=1"], {})
    try:
        assert (result.state, result.exit_code) == ("FAILED", 2), result.describe()
        assert "unknown key 'trainer.no_such_key'" in result.output, result.describe()
        assert "waiting" not in result.output and "stopping Ray" not in result.output, result.describe()
    finally:
        remove_ray_dirs(result.job_id)


def test_an_allocation_unlike_the_recipe_fails_before_ray_starts(slurm_cluster, tmp_path):
    """A 1-node recipe on --nodes=2: the validation step compares the allocation with trainer.nnodes and fails the
    job in seconds, naming the key and the sbatch option, before any `ray start` (before: one node idled)."""
    if "multinode" not in slurm_cluster.partitions:
        pytest.skip("the test cluster has no multinode partition (MEGATRON_GIGPO_SLURM_EMULATED_NODES=0)")
    result = run_job(tmp_path, ["--partition=multinode", "--nodes=2", "--gpus-per-node=1"], [RECIPE],
                     {"MEGATRON_GIGPO_DRIVER": PROBE})
    try:
        assert (result.state, result.exit_code) == ("FAILED", 2), result.describe()
        assert "validating: megatron-gigpo validate --plan --preflight --nodes=2 --gpus-per-node=1" in result.output
        assert ("the allocation (--nodes=2) does not match the recipe (trainer.nnodes=1): 1 node(s) would idle. "
                "Submit with `sbatch --nodes=1`, or set trainer.nnodes=2") in result.output, result.describe()
        assert "ray start" not in result.output and "waiting" not in result.output, result.describe()
        assert "RAY_PROBE" not in result.output and not job_paths(result.job_id), result.describe()
    finally:
        remove_ray_dirs(result.job_id)


def test_a_head_that_cannot_start_fails_the_job_instead_of_waiting(slurm_cluster, tmp_path):
    """Something else listens on the head's port: the GCS cannot bind it, `ray start` exits (after ~45 s), and
    the job ends with that reason. Before, the wait step's ray.init retried the foreign listener for good (the
    CI failure of 2026-12-06: an ephemeral head port taken before the GCS bound it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        env = {"MEGATRON_GIGPO_DRIVER": PROBE, "MEGATRON_GIGPO_VALIDATE": "",
               "MEGATRON_GIGPO_RAY_PORT": str(listener.getsockname()[1])}
        result = run_job(tmp_path, ["--partition=debug"], [RECIPE], env)
    try:
        assert result.state == "FAILED" and result.exit_code != 0, result.describe()
        assert "ended before the cluster was complete" in result.output, result.describe()
        assert "Failed to start GCS" in result.output, result.describe()  # the tail of the head's Ray log
        assert "RAY_PROBE" not in result.output, result.describe()
        assert wait_no_ray_processes(result.job_id) == []
    finally:
        remove_ray_dirs(result.job_id)


def test_driver_failure_is_the_job_exit_code_and_ray_still_stops(slurm_cluster, tmp_path):
    env = {"MEGATRON_GIGPO_DRIVER": f"{PROBE} --exit-code=3", "MEGATRON_GIGPO_VALIDATE": ""}
    result = run_job(tmp_path, ["--partition=debug"], [RECIPE], env)
    try:
        assert (result.state, result.exit_code) == ("FAILED", 3), result.describe()
        assert probe_report(result)["nodes"] == 1
        assert "Ray logs kept in" in result.output, result.describe()
        assert wait_no_ray_processes(result.job_id) == []
        kept = job_paths(result.job_id)
        assert kept and not any(p.name.endswith("auth") for p in kept), kept  # logs kept, token dir removed
        assert not list(Path("/tmp").glob(f"ray-j{result.job_id}n*/auth_token")), "node copies removed too"
    finally:
        remove_ray_dirs(result.job_id)


# Clients of the job's head started from outside the job, each in its own process with an empty HOME and no
# token variables but those given: a plain ray.init (a driver on the GCS port, or Ray Client on the head's
# ray:// port) and megatron-gigpo's connect_ray.
CLIENT = """
import logging, sys
if sys.argv[2].startswith("ray://"):  # Ray Client logs why the server turned it away at debug level only
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ray.util.client.worker").setLevel(logging.DEBUG)
if sys.argv[1] == "plain":
    import ray
    ray.init(address=sys.argv[2], logging_level="ERROR")
    ray.get(ray.remote(lambda: 1).remote(), timeout=60)
else:
    from megatron_gigpo.cluster.ray_setup import connect_ray
    connect_ray(sys.argv[2], logging_level="ERROR")
print("CONNECTED", flush=True)
"""
RAY_CLIENT_PORT = 10001  # `ray start --head` serves Ray Client there by default


def start_client(kind: str, address: str, home: Path, **env: str) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "MEGATRON_GIGPO_RAY_AUTH"))}
    # One-node job: its head listens on 127.0.0.1 only; the pin keeps the client on loopback too.
    base |= {"HOME": str(home), "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **env}
    return subprocess.Popen([sys.executable, "-c", CLIENT, kind, address], env=base, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(client: subprocess.Popen) -> tuple[int, str]:
    try:
        out, err = client.communicate(timeout=240)  # Ray retries a refused token for ~20 s
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
        pytest.fail(f"a Ray client still waits after 240 s (a hang):\n{out}\n{err[-3000:]}")
    return client.returncode, out + err


def secret_seen_outside_its_files(token: str, job_id: str) -> list[str]:
    """Where the token shows besides its files: command lines (ps) of any process, the environment of the
    job's Ray processes, the job's Ray logs and session files."""
    found = []
    marker = f"/ray-j{job_id}"
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if token in cmdline:
            found.append(f"command line of pid {proc.info['pid']}")
        if marker in cmdline:
            try:
                if any(token in v for v in proc.environ().values()):
                    found.append(f"environment of pid {proc.info['pid']}")
            except psutil.Error:
                pass
    for path in job_paths(job_id):
        for file in [path] if path.is_file() else path.rglob("*"):
            if file.is_file() and not file.is_symlink() and file.name != "auth_token" and file.stat().st_size < 50e6:
                if token.encode() in file.read_bytes():
                    found.append(str(file))
    return found


def test_job_head_refuses_clients_without_the_job_token(slurm_cluster, tmp_path):
    release = tmp_path / "release"
    env = {"MEGATRON_GIGPO_DRIVER": f"{PROBE} --hold={release}", "MEGATRON_GIGPO_VALIDATE": ""}
    job_id = submit(["--partition=debug"], [RECIPE], tmp_path, env)
    try:
        report = json.loads(wait_output_line(job_id, tmp_path, "RAY_PROBE ", JOB_TIMEOUT_S).removeprefix("RAY_PROBE "))
        address = report["ray_address"]
        token_file = Path(f"/tmp/ray-j{job_id}auth/auth_token")
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text()
        assert len(token) == 64

        home = tmp_path / "home"
        home.mkdir()
        (tmp_path / "wrong").write_text("0" * 64)
        ray_client = f"ray://{address.rsplit(':', 1)[0]}:{RAY_CLIENT_PORT}"
        refused = {
            "no token": start_client("plain", address, home),
            "wrong token": start_client("connect", address, home, RAY_AUTH_TOKEN_PATH=str(tmp_path / "wrong")),
            "ray client, no token": start_client("plain", ray_client, home),
        }
        results = {name: finish(client) for name, client in refused.items()}
        rc, out = results["no token"]
        assert rc != 0 and "InvalidAuthToken" in out and "CONNECTED" not in out, out[-3000:]
        rc, out = results["wrong token"]
        assert rc != 0 and f"the Ray cluster at {address} refused this process" in out, out[-3000:]
        assert "RAY_AUTH_TOKEN_PATH=<file holding it>" in out and "CONNECTED" not in out
        rc, out = results["ray client, no token"]  # the server's own verdict, not a timeout
        assert rc != 0 and "Invalid or missing authentication token" in out and "CONNECTED" not in out, out[-3000:]
        # The control, after the others (less load): the same client gets in with the job's token. (Not done for
        # Ray Client: its server starts a driver process per client, which fails at random on a loaded machine.)
        rc, out = finish(start_client("connect", address, home, RAY_AUTH_TOKEN_PATH=str(token_file)))
        assert rc == 0 and "CONNECTED" in out, out[-3000:]
        assert secret_seen_outside_its_files(token, job_id) == []
    finally:
        release.touch()
    result = wait_job(job_id, tmp_path, JOB_TIMEOUT_S)
    try:
        assert (result.state, result.exit_code) == ("COMPLETED", 0), result.describe()
        assert token not in result.output
        assert "Ray token authentication on" in result.output
        assert wait_no_ray_processes(job_id) == []
        assert not token_file.exists() and not job_paths(job_id), "the token is gone after the job"
    finally:
        remove_ray_dirs(job_id)


def test_opt_out_runs_without_a_token_and_warns(slurm_cluster, tmp_path):
    env = {"MEGATRON_GIGPO_DRIVER": PROBE, "MEGATRON_GIGPO_VALIDATE": "", "MEGATRON_GIGPO_RAY_AUTH": "disabled"}
    result = run_job(tmp_path, ["--partition=debug"], [RECIPE], env)

    assert (result.state, result.exit_code) == ("COMPLETED", 0), result.describe()
    assert "warning: MEGATRON_GIGPO_RAY_AUTH=disabled: Ray runs WITHOUT token authentication" in result.output
    report = probe_report(result)
    assert report["driver_auth"]["auth_mode"] == "disabled" and report["driver_auth"]["token_path"] == ""
    assert [a["auth_mode"] for a in report["task_auth"]] == ["disabled"]
    assert wait_no_ray_processes(result.job_id) == []


def test_contradicting_ray_auth_mode_fails_before_ray_starts(slurm_cluster, tmp_path):
    env = {"MEGATRON_GIGPO_DRIVER": PROBE, "MEGATRON_GIGPO_VALIDATE": "", "RAY_AUTH_MODE": "disabled"}
    result = run_job(tmp_path, ["--partition=debug"], [RECIPE], env)
    try:
        assert (result.state, result.exit_code) == ("FAILED", 1), result.describe()
        assert "RAY_AUTH_MODE=disabled contradicts MEGATRON_GIGPO_RAY_AUTH=token" in result.output
        assert "MEGATRON_GIGPO_RAY_AUTH=disabled" in result.output and "waiting" not in result.output
    finally:
        remove_ray_dirs(result.job_id)


@pytest.mark.slow
def test_cpu_smoke_recipe_stopped_mid_iteration_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """The real smoke recipe through sbatch --requeue, three iterations. Once step 1 is logged (iteration 2 has
    begun), the batch shell gets SIGTERM alone, as `sbatch --signal=B:TERM@T` sends it T seconds before the time
    limit (`scancel --batch --signal=TERM`). The driver abandons iteration 2's rollout (or, if the signal comes
    after it, finishes the iteration), checkpoints the last completed iteration K, exits 75; the script stops Ray
    and requeues the job; attempt 2 appends to the same output file, resumes from K and finishes. Each step is
    logged once."""
    run_dir = tmp_path / "run"
    run = run_dir / "smoke-cpu"
    # One-step episodes with short replies: the plumbing of a pretrained model, not its answers. save_every=5:
    # the only checkpoints are the stop's and the last iteration's.
    args = [RECIPE, "trainer.total_iterations=3", f"trainer.output_dir={run_dir}", "env.max_steps=1",
            "rollout.response_length=48", "checkpoint.save_every=5"]
    job_id = submit(["--partition=debug", "--requeue"], args, tmp_path, {})
    try:
        wait_metrics_step(job_id, tmp_path, run, 1, timeout_s=1500)
        subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], timeout=30, check=True)
        start_requeued_now(job_id, timeout_s=600)
        result = wait_job(job_id, tmp_path, timeout_s=1500)
        out = result.output
        assert (result.state, result.exit_code) == ("COMPLETED", 0), result.describe()
        first, _, second = out.partition(f"job {job_id}: attempt 2 (SLURM_RESTART_COUNT=1)")
        assert f"job {job_id}: attempt 1 (SLURM_RESTART_COUNT=0)" in first and second, result.describe()
        stop = re.search(r"stopped by SIGTERM \(train\) after iteration (\d+): checkpoint (\S+);", first)
        assert stop, result.describe()
        done = int(stop.group(1))
        assert done in (1, 2) and Path(stop.group(2)) == run / "checkpoints" / f"iter_{done:08d}", result.describe()
        if done == 1:
            assert "SIGTERM during the rollout of iteration 2: its episodes are abandoned" in first, result.describe()
        assert "SIGTERM: passed on to the driver" in first and "driver exited with 75" in first, result.describe()
        assert f"requeueing job {job_id}; attempt 2 resumes from the checkpoint" in first, result.describe()
        assert f"resumed from {run / 'checkpoints'} at iteration {done}" in second, result.describe()
        assert "driver exited with 0" in second and "Ray token authentication on" in second, result.describe()
        # Each step exactly once in the file itself (read_metrics would hide a duplicate), none set aside.
        lines = (run / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3], lines
        assert not (run / "previous_attempts").exists()
        for record in read_metrics(run):
            assert record["rollout/actor_logprob_diff_max"] < 1e-3, record
        assert [i for i, _ in complete_checkpoints(run / "checkpoints")] == [done, 3]
        assert wait_no_ray_processes(job_id) == []
        assert not job_paths(job_id), "Ray dirs and the token are removed after success"
    finally:
        remove_ray_dirs(job_id)
