"""Atomic file writes: readers of a file this package rewrites (resolved config, metrics, validation records,
checkpoint metadata, generated data) see the old file or the whole new one, never a partial write.

The one helper, :func:`write_text_atomic`, writes a uniquely named temporary file in the target's folder
(``tempfile.mkstemp``, so two writers never share it) and renames it over the target (``os.replace``, atomic
on POSIX within one file system).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = False, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically.

    Args:
        path: the file to write; its folder must exist.
        text: the whole new content.
        fsync: flush the data to disk before the rename (checkpoint metadata: the rename must not survive a
            crash without its content; the caller fsyncs the folder if the rename itself must persist).
        mode: permission bits of the new file (``mkstemp`` would leave 0600).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder is missing or not writable; the temporary file is removed and ``path`` unchanged.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
