"""A Ray cluster of stand-in nodes on this one machine, started with ``ray start`` (tests/placement, tests/rollout).

Each node is a separate ``ray start --block`` (its own raylet and Ray node id; the head on 127.0.0.1, node i on
127.0.0.(i+1), as the Slurm tests emulate nodes), optionally advertising stand-in GPUs (``--num-gpus``: Ray
assigns GPUs that do not exist like real ones) and a ``stand_in_node_<i>`` resource. The physical machine is the
same, so shared memory really is shared between the nodes; what differs is the Ray node id, which is what
placement and the same-node weight transports key on. Imported by module name (the tests folder is on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from megatron_gigpo.cluster.ray_setup import local_ray_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the stand-in Ray head did not listen on port {port}")


def _stop(procs: list[subprocess.Popen], root: Path) -> None:
    """SIGTERM each blocking `ray start` (it stops its node's processes), then kill what is left of ours: the
    processes started in ``root`` (Ray's agents rename themselves, so they are found by working directory)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(root):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue


def _node_args(i: int, port: int, root: Path, cpus: int, gpus: int) -> list[str]:
    args = ["ray", "start", "--block", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
            f"--resources={json.dumps({f'stand_in_node_{i}': 1})}", f"--temp-dir={root}/n{i}", "--disable-usage-stats"]
    if i == 0:
        # A free Ray Client port too (`ray start --head` takes 10001 by default): tests in other pytest-xdist
        # workers may run a head at the same time (another stand-in cluster, a Slurm job's).
        return args + ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
                       f"--ray-client-server-port={_free_port()}"]
    return args + [f"--address=127.0.0.1:{port}", f"--node-ip-address=127.0.0.{i + 1}"]


@contextlib.contextmanager
def stand_in_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int, pythonpath: Sequence[Path],
                     timeout_s: float = 120.0) -> Iterator[None]:
    """Start ``nodes`` stand-in Ray nodes and connect this process as their driver; stop them on exit.

    ``pythonpath``: folders the Ray workers can import from (the repository, test helper folders). Token
    authentication as every run has it: one fresh token for the nodes and the driver. Skips the test when the
    ``ray`` command is missing; fails it, with the nodes' logs, when the cluster does not come up in time.
    """
    import ray

    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not installed")
    root = Path(tempfile.mkdtemp(prefix="rpl", dir="/tmp"))  # short: Ray's socket paths must stay < 108 chars
    port = _free_port()
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout_s
    try:
        with local_ray_env(), pytest.MonkeyPatch.context() as mp:
            mp.delenv("RAY_ADDRESS", raising=False)
            mp.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)  # nodes on 127.0.0.1, 127.0.0.2, ...
            env = dict(os.environ) | {"PYTHONPATH": os.pathsep.join([*map(str, pythonpath),
                                                                     os.environ.get("PYTHONPATH", "")])}
            for i in range(nodes):
                with open(root / f"ray-start-{i}.log", "w") as log:
                    procs.append(subprocess.Popen(_node_args(i, port, root, cpus_per_node, gpus_per_node), cwd=root,
                                                  env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
                if i == 0:
                    _wait_for_port(port, deadline)
            ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR", log_to_driver=False)
            while len([n for n in ray.nodes() if n["Alive"]]) < nodes:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    logs = "\n".join((root / f"ray-start-{i}.log").read_text()[-2000:] for i in range(len(procs)))
                    pytest.fail(f"the stand-in cluster did not come up with {nodes} nodes:\n{logs}")
                time.sleep(0.5)
            yield
            ray.shutdown()  # before the token is removed
    finally:
        ray.shutdown()
        _stop(procs, root)
        shutil.rmtree(root, ignore_errors=True)
