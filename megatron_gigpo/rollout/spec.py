"""The contract of a weight sync: which HF tensors a rollout engine loads (names, shapes, transfer dtype), read
from the safetensors headers of the checkpoint the engine was started from.

Both ends check against it: the trainer's source (:class:`~megatron_gigpo.rollout.transfer.source.MegatronExportSource`)
before a tensor travels, the engine's staging (:class:`~megatron_gigpo.rollout.transfer.staged.StagedWeightTransfer`)
when it arrives and at the commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import dtype_from_name

__all__ = ["WeightSpec", "checkpoint_num_experts", "read_checkpoint_spec"]


@dataclass(frozen=True)
class WeightSpec:
    """HF tensors an engine loads, read from the safetensors headers of its checkpoint.

    Attributes:
        shapes: HF name -> shape of every tensor a sync must carry.
        optional: names a sync may carry but need not (``lm_head.weight`` of a tied-embedding model).
        dtype: transfer dtype name (the engine's model dtype).
    """

    shapes: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]]
    dtype: str

    def check_tensor(self, name: str, shape: Sequence[int], seen: set[str]) -> None:
        """Raises WeightSyncError for an unknown or repeated name or a wrong shape; adds ``name`` to ``seen``."""
        expected = self.shapes.get(name, self.optional.get(name))
        if expected is None:
            close = sorted(n for n in self.shapes if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:3]
            raise WeightSyncError(
                f"tensor {name!r} is not a weight of the engine's model (checkpoint names like {close})"
            )
        if tuple(shape) != tuple(expected):
            raise WeightSyncError(f"tensor {name!r} has shape {tuple(shape)}, the engine expects {tuple(expected)}")
        if name in seen:
            raise WeightSyncError(f"tensor {name!r} was sent twice in one sync")
        seen.add(name)

    def check_complete(self, seen: set[str]) -> None:
        """Raises WeightSyncError naming the tensors a sync did not carry."""
        missing = sorted(set(self.shapes) - seen)
        if missing:
            raise WeightSyncError(
                f"{len(missing)} of {len(self.shapes)} weights were not sent, e.g. {missing[:5]}"
            )


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def read_checkpoint_spec(model_dir: str | Path, dtype: str) -> WeightSpec:
    """The :class:`WeightSpec` of an HF checkpoint directory (headers only; no tensor is read).

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors``.
        dtype: the engine's model dtype (``"bfloat16"``, ``"float32"``, ``"float16"``).

    Raises:
        FileNotFoundError: no config.json or no safetensors file in ``model_dir``.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    config = json.loads(config_path.read_text())
    optional: dict[str, tuple[int, ...]] = {}
    # A tied lm_head is the embedding: exporters may send it or not, vLLM ignores it either way.
    if config.get("tie_word_embeddings", False) and "model.embed_tokens.weight" in shapes:
        shapes.pop("lm_head.weight", None)
        optional["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    dtype_from_name(dtype)
    return WeightSpec(shapes=shapes, optional=optional, dtype=dtype)


def checkpoint_num_experts(model_dir: str | Path) -> int:
    """Routed experts per layer of the checkpoint's config.json (:func:`megatron_gigpo.models.specs.moe_shape`;
    0 for a dense model)."""
    from megatron_gigpo.models.specs import moe_shape

    return moe_shape(json.loads((Path(model_dir) / "config.json").read_text()))[0]
