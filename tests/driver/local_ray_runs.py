"""Local Ray sessions one after another in one process, as test_ray_local_auth.py runs them (in a subprocess,
with its own HOME). Prints one line ``LOCAL_RAY {json}``: per session the auth mode and token file that a Ray
worker saw, plus the exit status of a client that tried the running local Ray without a token.

    python3 tests/driver/local_ray_runs.py runs            # a fixture's session, then two runs (init_ray), all
                                                           # beside a stale `ray start` address file
    python3 tests/driver/local_ray_runs.py after-default   # Ray's own default ray.init first, then a run
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ray

from megatron_gigpo.builders import init_ray
from megatron_gigpo.config import load_config
from megatron_gigpo.cluster.ray_setup import local_ray_env

ROOT = Path(__file__).resolve().parents[2]
# A plain ray.init(address=...) with no token anywhere: RAY_AUTH_MODE and token variables removed by the caller.
TOKENLESS_CLIENT = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print('CONNECTED')"


@ray.remote(num_cpus=0)
def worker_auth() -> dict[str, str]:
    return {"mode": os.environ.get("RAY_AUTH_MODE", ""), "token_path": os.environ.get("RAY_AUTH_TOKEN_PATH", "")}


def session(name: str) -> dict:
    """What a worker of the current Ray session sees; then shut the session down."""
    out = {"name": name, **ray.get(worker_auth.remote(), timeout=120)}
    ray.shutdown()
    return out


def tokenless_client() -> dict:
    """Try the running local Ray from another process that has no token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.run([sys.executable, "-c", TOKENLESS_CLIENT, ray.get_runtime_context().gcs_address],
                          env=env, capture_output=True, text=True, timeout=180)
    return {"rc": proc.returncode, "refused": "InvalidAuthToken" in proc.stderr,
            "connected": "CONNECTED" in proc.stdout}


def main(mode: str) -> None:
    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml")
    report: dict = {"sessions": []}
    if mode == "runs":
        # What `ray start` leaves behind (here: a cluster that is gone): a bare ray.init() would attach to it.
        from ray._common.utils import get_ray_address_file

        stale = Path(get_ray_address_file(None))  # under RAY_TMPDIR, which the caller sets
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("127.0.0.1:9")
        report["stale_address_file"] = str(stale)
        with local_ray_env():  # as a test fixture does
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
            report["sessions"].append(session("fixture"))
        init_ray(cfg)
        report["client"] = tokenless_client()
        report["sessions"].append(session("run 1"))
        init_ray(cfg)
        report["sessions"].append(session("run 2"))
    elif mode == "after-default":
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")  # Ray's default: ~/.ray/auth_token
        report["sessions"].append(session("ray default"))
        os.environ["RAY_AUTH_TOKEN"] = "a-stale-token-from-the-shell"  # must not reach the run's Ray
        init_ray(cfg)
        report["sessions"].append(session("run"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("LOCAL_RAY " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
