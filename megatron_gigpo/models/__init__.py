"""HF <-> Megatron models: GPTModel from HF configs, one weight mapping per architecture family.

Used by the actor (build + load), the converters in ``tools/`` and the live resharding into vLLM
(``export_hf_weights``). See ``mapping.py`` for the tensor layouts.
"""

import importlib
from typing import Any

# Public name -> the submodule that defines it. Imported on first use (PEP 562), so importing a light submodule
# (e.g. ``megatron_gigpo.models.random_init`` in the driver process) does not pull in torch and megatron-core.
_EXPORTS = {
    "build_gpt_model": "megatron_gigpo.models.builder",
    "head_dim": "megatron_gigpo.models.builder",
    "load_hf_config": "megatron_gigpo.models.builder",
    "padded_vocab_size": "megatron_gigpo.models.builder",
    "rope_settings": "megatron_gigpo.models.builder",
    "transformer_config_from_hf": "megatron_gigpo.models.builder",
    "unwrap_gpt_model": "megatron_gigpo.models.builder",
    "load_megatron_checkpoint": "megatron_gigpo.models.checkpoint",
    "save_megatron_checkpoint": "megatron_gigpo.models.checkpoint",
    "write_model_sidecar": "megatron_gigpo.models.checkpoint",
    "ModelMapping": "megatron_gigpo.models.mapping",
    "UnsupportedModelError": "megatron_gigpo.models.mapping",
    "WeightShapeError": "megatron_gigpo.models.mapping",
    "get_model_mapping": "megatron_gigpo.models.mapping",
    "supported_architectures": "megatron_gigpo.models.mapping",
    "HFCheckpointReader": "megatron_gigpo.models.weights",
    "MissingTensorError": "megatron_gigpo.models.weights",
    "export_hf_weights": "megatron_gigpo.models.weights",
    "global_parameters": "megatron_gigpo.models.weights",
    "load_hf_weights": "megatron_gigpo.models.weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = list(_EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
