"""Import every module of ``megatron_gigpo`` alone, each in a fresh child process in which no module of the
package has been imported yet; print one JSON line ``{"modules": N, "failed": {module: traceback}}``.

The parent first imports the third-party modules that the package imports at module level (torch,
megatron-core, transformers, ...), none of the package itself, then forks one child per module: every child
starts with an empty ``megatron_gigpo`` and imports just that module, so an import that works only after
some other module of the package was imported first (a partially initialised module in an import loop, a
package ``__init__`` that pulls in its importer) fails there. Forking keeps the run short (seconds, not the
minutes of one interpreter start per module); the children import only, no thread is used across the fork.

Usage: ``python3 tests/package/import_alone.py [PACKAGE_DIR]`` (default: the checkout's ``megatron_gigpo``).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_names(package_dir: Path) -> list[str]:
    """Dotted names of every module and package under ``package_dir``, sorted."""
    names = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def third_party_imports(package_dir: Path) -> list[str]:
    """Modules outside the package that its modules import at module level (not inside functions)."""
    package = package_dir.name
    found: set[str] = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    return sorted(name for name in found if name.split(".")[0] != package and name != "__future__")


def import_in_child(name: str) -> str | None:
    """Import ``name`` in a forked child; None on success, else the child's traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        try:
            importlib.import_module(name)
            message = b""
        except BaseException:  # noqa: BLE001 - report whatever the import raised
            message = traceback.format_exc().encode()
        with os.fdopen(write, "wb") as out:
            out.write(message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as src:
        message = src.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0 and not message:
        message = f"child exited with status {status}"
    return message or None


def main(package_dir: Path) -> dict:
    sys.path.insert(0, str(package_dir.parent))
    for name in third_party_imports(package_dir):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional dependency: the child reports it if it matters
            pass
    leaked = [m for m in sys.modules if m == package_dir.name or m.startswith(package_dir.name + ".")]
    if leaked:
        raise RuntimeError(f"a third-party import loaded {leaked[:3]}: the children would not start fresh")
    names = module_names(package_dir)
    failed = {name: error for name in names if (error := import_in_child(name)) is not None}
    return {"modules": len(names), "failed": failed}


if __name__ == "__main__":
    target = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "megatron_gigpo"
    print(json.dumps(main(target)))
