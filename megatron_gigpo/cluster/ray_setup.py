"""Ray's environment for a run: token authentication on, one secret per run, never ``~/.ray/auth_token``.

Every Ray process of a run (head, workers, driver) runs with ``RAY_AUTH_MODE=token``, so only holders of the
run's token can submit work to its cluster. Two ways in:

- :func:`local_ray_env` (a Ray this process starts: ``megatron-gigpo train`` without ``RAY_ADDRESS``, the tests,
  the benchmarks) writes a fresh random token into a new private temp dir (``auth_token``, mode 0600, dir 0700),
  points ``RAY_AUTH_TOKEN_PATH`` at it and removes it on exit. ``ray.init`` therefore never generates
  ``~/.ray/auth_token``, and a token left there (or in ``RAY_AUTH_TOKEN``) by someone else cannot reach the run.
- :func:`connect_ray` (an existing cluster, e.g. the one of ``slurm/train.sbatch``) uses the token that the
  environment provides (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, Ray's order) and
  turns a missing or refused token into a :class:`RayAuthError` that says how to supply it.

Opt-out, for clusters on an already private network: ``MEGATRON_GIGPO_RAY_AUTH=disabled`` (logged as a
warning). ``RAY_AUTH_MODE`` itself is set here from that one knob; a contradicting value in the environment
is an error, not a silent override. Token mode needs Ray >= :data:`MIN_RAY_TOKEN_AUTH` (an older Ray ignores
``RAY_AUTH_MODE`` and would run open while this module says it is protected): :func:`check_ray_version`
refuses an older one, here and in ``slurm/train.sbatch`` before ``ray start``.

Ray 2.60 caches the auth mode (``RayConfig``) and the token (``AuthenticationTokenLoader``) per process, read at
``import ray``; both are refreshed here after the environment changes, so that several Ray sessions in one
process (a test session) each use their own token instead of hanging on the previous one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from megatron_gigpo.cluster.preflight import PreflightError

log = logging.getLogger(__name__)

AUTH_KNOB = "MEGATRON_GIGPO_RAY_AUTH"
AUTH_MODES = ("token", "disabled")
# Defaults for every Ray process of a run: stop in seconds, not after a drain period.
RAY_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# Only for a local Ray: keeps the single node on 127.0.0.1 (it would break multi-node address lookups).
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_TOKEN_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_HOW_TO = (
    "Supply the cluster's token with RAY_AUTH_TOKEN_PATH=<file holding it> (slurm/train.sbatch exports this for "
    "its driver) or RAY_AUTH_TOKEN=<token>; or, if the cluster runs without token authentication on a private "
    f"network, set {AUTH_KNOB}=disabled."
)


#: The first Ray release with token authentication (``RAY_AUTH_MODE=token``): "Token authentication is available
#: in Ray 2.52.0 or later" (docs.ray.io, ray-security/token-auth). pyproject.toml's floor for ``ray``.
MIN_RAY_TOKEN_AUTH = "2.52.0"


class RayAuthError(PreflightError):
    """Ray's token authentication is misconfigured or refused this process; the message says how to fix it."""


def check_ray_version(mode: str, version: str | None = None) -> None:
    """Refuse token mode on a Ray without token authentication (older than :data:`MIN_RAY_TOKEN_AUTH`).

    Args:
        mode: ``"token"`` or ``"disabled"`` (:func:`ray_auth_mode`); ``disabled`` accepts any Ray.
        version: a Ray version string; default: the installed Ray's (its package metadata, read without
            importing Ray).

    Raises:
        RayAuthError: token mode on an older Ray; names the version, the floor and the opt-out.
    """
    from packaging.version import Version

    if mode != "token":
        return
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("ray")
        except PackageNotFoundError:  # a Ray that pip does not know of (a source tree on sys.path)
            import ray

            version = ray.__version__
    if Version(version) < Version(MIN_RAY_TOKEN_AUTH):
        raise RayAuthError(
            f"Ray {version} has no token authentication (it came with Ray {MIN_RAY_TOKEN_AUTH}): with "
            f"{AUTH_KNOB}=token its cluster would run without any. Install ray>={MIN_RAY_TOKEN_AUTH} (as "
            f"megatron-gigpo requires), or, only on an already private network, set {AUTH_KNOB}=disabled."
        )


def ray_auth_mode() -> str:
    """``"token"`` (default) or ``"disabled"``, from ``MEGATRON_GIGPO_RAY_AUTH``; warns when disabled.

    Raises:
        RayAuthError: an unknown value, ``RAY_AUTH_MODE`` set in the environment to the other mode, or token mode
            on a Ray without token authentication (:func:`check_ray_version`).
    """
    mode = os.environ.get(AUTH_KNOB, "token")
    if mode not in AUTH_MODES:
        raise RayAuthError(f"{AUTH_KNOB}={mode!r}: expected one of {', '.join(AUTH_MODES)}")
    ray_mode = os.environ.get("RAY_AUTH_MODE")
    if ray_mode is not None and ray_mode != mode:
        raise RayAuthError(
            f"RAY_AUTH_MODE={ray_mode!r} contradicts {AUTH_KNOB}={mode!r}"
            f"{'' if AUTH_KNOB in os.environ else ' (the default)'}: megatron-gigpo sets RAY_AUTH_MODE itself. "
            f"Unset RAY_AUTH_MODE, or opt out of token authentication with {AUTH_KNOB}=disabled."
        )
    check_ray_version(mode)
    if mode == "disabled":
        log.warning("%s=disabled: Ray runs WITHOUT token authentication; anyone who can reach its ports can "
                    "run code as you. Use it only on a private network.", AUTH_KNOB)
    return mode


def worker_env() -> dict[str, str]:
    """Variables to pass on in ``runtime_env={"env_vars": ...}`` to Ray workers and actors.

    Holds the auth mode, never a token or a token path: on a cluster each node's raylet has its own copy of
    the token file, and its workers inherit that path.
    """
    return {k: os.environ[k] for k in ("RAY_AUTH_MODE", *RAY_ENV) if k in os.environ}


def _refresh_ray() -> None:
    """Make this process's Ray re-read ``RAY_AUTH_MODE`` and the token source (both cached per process)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def local_ray_env() -> Iterator[dict[str, str]]:
    """Set up this process's environment for a Ray that it starts (``ray.init()`` without an address).

    Token mode: a fresh 256-bit token in ``<tmp>/megatron-gigpo-ray-*/auth_token`` (file 0600, dir 0700),
    ``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH`` set and ``RAY_AUTH_TOKEN`` removed (it would take
    precedence). Also sets :data:`RAY_ENV` and :data:`LOCAL_RAY_ENV` unless already set. Call ``ray.init``
    inside the block and ``ray.shutdown`` before it ends. On exit the token dir is removed and the
    environment (and Ray's cached view of it) is restored.

    Yields:
        :func:`worker_env`, for ``runtime_env={"env_vars": ...}``.
    Raises:
        RayAuthError: a bad ``MEGATRON_GIGPO_RAY_AUTH`` or a contradicting ``RAY_AUTH_MODE``.
    """
    mode = ray_auth_mode()
    names = (*_TOKEN_VARS, *RAY_ENV, *LOCAL_RAY_ENV)
    saved = {k: os.environ.get(k) for k in names}
    token_dir = None
    try:
        for key, value in (RAY_ENV | LOCAL_RAY_ENV).items():
            os.environ.setdefault(key, value)
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ["RAY_AUTH_MODE"] = mode
        if mode == "token":
            token_dir = Path(tempfile.mkdtemp(prefix="megatron-gigpo-ray-"))  # mode 0700
            token_file = token_dir / "auth_token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_file)
        _refresh_ray()
        yield worker_env()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if token_dir is not None:
            shutil.rmtree(token_dir, ignore_errors=True)
        import ray

        if not ray.is_initialized():  # a live session keeps what it started with
            _refresh_ray()


def _token_source() -> str:
    """Where Ray will read the driver's token from (Ray's order); raises RayAuthError when nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            readable = bool(Path(path).read_text().strip())
        except OSError as exc:
            raise RayAuthError(f"RAY_AUTH_TOKEN_PATH={path}: cannot read the token ({exc.strerror})") from None
        if not readable:
            raise RayAuthError(f"RAY_AUTH_TOKEN_PATH={path}: the file is empty")
        return f"RAY_AUTH_TOKEN_PATH={path}"
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return str(default)
    raise RayAuthError(f"Ray token authentication is on ({AUTH_KNOB}=token) but this process has no token "
                       f"(no RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {default}). {_HOW_TO}")


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from is Ray's authentication failure."""
    from ray.exceptions import AuthenticationError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, AuthenticationError) or "InvalidAuthToken" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def connect_ray(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address)`` with the auth mode of :func:`ray_auth_mode` and the environment's token.

    Workers get :func:`worker_env` through ``runtime_env`` (merged into ``init_kwargs['runtime_env']``).

    Raises:
        RayAuthError: no readable token (before contacting the cluster), or the cluster refused the token
            (after Ray's own retries, about 20 s); the message says how to supply it.
    """
    import ray

    mode = ray_auth_mode()
    os.environ["RAY_AUTH_MODE"] = mode
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    source = _token_source() if mode == "token" else "no token"
    _refresh_ray()
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**worker_env(), **runtime_env.get("env_vars", {})}
    try:
        ray.init(address=address, runtime_env=runtime_env, **init_kwargs)
    except Exception as exc:
        if not _refused(exc):
            raise
        raise RayAuthError(f"the Ray cluster at {address} refused this process: its token ({source}) is missing "
                           f"or wrong for that cluster. {_HOW_TO}") from None
