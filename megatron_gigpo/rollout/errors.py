"""The weight sync's error type (its own module so that the sync's parts import it without a cycle)."""

from __future__ import annotations

__all__ = ["WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight sync failed; the engines kept their previous weights. The message names the tensor,
    version, checksum, engine or writing rank at fault."""
