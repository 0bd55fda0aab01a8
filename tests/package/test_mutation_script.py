"""benchmarks/mutations.py stays applicable: each named mutation's text is found exactly once in the current
code and its tests exist (the script itself runs on demand, not in CI)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "benchmarks" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutations", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_once_and_names_existing_tests(tmp_path):
    script = _script()
    assert len(script.MUTATIONS) == 8
    for mutation in script.MUTATIONS:
        assert all((ROOT / test).exists() for test in mutation.tests), mutation.name
        copy = tmp_path / mutation.file
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((ROOT / mutation.file).read_text())
        script.apply(mutation, tmp_path)
        assert copy.read_text() != (ROOT / mutation.file).read_text(), mutation.name
    broken = script.Mutation("gone", script.COLLECTOR, (("no such text", "x"),), ())
    with pytest.raises(ValueError, match="gone: 'no such text' found 0 times"):
        script.apply(broken, tmp_path)
