"""Where a run's output goes: INFO to files under ``runs/<experiment>/logs/``, warnings and errors to the terminal.

The terminal of a run shows the progress bar, one line per iteration and what needs attention. Everything
else the worker processes print (vLLM's INFO lines, Megatron's and the libraries' import-time notices, our
own INFO records) goes to one file per Ray worker process, ``logs/worker-<pid>.log``:

- :func:`ray_runtime_env` adds Ray's ``worker_process_setup_hook`` (Ray runtime environments,
  ``worker_process_setup_hook``) and two environment variables to the run's runtime environment;
- :func:`setup_worker` (the hook, run first in every Ray worker process) points file descriptors 1 and 2
  (stdout and stderr, inherited by the processes the worker starts, e.g. vLLM's engine core) at the worker's
  file, keeps a copy of the original stderr (which Ray forwards to the driver's terminal) as
  :data:`TERMINAL`, and installs logging handlers: every record from INFO up to the file, WARNING and above
  also to :data:`TERMINAL`. Raw prints, progress bars and Python ``warnings`` go to the file only;
- vLLM configures its own logger from ``VLLM_LOGGING_CONFIG_PATH`` (vLLM's documented logging
  configuration), written by :func:`ray_runtime_env` with the same split.

Known environment notices (CPU-only fallbacks of vLLM, weight-sync messages of its layer-wise reload) are
kept off the terminal by :class:`DropHarmless`; they stay in the files.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "MEGATRON_GIGPO_LOG_DIR"
_FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"

# Warnings that are known and harmless here, kept off the terminal (they stay in the files):
# - every weight sync: vLLM's layer-wise reload skips the rotary buffers and the tied head, which our
#   weight-transfer backends refresh themselves (rollout/transfer/staged.py);
# - vLLM on CPU: notices about GPU-only features and optional CPU libraries at engine start;
# - the in-process CPU engine (rollout/engine.py sets torch's thread pool itself before vLLM binds threads,
#   and the engine actor's process runs nothing else that draws from the global random generators).
_HARMLESS = (
    "Failed to load weights",
    "Triton is installed, but doesn't include CPU backend", "Triton is not installed", "requires Triton",
    "does not officially support disabling chunked prefill", "Enforce eager set", "Inductor compilation was disabled",
    "SSM cache type", "is not found in LD_PRELOAD",
    "doesn't allow to use `torch.set_num_threads` after the thread binding", "The global random seed is set to",
)

#: The terminal (the worker's original stderr, forwarded by Ray) once :func:`setup_worker` ran; else None.
TERMINAL = None


class DropHarmless(logging.Filter):
    """Drops the known-harmless vLLM warnings of :data:`_HARMLESS` from the terminal (they stay in the file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _HARMLESS)


def _vllm_logging_config() -> dict:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT}},
        "filters": {"harmless": {"()": f"{__name__}.DropHarmless"}},
        "handlers": {
            "file": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "level": "INFO",
                     "formatter": "plain"},
            # None (a process without the hook, e.g. vLLM's engine core) falls back to sys.stderr (the file)
            "terminal": {"class": "logging.StreamHandler", "stream": f"ext://{__name__}.TERMINAL", "level": "WARNING",
                         "formatter": "plain", "filters": ["harmless"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }


def ray_runtime_env(log_dir: str | os.PathLike) -> dict:
    """The runtime-environment entries that send the run's worker output to ``log_dir``.

    Creates ``log_dir`` and writes ``log_dir/vllm_logging.json``.

    Returns:
        ``{"worker_process_setup_hook": ..., "env_vars": {...}}`` to merge into ``ray.init(runtime_env=...)``.
    """
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    vllm_config = log_dir / "vllm_logging.json"
    vllm_config.write_text(json.dumps(_vllm_logging_config(), indent=1))
    return {
        "worker_process_setup_hook": f"{__name__}.setup_worker",
        "env_vars": {LOG_DIR_ENV: str(log_dir), "VLLM_LOGGING_CONFIG_PATH": str(vllm_config),
                     "VLLM_CONFIGURE_LOGGING": "1"},
    }


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: this process's stdout and INFO records to its log file.

    Does nothing when ``MEGATRON_GIGPO_LOG_DIR`` is unset (a worker of a Ray cluster used by other jobs).
    """
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return
    global TERMINAL
    path = Path(log_dir) / f"worker-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    TERMINAL = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    formatter = logging.Formatter(_FORMAT)
    to_file = logging.StreamHandler(sys.stdout)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(formatter)
    to_terminal = logging.StreamHandler(TERMINAL)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.setFormatter(formatter)
    to_terminal.addFilter(DropHarmless())
    root = logging.getLogger()
    root.handlers[:] = [to_file, to_terminal]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # import-time notices of the libraries: the file, not the terminal
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.handlers[:] = [to_file]
    warnings_log.propagate = False
