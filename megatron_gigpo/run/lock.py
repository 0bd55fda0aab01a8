"""One driver per run directory: an advisory lock on ``<run dir>/run.lock``, held for the run's life.

Two jobs with the same ``trainer.output_dir`` and ``trainer.experiment_name`` (array tasks, a job submitted
twice) would append to one ``metrics.jsonl`` and save into one ``checkpoints/`` at once. :func:`hold_run_dir` takes
an exclusive ``fcntl.flock`` on the run directory's lock file before the run starts anything and keeps it until
the run ends; a second holder is refused at once (:class:`RunDirInUse`), with the first holder's host, PID and
Slurm job id, which the holder writes into the lock file.

The kernel drops a flock when the last descriptor of its open file closes, so also when the holder dies
(SIGKILL, the time limit, a crash): a requeued job or a re-run takes the directory over, and the file's stale
contents are replaced. The file itself stays (deleting a lock file races with the next holder).

Filesystems: local ones and NFS (the Linux NFS client maps flock to whole-file POSIX locks, which the server
arbitrates across nodes) lock across processes and nodes. Lustre locks only when mounted with ``-o flock``;
where a filesystem refuses locks (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``) the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator

__all__ = ["LOCK_FILE", "RunDirInUse", "hold_run_dir", "holder_of"]

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
# Lock files this process holds: resolved path -> [descriptor, depth]. A process that holds its run directory
# (the driver) may take it again (the SFT stage inside ``train``); only another process is refused.
_HELD: dict[Path, list[int]] = {}


class RunDirInUse(FileExistsError):
    """Another live process holds the run directory; the message names the directory and that process."""


def _holder() -> dict[str, object]:
    """Who holds the lock: what a refused second holder prints."""
    info: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        info["slurm_job"] = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    elif os.environ.get("SLURM_JOB_ID"):
        info["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return info


def holder_of(run_dir: str | os.PathLike) -> str:
    """The holder that ``run_dir``'s lock file names, as text (``host node01, pid 4242, Slurm job 77, since
    ...``); ``"unknown"`` when the file is missing or not written yet. Does not say whether it still runs."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return "unknown"
    if not isinstance(info, dict):
        return "unknown"
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if info.get("slurm_job"):
        parts.append(f"Slurm job {info['slurm_job']}")
    if info.get("since"):
        parts.append(f"since {info['since']}")
    return ", ".join(parts)


@contextlib.contextmanager
def hold_run_dir(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold ``run_dir`` (created if missing) for this process while inside; nested holds in one process are fine.

    Yields:
        The lock file's path.
    Raises:
        RunDirInUse: another process holds it; names the directory, the holder (:func:`holder_of`) and the way
            out (another ``trainer.experiment_name``, or waiting for that run).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_FILE).resolve()
    if path in _HELD:
        _HELD[path][1] += 1
        try:
            yield path
        finally:
            _HELD[path][1] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(
            f"run directory {run_dir} is in use by another run ({holder_of(run_dir)}); two runs must not write "
            f"one directory. Give each job its own trainer.experiment_name (or trainer.output_dir), or wait until "
            f"that run has ended (its lock goes with its process, so a requeued job takes the directory over)"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise
        log.warning("the filesystem of %s does not support file locks (%s): the run directory is not protected "
                    "against a second run (on Lustre, mount with -o flock)", run_dir, exc.strerror)
        yield path
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_holder()) + "\n").encode(), 0)
    _HELD[path] = [fd, 1]
    try:
        yield path
    finally:
        del _HELD[path]
        os.close(fd)  # releases the lock
