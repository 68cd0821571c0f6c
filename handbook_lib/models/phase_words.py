"""Each phase of :mod:`handbook_lib.models.phases` in words: where a peak falls, and what is alive
then. Pure data, for the faces (``memory``'s last lines, the planner's reasons, the published
page)."""

from __future__ import annotations

__all__ = ["PHASE_WORDS"]

PHASE_WORDS: dict[str, tuple[str, str]] = {
    "forward_start": ("as forward starts",
                      "forward begins: the root and the first layer gathered, each with its "
                      "all-gather buffer"),
    "layer_forward": ("as a layer is gathered in forward",
                      "a layer's all-gather in forward: its parameters copied out of the all-gather "
                      "buffer, the previous unit's buffer still kept, the activations so far "
                      "(SHARD_GRAD_OP: every unit gathered before it)"),
    "forward_end": ("as forward ends",
                    "forward ends: the logits just computed, the root gathered, the last "
                    "all-gather's buffer not yet freed"),
    "loss_backward": ("in the loss's backward",
                      "the loss's backward, with every activation still saved"),
    "backward_start": ("as backward starts",
                       "backward begins: the logits' gradient alive, the root still gathered"),
    "layer_backward": ("in a layer's backward",
                       "a layer's backward: that layer and the root gathered, the next layer's "
                       "all-gather buffer, the previous layer's reduce-scatter input kept"),
    "layer_reduce": ("in a layer's reduce-scatter",
                     "a layer's reduce-scatter: its gradients copied into the reduce-scatter input, "
                     "then the input and its output (HSDP: the earlier layers' all-reduce buffers kept)"),
    "root_reduce": ("at the end of backward",
                    "end of backward: the root's gradients cast and reduce-scattered"),
    "layer_recompute": ("while a layer is recomputed",
                        "a layer's activations recomputed (activation checkpointing)"),
    "head_backward": ("in the output head's backward",
                      "the output head's backward: the logits' gradient, the head's weight gradients "
                      "and the hidden states' gradient alive together"),
    "optimizer_step": ("in the optimizer step",
                       "the optimizer step: Adam's temporaries (foreach: one of every local "
                       "parameter; for-loop: two of one tensor, the previous one's still bound; "
                       "fused: none)"),
    "offload_gather": ("as offloaded shards are copied in",
                       "CPU offload on a GPU: a unit's shards copied to the device for its "
                       "all-gather, beside its output"),
}
"""Each phase of :func:`estimate_memory` in plain words: ``(when, what)`` — when it happens, to
end a sentence ("peak 34.0 GB per GPU in a layer's backward"), and what is alive then, for a
legend under a table. Each phase's formula is the docstring of its function in
:mod:`handbook_lib.models.phases`."""
