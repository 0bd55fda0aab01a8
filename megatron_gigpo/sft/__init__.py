"""Supervised cold start on the RL actor: demonstrations (:mod:`.data`) and the training loop (:mod:`.trainer`,
``megatron-gigpo sft``). Nothing is imported here, so reading the config does not load torch or Ray."""
