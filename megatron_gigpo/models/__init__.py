"""HF <-> Megatron models: GPTModel from HF configs, one weight mapping per architecture family.

Used by the actor (build + load), the converters in ``tools/`` and the live resharding into vLLM
(:func:`~megatron_gigpo.models.weights.export_hf_weights`). Nothing is imported here (the submodules import torch
and megatron-core; the driver process reads only the light ones):

- :mod:`.config`: the recipe's ``model`` section (:class:`~.config.ModelConfig`, ``model.architecture``,
  ``model.lora``);
- :mod:`.specs`: config.json facts of the models the recipes name (layout checks, memory plan, context length);
- :mod:`.mapping`: the HF <-> Megatron tensor layouts, one :class:`~.mapping.ModelMapping` per family;
- :mod:`.builder`: ``GPTModel`` from a HF config (:func:`~.builder.build_gpt_model`);
- :mod:`.weights`: HF safetensors -> Megatron shards (:func:`~.weights.load_hf_weights`) and back
  (:func:`~.weights.export_hf_weights`, the converter's and the live sync's one export);
- :mod:`.checkpoint`: Megatron checkpoints of a model (the converters are the actor's:
  :mod:`megatron_gigpo.actor.convert`);
- :mod:`.random_init`, :mod:`.builtin`: a randomly initialised model (``model.init: random``) and the built-in
  SmolLM2.
"""
