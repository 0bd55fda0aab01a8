"""Local Ray with token authentication: every session of a process gets its own token file, none writes
~/.ray/auth_token, sessions one after another start (a hang is a timeout, hence a failure), and the running
local Ray refuses a client without the token. Each scenario runs in a subprocess with an empty HOME and its own
Ray temp dir (RAY_TMPDIR)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 600  # five Ray starts take ~1-2 min on the loaded 2-core machine; a hang fails here


def run_sessions(mode: str, home: Path, ray_tmpdir: Path) -> dict:
    """``ray_tmpdir``: the subprocess's RAY_TMPDIR (short: Ray's socket paths must stay < 108 characters)."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "MEGATRON_GIGPO_RAY_AUTH"))}
    env |= {"HOME": str(home), "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
            "RAY_TMPDIR": str(ray_tmpdir)}
    try:
        proc = subprocess.run([sys.executable, str(HERE / "local_ray_runs.py"), mode], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"local Ray sessions ({mode}) still running after {TIMEOUT_S}s (a hang)\n{exc.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LOCAL_RAY ")]
    assert proc.returncode == 0 and len(lines) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return json.loads(lines[0].removeprefix("LOCAL_RAY "))


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sessions_in_a_row_each_use_their_own_token_and_write_none_in_home(tmp_path, ray_tmpdir):
    """Also: each session starts its own Ray although a stale `ray start` address file (a cluster that is gone)
    lies in Ray's temp dir, where a bare ``ray.init()`` would try to attach (a refused connection: exit != 0)."""
    home = tmp_path / "home"
    report = run_sessions("runs", home, ray_tmpdir)
    assert report["stale_address_file"] == str(ray_tmpdir / "ray" / "ray_current_cluster")

    sessions = report["sessions"]
    assert [s["name"] for s in sessions] == ["fixture", "run 1", "run 2"]
    assert all(s["mode"] == "token" for s in sessions), sessions
    paths = [s["token_path"] for s in sessions]
    assert len(set(paths)) == 3 and all(p and not p.startswith(str(home)) for p in paths), paths
    assert not any(Path(p).exists() for p in paths), "token files are removed when their session/process ends"
    assert not (home / ".ray").exists(), "no ~/.ray/auth_token written"
    client = report["client"]
    assert client["rc"] != 0 and client["refused"] and not client["connected"], client


def test_run_after_rays_default_init_ignores_the_token_it_left(tmp_path, ray_tmpdir):
    home = tmp_path / "home"
    report = run_sessions("after-default", home, ray_tmpdir)

    default, run = report["sessions"]
    assert default["mode"] == "token" and default["token_path"] == ""  # Ray's own: ~/.ray/auth_token
    stale = home / ".ray" / "auth_token"
    assert stale.is_file()
    assert run["mode"] == "token" and run["token_path"] and not run["token_path"].startswith(str(home))
    assert not Path(run["token_path"]).exists()
