"""Named mutations of the data path GiGPO depends on: does a test catch each? (issue #43; on demand, not in CI)

    python benchmarks/mutations.py [--only NAME ...] [--keep]

Each mutation is applied to a throwaway copy of the repository (the package, tests, recipes; no ``.git``, no
``runs/``), and only the tests that should catch it run there (``pytest -x``, the copy first on ``PYTHONPATH``
so that Ray workers and vLLM engines import it too). One line per mutation: ``<name>: caught by <test>`` or
``<name>: SURVIVED``, then ``mutations_caught=N/M``. A mutation whose text is not found once in its file is an
error (the code moved: update the mutation), not a survivor. Takes ~10-20 minutes on a 2-core machine (the
collector tests start a vLLM engine per mutation).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTOR = "megatron_gigpo/episodes/collector.py"
STATES_TEST = "tests/episodes/test_collector_states.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    edits: tuple[tuple[str, str], ...]  # (text found exactly once, its replacement)
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("anchor is the observation after the action", COLLECTOR,
             (("                anchor=episode.anchor,\n", "                anchor=result.anchor,\n"),),
             (STATES_TEST,)),
    Mutation("reward of step t recorded on step t+1", COLLECTOR,
             (("                reward=float(result.reward),\n",
               "                reward=float(getattr(episode, 'last_reward', 0.0)),\n"),
              ("        episode.prompt.advance(projected.action, result)\n",
               "        episode.prompt.advance(projected.action, result)\n"
               "        episode.last_reward = float(result.reward)\n")),
             (STATES_TEST,)),
    Mutation("invalid-action penalty on the next step, not its own", "megatron_gigpo/algo/advantages.py",
             (("        penalty = (~inputs.action_valid).to(torch.float64) * params.invalid_action_penalty_coef  # (R,)\n",
               "        penalty = torch.roll((~inputs.action_valid).to(torch.float64), 1) * "
               "params.invalid_action_penalty_coef\n"),),
             ("tests/algo",)),
    Mutation("group members reset with different seeds", COLLECTOR,
             (("                requests.append((task, seed))\n", "                requests.append((task, seed + j))\n"),),
             (STATES_TEST, "tests/episodes/test_collector.py")),
    Mutation("step groups keyed without the task (uid)", "megatron_gigpo/algo/grouping.py",
             (("    combined = uid_index * max(len(uniques), 1) + key_codes",
               "    combined = 0 * uid_index + key_codes"),),
             ("tests/algo",)),
    Mutation("discounted returns accumulated forward, not backward", "megatron_gigpo/algo/returns.py",
             (("    rows = has_next[torch.argsort(steps, descending=True, stable=True)]",
               "    rows = has_next[torch.argsort(steps, descending=False, stable=True)]"),
              ("    per_step = torch.bincount(steps).flip(0).tolist()", "    per_step = torch.bincount(steps).tolist()")),
             ("tests/algo",)),
    Mutation("episode normalisation over the batch, not the group", "megatron_gigpo/algo/advantages.py",
             (("        return group_stats.trajectory_group_normalize(episode_score, uid_index, traj_index, mode=mode, "
               "epsilon=epsilon)",
               "        return group_stats.trajectory_group_normalize(episode_score, torch.zeros_like(uid_index), "
               "traj_index, mode=mode, epsilon=epsilon)"),),
             ("tests/algo",)),
    Mutation("response mask covering the prompt's last token", "megatron_gigpo/actor/batching.py",
             (("        index = [starts[b] + prompt_lens[b] - 1 + torch.arange(resp_lens[b]) for b in range(len(rows))]",
               "        index = [starts[b] + prompt_lens[b] - 2 + torch.arange(resp_lens[b]) for b in range(len(rows))]"),
              ("        index = [(prompt_lens[b] - 1 + torch.arange(resp_lens[b])) * batch + b for b in range(batch)]",
               "        index = [(prompt_lens[b] - 2 + torch.arange(resp_lens[b])) * batch + b for b in range(batch)]")),
             ("tests/actor/test_batching.py", "tests/actor/test_logprob_unit.py")),
)


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
    for name in ("megatron_gigpo", "tests", "recipes", "benchmarks", "tools", "pyproject.toml"):
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))


def apply(mutation: Mutation, repo: Path) -> None:
    """Apply ``mutation``'s edits to ``repo``. Raises ValueError when a text is not found exactly once."""
    path = repo / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise ValueError(f"{mutation.name}: {old.strip()!r} found {text.count(old)} times in {mutation.file}")
        text = text.replace(old, new)
    path.write_text(text)


def run_one(mutation: Mutation, keep: bool) -> str | None:
    """The first test that failed on the mutant (``path::name``), or None when every test passed."""
    repo = Path(tempfile.mkdtemp(prefix="gigpo-mutant-"))
    try:
        _copy_repo(repo)
        apply(mutation, repo)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *mutation.tests]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode == 0:
            return None
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.MULTILINE)
        return failed[0] if failed else f"pytest exit {proc.returncode}: {proc.stdout[-300:]!r}"
    finally:
        if keep:
            print(f"  (copy kept in {repo})")
        else:
            shutil.rmtree(repo, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="names (or parts of names) of mutations to run")
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy (its path is printed)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or any(part in m.name for part in args.only)]
    caught = 0
    for mutation in chosen:
        test = run_one(mutation, args.keep)
        caught += test is not None
        print(f"{mutation.name}: {'caught by ' + test if test else 'SURVIVED'}", flush=True)
    print(f"mutations_caught={caught}/{len(chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
