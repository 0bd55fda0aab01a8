"""Import every module of ``megatron_gigpo`` alone, each in a fresh interpreter (``python3 -c "import M"``, a new
process that has imported nothing yet); print one JSON line ``{"modules": N, "failed": {module: error}}``.

An import that works only after some other module was imported first (a partially initialised module in an
import loop, a package ``__init__`` that pulls in its importer, a third-party submodule used but never imported)
fails here. The interpreters run ``--jobs`` at a time (default: one per CPU), since most of the time is torch's
and megatron-core's own imports.

Usage: ``python3 tests/package/import_alone.py [PACKAGE_DIR] [--jobs N]`` (default: the checkout's
``megatron_gigpo``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # one import; megatron-core's take ~5 s on an idle 2-core machine


def module_names(package_dir: Path) -> list[str]:
    """Dotted names of every module and package under ``package_dir``, sorted."""
    names = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def import_alone(name: str, package_parent: Path) -> str | None:
    """Import ``name`` in a new interpreter whose first path entry is ``package_parent``; None on success,
    else the end of its error output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_parent), os.environ.get("PYTHONPATH", "")]))
    try:
        out = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env,
                             cwd=package_parent, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"import did not finish within {TIMEOUT_S} s"
    return None if out.returncode == 0 else (out.stderr[-3000:] or f"exit status {out.returncode}")


def main(package_dir: Path, jobs: int) -> dict:
    names = module_names(package_dir)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        errors = list(pool.map(lambda name: import_alone(name, package_dir.parent), names))
    return {"modules": len(names), "failed": {n: e for n, e in zip(names, errors) if e is not None}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package_dir", nargs="?", type=Path, default=ROOT / "megatron_gigpo")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(json.dumps(main(args.package_dir.resolve(), args.jobs)))
