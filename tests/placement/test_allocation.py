"""A job's allocation (sbatch --nodes / --gpus-per-node) against the recipe, before Ray starts
(megatron_gigpo.cluster.preflight.allocation_errors, `validate --nodes N --gpus-per-node G`), and slurm/README.md's
two-node example, which `validate` refused until the data-parallel size followed the world size."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_gigpo.cli import main
from megatron_gigpo.cluster.preflight import Allocation, PreflightError, allocation_errors, preflight
from megatron_gigpo.config import load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
ALF_7B = REPO / "recipes/alfworld/qwen2.5-7b-instruct.yaml"  # 1 node x 8 GPUs
SEARCH_7B = REPO / "recipes/search_qa/qwen2.5-7b-instruct.yaml"  # 2 nodes x 8 GPUs
SMOKE = REPO / "recipes/smoke/cpu.yaml"  # 1 node, CPU


@pytest.mark.parametrize("recipe, nodes, gpus, message", [
    (ALF_7B, 2, 8, "the allocation (--nodes=2 --gpus-per-node=8) does not match the recipe (trainer.nnodes=1 x "
                   "trainer.devices_per_node=8 GPUs): 1 node(s) would idle. Submit with `sbatch --nodes=1 "
                   "--gpus-per-node=8`, or set trainer.nnodes=2 trainer.devices_per_node=8"),
    (SEARCH_7B, 4, 4, "(--nodes=4 --gpus-per-node=4) does not match the recipe (trainer.nnodes=2 x "
                      "trainer.devices_per_node=8 GPUs): 2 node(s) would idle and 4 GPU(s) per node are missing. "
                      "Submit with `sbatch --nodes=2 --gpus-per-node=8`"),
    (ALF_7B, 1, 4, "4 GPU(s) per node are missing"),  # fewer GPUs than the plan takes
    (ALF_7B, 1, 0, "8 GPU(s) per node are missing. Submit with `sbatch --nodes=1 --gpus-per-node=8`"),
    (SEARCH_7B, 1, 8, "1 node(s) are missing"),
    (SMOKE, 2, 0, "the allocation (--nodes=2) does not match the recipe (trainer.nnodes=1): 1 node(s) would idle"),
])
def test_an_allocation_unlike_the_recipe_is_refused_naming_keys_and_options(recipe, nodes, gpus, message, capsys):
    cfg = load_config(recipe)
    errors = allocation_errors(cfg, Allocation(nodes, gpus))
    assert len(errors) == 1 and message in errors[0]
    assert main(["validate", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(gpus)]) == 2
    err = capsys.readouterr().err
    assert "allocation check failed" in err and message in err


def test_a_matching_allocation_passes_and_replaces_the_local_device_count():
    assert allocation_errors(load_config(ALF_7B), Allocation(1, 8)) == []
    assert allocation_errors(load_config(SMOKE), Allocation(1, 4)) == []  # a CPU recipe does not count GPUs
    cfg = load_config(SEARCH_7B)
    assert allocation_errors(cfg, Allocation(2, 8)) == []
    # --preflight on the head node before Ray: the allocation, not this machine's (no) GPUs. Before, a multi-node
    # GPU recipe was told "this machine ... has 0".
    for allocation, devices_refused in ((None, True), (Allocation(2, 8), False), (Allocation(2, 4), True)):
        try:
            preflight(cfg, allocation=allocation, check_env=False)
            text = ""
        except PreflightError as exc:  # also for the model, which this machine may lack
            text = str(exc)
        assert ("has 0" in text or "does not match the recipe" in text) == devices_refused, text


def test_validate_allocation_flags_go_together(capsys):
    assert main(["validate", str(SMOKE), "--nodes", "1"]) == 2
    assert "--nodes and --gpus-per-node go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", str(SMOKE), "--nodes", "0", "--gpus-per-node", "0"])
    assert "--nodes: '0' must be a whole number >= 1" in capsys.readouterr().err


def test_the_slurm_readme_two_node_example_validates_on_16_gpus(capsys):
    """slurm/README.md's own example, word for word: it was refused ("TP(4) x PP(1) x DP(2) = 8 != world size 16")."""
    text = (REPO / "slurm/README.md").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith("sbatch --nodes=2 --gpus-per-node=8"))
    argv = shlex.split(line)
    script = argv.index("slurm/train.sbatch")
    recipe, overrides = argv[script + 1], argv[script + 2:]
    assert (recipe, overrides) == ("recipes/alfworld/qwen2.5-7b-instruct.yaml",
                                   ["trainer.nnodes=2", "trainer.devices_per_node=8"])
    # What the job's validation step runs, less --preflight (this machine has neither the model nor the data).
    assert main(["validate", "--plan", "--nodes=2", "--gpus-per-node=8", str(REPO / recipe), *overrides]) == 0
    out = capsys.readouterr().out
    assert "TP4 x PP1 x DP4 on 2 node(s) x 8 cuda device(s), 8 engine(s) x TP2" in out
    assert re.search(r"^total: 16 GPUs on 2 node\(s\) \(8, 8 per node\); 16 actor ranks, 8 engines x TP2", out,
                     re.MULTILINE), out
    # A number instead of auto is still checked as written.
    assert main(["validate", str(REPO / recipe), *overrides, "parallel.data_parallel_size=2"]) == 2
    assert "TP(4) x PP(1) x DP(2) = 8 != world size 16" in capsys.readouterr().err
