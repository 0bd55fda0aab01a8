"""The auxiliary load-balancing loss of a mixture-of-experts policy as a metric, read from megatron-core's tracker.

megatron-core's router (``TopKRouter``, ``moe_router_load_balancing_type="aux_loss"``) computes, for each MoE
layer and each micro-batch of a training forward pass with ``moe_aux_loss_coeff > 0``, the Switch-Transformer
loss ``E * sum_i f_i * P_i`` (``f_i``: the fraction of the micro-batch's token-to-expert assignments that go to
expert ``i``, ``sum_i f_i = 1``; ``P_i``: the mean router probability of expert ``i``; ``E``: the expert count)
and adds it, divided by the coefficient, to its layer-wise tracker
(``megatron.core.transformer.moe.moe_utils.save_to_aux_losses_tracker``). It is 1 for a uniform router and up
to ``E / k`` (``k`` experts per token) when every token goes to the same ``k`` experts. Relation to transformers:
``load_balancing_loss_func`` of Qwen3-MoE on one layer's router logits equals ``k`` times this layer's value
(its expert fractions sum to ``k``); on several layers at once it averages fractions and probabilities over the
layers before multiplying them, so it is not the mean of the per-layer values.

The forward pass does not compute the loss with a zero coefficient (nor in evaluation mode): the metric is then
absent, as it is for a dense model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUX_LOSS_NAME", "moe_aux_loss_metrics"]

#: megatron-core's tracker name of the ``aux_loss`` load-balancing loss (``TopKRouter._apply_aux_loss``).
AUX_LOSS_NAME = "load_balancing_loss"


def moe_aux_loss_metrics(config: Any, num_micro_batches: int) -> dict[str, float]:
    """``{"moe_aux_loss": value}`` of the training pass just run, and megatron-core's tracker cleared; a collective of
    all ranks (pipeline, tensor and data-parallel groups). ``{}`` (no collective) for a dense model or a zero
    ``moe_aux_loss_coeff``.

    ``value``: the load-balancing loss without its coefficient, per MoE layer the mean over this rank's
    ``num_micro_batches`` micro-batches, averaged over the data-parallel ranks (megatron-core's
    ``reduce_aux_losses_tracker_across_ranks``), then the mean over the MoE layers as megatron-core's
    ``track_moe_metrics`` reports it (Megatron-LM's ``load_balancing_loss``). Identical on every rank.

    Every pipeline stage must hold at least one MoE layer (Qwen3-MoE: every layer is one), so that every rank
    has the tracker entry the reduction runs over.

    Args:
        config: the policy's megatron-core ``TransformerConfig``.
        num_micro_batches: micro-batches this rank ran since the tracker was last cleared (stand-ins included).

    Raises:
        RuntimeError: MoE with a positive coefficient but nothing in the tracker (no training forward pass ran).
    """
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0)
    if not getattr(config, "num_moe_experts", None) or not coeff:
        return {}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    entry = get_moe_layer_wise_logging_tracker().get(AUX_LOSS_NAME)
    if entry is None:
        raise RuntimeError(f"moe_aux_loss_coeff={coeff} but megatron-core's tracker holds no {AUX_LOSS_NAME!r}: "
                           "no MoE layer ran a training forward pass")
    # per rank first: data-parallel ranks may run different numbers of micro-batches
    entry["values"].div_(max(num_micro_batches, 1))
    totals: dict[str, Any] = {}
    track_moe_metrics(loss_scale=1.0, iteration=0, total_loss_dict=totals, num_layers=config.num_layers,
                      moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers)
    return {"moe_aux_loss": float(totals[AUX_LOSS_NAME])}
