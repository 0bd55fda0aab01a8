"""Supervised cold start on the RL actor: demonstrations (:mod:`.data`) and the training loop (:mod:`.trainer`,
``megatron-gigpo sft``). Nothing heavy is imported here, so reading the config does not load torch or Ray."""


class SFTDataError(ValueError):
    """A demonstration file cannot be used; the message names the file (and line) and the reason.

    Defined here (no heavy imports) so the command line can report it without loading torch."""
