"""Every command in README.md, docs/*.md and slurm/README.md runs as written, as far as a machine without a GPU can
tell.

The fenced ``bash`` / ``sh`` / ``shell`` blocks are read line by line (backslash continuations joined, ``&&``
chains split, leading ``VAR=value`` assignments dropped). Each command is checked without training anything:

- ``megatron-gigpo train|sft|eval|demos|validate RECIPE [options] [overrides]``: the line is parsed by the CLI's own
  parser, then ``megatron-gigpo validate RECIPE [overrides]`` (with ``--plan``, ``--gpu-memory-gib``,
  ``--allow-over-memory``, ``--nodes``, ``--gpus-per-node`` when given) must exit 0, so the recipe exists, every
  key and value is valid and the layout fits (its memory too, with ``--plan``). ``--preflight`` is left out (it
  checks this machine's data, devices and services). A ``model.path=runs/...`` override naming the output of an
  earlier command that is not there is checked with the recipe's own ``model.path`` instead.
- the other ``megatron-gigpo`` subcommands (``plot``, ``convert``, ``serve-retriever``): with ``--help``.
- ``python3 benchmarks/X.py ...`` and ``python3 tools/X.py ...``: ``--help``.
- ``sbatch [options] slurm/train.sbatch RECIPE [overrides]``: what the job's validation step checks, less the
  machine (``--preflight``): ``validate --plan --nodes N --gpus-per-node G RECIPE [overrides]`` with the
  allocation of the sbatch options (``--nodes``/``-N``, default 1; ``--gpus-per-node``, default 0); only
  ``validate RECIPE [overrides]`` when the command sets ``MEGATRON_GIGPO_VALIDATE=`` (the job skips the step).
- ``hf download REPO_ID`` (``huggingface-cli download``): the CLI takes ``download --help``, and REPO_ID is the
  ``model.path`` of a shipped recipe.
- ``export NAME=value``: NAME is read by megatron-gigpo or ``slurm/train.sbatch``, or is one of
  :data:`LIBRARY_VARIABLES`.
- commands that set up a machine (``bash scripts/*.sh``, ``sudo scripts/*.sh``, ``pip install``, ``source``) are
  not run.

Anything else must follow a comment ``# needs ...`` in its block (a GPU, a Slurm cluster); it is then not run.
That comment is also required where a command needs what this machine lacks: ``train`` / ``sft`` / ``eval`` or
``validate --preflight`` of a recipe whose ``trainer.device`` is ``cuda`` without ``--nodes`` (with it, the
allocation replaces this machine's GPUs), a script given ``--device cuda``, and ``sbatch``. Each checked command
is one test, named ``<file>:<line>``.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "slurm" / "README.md"]
SHELL_FENCES = ("bash", "sh", "shell")
RECIPE_COMMANDS = ("train", "sft", "eval", "demos", "validate")
NEEDS_GPU_COMMANDS = ("train", "sft", "eval")
SETUP_COMMANDS = ("pip", "source")
# Variables a documented `export` may set besides those megatron-gigpo and slurm/train.sbatch read: the module whose
# source reads it, or None where a native library reads it (NCCL; PyTorch's gloo backend, in C++).
LIBRARY_VARIABLES = {"HF_HOME": "huggingface_hub.constants", "HF_HUB_OFFLINE": "huggingface_hub.constants",
                     "NCCL_SOCKET_IFNAME": None, "GLOO_SOCKET_IFNAME": None}
MAX_README_LINES_BEFORE_DOCS_LINK = 120
# The two commands a fresh machine runs (CI reads the second from README).
README_COMMANDS = ("bash scripts/setup.sh && megatron-gigpo train recipes/cpu/sokoban.yaml", "bash scripts/test.sh")


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repository root
    line: int  # 1-based line of the command's start
    text: str  # the command as written (continuations joined)
    needs: str  # the text of the `# needs ...` comment before it, or ""

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.text, comments=True)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)
        return words

    @property
    def assignments(self) -> dict[str, str]:
        """The leading ``VAR=value`` words of the command (the environment it sets for itself)."""
        out = {}
        for word in shlex.split(self.text, comments=True):
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
                break
            name, _, value = word.partition("=")
            out[name] = value
        return out

    @property
    def needs_gpu(self) -> bool:
        return re.search(r"\bGPUs?\b", self.needs, re.IGNORECASE) is not None

    @property
    def needs_slurm(self) -> bool:
        return "slurm" in self.needs.lower()


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """``(first line number, lines)`` of each fenced shell block of a Markdown file."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if current is None:
            if stripped.startswith("```") and stripped[3:].strip() in SHELL_FENCES:
                current, start = [], number + 1
        elif stripped.startswith("```"):
            blocks.append((start, current))
            current = None
        else:
            current.append(line)
    return blocks


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands of ``path``'s shell blocks, each with the ``# needs ...`` comment that precedes it."""
    rel = str(path.relative_to(ROOT))
    out: list[DocCommand] = []
    for start, lines in shell_blocks(path):
        needs, pending, pending_line = "", "", 0
        for offset, line in enumerate(lines):
            stripped = line.strip()
            if not pending:
                if not stripped:
                    continue
                if stripped.startswith("#"):
                    if stripped.lstrip("# ").lower().startswith("needs"):
                        needs = stripped.lstrip("# ")
                    continue
                pending_line = start + offset
            pending += stripped
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            for part in re.split(r"\s+&&\s+", pending):
                out.append(DocCommand(rel, pending_line, part.strip(), needs))
            needs, pending = "", ""
    return out


ALL_COMMANDS = [command for path in DOC_FILES for command in doc_commands(path)]


def classify(command: DocCommand) -> str:
    """``recipe``, ``cli-help``, ``script-help``, ``sbatch``, ``hf-download``, ``export``, ``setup`` or ``unknown``."""
    argv = command.argv
    if not argv:
        return "unknown"
    if argv[0] == "megatron-gigpo":
        asks_help = "--help" in argv or "-h" in argv
        return "recipe" if len(argv) > 2 and argv[1] in RECIPE_COMMANDS and not asks_help else "cli-help"
    if argv[0] in ("python", "python3") and len(argv) > 1 and re.match(r"^(benchmarks|tools)/[\w.-]+\.py$", argv[1]):
        return "script-help"
    if argv[0] == "sbatch":
        return "sbatch"
    if argv[0] in ("hf", "huggingface-cli") and argv[1:2] == ["download"]:
        return "hf-download"
    if argv[0] == "export" and len(argv) == 2 and "=" in argv[1]:
        return "export"
    if (argv[0] in ("bash", "sudo") and len(argv) > 1 and argv[1].startswith("scripts/")) or argv[0] in SETUP_COMMANDS:
        return "setup"
    return "unknown"


CHECKED = [c for c in ALL_COMMANDS
           if classify(c) in ("recipe", "cli-help", "script-help", "sbatch", "hf-download", "export")]


def _ids(commands: list[DocCommand]) -> list[str]:
    ids: list[str] = []
    for c in commands:
        name = f"{c.file}:{c.line}"
        ids.append(name if name not in ids else f"{name}#{sum(i.startswith(name) for i in ids) + 1}")
    return ids


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """``megatron-gigpo *argv`` in this process (the console script's own ``main``): exit code and output."""
    from megatron_gigpo.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:  # --help, or an argparse error
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    out = capsys.readouterr()
    return rc, out.out[-3000:] + out.err[-3000:]


def _parse_recipe_command(argv: list[str]):
    """The CLI parser's reading of ``megatron-gigpo argv`` (overrides after options merged, as ``main`` does)."""
    from megatron_gigpo.cli import build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert not extra or not any(item.startswith("-") for item in extra), f"unrecognized arguments: {extra}"
    args.overrides = [*args.overrides, *extra]
    return args


def _validate_argv(args, recipe: str, overrides: list[str]) -> list[str]:
    """``validate RECIPE overrides`` for a recipe command, a missing ``runs/`` model swapped for the recipe's."""
    from megatron_gigpo.config import load_config

    kept, swap = [], False
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model.path" and value.startswith("runs/") and not (ROOT / value).exists():
            swap = True  # the output of an earlier command in the docs (e.g. `sft`); its keys are still checked
            continue
        kept.append(item)
    if swap:
        kept.append(f"model.path={load_config(recipe, kept).model.path}")
    argv = ["validate", recipe, *kept]
    if getattr(args, "plan", False):
        argv.append("--plan")
    if getattr(args, "gpu_memory_gib", None) is not None:
        argv += ["--gpu-memory-gib", str(args.gpu_memory_gib)]
    if getattr(args, "nodes", None) is not None:
        argv += ["--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node)]
    if getattr(args, "allow_over_memory", False):
        argv.append("--allow-over-memory")
    return argv


def _sbatch_allocation(options: list[str]) -> tuple[int, int]:
    """``(nodes, GPUs per node)`` that sbatch ``options`` ask for: train.sbatch's ``--nodes=1`` and no GPU unless
    ``--nodes``/``-N`` or ``--gpus-per-node`` (``8`` or ``h100:8``) say otherwise."""
    nodes, gpus = 1, 0
    words = iter(options)
    for word in words:
        key, eq, value = word.partition("=")
        if key in ("--nodes", "-N", "--gpus-per-node"):
            value = value if eq else next(words)
            if key == "--gpus-per-node":
                gpus = int(value.rsplit(":", 1)[-1])
            else:
                nodes = int(value.split("-")[0])  # a range min-max: its minimum
    return nodes, gpus


@functools.lru_cache(maxsize=None)
def _read_by_the_project() -> str:
    """The text of megatron-gigpo's sources and slurm/train.sbatch, where the variables they read are named."""
    files = [ROOT / "slurm" / "train.sbatch", *sorted((ROOT / "megatron_gigpo").rglob("*.py"))]
    return "\n".join(f.read_text() for f in files)


def _check_export(command: DocCommand, where: str) -> None:
    import importlib
    import inspect

    name = command.argv[1].partition("=")[0]
    if name in LIBRARY_VARIABLES:
        module = LIBRARY_VARIABLES[name]
        if module is not None:
            assert name in inspect.getsource(importlib.import_module(module)), f"{where}\n{module} does not read {name}"
        return
    assert re.search(rf"\b{name}\b", _read_by_the_project()), (
        f"{where}\nneither megatron-gigpo nor slurm/train.sbatch reads {name} (a library's variable: add it to "
        f"LIBRARY_VARIABLES with the module that reads it)")


def _check_hf_download(command: DocCommand, where: str) -> None:
    from megatron_gigpo.config import load_config

    argv = command.argv
    repo_id = next((w for w in argv[2:] if not w.startswith("-")), None)
    recipes = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.name != "base.yaml" and "_base" not in p.parts)
    models = {load_config(p).model.path for p in recipes}
    assert repo_id in models, f"{where}\n{repo_id} is the model of no shipped recipe ({', '.join(sorted(models))})"
    rc, out = _tool_help((argv[0], "download"))
    assert rc == 0, f"{where}\n`{argv[0]} download --help` exited {rc}:\n{out}"


@functools.lru_cache(maxsize=None)
def _tool_help(words: tuple[str, ...]) -> tuple[int, str]:
    try:
        proc = subprocess.run([*words, "--help"], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return 127, f"{words[0]}: not found"
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-3000:]


@functools.lru_cache(maxsize=None)
def _script_help(script: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("command", CHECKED, ids=_ids(CHECKED))
def test_doc_command(command: DocCommand, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    kind, argv = classify(command), command.argv
    where = f"{command.file}:{command.line}: {command.text}"
    if kind == "script-help":
        if "cuda" in argv and not command.needs_gpu:
            pytest.fail(f"{where}\nruns on CUDA: put a `# needs a GPU` comment before it")
        rc, out = _script_help(argv[1])
        assert rc == 0, f"{where}\n`{argv[1]} --help` exited {rc}:\n{out}"
        return
    if kind == "cli-help":
        sub = [w for w in argv[1:3] if not w.startswith("-") and w != "..."]
        rc, out = _cli([*sub, "--help"], capsys)
        assert rc == 0, f"{where}\n`megatron-gigpo {' '.join(sub)} --help` exited {rc}:\n{out}"
        return
    if kind == "export":
        _check_export(command, where)
        return
    if kind == "hf-download":
        _check_hf_download(command, where)
        return
    allocation = []
    if kind == "sbatch":
        assert command.needs_slurm, f"{where}\nneeds a Slurm cluster: put a `# needs a Slurm cluster` comment before it"
        script = next((i for i, w in enumerate(argv) if w == "slurm/train.sbatch"), None)
        assert script is not None and len(argv) > script + 1, f"{where}\nexpected `sbatch ... slurm/train.sbatch RECIPE`"
        if command.assignments.get("MEGATRON_GIGPO_VALIDATE", None) != "":  # the job's validation step runs
            nodes, gpus = _sbatch_allocation(argv[1:script])
            allocation = ["--plan", "--nodes", str(nodes), "--gpus-per-node", str(gpus)]
        argv = ["megatron-gigpo", "train", *argv[script + 1:]]
    args = _parse_recipe_command(argv[1:])
    from megatron_gigpo.config import load_config

    check = _validate_argv(args, args.recipe, list(args.overrides)) + allocation
    rc, out = _cli(check, capsys)
    assert rc == 0, f"{where}\n`megatron-gigpo {' '.join(check)}` exited {rc}:\n{out}"
    device = load_config(args.recipe, [w for w in check[2:] if "=" in w]).trainer.device
    runs_here = argv[1] in NEEDS_GPU_COMMANDS or (
        argv[1] == "validate" and getattr(args, "preflight", False) and getattr(args, "nodes", None) is None)
    if kind == "recipe" and runs_here and device == "cuda":
        assert command.needs_gpu, f"{where}\nthe recipe trains on CUDA: put a `# needs a GPU` comment before it"


def test_every_doc_command_is_checked_or_declared():
    """A command the test cannot check says what it needs, or is a setup command."""
    unchecked = [c for c in ALL_COMMANDS if classify(c) == "unknown" and not c.needs]
    assert not unchecked, "commands neither checked nor marked `# needs ...`:\n" + "\n".join(
        f"{c.file}:{c.line}: {c.text}" for c in unchecked)
    assert CHECKED, "no commands found in README.md, docs/ and slurm/README.md"


def test_readme_keeps_the_fresh_machine_commands():
    readme = [c.text for c in ALL_COMMANDS if c.file == "README.md"]
    joined = {" && ".join(readme[i:i + 2]) for i in range(len(readme))} | set(readme)
    for command in README_COMMANDS:
        assert command in joined, f"README.md lost `{command}`"


def test_readme_links_the_docs_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next((i for i, line in enumerate(lines, start=1) if "](docs/" in line), None)
    assert first is not None, "README.md links no page under docs/"
    assert first <= MAX_README_LINES_BEFORE_DOCS_LINK, f"README.md's first docs/ link is on line {first}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_doc_links_resolve(path: Path):
    """Relative links point at files that exist, and at headings that exist in them."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)
