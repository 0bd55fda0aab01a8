"""megatron_gigpo.cluster.ray_setup without starting Ray: the per-run token file, the opt-out and the errors that say
how to supply a token."""

from __future__ import annotations

import logging
import os
import re
import stat
import tomllib
from pathlib import Path

import pytest

from megatron_gigpo.cluster.ray_setup import (
    AUTH_KNOB, MIN_RAY_TOKEN_AUTH, RayAuthError, check_ray_version, connect_ray, local_ray_env, ray_auth_mode,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def clean_env(monkeypatch, tmp_path) -> Path:
    """No Ray auth settings and an empty HOME (so no ~/.ray/auth_token); monkeypatch restores everything."""
    for key in (AUTH_KNOB, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_local_env_writes_a_private_token_per_run_and_removes_it(clean_env, monkeypatch):
    stale = clean_env / ".ray" / "auth_token"
    stale.parent.mkdir()
    stale.write_text("someone-elses-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a-token-from-the-shell")  # would take precedence over the file
    paths, tokens = [], []
    for _ in range(2):
        with local_ray_env() as env:
            path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
            assert env["RAY_AUTH_MODE"] == os.environ["RAY_AUTH_MODE"] == "token"
            assert "RAY_AUTH_TOKEN_PATH" not in env and "RAY_AUTH_TOKEN" not in os.environ
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            assert not path.is_relative_to(clean_env)  # never under ~/.ray
            tokens.append(path.read_text())
            paths.append(path)
        assert not path.parent.exists(), "the token dir is removed at the end of the run"
        assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ
        assert os.environ["RAY_AUTH_TOKEN"] == "a-token-from-the-shell"  # restored
    assert paths[0] != paths[1] and tokens[0] != tokens[1]
    assert all(len(t) == 64 for t in tokens)  # 256 bits, hex
    assert stale.read_text() == "someone-elses-token"


def test_opt_out_is_a_warning_and_writes_no_token(clean_env, monkeypatch, caplog):
    monkeypatch.setenv(AUTH_KNOB, "disabled")
    with caplog.at_level(logging.WARNING, logger="megatron_gigpo"), local_ray_env() as env:
        assert env["RAY_AUTH_MODE"] == "disabled"
        assert "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert f"{AUTH_KNOB}=disabled: Ray runs WITHOUT token authentication" in caplog.text


@pytest.mark.parametrize(
    "env, message",
    [
        ({AUTH_KNOB: "off"}, f"{AUTH_KNOB}='off': expected one of token, disabled"),
        ({"RAY_AUTH_MODE": "disabled"}, f"opt out of token authentication with {AUTH_KNOB}=disabled"),
        ({AUTH_KNOB: "disabled", "RAY_AUTH_MODE": "token"}, "RAY_AUTH_MODE='token' contradicts"),
    ],
)
def test_bad_or_contradicting_settings_are_errors(clean_env, monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RayAuthError, match=message.replace("(", r"\(")):
        ray_auth_mode()
    with pytest.raises(RayAuthError):
        with local_ray_env():
            pass


def test_connecting_without_a_token_says_how_to_supply_one(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # recorded, so that monkeypatch restores it
    # Raised before contacting anything: nothing listens on port 1.
    with pytest.raises(RayAuthError, match="has no token .*RAY_AUTH_TOKEN_PATH=<file holding it>"):
        connect_ray("127.0.0.1:1")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "missing"))
    with pytest.raises(RayAuthError, match="RAY_AUTH_TOKEN_PATH=.*missing: cannot read the token"):
        connect_ray("127.0.0.1:1")
    (clean_env / "empty").write_text("\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "empty"))
    with pytest.raises(RayAuthError, match="the file is empty"):
        connect_ray("127.0.0.1:1")


@pytest.mark.parametrize("version, refused", [("2.40.0", True), ("2.51.2", True), ("2.52.0rc1", True),
                                              ("2.52.0", False), ("2.60.0", False), ("3.0.0.dev0", False)])
def test_token_mode_refuses_a_ray_without_token_authentication(version, refused):
    if refused:
        with pytest.raises(RayAuthError, match=rf"Ray {re.escape(version)} has no token authentication .*"
                                               rf"ray>=2\.52\.0.*{AUTH_KNOB}=disabled"):
            check_ray_version("token", version)
    else:
        check_ray_version("token", version)
    check_ray_version("disabled", version)  # the opt-out runs on any Ray


def test_the_installed_ray_and_the_package_floor_have_token_authentication():
    check_ray_version("token")  # the installed Ray (its metadata)
    deps = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    floor = next(d for d in deps["dependencies"] if re.match(r"ray\b", d))
    assert floor == f"ray>={MIN_RAY_TOKEN_AUTH.removesuffix('.0')}"
